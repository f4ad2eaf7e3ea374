"""Engine configuration: the resolved dataclasses the engine runs with (EngineArgs, in
engine/arg_utils.py, is what users set; every front-end maps onto it). Field names and defaults
follow vLLM."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.sampling_params import StructuredOutputsConfig

if TYPE_CHECKING:  # torch is imported where it is used: `splitserve serve` parses its flags and
    import torch  # starts its engine process before its own torch import (1 s)

    from splitserve.spec_decode.config import SpeculativeConfig

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")


@dataclass
class ModelConfig:
    model: str  # the path that was resolved (directory or .gguf file)
    tokenizer: str
    hf_config: object  # transformers.PretrainedConfig
    dtype: torch.dtype
    max_model_len: int
    load_format: str
    seed: int = 0
    gguf_file: str | None = None
    trust_remote_code: bool = False
    served_model_name: str = ""
    quant_config: object | None = None  # splitserve.quantization.linear.QuantizationConfig
    # The tokenizer is a stand-in (a dummy-weight model without its own tokenizer): its special
    # tokens are not the model's, so end-of-sequence ids come from the model's config instead.
    substitute_tokenizer: bool = False
    # A request's default sampling (loader/generation_config.py): auto, vllm or a directory
    generation_config: str = "auto"
    override_generation_config: dict | None = None
    sampling_defaults: dict = field(default_factory=dict)  # what they give (set by create_engine_config)
    runner_type: str = "generate"  # "pooling": requests ask for embeddings (pooling_params.py)
    pooler_config: object | None = None  # pooling_params.PoolerConfig, with the pooling runner
    limit_mm_per_prompt: dict = field(default_factory=dict)  # most images per prompt ({"image": N}; none: 999)
    # sampling_params.StructuredOutputsConfig: structured output's defaults (--structured-outputs-config)
    structured_outputs_config: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)

    @property
    def architecture(self) -> str:
        archs = getattr(self.hf_config, "architectures", None) or []
        return archs[0] if archs else ""

    @property
    def hf_text_config(self):
        """The language model's config: a vision-language model's text_config, else hf_config itself."""
        return text_config(self.hf_config)

    @property
    def is_multimodal(self) -> bool:
        return self.hf_text_config is not self.hf_config

    @property
    def vocab_size(self) -> int:
        return self.hf_text_config.vocab_size

    @property
    def num_layers(self) -> int:
        return self.hf_text_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        cfg = self.hf_text_config
        return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads

    @property
    def head_dim(self) -> int:
        cfg = self.hf_text_config
        return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


def text_config(hf_config):
    """The config of a model's language model (vLLM's hf_text_config): the text_config of a
    vision-language model's config, the config itself otherwise."""
    return getattr(hf_config, "text_config", None) or hf_config


# int8 / fp8 / int4: quantized with a scale per token and KV head (splitserve/quantization/kv_cache.py).
KV_CACHE_DTYPES = ("auto", "int8", "fp8", "fp8_e4m3", "fp8_e5m2", "int4")


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    enable_prefix_caching: bool = True
    cache_dtype: str = "auto"
    num_gpu_blocks: int | None = None  # decided when the KV cache is allocated
    # Host memory for swapped-out KV (preemption_mode "swap"): a block count, or bytes.
    num_cpu_blocks_override: int | None = None
    swap_space_bytes: int = 0
    num_cpu_blocks: int = 0  # decided when the KV cache is allocated
    # The KV offloading tier (kv_tier/index.py): host memory per rank for prefix-cache blocks
    # evicted from the device pool; a directory that keeps them on disk too, up to a size per rank.
    kv_offloading_bytes: int = 0
    kv_cache_dir: str | None = None
    kv_cache_dir_bytes: int = 16 << 30
    num_offload_blocks: int = 0  # host blocks of the tier, decided when the KV cache is allocated

    @property
    def offloads_kv(self) -> bool:
        return self.kv_offloading_bytes > 0 or self.kv_cache_dir is not None

    def verify(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}.")
        if self.swap_space_bytes < 0:
            raise ValueError(f"swap space must be >= 0 bytes, got {self.swap_space_bytes}.")
        if self.kv_offloading_bytes < 0 or self.kv_cache_dir_bytes <= 0:
            raise ValueError("kv_offloading_size must be >= 0 GiB and kv_cache_dir_size > 0 GiB.")
        if self.offloads_kv and not self.enable_prefix_caching:
            raise ValueError(
                "KV offloading (--kv-offloading-size, --kv-cache-dir) keeps prefix-cache blocks: it needs "
                "prefix caching, which is off (--no-enable-prefix-caching, or a pooling model that cannot cache)."
            )
        if self.cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(
                f"kv_cache_dtype must be one of {KV_CACHE_DTYPES} (auto: the model's dtype; fp8 is "
                f"fp8_e4m3), got {self.cache_dtype!r}."
            )


@dataclass
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_chunked_prefill: bool = True
    long_prefill_token_threshold: int = 0  # 0: a single prompt may take the whole step budget
    # A prompt chunk that the step budget would cut short by at most this many tokens (all such
    # chunks of a step together) takes them now, past max_num_batched_tokens, so that its request
    # streams one step sooner instead of waiting a whole step for a few tokens (0: off).
    prompt_tail_tokens: int = 0
    kv_cache_ratio: float = 1.0  # share of KV blocks that admitting new prompts may fill (FastDeploy)
    # New prompts wait until the oldest has waited this many times the last prompt step's latency
    # (or nothing runs), so that prompts arriving close together are batched (vLLM's delay_factor).
    delay_factor: float = 0.0
    # What preemption does with a request's KV: "recompute" frees it, "swap" copies it to host
    # memory (CacheConfig.num_cpu_blocks) and back when the request resumes.
    preemption_mode: str = "recompute"
    # KV slots reserved past a step's tokens (speculative decoding's draft model writes its next
    # drafts' KV there; vLLM's num_lookahead_slots).
    num_lookahead_tokens: int = 0
    # "fcfs": requests in arrival order; "priority": by each request's priority (lower first, then
    # arrival), and under memory pressure the lowest-priority running request is preempted (vLLM's).
    policy: str = "fcfs"
    # FastDeploy's LocalScheduler TTL: a request still waiting (never scheduled) after this many
    # seconds is dropped with an error (0: requests wait as long as it takes).
    waiting_ttl: float = 0.0

    def verify(self) -> None:
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.policy!r}.")
        if self.preemption_mode not in ("recompute", "swap"):
            raise ValueError(f"preemption_mode must be 'recompute' or 'swap', got {self.preemption_mode!r}.")
        if self.delay_factor < 0:
            raise ValueError(f"scheduler_delay_factor must be >= 0, got {self.delay_factor}.")
        if self.waiting_ttl < 0:
            raise ValueError(f"scheduler_ttl must be >= 0 seconds, got {self.waiting_ttl}.")
        if not 0.0 < self.kv_cache_ratio <= 1.0:
            raise ValueError(f"kv_cache_ratio must be in (0, 1], got {self.kv_cache_ratio}.")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}.")
        if self.prompt_tail_tokens < 0:
            raise ValueError(f"prompt_tail_tokens must be >= 0, got {self.prompt_tail_tokens}.")
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"With chunked prefill disabled, max_num_batched_tokens ({self.max_num_batched_tokens}) must be "
                f">= max_model_len ({self.max_model_len}) so that any prompt fits in one step."
            )

    @property
    def max_step_tokens(self) -> int:
        """The most tokens one step can hold: the budget plus the prompt tails it may finish."""
        return self.max_num_batched_tokens + (self.prompt_tail_tokens if self.enable_chunked_prefill else 0)


PD_ROLES = ("mixed", "prefill", "decode")


@dataclass
class KVTransferConfig:
    """Prefill/decode disaggregation: this instance's role and its KV connector's address."""

    pd_role: str = "mixed"
    kv_host: str = "127.0.0.1"  # the address decode instances use to reach this one's KV server
    kv_port: int = 0  # 0: any free port (reported to the router in every prefill answer)
    lease_seconds: float = 60.0  # a prefill instance frees unclaimed KV blocks after this long

    def verify(self) -> None:
        if self.pd_role not in PD_ROLES:
            raise ValueError(f"pd_role must be one of {PD_ROLES}, got {self.pd_role!r}.")
        if not 0 <= self.kv_port <= 65535:
            raise ValueError(f"kv_port must be in 0..65535, got {self.kv_port}.")
        if self.lease_seconds <= 0:
            raise ValueError(f"kv_lease_seconds must be > 0, got {self.lease_seconds}.")

    @property
    def is_disaggregated(self) -> bool:
        return self.pd_role != "mixed"


DISTRIBUTED_EXECUTOR_BACKENDS = ("uni", "mp", "ray")


@dataclass
class ParallelConfig:
    """How many ranks run the model and how they are started (docs/parallel.md). uni: in the engine
    process (one rank only); mp: one worker process per rank on this machine; ray: Ray actors, on
    this machine or across the machines of a Ray cluster."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    distributed_executor_backend: str = "uni"
    # Mixture-of-experts layers: each tensor-parallel rank holds whole experts (E / tp of them)
    # instead of a slice of every expert (vLLM's --enable-expert-parallel).
    enable_expert_parallel: bool = False
    # Replicas of the whole model (each with world_size ranks), each its own engine process: offline
    # only for now (engine/dp_client.py).
    data_parallel_size: int = 1

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def verify(self) -> None:
        if self.tensor_parallel_size < 1 or self.pipeline_parallel_size < 1:
            raise ValueError(
                f"tensor_parallel_size and pipeline_parallel_size must be >= 1, got "
                f"{self.tensor_parallel_size} and {self.pipeline_parallel_size}."
            )
        if self.data_parallel_size < 1:
            raise ValueError(f"data_parallel_size must be >= 1, got {self.data_parallel_size}.")
        if self.distributed_executor_backend not in DISTRIBUTED_EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {DISTRIBUTED_EXECUTOR_BACKENDS}, "
                f"got {self.distributed_executor_backend!r}."
            )
        if self.distributed_executor_backend == "uni" and self.world_size > 1:
            raise ValueError(
                f"distributed_executor_backend='uni' runs one rank in the engine process; "
                f"{self.world_size} ranks need 'mp' or 'ray'."
            )

    def verify_with_model(self, hf_config) -> None:
        """Refuse a split the model's shapes cannot take, before any rank is started."""
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        heads = hf_config.num_attention_heads
        kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
        checks = [
            (heads % tp == 0, f"its {heads} attention heads"),
            (kv_heads % tp == 0 or tp % kv_heads == 0, f"its {kv_heads} KV heads (nor replicated evenly)"),
            (hf_config.intermediate_size % tp == 0, f"its MLP's {hf_config.intermediate_size} channels"),
        ]
        for ok, what in checks:
            if not ok:
                raise ValueError(f"tensor_parallel_size={tp} does not divide {what}.")
        experts = next((getattr(hf_config, k) for k in _EXPERT_COUNT_KEYS if getattr(hf_config, k, None)), None)
        if self.enable_expert_parallel and experts and experts % tp:
            raise ValueError(
                f"--enable-expert-parallel puts whole experts on each rank: the model's {experts} experts do not "
                f"divide over the {tp} tensor-parallel ranks."
            )
        if hf_config.num_hidden_layers < pp:
            raise ValueError(
                f"pipeline_parallel_size={pp} is more than the model's {hf_config.num_hidden_layers} layers."
            )


_EXPERT_COUNT_KEYS = ("num_experts", "num_local_experts", "moe_num_experts")  # as MoE configs name it


@dataclass
class LoRAConfig:
    """Serving LoRA adapters (docs/lora.md): at most `max_loras` adapters in one step (each has a slot
    of device memory in every LoRA layer, sized for `max_lora_rank`), `max_cpu_loras` kept read in
    host memory; `lora_modules`, the adapters named at start-up (LoRAModulePath)."""

    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_modules: list = field(default_factory=list)

    def verify(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}.")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}.")
        if self.max_cpu_loras is None:
            self.max_cpu_loras = self.max_loras
        if self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras}).")


@dataclass
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    device: torch.device
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
    enforce_eager: bool = False
    cuda_graph_sizes: list[int] | None = None  # see executor/cuda_graph.capture_sizes
    max_seq_len_to_capture: int = 8192  # a decode step with a longer sequence runs eagerly
    async_scheduling: bool = False  # overlap: schedule step N+1 while the device runs step N
    use_tqdm_on_load: bool = True
    kv_transfer_config: KVTransferConfig = field(default_factory=KVTransferConfig)
    lora_config: LoRAConfig | None = None  # None: no LoRA adapters (enable_lora off)
    health_timeout: float = 30.0  # a step running longer is reported by the engine's watchdog (the server's)
    speculative_config: SpeculativeConfig | None = None  # None: no speculative decoding
    batch_invariant: bool = False  # a row's results never depend on the rest of its step (CPU)
    draft_model_config: ModelConfig | None = None  # speculative_config's draft model, resolved
    kv_events_config: object | None = None  # engine/core/kv_events.KVEventsConfig; None: no KV cache events
