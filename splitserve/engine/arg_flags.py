"""EngineArgs on the command line: one flag per field, named as vLLM's (--max-model-len,
--enable-prefix-caching ...), read back into EngineArgs, and written out again (the flags that
recreate a set of EngineArgs, for launchers that start instances)."""

from __future__ import annotations

import argparse
import dataclasses
import json

from splitserve.engine.arg_utils import EngineArgs

_ENGINE_HELP = {
    "model": "Hugging Face directory, hub id, or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer directory or hub id, when it is not the model's",
    "dtype": "auto, float32, bfloat16 or float16 (auto: the checkpoint's; float16 becomes bfloat16 on CPU)",
    "load_format": "auto, safetensors, pt, gguf, or dummy (random weights from the config, for benchmarks)",
    "max_model_len": "longest sequence (prompt + output) in tokens; default: the model's max_position_embeddings "
    "(longer only with dynamic NTK rope scaling)",
    "hf_overrides": "JSON object of config.json keys to change (vLLM's --hf-overrides), e.g. "
    "rope_scaling (which keeps the rope's frequency base) or use_logn_attn",
    "generation_config": "a request's default sampling: auto (the model's generation_config.json, a .gguf "
    "file's general.sampling keys, or the embedded default model's recommended temperature 0.2 / top_p 0.9), "
    "vllm (splitserve's own defaults) or a directory holding generation_config.json",
    "override_generation_config": 'JSON of generation-config keys laid over those defaults, e.g. {"temperature": 0.5}',
    "block_size": "tokens per KV-cache block",
    "kv_cache_dtype": "KV-cache storage: auto (the model's dtype), int8, fp8 (= fp8_e4m3), fp8_e5m2 or int4, "
    "quantized with a scale per token and KV head",
    "kv_cache_memory_bytes": "bytes for the KV cache (default: 4 GiB on CPU, or $SPLITSERVE_CPU_KVCACHE_SPACE GiB)",
    "num_gpu_blocks_override": "exact number of KV-cache blocks, overriding every memory budget",
    "max_num_batched_tokens": "token budget of one engine step (prompt chunks + decodes), which may take "
    "--prompt-tail-tokens more to finish prompts",
    "max_num_seqs": "most sequences running at once",
    "enable_prefix_caching": "reuse the KV blocks of earlier prompts with the same prefix",
    "enable_chunked_prefill": "split long prompts across steps, sharing steps with decodes",
    "tensor_parallel_size": "tensor-parallel ranks: each holds a share of every layer's heads and weights",
    "pipeline_parallel_size": "pipeline stages: each holds a contiguous range of the layers",
    "distributed_executor_backend": "how the ranks are started: mp (a process per rank on this machine), ray (Ray "
    "actors, across the machines of a Ray cluster), uni (one rank, in the engine "
    "process); default: uni for one rank, ray with RAY_ADDRESS or more ranks than "
    "GPUs, else mp",
    "quantization": "weight quantization: awq, gptq, weight_only_int8, smooth_quant, fp8 or gguf (default: what "
    "the checkpoint's quantization_config says, and gguf for a quantized .gguf on CPU; weight_only_int8 and fp8 "
    "also quantize an unquantized model while loading; none runs a quantized .gguf dequantized to --dtype)",
    "kv_cache_ratio": "share of KV blocks new prompts may fill while others run (FastDeploy; 1.0: no reserve)",
    "kv_events_config": "publish the prefix cache's changes (vLLM's KV events), as JSON: {\"enable_kv_cache_events\": "
    'true, "publisher": "zmq", "endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}',
    "long_prefill_token_threshold": "most prompt tokens one request may compute in a step (0: no limit; with "
    "--scheduling-policy priority, only for prompts of a worse priority than the best seen)",
    "prompt_tail_tokens": "a prompt chunk that the step budget would cut short by at most N tokens (all such "
    "chunks of a step together) takes them in the same step, so that its request streams a step sooner "
    "(default: 1/16 of --max-num-batched-tokens; 0: off)",
    "pd_role": "prefill/decode disaggregation role: mixed (default), prefill or decode",
    "kv_host": "address decode instances use to reach this prefill instance's KV server",
    "kv_port": "port of this instance's KV server (0: any free port)",
    "enforce_eager": "no CUDA graphs: launch every kernel of every step from Python (GPU only)",
    "cuda_graph_sizes": "decode batch sizes captured in CUDA graphs: one value N means 1, 2, 4 and the multiples "
    "of 8 up to N; several values are the sizes (default: N = min(max_num_seqs, 512))",
    "max_seq_len_to_capture": "longest sequence a CUDA graph runs: a decode step with a longer one runs eagerly",
    "disable_async_output_proc": "do not overlap a step's output handling with the next step (turns "
    "--async-scheduling off)",
    "num_scheduler_steps": "forward steps per scheduler call: only 1 (multi-step decoding is not implemented)",
    "scheduler_delay_factor": "hold new prompts back until the oldest has waited this many times the last "
    "prompt step's latency (0: no delay), so that prompts arriving close together are batched",
    "tokenizer_extension_path": "AIAK's tokenizer extension module: refused (use --tokenizer)",
    "enable_mm": "multimodal input (FastDeploy's flag): accepted for a vision-language model, which takes images "
    "without it (docs/multimodal.md); refused for a text-only model",
    "structured_outputs_config": "structured output's defaults, as JSON (vLLM's keys): {\"disable_any_whitespace\": "
    "false} lets JSON guides place whitespace anywhere JSON allows (default true: one-line JSON, which keeps small "
    'models from spending max_tokens on whitespace); {"backend": "xgrammar"}',
    "limit_mm_per_prompt": 'most images one prompt may carry, as JSON: {"image": N} (default 999; vLLM\'s flag)',
    "async_scheduling": "overlap scheduling: prepare step N+1 while the device runs step N (default: on for "
    "CUDA, off for CPU, where the forward runs on the host's own cores)",
    "kv_lease_seconds": "a prefill instance frees KV blocks no decode instance pulled after this long",
    "swap_space": "GiB of host memory per rank that preempted requests' KV is swapped to (with --preemption-mode swap)",
    "preemption_mode": "recompute (free a preempted request's KV and compute it again) or swap (copy it to host "
    "memory, --swap-space, and back)",
    "kv_offloading_size": "GiB of host memory (all ranks together) that prefix-cache blocks evicted from the KV "
    "cache are kept in and loaded back from, instead of computed again (docs/scaling.md)",
    "kv_offloading_backend": "native: splitserve's own host tier (vLLM's flag; LMCache is not integrated)",
    "kv_cache_dir": "also keep offloaded KV blocks as files in this directory: they survive a restart, and "
    "instances of the same model on this host read one another's (docs/scaling.md)",
    "kv_cache_dir_size": "GiB of files (all ranks together) --kv-cache-dir may hold; the least recently used "
    "blocks are deleted past it",
    "enable_lora": "serve LoRA adapters (docs/lora.md): requests pick one by its name in the model field",
    "max_loras": "most LoRA adapters in one step (each takes a slot of memory in every LoRA layer)",
    "max_lora_rank": "highest LoRA rank an adapter may have (the slots are sized for it)",
    "max_cpu_loras": "LoRA adapters kept read in host memory (default: max_loras)",
    "lora_modules": 'adapters to serve from the start: name=path, or JSON {"name": ..., "path": ..., '
    '"base_model_name": ...}; several may follow the flag',
    "data_parallel_size": "replicas of the whole model, each its own engine process with its share of the CPU cores "
    "or GPUs, requests to the least busy: behind one API server (`splitserve serve`) or the offline LLM "
    "(docs/scaling.md)",
    "data_parallel_backend": "where the replicas' ranks run: mp (this machine, each replica its share of the cores "
    "or GPUs) or ray (Ray actors on the machines of the Ray cluster in RAY_ADDRESS, placed by Ray; vLLM's flag)",
    "enable_expert_parallel": "mixture-of-experts layers: whole experts per tensor-parallel rank (E / tp each) "
    "instead of a slice of every expert (docs/moe.md)",
    "batch_invariant": "every row of a step computed as it would be alone: greedy output that does not depend on the "
    "batch, chunking, prefix hits or the deployment (CPU; also SPLITSERVE_BATCH_INVARIANT=1; docs/determinism.md)",
    "scheduler_ttl": "FastDeploy's LocalScheduler TTL: a request that has waited this many seconds without "
    "running is dropped with a 503 (0, the default: no limit; FastDeploy's own default is 900)",
    "scheduling_policy": "fcfs (arrival order) or priority (a request's `priority` field, lower first; the "
    "lowest priority is preempted first)",
    "served_model_name": 'the name requests give as `model` (default: the model\'s name; "default" is always accepted)',
    "speculative_config": 'speculative decoding, as JSON: {"method": "ngram", "num_speculative_tokens": 4} (also '
    '"suffix", or "model": a draft model; see docs/speculative.md)',
    "runner": "generate (completions, chat) or pooling (embeddings, score, rerank; docs/pooling.md); auto: pooling "
    "for a bare *Model architecture (Qwen3Model, LlamaModel ...), else generate",
    "task": "vLLM's older spelling of --runner: generate, or embed / embedding (the pooling runner)",
    "pooler_config": 'how the pooling runner pools, as JSON: {"pooling_type": "LAST"|"MEAN"|"CLS", "normalize": '
    'true, "matryoshka_dimensions": [...]} (default: the model\'s sentence-transformers files, else LAST and '
    "normalized; also --override-pooler-config)",
}
_ALIASES = {
    "tensor_parallel_size": ["-tp"],
    "pipeline_parallel_size": ["-pp"],
    "data_parallel_size": ["-dp"],
    "quantization": ["-q"],
    "pooler_config": ["--override-pooler-config"],
}
# Arguments that only a Python caller sets, or that exist to be refused with a clear message.
_HIDDEN_ENGINE_ARGS = {"revision", "num_cpu_blocks", "device", "use_tqdm_on_load"}


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
        elif field.type == "list[str] | None":
            kwargs.update(nargs="+", action="extend")  # the flag may also be repeated
        elif field.type in ("int", "int | None"):
            kwargs["type"] = int
        elif field.type in ("float", "float | None"):
            kwargs["type"] = float
        elif field.type == "dict | None":
            kwargs["type"] = _json_object
        group.add_argument(*flags, **kwargs)


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"not JSON: {exc}") from exc
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {text!r}")
    return value


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
        elif isinstance(value, dict):
            flags += [flag, json.dumps(value)]
        else:
            flags += [flag, str(value)]
    return flags
