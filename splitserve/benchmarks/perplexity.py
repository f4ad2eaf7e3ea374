"""`splitserve perplexity`: the model's perplexity on a text, computed by the engine itself (its
prompt logprobs), with transformers' sliding-window method for texts longer than one window:
windows of `max_length` tokens every `stride` tokens, each scoring only the tokens that the
previous window did not, with all that precedes them in the window as context."""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass

from splitserve.engine.arg_utils import EngineArgs

# A few paragraphs written for this project, so that a perplexity can be had with no file at hand.
BUILTIN_TEXT = (
    "The harbour town woke slowly on winter mornings. Before the sun cleared the hills, the bakers had "
    "already lit their ovens, and the smell of bread drifted down the narrow streets towards the water. "
    "Fishing boats came back with the tide, their decks crowded with crates of silver fish and coils of "
    "wet rope, and the market filled with people who argued about prices as if it were a sport.\n\n"
    "In the library at the top of the hill, an old clerk kept the records of every ship that had ever "
    "anchored in the bay. He wrote in a careful hand, noting the name of each vessel, its captain, its "
    "cargo and the weather on the day it arrived. Children sometimes climbed the steps to ask him about "
    "storms and pirates, and he would open one of the heavy books and read them a page or two.\n\n"
    "Scientists who study such towns say that their economies depend on a delicate balance between the "
    "sea and the land. When fish are plentiful, families can afford to repair their homes and send their "
    "children to school; when the catch fails, many leave for the cities in search of work. Some towns "
    "have turned to tourism, inviting visitors to walk along the cliffs, eat in small restaurants and "
    "watch the boats return in the evening light.\n\n"
    "A computer program, like a town, is built from many small parts that must work together. Each "
    "function receives some values, does one thing with them, and hands the result to the next. When the "
    "parts are simple and their names are honest, a new engineer can read the code and change it without "
    "fear; when they are tangled, every change breaks something far away."
)


@dataclass
class PerplexityResult:
    perplexity: float
    mean_nll: float
    num_tokens_scored: int
    num_windows: int
    seconds: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--text-file", help="a UTF-8 text file (default: a built-in text of a few paragraphs)")
    source.add_argument("--text", help="the text itself")
    parser.add_argument(
        "--max-length", type=int, default=None, help="tokens per window (default: min(max_model_len - 1, 1024))"
    )
    parser.add_argument("--stride", type=int, default=None, help="tokens between windows (default: max-length / 2)")


def windows(num_tokens: int, max_length: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, num_targets) per window: tokens [begin, end) are fed, and the last num_targets
    of them are scored (the first token of the text is never scored: nothing predicts it)."""
    if max_length < 2 or not 1 <= stride <= max_length:
        raise ValueError(f"need max_length >= 2 and 1 <= stride <= max_length, got {max_length} and {stride}.")
    out, prev_end = [], 1
    for begin in range(0, num_tokens, stride):
        end = min(begin + max_length, num_tokens)
        if end > prev_end:
            out.append((begin, end, end - prev_end))
        prev_end = max(prev_end, end)
        if end == num_tokens:
            break
    return out


def compute_perplexity(llm, token_ids: list[int], max_length: int, stride: int) -> PerplexityResult:
    from splitserve.sampling_params import SamplingParams

    if len(token_ids) < 2:
        raise ValueError("The text has fewer than two tokens: there is nothing to score.")
    spans = windows(len(token_ids), max_length, stride)
    start = time.perf_counter()
    outputs = llm.generate(
        [{"prompt_token_ids": token_ids[b:e]} for b, e, _ in spans],
        SamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False),
        use_tqdm=False,
    )
    nll = 0.0
    for (begin, end, targets), out in zip(spans, outputs):
        window = token_ids[begin:end]
        for pos in range(len(window) - targets, len(window)):
            nll -= out.prompt_logprobs[pos][window[pos]].logprob
    count = sum(t for _, _, t in spans)
    return PerplexityResult(math.exp(nll / count), nll / count, count, len(spans), time.perf_counter() - start)


def main(ns: argparse.Namespace, args: EngineArgs) -> PerplexityResult:
    from splitserve.entrypoints.llm import LLM

    if ns.text_file:
        with open(ns.text_file, encoding="utf-8") as f:
            text = f.read()
    else:
        text = ns.text if ns.text is not None else BUILTIN_TEXT
    llm = LLM(**dataclasses.asdict(args))
    # Each window is scored as a prompt that generates one token, so it needs one slot more.
    max_model_len = llm.llm_engine.model_config.max_model_len
    max_length = ns.max_length or min(max_model_len - 1, 1024)
    if max_length >= max_model_len:
        raise ValueError(
            f"--max-length {max_length} needs --max-model-len of at least {max_length + 1} (each window is "
            f"scored as a prompt that generates one token); max_model_len is {max_model_len}."
        )
    result = compute_perplexity(llm, llm.get_tokenizer()(text).input_ids, max_length, ns.stride or max_length // 2)
    print(
        f"perplexity {result.perplexity:.4f} (mean NLL {result.mean_nll:.4f}) over {result.num_tokens_scored} "
        f"tokens in {result.num_windows} windows of up to {max_length} tokens, {result.seconds:.1f} s"
    )
    return result
