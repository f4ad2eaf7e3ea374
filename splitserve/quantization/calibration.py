"""Calibration for `splitserve quantize`: the token sequences (a file of token ids, or a built-in
text), and the statistics of each linear layer's input that the algorithms need, gathered with
forward hooks in one pass of the float model."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

# Written for calibration only (evaluation uses benchmarks/perplexity.py's text, which must stay
# unseen here). Varied on purpose: prose, a dialogue, code, numbers and a list, so that the
# activation statistics cover more than one kind of input.
BUILTIN_CALIBRATION_TEXT = (
    "Every spring the river that runs through the valley floods its lower meadows. Farmers there have "
    "learned to plant late, after the water has drawn back and left a layer of dark silt behind. Their "
    "grandparents built the barns on stone piers, and the oldest houses still have a door on the upper "
    "floor, where a boat could be tied when the water rose higher than anyone expected. Nobody in the "
    "valley calls the flood a disaster; it is simply the season before the sowing.\n\n"
    '"Did you remember to bring the map?" asked Mara, pulling the tent bag out of the car.\n'
    '"It\'s on my phone," said Joel. "We won\'t need paper."\n'
    '"There is no signal past the second bridge. You know that."\n'
    "He paused, looked at the mountains, and sighed. \"Fine. I'll draw one from memory, then. North is "
    'up, the lake is somewhere on the left, and we walk until we find it."\n'
    '"That is exactly how we got lost last year."\n\n'
    "def moving_average(values, window):\n"
    '    """Return the mean of each run of `window` consecutive values."""\n'
    "    if window <= 0:\n"
    '        raise ValueError("window must be positive")\n'
    "    total = sum(values[:window])\n"
    "    result = [total / window]\n"
    "    for i in range(window, len(values)):\n"
    "        total += values[i] - values[i - window]\n"
    "        result.append(total / window)\n"
    "    return result\n\n"
    "print(moving_average([3, 1, 4, 1, 5, 9, 2, 6], 3))\n\n"
    "Quarterly report, in thousands of euros: revenue rose from 1,284.5 in Q1 to 1,402.0 in Q2 (+9.1%), "
    "while costs grew from 977.3 to 1,015.8. The operating margin therefore improved from 23.9% to "
    "27.5%. Headcount stayed at 42; the average order value was 318.75, and 2,917 orders were shipped "
    "between 1 April and 30 June 2024, of which 64 were returned.\n\n"
    "How to replace a bicycle chain:\n"
    "1. Shift to the smallest sprocket at the back and the smallest ring at the front.\n"
    "2. Open the quick link with pliers, or push a pin out with a chain tool.\n"
    "3. Lay the old chain next to the new one and cut the new chain to the same length.\n"
    "4. Thread it through the derailleur, join the ends, and check that every link bends freely.\n\n"
    "Photosynthesis turns light into chemical energy. In the chloroplasts of a leaf, pigments absorb "
    "photons, and the energy splits water into oxygen, protons and electrons. The electrons travel "
    "along a chain of proteins that pumps protons across a membrane; the flow of protons back drives "
    "an enzyme that makes ATP. In a second set of reactions, the cell spends that ATP to fix carbon "
    "dioxide from the air into sugars, which feed the plant and, eventually, almost everything that "
    "eats plants.\n\n"
    "SELECT city, COUNT(*) AS stations, AVG(temperature_c) AS mean_temp\n"
    "FROM readings\n"
    "WHERE recorded_at >= '2023-01-01'\n"
    "GROUP BY city\n"
    "ORDER BY mean_temp DESC\n"
    "LIMIT 10;\n\n"
    "User: What is the difference between a list and a tuple in Python?\n"
    "Assistant: Both hold an ordered sequence of values. A list is mutable: you can append, remove or "
    "replace its items after creating it. A tuple is immutable, so it can serve as a dictionary key and "
    "signals to the reader that the values belong together, like the x and y of a point.\n"
    "User: So when should I use one or the other?\n"
    "Assistant: Use a list for a collection that grows or changes, such as the lines read from a file, "
    "and a tuple for a fixed record, such as (latitude, longitude).\n\n"
    "The lighthouse keeper's logbook, 14 March: wind from the south-west, force 6, rising to 8 by "
    "evening. Visibility poor in rain squalls. Two trawlers sheltered in the lee of the island from "
    "noon. Lamp lit at 18:42, the clockwork wound twice in the night. At dawn the sea was still heavy, "
    "but the sky had cleared, and a seal was asleep on the landing stage as if nothing had happened.\n\n"
    '{"id": 4711, "name": "sensor-north", "active": true, "readings": [12.5, 12.7, 13.1], '
    '"location": {"lat": 59.3293, "lon": 18.0686}, "tags": ["outdoor", "calibrated"]}\n\n'
    "To make a simple lentil soup, soften a chopped onion, two carrots and a stick of celery in olive "
    "oil for ten minutes. Add two cloves of garlic, a teaspoon of cumin and 250 grams of red lentils, "
    "then pour in 1.2 litres of stock. Simmer for twenty-five minutes, until the lentils fall apart, "
    "season with salt, pepper and the juice of half a lemon, and blend part of it if you like it thick.\n\n"
    "Why does the sky look blue? Sunlight contains every colour, but the molecules of the air scatter "
    "short wavelengths much more strongly than long ones; the intensity goes with the inverse fourth "
    "power of the wavelength. Blue light is therefore sent in all directions across the sky, while at "
    "sunset, when the light crosses far more air, most of the blue is scattered away before it reaches "
    "us and the remaining light looks red and orange.\n\n"
    "Le marché du samedi ouvre à sept heures. On y trouve des fromages, du pain encore chaud et des "
    "légumes du jardin. Die Kinder laufen zwischen den Ständen umher, und die Verkäufer rufen ihre "
    "Preise. Al final de la mañana, todos se sientan en la plaza a tomar un café."
)


def read_token_ids(path: str, vocab_size: int, seq_len: int, num_samples: int) -> list[list[int]]:
    """Calibration sequences from a file of token ids, one sequence per line (separated by
    whitespace or commas): at most `num_samples` lines, each cut to `seq_len` tokens."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Calibration token ids file {path} does not exist.")
    sequences = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            ids = []
            for token in line.replace(",", " ").split():
                try:
                    token_id = int(token)
                except ValueError:
                    raise ValueError(f"{path}:{line_no}: {token!r} is not an integer token id.") from None
                if not 0 <= token_id < vocab_size:
                    raise ValueError(
                        f"{path}:{line_no}: token id {token_id} is outside the model's vocabulary "
                        f"(0..{vocab_size - 1})."
                    )
                ids.append(token_id)
            if ids:
                sequences.append(ids[:seq_len])
            if len(sequences) == num_samples:
                break
    if not sequences:
        raise ValueError(f"Calibration token ids file {path} holds no token ids.")
    return sequences


def builtin_sequences(tokenizer, vocab_size: int, seq_len: int, num_samples: int) -> list[list[int]]:
    """The built-in calibration text, tokenized and cut into sequences of `seq_len` tokens."""
    ids = tokenizer(BUILTIN_CALIBRATION_TEXT)["input_ids"]
    if max(ids) >= vocab_size:
        raise ValueError(
            f"The tokenizer makes token id {max(ids)} from the built-in calibration text, outside "
            f"the model's vocabulary (0..{vocab_size - 1}); pass calibration data with --tokenids-path."
        )
    return [ids[i : i + seq_len] for i in range(0, len(ids), seq_len)][:num_samples]


@dataclass
class InputStats:
    """What was seen at one linear layer's input (shared by the linears that read the same input)."""

    absmax: torch.Tensor  # [in] max |x| per channel (SmoothQuant)
    abssum: torch.Tensor  # [in] sum of |x| per channel (AWQ's scale candidates)
    tokens: int = 0
    gram: torch.Tensor | None = None  # [in, in] sum of x^T x (GPTQ's Hessian, AWQ's objective)
    fold_absmax: torch.Tensor | None = None  # [folds, in] max |x| per fold of the tokens (`token_folds`)

    @property
    def absmean(self) -> torch.Tensor:
        return self.abssum / max(self.tokens, 1)

    def second_moment(self) -> torch.Tensor:
        """E[x^T x] = X^T X / n: the mean squared output error of a weight error E is
        tr(E M E^T) / out, so objectives over all calibration tokens cost no pass over them."""
        return self.gram / max(self.tokens, 1)


def token_folds(sequences: list[list[int]], folds: int) -> list[torch.Tensor]:
    """The fold of every calibration token: the tokens, in order, cut into `folds` contiguous runs
    of (nearly) equal length. Contiguous, so that a held-out fold is other text, not other tokens of
    the same sentences."""
    total = sum(map(len, sequences))
    result, start = [], 0
    for ids in sequences:
        result.append(torch.arange(start, start + len(ids)) * folds // max(total, 1))
        start += len(ids)
    return result


def run_with_input_hooks(
    model: nn.Module,
    sites: dict[str, nn.Linear],
    sequences: list[list[int]],
    record: Callable[[str, torch.Tensor, torch.Tensor], None],
    folds: int = 1,
    desc: str = "Calibrating",
) -> None:
    """Run the float model over the sequences (one at a time, so no padding enters) and call
    record(site, x [tokens, in] float32, fold of each token [tokens]) at each site's input."""
    current: list[torch.Tensor] = []

    def hook_for(name: str):
        def hook(module, args):
            record(name, args[0].detach().reshape(-1, module.in_features).float(), current[0])

        return hook

    handles = [module.register_forward_pre_hook(hook_for(name)) for name, module in sites.items()]
    try:
        with torch.no_grad():
            for ids, fold in tqdm(list(zip(sequences, token_folds(sequences, folds))), desc=desc, unit="seq"):
                current[:] = [fold]
                model(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def collect_input_stats(
    model: nn.Module,
    sites: dict[str, nn.Linear],
    sequences: list[list[int]],
    *,
    gram: bool = False,
    folds: int = 1,
) -> dict[str, InputStats]:
    """Each site's input over the calibration sequences: per-channel max and mean |x|, X^T X if
    asked, and with `folds` > 1 the per-channel max of each fold (`token_folds`)."""
    stats = {
        name: InputStats(
            torch.zeros(m.in_features),
            torch.zeros(m.in_features),
            gram=torch.zeros(m.in_features, m.in_features) if gram else None,
            fold_absmax=torch.zeros(folds, m.in_features) if folds > 1 else None,
        )
        for name, m in sites.items()
    }

    def record(name: str, x: torch.Tensor, fold: torch.Tensor) -> None:
        s = stats[name]
        torch.maximum(s.absmax, x.abs().amax(dim=0), out=s.absmax)
        s.abssum += x.abs().sum(dim=0)
        s.tokens += x.shape[0]
        if s.gram is not None:
            s.gram.addmm_(x.t(), x)
        if s.fold_absmax is not None:
            for k in fold.unique().tolist():
                torch.maximum(s.fold_absmax[k], x[fold == k].abs().amax(dim=0), out=s.fold_absmax[k])

    run_with_input_hooks(model, sites, sequences, record, folds)
    return stats
