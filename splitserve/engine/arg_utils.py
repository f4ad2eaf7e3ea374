"""EngineArgs: everything a user can set, flat, with vLLM's names, and what resolves it into an
EngineConfig (its command-line flags are in arg_flags.py)."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING

from splitserve import envs
from splitserve.config import (
    CacheConfig,
    EngineConfig,
    KVTransferConfig,
    LoRAConfig,
    ParallelConfig,
    SchedulerConfig,
)
from splitserve.devices import resolve_device
from splitserve.engine import compatibility, startup
from splitserve.engine.arg_defaults import (
    default_executor_backend,
    default_step_budget,
    pooling_may_cache,
    resolve_async_scheduling,
)
from splitserve.engine.compatibility import check_settings
from splitserve.engine.core.kv_events import KVEventsConfig
from splitserve.sampling_params import StructuredOutputsConfig
from splitserve.spec_decode.config import SpeculativeConfig

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
    generation_config: str = "auto"  # a request's default sampling: auto (the model's), vllm or a directory
    override_generation_config: dict | None = None
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
    enable_expert_parallel: bool = False
    data_parallel_size: int = 1  # model replicas, each its own engine process (engine/dp_client.py, dp_async_llm.py)
    data_parallel_backend: str = "mp"  # where the replicas' ranks run: mp (this machine), ray (the Ray cluster)
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
    scheduling_policy: str = "fcfs"
    scheduler_ttl: float = 0.0  # FastDeploy's: seconds a request may wait before it first runs (0: no limit)
    num_cpu_blocks: int | None = None  # exact host blocks, instead of swap_space (LMDeploy's num_cpu_blocks)
    kv_offloading_size: float | None = None  # GiB of host memory (all ranks together) for evicted prefix blocks
    kv_offloading_backend: str | None = None  # native (vLLM's names; kv_tier/index.py)
    kv_cache_dir: str | None = None  # the offloaded blocks on disk too: survive restarts, shared on a host
    kv_cache_dir_size: float = 16.0  # GiB of files (all ranks together) in kv_cache_dir
    pd_role: str = "mixed"
    kv_host: str = "127.0.0.1"
    kv_port: int = 0
    kv_lease_seconds: float = 60.0
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    lora_modules: list[str] | None = None
    speculative_config: dict | None = None  # SpeculativeConfig's keys (spec_decode/config.py)
    batch_invariant: bool = False  # or SPLITSERVE_BATCH_INVARIANT=1 (kernels/batch_invariant.py)
    runner: str = "auto"  # generate or pooling (embeddings); auto: pooling for a bare *Model architecture
    task: str = "auto"  # vLLM's older name for the runner: generate, embed (embedding)
    pooler_config: dict | None = None  # PoolerConfig's keys: pooling_type, normalize, matryoshka_dimensions
    kv_events_config: dict | None = None  # vLLM's KVEventsConfig keys (engine/core/kv_events.py)
    limit_mm_per_prompt: dict | None = None  # vLLM's: most items per prompt by modality, {"image": N}
    structured_outputs_config: dict | None = None  # vLLM's StructuredOutputsConfig keys (sampling_params.py)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in fields(cls)}

    def create_engine_config(self) -> EngineConfig:
        from splitserve.loader.generation_config import sampling_defaults
        from splitserve.loader.resolve import load_model_config  # transformers: only when an engine is made

        check_settings(self)
        device = resolve_device(self.device)
        with startup.phase("model config"):
            model_config = load_model_config(self, device)
            model_config.sampling_defaults = sampling_defaults(model_config)
            self._resolve_runner(model_config)
            self._resolve_multimodal(model_config)
            model_config.structured_outputs_config = StructuredOutputsConfig.from_value(self.structured_outputs_config)
        cache_config = CacheConfig(
            block_size=self.block_size,
            gpu_memory_utilization=self.gpu_memory_utilization,
            kv_cache_memory_bytes=self.kv_cache_memory_bytes,
            num_gpu_blocks_override=self.num_gpu_blocks_override,
            enable_prefix_caching=self.enable_prefix_caching and pooling_may_cache(model_config),
            cache_dtype=self.kv_cache_dtype,
            num_cpu_blocks_override=self.num_cpu_blocks,
            swap_space_bytes=int(self.swap_space * (1 << 30)),
            kv_offloading_bytes=int((self.kv_offloading_size or 0) * (1 << 30) / self._world_size),
            kv_cache_dir=self.kv_cache_dir,
            kv_cache_dir_bytes=int(self.kv_cache_dir_size * (1 << 30) / self._world_size),
        )
        cache_config.verify()
        max_len = model_config.max_model_len
        budget = self.max_num_batched_tokens or default_step_budget(device, max_len, self.enable_chunked_prefill)
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
            policy=self.scheduling_policy,
            waiting_ttl=self.scheduler_ttl,
        )
        speculative = SpeculativeConfig.parse(self.speculative_config)
        if speculative is not None and speculative.method == "draft_model":
            # The draft model writes its next drafts' KV past the verified tokens: room for them.
            scheduler_config.num_lookahead_tokens = speculative.num_speculative_tokens
        scheduler_config.verify()
        kv_transfer_config = KVTransferConfig(self.pd_role, self.kv_host, self.kv_port, self.kv_lease_seconds)
        kv_transfer_config.verify()
        parallel_config = self._parallel_config(device)
        parallel_config.verify_with_model(model_config.hf_text_config)
        return EngineConfig(
            model_config,
            cache_config,
            scheduler_config,
            device,
            parallel_config=parallel_config,
            enforce_eager=self.enforce_eager,
            cuda_graph_sizes=self.cuda_graph_sizes,
            max_seq_len_to_capture=self.max_seq_len_to_capture,
            async_scheduling=self._async_scheduling(device, parallel_config, speculative),
            use_tqdm_on_load=self.use_tqdm_on_load,
            kv_transfer_config=kv_transfer_config,
            kv_events_config=self._kv_events_config(),
            lora_config=self._lora_config(),
            speculative_config=speculative,
            batch_invariant=self.batch_invariant or envs.SPLITSERVE_BATCH_INVARIANT,
            draft_model_config=self._draft_model_config(speculative, model_config, device),
        )

    def _resolve_runner(self, model_config) -> None:
        """The pooling runner (embeddings) or the generate runner, and the pooler config with it."""
        from splitserve.pooling_params import PoolerConfig, is_classifier

        tasks = {"auto": None, "generate": "generate"} | dict.fromkeys(
            ("embed", "embedding", "classify", "score", "rerank"), "pooling"
        )
        if self.runner not in ("auto", "generate", "pooling"):
            raise ValueError(f"runner must be auto, generate or pooling; got {self.runner!r}.")
        if self.task not in tasks:
            raise ValueError(f"task must be one of {', '.join(tasks)}; got {self.task!r}.")
        runner = self.runner if self.runner != "auto" else tasks[self.task]
        classifier = is_classifier(model_config.hf_config)
        if runner is None:  # auto: a bare transformer (Qwen3Model ...) or a classifier has no LM head to generate with
            runner = "pooling" if model_config.architecture.endswith("Model") or classifier else "generate"
        if runner == "generate" and classifier:
            raise ValueError(
                f"{model_config.architecture} is a classification model (a reranker or classifier): it scores and "
                "classifies with the pooling runner (--runner pooling, the default for it), it cannot generate."
            )
        if runner == "pooling":  # chosen from the model's architecture too: compatibility.check could not see it
            if self.speculative_config:
                raise compatibility.refusal("pooling+speculative")
            if self.pd_role != "mixed":
                raise compatibility.refusal("pooling+pd_role")
            directory = model_config.model if os.path.isdir(model_config.model) else None
            model_config.pooler_config = PoolerConfig.resolve(directory, model_config.hf_config, self.pooler_config)
        elif self.pooler_config:
            raise ValueError("--pooler-config is for the pooling runner: add --runner pooling.")
        model_config.runner_type = runner

    def _resolve_multimodal(self, model_config) -> None:
        """Image input: a vision-language model takes it without a flag (--enable-mm, FastDeploy's, is
        accepted for one); --limit-mm-per-prompt caps the images of a prompt."""
        limits = self.limit_mm_per_prompt
        if not model_config.is_multimodal:
            if self.enable_mm or limits:
                raise ValueError(
                    f"--enable-mm / --limit-mm-per-prompt: {model_config.architecture} has no vision encoder, "
                    "so it takes no images. Serve a vision-language model (LLaVA, docs/multimodal.md)."
                )
            return
        for key, value in (limits or {}).items():
            if key != "image" or not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f'--limit-mm-per-prompt takes {{"image": N}} with N >= 0; got {key!r}: {value!r}.')
        model_config.limit_mm_per_prompt = dict(limits or {})

    def _draft_model_config(self, speculative: SpeculativeConfig | None, target, device: torch.device):
        """The draft model of speculative decoding, loaded as any model is, sharing the target's vocabulary."""
        if speculative is None or speculative.method != "draft_model":
            return None
        from splitserve.loader.resolve import load_model_config

        args = EngineArgs(
            model=speculative.model,
            dtype=speculative.dtype or self.dtype,
            load_format=speculative.load_format or self.load_format,
            quantization=speculative.quantization,
            max_model_len=target.max_model_len,
            trust_remote_code=self.trust_remote_code,
            seed=self.seed,
        )
        with startup.phase("draft model config"):
            draft = load_model_config(args, device)
        if draft.vocab_size != target.vocab_size:
            raise ValueError(
                f"The draft model {speculative.model} has a vocabulary of {draft.vocab_size} tokens, the target "
                f"{target.vocab_size}: speculative decoding needs a draft that shares the target's tokenizer."
            )
        return draft

    def _kv_events_config(self) -> KVEventsConfig | None:
        config = KVEventsConfig.from_value(self.kv_events_config)
        if config is not None:  # each replica publishes on its own sockets (vLLM's port offset)
            config.check_ranks(self.data_parallel_size)
        return config

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

    def _async_scheduling(self, device: torch.device, parallel: ParallelConfig, speculative) -> bool:
        """vLLM's --disable-async-output-proc turns off the overlap of one step's output handling with
        the next step's forward, which is what overlap scheduling does here. Speculative decoding
        needs each step's tokens before it can propose the next step's drafts: overlap only when
        asked for, and then of the output handling (EngineCore.step_with_overlap)."""
        if self.disable_async_output_proc:  # asked for too: refused by compatibility.py
            return False
        if speculative is not None and self.async_scheduling is None:  # off unless asked for
            return False
        return resolve_async_scheduling(self.async_scheduling, device, parallel)

    @property
    def _world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def _parallel_config(self, device: torch.device) -> ParallelConfig:
        config = ParallelConfig(
            self.tensor_parallel_size,
            self.pipeline_parallel_size,
            self.distributed_executor_backend or "uni",
            self.enable_expert_parallel,
            self.data_parallel_size,
        )
        if self.data_parallel_backend not in ("mp", "ray"):
            raise ValueError(f"data_parallel_backend must be 'mp' or 'ray', got {self.data_parallel_backend!r}.")
        if self.data_parallel_backend == "ray":  # every replica's ranks are Ray actors, placed by Ray
            if self.distributed_executor_backend not in (None, "ray"):
                raise ValueError(
                    f"--data-parallel-backend ray runs each replica's ranks as Ray actors: not with "
                    f"--distributed-executor-backend {self.distributed_executor_backend}."
                )
            config.distributed_executor_backend = "ray"
        elif self.distributed_executor_backend is None and config.world_size > 1:
            config.distributed_executor_backend = default_executor_backend(config.world_size, device)
        config.verify()
        return config
