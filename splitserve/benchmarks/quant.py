"""`splitserve bench quant`: what each quantization costs in quality and gains in memory and speed,
measured one variant after the other in one run, against the first variant.

A variant is `base` (the model as given), the name of a method that quantizes while loading
(`weight_only_int8`, `fp8`), the directory of a quantized checkpoint (`splitserve quantize` output,
an AutoAWQ / GPTQ / llm-compressor checkpoint) or a .gguf file (llama.cpp's `llama-quantize` output);
`label=variant` names it in the table. For each:
  - perplexity on each text (`splitserve perplexity`'s sliding windows; `--text-file A B ...`),
  - weight memory (every parameter and buffer of the loaded model),
  - prefill throughput: the workload's prompts with one output token each, prompt tokens/s,
  - throughput: the whole workload (`bench throughput`), output tokens/s,
  - single-stream decode: one request of the workload's lengths alone, output tokens/s.
`--quality-only` measures perplexity and memory alone (the side-by-side quality benchmark against
other tools, scripts/quant_peers.sh).
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import logging
import os
import time
from dataclasses import dataclass

from splitserve.benchmarks import perplexity, throughput
from splitserve.engine.arg_utils import EngineArgs
from splitserve.quantization.config import ONLINE_METHODS
from splitserve.quantization.linear import weight_bytes

logger = logging.getLogger(__name__)


@dataclass
class QuantResult:
    label: str
    quantization: str
    perplexity: list[float]  # one per text
    weight_mib: float
    prefill_tokens_per_s: float | None  # None: --quality-only
    output_tokens_per_s: float | None
    single_stream_tokens_per_s: float | None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--variants",
        nargs="+",
        required=True,
        help="base, a method quantizing while loading (weight_only_int8, fp8), a quantized checkpoint "
        "directory or a .gguf file; optionally label=variant. The first is the baseline.",
    )
    throughput.add_workload_arguments(parser)
    parser.add_argument(
        "--text-file",
        nargs="+",
        help="perplexity texts, one column each (default: splitserve perplexity's built-in text)",
    )
    parser.add_argument("--max-length", type=int, default=256, help="perplexity window in tokens")
    parser.add_argument(
        "--quality-only", action="store_true", help="perplexity and weight memory only, no speed measurements"
    )
    parser.add_argument("--output-json", help="write the results to this file")


def _engine_args(args: EngineArgs, variant: str) -> EngineArgs:
    if variant == "base":
        return args
    if variant in ONLINE_METHODS:
        return dataclasses.replace(args, quantization=variant)
    if os.path.isdir(variant) or (os.path.isfile(variant) and variant.endswith(".gguf")):
        return dataclasses.replace(args, model=variant, tokenizer=args.tokenizer or args.model, load_format="auto")
    raise ValueError(f"Variant {variant!r} is not 'base', one of {ONLINE_METHODS}, a directory or a .gguf file.")


def _timed_generate(llm, prompts: list[list[int]], output_lens: list[int]) -> tuple[float, int]:
    from splitserve.sampling_params import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, detokenize=False) for n in output_lens]
    start = time.perf_counter()
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def measure(
    label: str,
    args: EngineArgs,
    workload: throughput.Workload,
    texts_ids: list[list[int]],
    max_length: int,
    quality_only: bool = False,
) -> QuantResult:
    from splitserve.entrypoints.llm import LLM

    llm = LLM(**dataclasses.asdict(args))
    model_config = llm.llm_engine.model_config
    quant = model_config.quant_config.method if model_config.quant_config is not None else "none"
    mib = weight_bytes(llm.llm_engine.engine_core.executor.runner.model) / (1 << 20)
    ppl = [perplexity.compute_perplexity(llm, ids, max_length, max_length // 2).perplexity for ids in texts_ids]
    if quality_only:
        del llm
        gc.collect()
        return QuantResult(label, quant, ppl, mib, None, None, None)
    _timed_generate(llm, [workload.prompts[0][:8]], [4])  # warm-up
    prefill_s, _ = _timed_generate(llm, workload.prompts, [1] * len(workload.prompts))
    total_s, produced = _timed_generate(llm, workload.prompts, workload.output_lens)
    single_s, single = _timed_generate(llm, workload.prompts[:1], workload.output_lens[:1])
    del llm
    gc.collect()
    return QuantResult(
        label, quant, ppl, mib, workload.num_prompt_tokens / prefill_s, produced / total_s, single / single_s
    )


def main(ns: argparse.Namespace, args: EngineArgs) -> list[QuantResult]:
    from splitserve.devices import resolve_device
    from splitserve.loader.resolve import load_model_config
    from splitserve.tokenizer import get_tokenizer

    config = load_model_config(args, resolve_device(args.device))
    tokenizer = get_tokenizer(config.tokenizer)
    workload = throughput.make_workload(ns, config.vocab_size, set(tokenizer.all_special_ids))
    texts = []
    for path in ns.text_file or []:
        with open(path, encoding="utf-8") as f:
            texts.append(f.read())
    texts_ids = [tokenizer(text).input_ids for text in texts or [perplexity.BUILTIN_TEXT]]
    variants = [v.split("=", 1) if "=" in v else (v, v) for v in ns.variants]
    runs = [(label, _engine_args(args, spec)) for label, spec in variants]  # all checked before any runs
    results = []
    for i, (label, run_args) in enumerate(runs, 1):
        logger.info("Variant %d of %d: %s", i, len(runs), label)
        results.append(measure(label, run_args, workload, texts_ids, ns.max_length, ns.quality_only))
    report(results, ns)
    return results


def report(results: list[QuantResult], ns: argparse.Namespace) -> None:
    """The table, ratios against the first variant: perplexity per text (relative change), weight
    memory, and the speeds unless --quality-only."""
    base = results[0]
    names = [os.path.basename(p) for p in ns.text_file] if ns.text_file else ["built-in text"]
    workload = (
        "" if ns.quality_only else f"{ns.num_prompts} prompts, input {ns.input_len} / output {ns.output_len} tokens; "
    )
    print(f"\n{workload}perplexity in {ns.max_length}-token windows; ratios against {base.label}")
    header = [f"perplexity ({name})" for name in names] + ["weights MiB"]
    if not ns.quality_only:
        header += ["prefill tok/s", "output tok/s", "single-stream tok/s"]
    print("| variant | " + " | ".join(header) + " |")
    print("|---" * (len(header) + 1) + "|")
    for r in results:
        cells = [f"{p:.3f} ({(p / b - 1) * 100:+.1f}%)" for p, b in zip(r.perplexity, base.perplexity)]
        cells.append(f"{r.weight_mib:.1f} ({r.weight_mib / base.weight_mib:.2f}x)")
        if not ns.quality_only:
            speeds = [
                (r.prefill_tokens_per_s, base.prefill_tokens_per_s, ".0f"),
                (r.output_tokens_per_s, base.output_tokens_per_s, ".1f"),
                (r.single_stream_tokens_per_s, base.single_stream_tokens_per_s, ".1f"),
            ]
            cells += [f"{v:{fmt}} ({v / b:.2f}x)" for v, b, fmt in speeds]
        print(f"| {r.label} | " + " | ".join(cells) + " |")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump({"texts": names, "results": [dataclasses.asdict(r) for r in results]}, f, indent=2)
