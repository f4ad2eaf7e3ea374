"""The Prometheus metrics that gateways' endpoint pickers read from vLLM, beyond the load gauges
every splitserve server exports (metrics.py: num_requests_running, num_requests_waiting,
kv_cache_usage_perc). Under `--metrics-prefix vllm` they carry vLLM's names and labels:

- `vllm:gpu_cache_usage_perc`: vLLM's older name of kv_cache_usage_perc (the Gateway API Inference
  Extension's endpoint picker read it before vLLM renamed it), the same value;
- `vllm:cache_config_info`: an info gauge (value 1) whose labels carry the KV cache's configuration:
  `block_size` and `num_gpu_blocks` are what the endpoint picker's prefix-cache scorer reads, the
  others are vLLM's CacheConfig fields splitserve has (`engine` is the data-parallel replica);
- `vllm:lora_requests_info` (LoRA on only, as in vLLM): labels `running_lora_adapters` and
  `waiting_lora_adapters` (the adapters of the requests running and waiting, comma-separated) and
  `max_lora`; its value is the time it was set, the picker reads the newest series (the Inference
  Extension's model server protocol, "LoRA Adapter Serving"). As in vLLM, it has no model_name label.
"""

from __future__ import annotations

import os

from splitserve.config import EngineConfig
from splitserve.engine.messages import SchedulerStats

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def cache_config_labels(config: EngineConfig, engine: int = 0) -> dict[str, str]:
    """vllm:cache_config_info's labels: vLLM's CacheConfig field names, values as str() gives them."""
    cc = config.cache_config
    return {
        "block_size": str(cc.block_size),
        "cache_dtype": str(cc.cache_dtype),
        "enable_prefix_caching": str(cc.enable_prefix_caching),
        "gpu_memory_utilization": str(cc.gpu_memory_utilization),
        "num_cpu_blocks": str(cc.num_cpu_blocks),
        "num_gpu_blocks": str(cc.num_gpu_blocks),
        "num_gpu_blocks_override": str(cc.num_gpu_blocks_override),
        "engine": str(engine),
    }


def lora_labels(stats: SchedulerStats, max_loras: int) -> dict[str, str]:
    """vllm:lora_requests_info's labels from the engine's stats: adapter names comma-separated, sorted
    (one series per set of adapters, whatever order their requests came in)."""
    return {
        "max_lora": str(max_loras),
        "waiting_lora_adapters": ",".join(sorted(stats.waiting_loras or {})),
        "running_lora_adapters": ",".join(sorted(stats.running_loras or {})),
    }


class GatewayMetrics:
    """The gauges above, set from the engine's stats (`record`, called with every stats message)."""

    def __init__(self, config: EngineConfig, model_name: str, prefix: str):
        from prometheus_client import Gauge

        mode = {"multiprocess_mode": "mostrecent"} if os.environ.get(MULTIPROC_ENV) is not None else {}
        self.gpu_cache_usage_perc = Gauge(
            f"{prefix}:gpu_cache_usage_perc",
            "Fraction of KV-cache blocks in use (0-1): kv_cache_usage_perc under vLLM's older name.",
            ["model_name"],
            **mode,
        ).labels(model_name=model_name)
        replicas = config.parallel_config.data_parallel_size
        info = [cache_config_labels(config, engine) for engine in range(replicas)]
        cache_info = Gauge(
            f"{prefix}:cache_config_info", "Information of the LLMEngine CacheConfig", list(info[0]), **mode
        )
        for labels in info:
            cache_info.labels(**labels).set(1)
        self.max_loras = config.lora_config.max_loras if config.lora_config is not None else None
        self.lora_info = None
        if self.max_loras is not None:
            self.lora_info = Gauge(
                f"{prefix}:lora_requests_info",
                "Running stats on lora requests.",
                ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                **mode,
            )

    def record(self, stats: SchedulerStats) -> None:
        self.gpu_cache_usage_perc.set(stats.kv_cache_usage)
        if self.lora_info is not None:
            self.lora_info.labels(**lora_labels(stats, self.max_loras)).set_to_current_time()
