"""What the scheduler hands the engine each step (SchedulePlan, live Request objects included) and
its prefix-cache counters."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.engine.core.request import Request
from splitserve.kv_tier.ops import KVOffloadOps


@dataclass
class PrefixCacheStats:
    queries: int = 0  # tokens of admitted requests that were looked up in the prefix cache
    hits: int = 0  # of which were found cached

    def reset(self) -> PrefixCacheStats:
        taken = PrefixCacheStats(self.queries, self.hits)
        self.queries = self.hits = 0
        return taken


@dataclass
class SchedulePlan:
    """One step's plan, live objects included (it stays in the engine; engine/core/step_input_builder.py turns it
    into the data-only StepInput the runners get): requests in execution order with the number of
    tokens each computes, preemptions, KV pulls and swap copies."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    # PD decode side: (request, first block index in the prefill instance, local destination blocks)
    kv_pulls: list[tuple[Request, int, list[int]]] = field(default_factory=list)
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device block, host block) copies
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (host block, device block) copies
    # Speculative decoding: the draft tokens each request verifies in this step (its scheduled count
    # includes them, after its last token).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    # Copies to and from the KV offloading tier that this step's allocations need (kv_tier/index.py).
    kv_offload: KVOffloadOps | None = None
    # Requests dropped before they ever ran: they waited longer than SchedulerConfig.waiting_ttl.
    expired: list[Request] = field(default_factory=list)

    @property
    def total_num_scheduled_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)

    @property
    def is_empty(self) -> bool:
        """Nothing to run and no blocks to copy."""
        return not self.scheduled and not self.swap_out and not self.swap_in and self.kv_offload is None
