"""EngineArgs: everything a user can set, flat, with vLLM's names, and what resolves it into an
EngineConfig; on the command line, one flag per field (--max-model-len, --enable-prefix-caching ...),
and back again (the flags that recreate a set of EngineArgs, for launchers that start instances)."""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from splitserve.config import (
    LOAD_FORMATS,
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
    resolve_device,
)
from splitserve.engine import startup

if TYPE_CHECKING:
    import torch


@dataclass
class EngineArgs:
    """Everything a user can set, flat, with vLLM's names. `create_engine_config()` resolves it."""

    model: str | None = None
    tokenizer: str | None = None
    revision: str | None = None
    trust_remote_code: bool = False
    dtype: str = "auto"
    load_format: str = "auto"
    use_tqdm_on_load: bool = True
    seed: int = 0
    max_model_len: int | None = None
    hf_overrides: dict | None = None  # config.json keys to change (rope_scaling, use_logn_attn ...)
    served_model_name: str | None = None
    block_size: int = 16
    kv_cache_dtype: str = "auto"
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_batched_tokens: int | None = None
    max_num_seqs: int = 256
    long_prefill_token_threshold: int = 0
    prompt_tail_tokens: int | None = None  # None: 1/16 of the step budget with chunked prefill
    kv_cache_ratio: float = 1.0
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str | None = None  # None: uni for one rank, else mp (or ray, see below)
    device: str = "auto"
    quantization: str | None = None
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None
    max_seq_len_to_capture: int = 8192
    async_scheduling: bool | None = None  # None: on for CUDA, off for CPU
    disable_async_output_proc: bool = False
    num_scheduler_steps: int = 1
    scheduler_delay_factor: float = 0.0
    tokenizer_extension_path: str | None = None
    enable_mm: bool = False
    swap_space: float = 0.0  # GiB of host memory per rank for swapped-out KV (preemption_mode "swap")
    preemption_mode: str = "recompute"
    num_cpu_blocks: int | None = None  # exact host blocks, instead of swap_space (LMDeploy's num_cpu_blocks)
    pd_role: str = "mixed"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_lease_seconds: float = 60.0
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[str] | None = None

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        from splitserve.loader.resolve import load_model_config  # transformers: only when an engine is made

        self._verify_supported()
        device = resolve_device(self.device)
        with startup.phase("model config"):
            model_config = load_model_config(self, device)
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching,
            cache_dtype=self.kv_cache_dtype,
            num_cpu_blocks_override=self.num_cpu_blocks,
            swap_space_bytes=int(self.swap_space * (1 << 30)),
        )
        cache_config.verify()
        max_len = model_config.max_model_len
        budget = self.max_num_batched_tokens or _default_step_budget(device, max_len, self.enable_chunked_prefill)
        scheduler_config = SchedulerConfig(
            max_num_seqs=self.max_num_seqs,
            max_num_batched_tokens=budget,
            max_model_len=max_len,
            enable_chunked_prefill=self.enable_chunked_prefill,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            prompt_tail_tokens=budget // 16 if self.prompt_tail_tokens is None else self.prompt_tail_tokens,
            kv_cache_ratio=self.kv_cache_ratio,
            delay_factor=self.scheduler_delay_factor,
            preemption_mode=self.preemption_mode,
        )
        scheduler_config.verify()
        kv_transfer_config = KVTransferConfig(self.pd_role, self.kv_host, self.kv_port, self.kv_lease_seconds)
        kv_transfer_config.verify()
        parallel_config = self._parallel_config(device)
        parallel_config.verify_with_model(model_config.hf_config)
        return EngineConfig(
            model_config,
            cache_config,
            scheduler_config,
            device,
            parallel_config=parallel_config,
            enforce_eager=self.enforce_eager,
            cuda_graph_sizes=self.cuda_graph_sizes,
            max_seq_len_to_capture=self.max_seq_len_to_capture,
            async_scheduling=self._async_scheduling(device, parallel_config),
            use_tqdm_on_load=self.use_tqdm_on_load,
            kv_transfer_config=kv_transfer_config,
            lora_config=self._lora_config(),
        )

    def _lora_config(self) -> LoRAConfig | None:
        from splitserve.lora.request import parse_lora_modules

        modules = parse_lora_modules(self.lora_modules)
        if not self.enable_lora:
            if modules:
                raise ValueError("--lora-modules needs --enable-lora.")
            return None
        config = LoRAConfig(self.max_loras, self.max_lora_rank, self.max_cpu_loras, modules)
        config.verify()
        return config

    def _async_scheduling(self, device: torch.device, parallel: ParallelConfig) -> bool:
        """vLLM's --disable-async-output-proc turns off the overlap of one step's output handling with
        the next step's forward, which is what overlap scheduling does here."""
        if self.disable_async_output_proc:
            if self.async_scheduling:
                raise ValueError("--async-scheduling and --disable-async-output-proc contradict each other.")
            return False
        return _resolve_async_scheduling(self.async_scheduling, device, parallel)

    def _parallel_config(self, device: torch.device) -> ParallelConfig:
        config = ParallelConfig(
            self.tensor_parallel_size, self.pipeline_parallel_size, self.distributed_executor_backend or "uni"
        )
        if self.distributed_executor_backend is None and config.world_size > 1:
            config.distributed_executor_backend = _default_executor_backend(config.world_size, device)
        config.verify()
        return config

    def _verify_supported(self) -> None:
        """Refuse settings whose feature does not exist yet, instead of silently ignoring them."""
        if self.swap_space < 0 or (self.num_cpu_blocks is not None and self.num_cpu_blocks < 0):
            raise ValueError("swap_space and num_cpu_blocks must be >= 0.")
        swap_memory = self.swap_space > 0 or bool(self.num_cpu_blocks)
        if swap_memory and self.preemption_mode != "swap":
            raise ValueError("--swap-space / num_cpu_blocks is host memory for --preemption-mode swap; set that too.")
        if self.preemption_mode == "swap" and not swap_memory:
            raise ValueError("--preemption-mode swap needs host memory: give --swap-space (GiB per rank).")
        if self.num_scheduler_steps != 1:
            raise ValueError(
                f"num_scheduler_steps={self.num_scheduler_steps}: multi-step decoding is not implemented; only 1 "
                "is. Its purpose, hiding the scheduler's time behind the device's, is what --async-scheduling "
                "does (on by default on GPUs)."
            )
        if self.tokenizer_extension_path is not None:
            raise ValueError(
                "--tokenizer-extension-path (AIAK's vllm_extension.py hook) is not supported: splitserve loads "
                "tokenizers with transformers. Give a tokenizer directory with --tokenizer (and "
                "--trust-remote-code for a custom tokenizer class)."
            )
        if self.enable_mm:
            raise ValueError("--enable-mm: multimodal input is not supported yet; splitserve serves text models.")
        if self.max_seq_len_to_capture < 1:
            raise ValueError(f"max_seq_len_to_capture must be >= 1, got {self.max_seq_len_to_capture}.")
        if self.cuda_graph_sizes is not None and (not self.cuda_graph_sizes or min(self.cuda_graph_sizes) < 1):
            raise ValueError(f"cuda_graph_sizes must be positive batch sizes, got {self.cuda_graph_sizes}.")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}.")


def _resolve_async_scheduling(asked: bool | None, device: torch.device, parallel: ParallelConfig) -> bool:
    """Overlap pays where the device computes while the host works: on a GPU. A CPU forward runs
    on the host's own cores, so there it only reorders work (it stays available, for testing).
    Pipeline stages run one after another within a step, so with several there is no overlap."""
    if parallel.pipeline_parallel_size > 1:
        if asked:
            raise ValueError(
                "async_scheduling does not work with pipeline_parallel_size > 1 yet: the first "
                "stage would need the last stage's sampled tokens on its own device."
            )
        return False
    return device.type == "cuda" if asked is None else asked


def _default_executor_backend(world_size: int, device: torch.device) -> str:
    """vLLM's rule: Ray when a Ray cluster is given (RAY_ADDRESS, or Ray already running in this
    process) or the world is larger than this machine's GPUs; else one process per rank here
    (on CPU, ranks share the cores when there are fewer cores than ranks)."""
    import os
    import sys

    ray = sys.modules.get("ray")
    if os.environ.get("RAY_ADDRESS") or (ray is not None and ray.is_initialized()):
        return "ray"
    import torch

    if device.type == "cuda" and world_size > torch.cuda.device_count():
        return "ray"
    return "mp"


def _default_step_budget(device: torch.device, max_model_len: int, chunked_prefill: bool) -> int:
    """max_num_batched_tokens when not given. Without chunked prefill a whole prompt must fit.
    With it: 8192 on GPUs; 2048 on CPUs, where smaller prompt chunks mixed with the running decodes
    measured ~8% more output tokens/s than 8192 (docs/cpu-performance.md) and let the first
    requests of a burst start streaming after one chunk instead of after every prompt."""
    if not chunked_prefill:
        return max(8192, max_model_len)
    return 2048 if device.type == "cpu" else 8192


_ENGINE_HELP = {
    "model": "Hugging Face directory, hub id, or .gguf file (default: the embedded SmolLM2-135M-Instruct)",
    "tokenizer": "tokenizer directory or hub id, when it is not the model's",
    "dtype": "auto, float32, bfloat16 or float16 (auto: the checkpoint's; float16 becomes bfloat16 on CPU)",
    "load_format": "auto, safetensors, pt, gguf, or dummy (random weights from the config, for benchmarks)",
    "max_model_len": "longest sequence (prompt + output) in tokens; default: the model's max_position_embeddings "
    "(longer only with dynamic NTK rope scaling)",
    "hf_overrides": "JSON object of config.json keys to change (vLLM's --hf-overrides), e.g. "
    "rope_scaling (which keeps the rope's frequency base) or use_logn_attn",
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
    "long_prefill_token_threshold": "most prompt tokens one request may compute in a step (0: no limit)",
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
    "enable_mm": "multimodal input: refused (not supported yet)",
    "async_scheduling": "overlap scheduling: prepare step N+1 while the device runs step N (default: on for "
    "CUDA, off for CPU, where the forward runs on the host's own cores)",
    "kv_lease_seconds": "a prefill instance frees KV blocks no decode instance pulled after this long",
    "swap_space": "GiB of host memory per rank that preempted requests' KV is swapped to (with --preemption-mode swap)",
    "preemption_mode": "recompute (free a preempted request's KV and compute it again) or swap (copy it to host "
    "memory, --swap-space, and back)",
    "enable_lora": "serve LoRA adapters (docs/lora.md): requests pick one by its name in the model field",
    "max_loras": "most LoRA adapters in one step (each takes a slot of memory in every LoRA layer)",
    "max_lora_rank": "highest LoRA rank an adapter may have (the slots are sized for it)",
    "max_cpu_loras": "LoRA adapters kept read in host memory (default: max_loras)",
    "lora_modules": 'adapters to serve from the start: name=path, or JSON {"name": ..., "path": ..., '
    '"base_model_name": ...}; several may follow the flag',
}
_ALIASES = {"tensor_parallel_size": ["-tp"], "pipeline_parallel_size": ["-pp"], "quantization": ["-q"]}
# Arguments that only a Python caller sets, or that exist to be refused with a clear message.
_HIDDEN_ENGINE_ARGS = {"revision", "served_model_name", "num_cpu_blocks", "device", "use_tqdm_on_load"}


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
