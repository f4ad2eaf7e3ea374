"""The LMDeploy-style engine configurations, mapped onto splitserve's EngineArgs: `PytorchEngineConfig`
and `TurbomindEngineConfig` (see lmdeploy_api.py; GenerationConfig is lmdeploy_generation.py's)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.devices import resolve_device
from splitserve.engine.arg_utils import EngineArgs


def _refuse_unsupported(config, unsupported: dict[str, tuple[object, str]]) -> None:
    """Raise for the first field whose value is not its supported default: silently ignoring a
    setting would hand the user a different engine from the one asked for."""
    for name, (supported, why) in unsupported.items():
        value = getattr(config, name)
        if value != supported:
            raise ValueError(
                f"{type(config).__name__}.{name}={value!r} is not supported by splitserve: {why} "
                f"Leave it at {supported!r}."
            )


def _check_range(config, name: str, ok: bool, expected: str) -> None:
    if not ok:
        raise ValueError(f"{type(config).__name__}.{name} must be {expected}, got {getattr(config, name)!r}.")


def _mem_available_bytes() -> int:
    """Free host memory as the kernel counts it (MemAvailable), for the CPU KV-cache budget."""
    try:
        import psutil
    except ImportError:
        pass
    else:
        return int(psutil.virtual_memory().available)
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    raise ValueError(
        "Cannot tell how much host memory is free (no psutil, no /proc/meminfo), so "
        "cache_max_entry_count cannot be turned into a KV-cache size: set num_gpu_blocks instead."
    )


def _kv_cache_kwargs(fraction: float, device: str) -> dict:
    """cache_max_entry_count is LMDeploy's share of free memory for the KV cache. On CUDA it becomes
    gpu_memory_utilization (the cache then gets free - (1 - fraction) * total bytes: the same share
    when the GPU holds nothing else). On CPU it is that share of MemAvailable, measured now, before
    the weights are loaded."""
    if resolve_device(device).type == "cuda":
        return {"gpu_memory_utilization": fraction}
    return {"kv_cache_memory_bytes": int(fraction * _mem_available_bytes())}


def _common_engine_args(config, model_path: str, block_size: int, device: str, **extra) -> EngineArgs:
    """The EngineArgs that both backend configs share; their fields have the same names here."""
    _check_range(
        config,
        "cache_max_entry_count",
        0.0 < config.cache_max_entry_count <= 1.0,
        "a fraction of free memory in (0, 1]",
    )
    _check_range(config, "max_prefill_token_num", config.max_prefill_token_num >= 1, ">= 1")
    _check_range(config, "max_batch_size", config.max_batch_size is None or config.max_batch_size >= 1, "None or >= 1")
    _check_range(config, "session_len", config.session_len is None or config.session_len >= 1, "None or >= 1")
    kwargs = dict(
        model=model_path,
        dtype=config.dtype,
        kv_cache_dtype=_kv_cache_dtype(config),
        revision=config.revision,
        max_model_len=config.session_len,
        block_size=block_size,
        enable_prefix_caching=config.enable_prefix_caching,
        max_num_batched_tokens=config.max_prefill_token_num,
        tensor_parallel_size=config.tp,
        device=device,
        **extra,
    )
    if config.max_batch_size is not None:
        kwargs["max_num_seqs"] = config.max_batch_size
    if kwargs.get("num_gpu_blocks_override") is None:
        kwargs.update(_kv_cache_kwargs(config.cache_max_entry_count, device))
    return EngineArgs(**kwargs)


# As the pipeline document defines quant_policy: "set it to 4 when the KV cache is quantized to 8
# bits". Newer LMDeploy releases spell 8-bit as 8, which is accepted too. An int4 KV cache is
# kv_cache_dtype='int4' (EngineArgs, LLM, the server's --kv-cache-dtype).
_QUANT_POLICY_KV_CACHE_DTYPES = {0: "auto", 4: "int8", 8: "int8"}


def _kv_cache_dtype(config) -> str:
    """LMDeploy's quant_policy as a kv_cache_dtype: 0 none, 4 (or 8) int8, quantized per token and
    KV head with no calibration, as LMDeploy's is."""
    if config.quant_policy not in _QUANT_POLICY_KV_CACHE_DTYPES:
        raise ValueError(
            f"{type(config).__name__}.quant_policy must be 0 (no KV-cache quantization) or 4 (8-bit KV "
            f"cache; 8 is accepted for it too), got {config.quant_policy!r}."
        )
    return _QUANT_POLICY_KV_CACHE_DTYPES[config.quant_policy]


_DOWNLOAD_WHY = "models are cached where huggingface_hub puts them (set HF_HUB_CACHE to move it)."


@dataclass
class PytorchEngineConfig:
    """LMDeploy's PyTorch-backend settings; `to_engine_args()` maps them onto EngineArgs.

    session_len -> max_model_len (None: the model's maximum); max_batch_size -> max_num_seqs
    (128, the document's default; None: splitserve's 256); block_size -> block_size; num_gpu_blocks > 0 ->
    num_gpu_blocks_override; max_prefill_token_num -> max_num_batched_tokens (the step budget,
    which decodes share); cache_max_entry_count -> the KV-cache budget (see `_kv_cache_kwargs`);
    eager_mode -> enforce_eager; quant_policy 0 / 4 (or 8) -> kv_cache_dtype auto / int8;
    model_name names the chat template (see lmdeploy_chat_template.py);
    dtype, revision, enable_prefix_caching keep their names.
    device_type 'cuda' runs on CUDA when it is there and on the CPU otherwise (refusing would
    break every LMDeploy example on a CPU machine); 'cpu' forces the CPU.
    prefill_interval is accepted (>= 1): the chunked-prefill scheduler admits waiting prompts on
    every step, which meets "a prefill at least every prefill_interval steps".
    adapters ({name: PEFT LoRA directory}) are served from the start; a call's adapter_name picks one.
    eviction_type 'copy' -> preemption_mode 'swap' with num_cpu_blocks host blocks (0: 4 GiB per rank).
    thread_safe is accepted: a Pipeline may always be used from several threads.
    """

    dtype: str = "auto"
    model_name: str = ""
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = 128
    cache_max_entry_count: float = 0.8  # LMDeploy's PyTorch engine's (the document leaves it out)
    prefill_interval: int = 16
    block_size: int = 64
    num_cpu_blocks: int = 0
    num_gpu_blocks: int = 0
    adapters: dict[str, str] | None = None
    max_prefill_token_num: int = 4096
    thread_safe: bool = False
    enable_prefix_caching: bool = False
    device_type: str = "cuda"
    eager_mode: bool = False
    download_dir: str | None = None
    revision: str | None = None
    quant_policy: int = 0
    eviction_type: str = "recompute"  # 'copy': preempted requests' KV goes to host memory and back

    def to_engine_args(self, model_path: str) -> EngineArgs:
        _refuse_unsupported(self, {"download_dir": (None, _DOWNLOAD_WHY)})
        _check_range(self, "prefill_interval", self.prefill_interval >= 1, ">= 1")
        _check_range(self, "num_gpu_blocks", self.num_gpu_blocks >= 0, ">= 0")
        _check_range(self, "eviction_type", self.eviction_type in ("recompute", "copy"), "'recompute' or 'copy'")
        _check_range(self, "num_cpu_blocks", self.num_cpu_blocks >= 0, ">= 0")
        if self.num_cpu_blocks and self.eviction_type != "copy":
            raise ValueError(
                "PytorchEngineConfig.num_cpu_blocks is host memory for eviction_type='copy'; with "
                f"eviction_type={self.eviction_type!r} it would be unused."
            )
        return _common_engine_args(
            self,
            model_path,
            self.block_size,
            _device(self.device_type),
            num_gpu_blocks_override=self.num_gpu_blocks or None,
            enforce_eager=self.eager_mode,
            **_eviction_kwargs(self.eviction_type, self.num_cpu_blocks),
            **_lora_kwargs(self.adapters),
        )


def _eviction_kwargs(eviction_type: str, num_cpu_blocks: int) -> dict:
    """eviction_type 'copy' swaps preempted requests' KV to host memory: num_cpu_blocks blocks, or
    (0, "as the environment allows") vLLM's default 4 GiB of swap space per rank."""
    if eviction_type != "copy":
        return {}
    if num_cpu_blocks:
        return dict(preemption_mode="swap", num_cpu_blocks=num_cpu_blocks)
    return dict(preemption_mode="swap", swap_space=4.0)


def _lora_kwargs(adapters: dict[str, str] | None) -> dict:
    """LMDeploy's `adapters` ({name: PEFT directory}) as LoRA engine arguments: every adapter may run
    in the same step, and the slots are sized for the largest rank among them."""
    if not adapters:
        return {}
    from splitserve.lora.peft import read_adapter_config

    ranks = []
    for path in adapters.values():
        config = read_adapter_config(path)
        ranks += [config.get("r", 8), *(config.get("rank_pattern") or {}).values()]
    return dict(
        enable_lora=True,
        max_loras=len(adapters),
        max_lora_rank=max(ranks),
        lora_modules=[f"{name}={path}" for name, path in adapters.items()],
    )


# LMDeploy's model_format -> splitserve's quantization (None: as the checkpoint says)
# ('llama': Meta's original layout as TurboMind names it; splitserve reads the checkpoint's own names)
_MODEL_FORMATS = {None: None, "hf": None, "llama": None, "awq": "awq", "gptq": "gptq", "fp8": "fp8"}


@dataclass
class TurbomindEngineConfig:
    """LMDeploy's TurboMind-backend settings, served by splitserve's engine like PytorchEngineConfig
    (cache_block_seq_len -> block_size; the other shared fields map the same way). The engine runs
    on CUDA when it is there and on the CPU otherwise. model_format 'awq' / 'gptq' / 'fp8' ->
    quantization (the checkpoint must be in that format; None, 'hf' or 'llama' take whatever the checkpoint's
    quantization_config says). rope_scaling_factor > 0 is dynamic NTK rope scaling with that factor, as
    transformers' LlamaAttention does it (session_len may then exceed max_position_embeddings);
    use_logn_attn scales queries past the training length by log-n (Qwen-1's). Both reach the model as
    hf_overrides. The iteration knobs are refused. Defaults as the pipeline document gives them
    (max_batch_size 128, cache_max_entry_count 0.5)."""

    dtype: str = "auto"
    model_name: str | None = None
    model_format: str | None = None
    tp: int = 1
    session_len: int | None = None
    max_batch_size: int | None = 128
    cache_max_entry_count: float = 0.5
    cache_block_seq_len: int = 64
    enable_prefix_caching: bool = False
    quant_policy: int = 0
    rope_scaling_factor: float = 0.0
    use_logn_attn: bool = False
    download_dir: str | None = None
    revision: str | None = None
    max_prefill_token_num: int = 8192
    num_tokens_per_iter: int = 0
    max_prefill_iters: int = 1

    def to_engine_args(self, model_path: str) -> EngineArgs:
        if self.model_format not in _MODEL_FORMATS:
            raise ValueError(
                f"TurbomindEngineConfig.model_format must be one of {sorted(_MODEL_FORMATS, key=str)}, "
                f"got {self.model_format!r}."
            )
        _check_range(self, "rope_scaling_factor", self.rope_scaling_factor >= 0, ">= 0 (0: no rope scaling)")
        _check_range(self, "use_logn_attn", isinstance(self.use_logn_attn, bool), "True or False")
        _refuse_unsupported(
            self,
            {
                "download_dir": (None, _DOWNLOAD_WHY),
                "num_tokens_per_iter": (0, "the step budget is max_prefill_token_num; there is no separate one."),
                "max_prefill_iters": (1, "long prompts are chunked by the step budget, not by an iteration count."),
            },
        )
        return _common_engine_args(
            self,
            model_path,
            self.cache_block_seq_len,
            "auto",
            quantization=_MODEL_FORMATS[self.model_format],
            hf_overrides=self._hf_overrides(),
        )

    def _hf_overrides(self) -> dict | None:
        """The model config changes that rope_scaling_factor and use_logn_attn ask for."""
        overrides: dict = {}
        if self.rope_scaling_factor:
            overrides["rope_scaling"] = {"rope_type": "dynamic", "factor": float(self.rope_scaling_factor)}
        if self.use_logn_attn:
            overrides["use_logn_attn"] = True
        return overrides or None


def _device(device_type: str) -> str:
    """LMDeploy's device_type as an EngineArgs device; see PytorchEngineConfig for why 'cuda' is 'auto'."""
    if device_type == "cuda":
        return "auto"
    if device_type == "cpu":
        return "cpu"
    raise ValueError(
        f"PytorchEngineConfig.device_type={device_type!r} is not supported by splitserve: "
        "use 'cuda' (CUDA when available, else the CPU) or 'cpu'."
    )
