"""The `splitserve` command: generate, bench throughput."""
from __future__ import annotations

import argparse
import dataclasses
import logging
import sys

from splitserve.config import EngineArgs

_ENGINE_HELP = {
    "model": "Hugging Face directory, hub id, or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer directory or hub id, when it is not the model's",
    "dtype": "auto, float32, bfloat16 or float16 (auto: the checkpoint's; float16 becomes bfloat16 on CPU)",
    "load_format": "auto, safetensors, pt, gguf, or dummy (random weights from the config, for benchmarks)",
    "max_model_len": "longest sequence (prompt + output) in tokens; default: the model's max_position_embeddings",
    "block_size": "tokens per KV-cache block",
    "kv_cache_dtype": "KV-cache storage: auto (the model's dtype), int8, fp8 (= fp8_e4m3), fp8_e5m2 or int4, "
                      "quantized with a scale per token and KV head",
    "kv_cache_memory_bytes": "bytes for the KV cache (default: 4 GiB on CPU, or $SPLITSERVE_CPU_KVCACHE_SPACE GiB)",
    "num_gpu_blocks_override": "exact number of KV-cache blocks, overriding every memory budget",
    "max_num_batched_tokens": "token budget of one engine step (prompt chunks + decodes)",
    "max_num_seqs": "most sequences running at once",
    "enable_prefix_caching": "reuse the KV blocks of earlier prompts with the same prefix",
    "enable_chunked_prefill": "split long prompts across steps, sharing steps with decodes",
    "tensor_parallel_size": "tensor-parallel ranks (only 1 is supported yet)",
    "quantization": "weight quantization: awq, gptq, weight_only_int8, smooth_quant or fp8 (default: what the "
                    "checkpoint's quantization_config says; weight_only_int8 and fp8 also quantize an "
                    "unquantized model while loading)",
    "kv_cache_ratio": "share of KV blocks new prompts may fill while others run (FastDeploy; 1.0: no reserve)",
    "long_prefill_token_threshold": "most prompt tokens one request may compute in a step (0: no limit)",
    "pd_role": "prefill/decode disaggregation role: mixed (default), prefill or decode",
    "kv_host": "address decode instances use to reach this prefill instance's KV server",
    "kv_port": "port of this instance's KV server (0: any free port)",
    "enforce_eager": "no CUDA graphs: launch every kernel of every step from Python (GPU only)",
    "cuda_graph_sizes": "decode batch sizes captured in CUDA graphs: one value N means 1, 2, 4 and the multiples "
                        "of 8 up to N; several values are the sizes (default: N = min(max_num_seqs, 512))",
    "async_scheduling": "overlap scheduling: prepare step N+1 while the device runs step N (default: on for "
                        "CUDA, off for CPU, where the forward runs on the host's own cores)",
    "kv_lease_seconds": "a prefill instance frees KV blocks no decode instance pulled after this long",
}
_ALIASES = {"tensor_parallel_size": ["-tp"]}
# Arguments that only a Python caller sets, or that exist to be refused with a clear message.
_HIDDEN_ENGINE_ARGS = {"revision", "served_model_name", "pipeline_parallel_size", "swap_space",
                       "preemption_mode", "device", "use_tqdm_on_load"}


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """One flag per EngineArgs field, named as vLLM's (--max-model-len, --enable-prefix-caching ...)."""
    group = parser.add_argument_group("engine")
    for field in dataclasses.fields(EngineArgs):
        flags = ["--" + field.name.replace("_", "-")] + _ALIASES.get(field.name, [])
        kwargs: dict = {"default": field.default, "help": _ENGINE_HELP.get(field.name)}
        if field.name in _HIDDEN_ENGINE_ARGS:
            kwargs["help"] = argparse.SUPPRESS
        if isinstance(field.default, bool) or field.type == "bool | None":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif field.type == "list[int] | None":
            kwargs.update(type=int, nargs="+")
        elif field.type in ("int", "int | None"):
            kwargs["type"] = int
        elif field.type in ("float", "float | None"):
            kwargs["type"] = float
        group.add_argument(*flags, **kwargs)


def engine_args_from(ns: argparse.Namespace) -> EngineArgs:
    return EngineArgs(**{name: getattr(ns, name) for name in EngineArgs.field_names()})


def _cmd_generate(ns: argparse.Namespace) -> None:
    from splitserve import LLM, SamplingParams

    llm = LLM(**dataclasses.asdict(engine_args_from(ns)))
    params = SamplingParams(temperature=ns.temperature, top_p=ns.top_p, max_tokens=ns.max_tokens, seed=ns.seed)
    prompts = ns.prompt or ["Hello, my name is", "The capital of France is", "List 3 countries and their capitals."]
    if ns.chat:
        outputs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
    else:
        outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        print(f"\n=== {prompt!r}\n{out.outputs[0].text}")


def _cmd_serve(ns: argparse.Namespace) -> None:
    from splitserve.disagg.launch import serve
    from splitserve.entrypoints.openai.api_server import split_args

    serve(*split_args(ns))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="splitserve", description="splitserve: an LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate text for a few prompts (offline)")
    add_engine_args(gen)
    gen.add_argument("--prompt", action="append", help="a prompt (repeatable); default: three examples")
    gen.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                     help="wrap each prompt in the model's chat template as a user message")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.set_defaults(func=_cmd_generate)

    from splitserve.entrypoints.openai import api_server

    serve = sub.add_parser("serve", help="the OpenAI-compatible HTTP server")
    api_server.make_arg_parser(serve)
    serve.set_defaults(func=_cmd_serve)

    from splitserve.disagg import router

    rt = sub.add_parser("router", help="the prefill/decode disaggregation router (an OpenAI-compatible front "
                                       "for prefill and decode instances)")
    router.add_arguments(rt)
    rt.set_defaults(func=router.main)

    from splitserve.benchmarks import perplexity

    ppl = sub.add_parser("perplexity", help="the model's perplexity on a text (sliding windows)")
    add_engine_args(ppl)
    perplexity.add_arguments(ppl)
    ppl.set_defaults(func=lambda ns: perplexity.main(ns, engine_args_from(ns)))

    from splitserve.quantization import tool as quantize_tool

    qt = sub.add_parser("quantize", help="quantize a model offline (weight_only_int8, smooth_quant, awq, gptq) "
                                         "into a Hugging Face directory")
    quantize_tool.add_arguments(qt)
    qt.set_defaults(func=quantize_tool.main)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from splitserve.benchmarks import serve, throughput

    tp = bench_sub.add_parser("throughput", help="offline throughput (vLLM's `bench throughput` workload)")
    add_engine_args(tp)
    throughput.add_arguments(tp)
    tp.set_defaults(func=lambda ns: throughput.main(ns, engine_args_from(ns)))

    sv = bench_sub.add_parser("serve", help="online serving benchmark against an OpenAI-compatible server "
                                            "(vLLM's `bench serve`)")
    serve.add_arguments(sv)
    sv.set_defaults(func=lambda ns: serve.main(ns))

    from splitserve.benchmarks import quant

    qb = bench_sub.add_parser("quant", help="quantized variants of a model against the base, one run: "
                                            "perplexity, weight memory, prefill / decode throughput")
    add_engine_args(qb)
    quant.add_arguments(qb)
    qb.set_defaults(func=lambda ns: quant.main(ns, engine_args_from(ns)))

    from splitserve.benchmarks import pd

    pdb = bench_sub.add_parser("pd", help="a PD deployment against one mixed instance, same workload, one run")
    pd.add_arguments(pdb)
    pdb.set_defaults(func=lambda ns: pd.main(ns))

    rt = sub.add_parser("ranktable", help="rank tables of a prefill/decode disaggregated deployment")
    rt_sub = rt.add_subparsers(dest="ranktable_command", required=True)
    from splitserve.disagg import ranktable

    rt_gen = rt_sub.add_parser("gen", help="this machine's part of the global rank table and its local tables")
    ranktable.add_gen_arguments(rt_gen)
    rt_gen.set_defaults(func=ranktable.gen_main)
    rt_merge = rt_sub.add_parser("merge", help="merge the machines' global rank tables into one, and validate it")
    ranktable.add_merge_arguments(rt_merge)
    rt_merge.set_defaults(func=ranktable.merge_main)
    return parser


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ns = build_parser().parse_args(argv)
    try:
        ns.func(ns)
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        logging.getLogger("splitserve").error("%s", exc)
        sys.exit(2)


if __name__ == "__main__":
    main()
