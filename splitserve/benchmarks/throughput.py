"""`splitserve bench throughput`: an offline throughput benchmark with vLLM's / nano-vllm's workload
(random token prompts, fixed or uniformly random lengths, ignore_eos), run through splitserve and,
as a baseline in the same run, through transformers' batched `generate`."""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import random
import time
from dataclasses import dataclass

from splitserve.engine.arg_utils import EngineArgs

logger = logging.getLogger(__name__)

BACKENDS = ("splitserve", "hf")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)


@dataclass
class Result:
    backend: str
    elapsed: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    # a mixture-of-experts model's tokens per expert during the run, by layer (splitserve only)
    expert_load: dict[int, list[int]] = dataclasses.field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        nargs="+",
        choices=BACKENDS,
        default=["splitserve"],
        help="engines to run, one after the other; with both, the ratio is printed",
    )
    add_workload_arguments(parser)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument(
        "--hf-max-batch-size",
        type=int,
        default=None,
        help="transformers baseline batch size (default: all prompts in one batch)",
    )
    parser.add_argument("--output-json", help="write the results to this file")
    parser.add_argument(
        "--profile",
        metavar="DIR",
        help="run splitserve's timed generate under torch.profiler: a Chrome trace in DIR and a summary of GPU "
        "busy time, top kernels and top host operators (slower: not a speed figure); the host's time per "
        "engine step by phase (--step-breakdown) is printed too",
    )
    parser.add_argument(
        "--step-breakdown",
        action="store_true",
        help="print the host's time per engine step by phase (scheduling, input preparation, forward, sampling, "
        "output processing...), per step and per request, measured without the profiler",
    )


def add_workload_arguments(parser: argparse.ArgumentParser) -> None:
    """The random workload of vLLM's `bench throughput` (token ids drawn from the vocabulary)."""
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="draw lengths uniformly from [len*(1-r), len*(1+r)] (vLLM's random dataset)",
    )
    parser.add_argument("--min-input-len", type=int, help="with --max-input-len: input lengths uniform in range")
    parser.add_argument("--max-input-len", type=int)
    parser.add_argument("--min-output-len", type=int, help="with --max-output-len: output lengths uniform in range")
    parser.add_argument("--max-output-len", type=int)


def _lengths(rng: random.Random, n: int, base: int, ratio: float, lo: int | None, hi: int | None) -> list[int]:
    if lo is not None or hi is not None:
        if lo is None or hi is None or not 1 <= lo <= hi:
            raise ValueError("give both --min-*-len and --max-*-len, with 1 <= min <= max")
        return [rng.randint(lo, hi) for _ in range(n)]
    low, high = max(1, int(base * (1 - ratio))), max(1, int(base * (1 + ratio)))
    return [rng.randint(low, high) for _ in range(n)]


def make_workload(ns: argparse.Namespace, vocab_size: int, special_ids: set[int]) -> Workload:
    rng = random.Random(ns.seed)
    input_lens = _lengths(rng, ns.num_prompts, ns.input_len, ns.random_range_ratio, ns.min_input_len, ns.max_input_len)
    output_lens = _lengths(
        rng, ns.num_prompts, ns.output_len, ns.random_range_ratio, ns.min_output_len, ns.max_output_len
    )
    ordinary = [t for t in range(min(vocab_size, 32000)) if t not in special_ids]
    prompts = [[rng.choice(ordinary) for _ in range(n)] for n in input_lens]
    return Workload(prompts, output_lens)


def run_splitserve(
    args: EngineArgs, workload: Workload, temperature: float, profile: str | None = None, breakdown: bool = False
) -> Result:
    from splitserve import step_timing
    from splitserve.benchmarks.profiling import profiled
    from splitserve.devices import resolve_device
    from splitserve.entrypoints.llm import LLM
    from splitserve.sampling_params import SamplingParams

    llm = LLM(**dataclasses.asdict(args))
    llm.generate([{"prompt_token_ids": workload.prompts[0][:8]}], SamplingParams(max_tokens=4), use_tqdm=False)
    params = [
        SamplingParams(temperature=temperature, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in workload.output_lens
    ]
    per_expert = getattr(args, "data_parallel_size", 1) == 1  # replicas count their experts in their own processes
    before = llm.llm_engine.expert_load() if per_expert else {}
    with profiled(profile, cuda=resolve_device(args.device).type == "cuda"):
        # Data-parallel replicas run their engine steps in their own processes: nothing to time here.
        timer = step_timing.start() if (breakdown or profile) and per_expert else None
        start = time.perf_counter()
        outputs = llm.generate([{"prompt_token_ids": p} for p in workload.prompts], params)
        elapsed = time.perf_counter() - start
        step_timing.stop()
    if timer is not None:
        print(timer.report())
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert produced == sum(workload.output_lens), "ignore_eos requests must produce exactly max_tokens"
    after = llm.llm_engine.expert_load() if per_expert else {}
    load = {layer: [a - b for a, b in zip(counts, before[layer])] for layer, counts in after.items()}
    return Result("splitserve", elapsed, len(outputs), workload.num_prompt_tokens, produced, load)


def run_hf(args: EngineArgs, workload: Workload, temperature: float, max_batch: int | None) -> Result:
    """transformers' generate on left-padded batches, with the same weights and dtype."""
    import torch
    from tqdm.auto import tqdm

    from splitserve.devices import resolve_device
    from splitserve.loader.hf_model import dummy_hf_model, load_hf_model
    from splitserve.loader.resolve import load_model_config, split_gguf

    device = resolve_device(args.device)
    config = load_model_config(args, device)
    if config.load_format == "dummy":
        model = dummy_hf_model(config.hf_config, config.dtype, config.seed, device)
    else:
        directory, gguf_file = split_gguf(config.model)
        model = load_hf_model(directory, gguf_file, config.dtype, config.hf_config).to(device)
    pad = config.hf_config.pad_token_id or 0
    batch = max_batch or len(workload.prompts)
    _hf_generate(model, [workload.prompts[0][:8]], 4, pad, temperature)
    start = time.perf_counter()
    produced = 0
    for i in tqdm(range(0, len(workload.prompts), batch), desc="transformers batches"):
        prompts, lens = workload.prompts[i : i + batch], workload.output_lens[i : i + batch]
        _hf_generate(model, prompts, max(lens), pad, temperature)
        produced += sum(lens)
    elapsed = time.perf_counter() - start
    del model
    gc.collect()
    torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return Result("hf", elapsed, len(workload.prompts), workload.num_prompt_tokens, produced)


def _hf_generate(model, prompts: list[list[int]], max_new: int, pad: int, temperature: float):
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    sample = temperature > 0
    with torch.inference_mode():
        return model.generate(
            input_ids=ids.to(model.device),
            attention_mask=mask.to(model.device),
            max_new_tokens=max_new,
            min_new_tokens=max_new,
            do_sample=sample,
            temperature=temperature if sample else None,
            top_p=1.0,
            top_k=0,
            pad_token_id=pad,
        )


def fit_max_model_len(args: EngineArgs, workload: Workload, model_limit: int) -> EngineArgs:
    """Without --max-model-len, the longest request of the workload (prompt + output), not the model's
    whole context (40960 tokens for Qwen3, 131072 for Llama 3): every request still runs to its full
    length, and the KV cache need not hold a full-context request that the benchmark never sends."""
    if args.max_model_len is not None:
        return args
    longest = max(len(p) + n for p, n in zip(workload.prompts, workload.output_lens))
    if longest >= model_limit:
        return args
    logger.info(
        "max_model_len: %d, the workload's longest request (the model allows %d; --max-model-len sets it)",
        longest,
        model_limit,
    )
    return dataclasses.replace(args, max_model_len=longest)


def main(ns: argparse.Namespace, args: EngineArgs) -> list[Result]:
    if getattr(ns, "step_breakdown", False) and args.data_parallel_size > 1:
        raise ValueError(
            "--step-breakdown times the engine steps of this process; with --data-parallel-size above 1 they run "
            "in the replicas' processes. Time one replica (--data-parallel-size 1)."
        )
    from splitserve.devices import resolve_device
    from splitserve.loader.resolve import load_model_config
    from splitserve.tokenizer import get_tokenizer

    config = load_model_config(args, resolve_device(args.device))
    tokenizer = get_tokenizer(config.tokenizer)
    workload = make_workload(ns, config.vocab_size, set(tokenizer.all_special_ids))
    args = fit_max_model_len(args, workload, config.max_model_len)
    results = []
    for backend in dict.fromkeys(ns.backend):
        if backend == "splitserve":
            results.append(
                run_splitserve(
                    args, workload, ns.temperature, getattr(ns, "profile", None), getattr(ns, "step_breakdown", False)
                )
            )
        else:
            results.append(run_hf(args, workload, ns.temperature, ns.hf_max_batch_size))
        gc.collect()
    report(results, ns, config)
    return results


def _describe_lengths(base: int, ratio: float, lo: int | None, hi: int | None) -> str:
    if lo is not None and hi is not None:
        return f"{lo}..{hi}"
    return f"{base}" if ratio == 0 else f"{base} (range ratio {ratio})"


def report(results: list[Result], ns: argparse.Namespace, config) -> None:
    weights = ", random weights" if config.load_format == "dummy" else ""
    print(
        f"\nModel {config.served_model_name} ({config.dtype}{weights}), {ns.num_prompts} prompts, "
        f"input {_describe_lengths(ns.input_len, ns.random_range_ratio, ns.min_input_len, ns.max_input_len)} / "
        f"output {_describe_lengths(ns.output_len, ns.random_range_ratio, ns.min_output_len, ns.max_output_len)} "
        f"tokens, seed {ns.seed}"
    )
    print(f"{'backend':<12}{'elapsed s':>10}{'requests/s':>12}{'output tok/s':>14}{'total tok/s':>13}")
    for r in results:
        print(
            f"{r.backend:<12}{r.elapsed:>10.2f}{r.requests_per_s:>12.2f}{r.output_tokens_per_s:>14.1f}"
            f"{r.total_tokens_per_s:>13.1f}"
        )
    for r in results:
        if r.expert_load:
            print(expert_load_summary(r.expert_load))
    by_name = {r.backend: r for r in results}
    if "splitserve" in by_name and "hf" in by_name:
        ratio = by_name["splitserve"].output_tokens_per_s / by_name["hf"].output_tokens_per_s
        print(f"splitserve / transformers output tokens/s: {ratio:.2f}x")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(
                [dataclasses.asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s} for r in results], f, indent=2
            )


def expert_load_summary(load: dict[int, list[int]]) -> str:
    """Load balance of a run's routing: per MoE layer, the busiest expert's tokens over the mean
    (1.0: perfectly even), summarised over layers, and the layer's counts where it is worst."""
    imbalance = {layer: max(c) * len(c) / max(sum(c), 1) for layer, c in load.items()}
    worst = max(imbalance, key=imbalance.get)
    mean = sum(imbalance.values()) / len(imbalance)
    return (
        f"expert load over {len(load)} MoE layers ({len(load[worst])} experts): busiest expert / mean "
        f"{mean:.2f} on average, {imbalance[worst]:.2f} at worst (layer {worst}: {load[worst]})"
    )
