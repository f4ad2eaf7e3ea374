"""EngineArgs on the command line: one flag per field, named as vLLM's (--max-model-len,
--enable-prefix-caching ...), and back again (the flags that recreate a set of EngineArgs, for
launchers that start instances as processes)."""
from __future__ import annotations

import argparse
import dataclasses

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


def engine_flags(args: EngineArgs, skip: tuple[str, ...] = ()) -> list[str]:
    """EngineArgs as `serve` flags (only what differs from the defaults, and not the fields in `skip`)."""
    flags = []
    for field in dataclasses.fields(EngineArgs):
        value = getattr(args, field.name)
        if value == field.default or field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags
