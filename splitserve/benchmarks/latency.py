"""`splitserve bench latency`: the latency of one batch of requests, vLLM's `bench latency`, and the
decode rate that llama.cpp's `llama-bench` reports as tg<N>.

Each iteration generates `--output-len` tokens (ignore_eos) for `--batch-size` prompts of
`--input-len` random token ids; a second series generates one token for the same prompt lengths.
The decode rate is (output_len - 1) tokens over the difference of their medians: the time after the
prompt's step, per sequence and for the batch. Every iteration draws new prompts, so the prefix
cache never serves one from an earlier iteration.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import statistics
import time

from tqdm.auto import tqdm

from splitserve.engine.arg_utils import EngineArgs

PERCENTILES = (10, 25, 50, 75, 90, 99)


@dataclasses.dataclass
class LatencyResult:
    batch_size: int
    input_len: int
    output_len: int
    latencies: list[float]  # seconds, output_len tokens per request
    first_token_latencies: list[float]  # seconds, one token per request (the prompt's step)

    @property
    def avg_latency(self) -> float:
        return statistics.fmean(self.latencies)

    def percentiles(self) -> dict[int, float]:
        ordered = sorted(self.latencies)
        return {p: ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))] for p in PERCENTILES}

    @property
    def decode_seconds(self) -> float:
        """Median time of the tokens after the first."""
        return statistics.median(self.latencies) - statistics.median(self.first_token_latencies)

    @property
    def decode_tokens_per_s(self) -> float:
        """Per sequence: llama-bench's tg<output_len> at batch size 1."""
        if self.output_len < 2 or self.decode_seconds <= 0:
            return float("nan")
        return (self.output_len - 1) / self.decode_seconds


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request (ignore_eos)")
    parser.add_argument("--batch-size", type=int, default=8, help="requests per iteration, sent together")
    parser.add_argument("--num-iters-warmup", type=int, default=10, help="iterations run before the timed ones")
    parser.add_argument("--num-iters", type=int, default=30, help="timed iterations of each series")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--output-json", help="write the latencies and the decode rate to this file")


def _check(ns: argparse.Namespace) -> None:
    for name in ("input_len", "output_len", "batch_size", "num_iters"):
        if getattr(ns, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(ns, name)}")
    if ns.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be at least 0, got {ns.num_iters_warmup}")


def main(ns: argparse.Namespace, args: EngineArgs) -> LatencyResult:
    from splitserve.entrypoints.llm import LLM
    from splitserve.sampling_params import SamplingParams

    _check(ns)
    if args.max_model_len is None:
        args = dataclasses.replace(args, max_model_len=ns.input_len + ns.output_len)
    llm = LLM(**dataclasses.asdict(args))
    model_config = llm.llm_engine.config.model_config
    special = set(llm.get_tokenizer().all_special_ids)
    ordinary = [t for t in range(min(model_config.vocab_size, 32000)) if t not in special]
    rng = random.Random(args.seed)

    def one_batch(max_tokens: int) -> float:
        prompts = [{"prompt_token_ids": rng.choices(ordinary, k=ns.input_len)} for _ in range(ns.batch_size)]
        params = SamplingParams(temperature=ns.temperature, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        assert all(len(o.outputs[0].token_ids) == max_tokens for o in outputs), "ignore_eos makes max_tokens"
        return elapsed

    for _ in tqdm(range(ns.num_iters_warmup), desc="warm-up iterations"):
        one_batch(ns.output_len)
    latencies = [one_batch(ns.output_len) for _ in tqdm(range(ns.num_iters), desc=f"{ns.output_len} tokens")]
    first = [one_batch(1) for _ in tqdm(range(ns.num_iters), desc="1 token (the prompt's step)")]
    result = LatencyResult(ns.batch_size, ns.input_len, ns.output_len, latencies, first)
    report(result, model_config)
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(to_json(result), f, indent=2)
    return result


def to_json(r: LatencyResult) -> dict:
    return {
        "avg_latency": r.avg_latency,
        "latencies": r.latencies,
        "percentiles": {str(p): v for p, v in r.percentiles().items()},
        "first_token_latencies": r.first_token_latencies,
        "decode_tokens_per_s_per_sequence": r.decode_tokens_per_s,
        "decode_tokens_per_s": r.decode_tokens_per_s * r.batch_size,
    }


def report(r: LatencyResult, model_config) -> None:
    print(
        f"\nModel {model_config.served_model_name} ({model_config.dtype}), batch {r.batch_size}, "
        f"input {r.input_len} / output {r.output_len} tokens, {len(r.latencies)} iterations"
    )
    print(f"Avg latency: {r.avg_latency:.4f} seconds")
    for p, v in r.percentiles().items():
        print(f"{p}% percentile latency: {v:.4f} seconds")
    print(f"First token (1 token per request): median {statistics.median(r.first_token_latencies):.4f} seconds")
    if r.output_len >= 2:
        print(
            f"Decode: {r.output_len - 1} tokens in {r.decode_seconds:.4f} s after the first: "
            f"{r.decode_tokens_per_s:.1f} tok/s per sequence, {r.decode_tokens_per_s * r.batch_size:.1f} tok/s "
            f"for the batch (llama-bench's tg{r.output_len} at batch 1)"
        )
