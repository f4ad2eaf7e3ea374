"""Calibration for `splitserve quantize`: the token sequences (a file of token ids, or a built-in
text), and the statistics of each linear layer's input that the algorithms need, gathered with
forward hooks in one pass of the float model (or layer by layer: sequential.py)."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from tqdm.auto import tqdm

# The built-in calibration corpus (about 4,500 SmolLM2 tokens), written for calibration only:
# evaluation uses benchmarks/perplexity.py's text and texts outside the project, which must stay
# unseen here. Varied on purpose: stories, news, history, letters, contract terms, a manual page,
# code in several languages, tables, mathematics, verse, dialogue, notes and several languages,
# so that the activation statistics (and GPTQ's Hessians) cover more than one kind of input.
CALIBRATION_CORPUS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "calibration_corpus.txt")


def builtin_calibration_text() -> str:
    with open(CALIBRATION_CORPUS, encoding="utf-8") as f:
        return f.read()


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
    """The built-in calibration corpus, tokenized and cut into sequences of `seq_len` tokens."""
    return text_sequences(
        builtin_calibration_text(), "the built-in calibration corpus", tokenizer, vocab_size, seq_len, num_samples
    )


def read_text_sequences(path: str, tokenizer, vocab_size: int, seq_len: int, num_samples: int) -> list[list[int]]:
    """`--calib-data FILE`: a UTF-8 text, tokenized and cut into sequences of `seq_len` tokens."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Calibration text file {path} does not exist.")
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if not text.strip():
        raise ValueError(f"Calibration text file {path} is empty.")
    return text_sequences(text, path, tokenizer, vocab_size, seq_len, num_samples)


def text_sequences(
    text: str, source: str, tokenizer, vocab_size: int, seq_len: int, num_samples: int
) -> list[list[int]]:
    ids = tokenizer(text)["input_ids"]
    if max(ids) >= vocab_size:
        raise ValueError(
            f"The tokenizer makes token id {max(ids)} from {source}, outside the model's vocabulary "
            f"(0..{vocab_size - 1}); pass calibration token ids with --tokenids-path."
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

    def divide(self, s: torch.Tensor) -> None:
        """The statistics of x / s (per input channel) in place of those of x."""
        self.absmax, self.abssum = self.absmax / s, self.abssum / s
        if self.gram is not None:
            self.gram = self.gram / s[:, None] / s[None, :]
        if self.fold_absmax is not None:
            self.fold_absmax = self.fold_absmax / s

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

    # The decoder without its head: no site reads the logits, whose product (the whole vocabulary
    # per token) was a fifth of the default model's calibration time.
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    handles = [module.register_forward_pre_hook(hook_for(name)) for name, module in sites.items()]
    try:
        with torch.no_grad():
            for ids, fold in tqdm(list(zip(sequences, token_folds(sequences, folds))), desc=desc, unit="seq"):
                current[:] = [fold]
                decoder(input_ids=torch.tensor([ids]), use_cache=False)
    finally:
        for handle in handles:
            handle.remove()


def new_stats(sites: dict[str, nn.Linear], *, gram: bool = False, folds: int = 1) -> dict[str, InputStats]:
    """Empty statistics for each site's input (see `collect_input_stats`)."""
    return {
        name: InputStats(
            torch.zeros(m.in_features),
            torch.zeros(m.in_features),
            gram=torch.zeros(m.in_features, m.in_features) if gram else None,
            fold_absmax=torch.zeros(folds, m.in_features) if folds > 1 else None,
        )
        for name, m in sites.items()
    }


def recorder(stats: dict[str, InputStats]) -> Callable[[str, torch.Tensor, torch.Tensor], None]:
    """record(site, x [tokens, in], fold of each token) adding x to that site's statistics."""

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

    return record


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
    stats = new_stats(sites, gram=gram, folds=folds)
    run_with_input_hooks(model, sites, sequences, recorder(stats), folds)
    return stats
