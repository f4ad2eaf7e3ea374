"""What an engine core reports to its front-ends with every batch of outputs (SchedulerStats: /metrics,
the dashboard, the router's load signals): the scheduler's queues and counters, KV cache use and
memory, prefix-cache hits, KV transfer and offloading counters, speculative decoding's acceptance,
MoE expert load and LoRA adapters in use."""

from __future__ import annotations

import time

from splitserve.engine.messages import SchedulerStats

KV_MEMORY_REFRESH_S = 5.0  # how often stats ask the ranks how much of their KV cache is resident


class CoreStats:
    def __init__(self, core):
        self.core = core  # an EngineCore
        self._kv_memory, self._kv_memory_at = (0, 0), -KV_MEMORY_REFRESH_S

    def snapshot(self) -> SchedulerStats:
        core, s = self.core, self.core.scheduler
        kv_stats = core.connector.snapshot_stats() if core.connector is not None else None
        tier = core.kv_manager.pool.tier
        return SchedulerStats(
            s.num_running,
            s.num_waiting,
            core.kv_manager.usage,
            s.num_preemptions,
            s.prefix_cache_stats.queries,
            s.prefix_cache_stats.hits,
            kv_stats,
            core.loras.version,
            *self._kv_cache_memory(),
            spec_decoding=core.speculator.stats if core.speculator.enabled else None,
            kv_offload=tier.snapshot_stats() if tier is not None else None,
            generation_tokens=s.num_generated_tokens,
            expert_load=core.expert_load.snapshot(),
            **core.loras.request_counts(s),
        )

    def _kv_cache_memory(self) -> tuple[int, int]:
        """The executor's answer, asked at most every few seconds (it asks every rank, and a rank
        answers after the step it is running)."""
        now = time.monotonic()
        if now - self._kv_memory_at >= KV_MEMORY_REFRESH_S:
            self._kv_memory, self._kv_memory_at = self.core.executor.kv_cache_memory(), now
        return self._kv_memory
