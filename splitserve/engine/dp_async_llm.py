"""Data parallelism in the API server (`splitserve serve --data-parallel-size N`, vLLM's flag): N
engine replicas, each a whole copy of the model with its own ranks and KV cache in its own engine
process (kept running by its own supervisor), behind one front-end per API worker.

DataParallelAsyncLLM stands where an AsyncLLM otherwise stands, over one AsyncLLM per replica: a
request goes to the live replica with the fewest requests in flight from this worker (in turn on a
tie); aborts, LoRA adapter changes, sleep mode and weight updates go to every replica; the replicas'
engine stats are merged into one (summed; the KV cache usage averaged) for /metrics and for admission
control. /health is healthy while every replica is.
"""

from __future__ import annotations

import itertools
from collections.abc import AsyncIterator

import msgspec

from splitserve.engine.async_llm import AsyncLLM
from splitserve.engine.messages import (
    KVOffloadStats,
    KVTransferParams,
    LoRAReply,
    SchedulerStats,
    SleepReply,
    SpecDecodingStats,
)
from splitserve.engine.output_processor import RequestOutputKind
from splitserve.engine.processor import ProcessedRequest
from splitserve.lora.request import LoRARequest
from splitserve.outputs import RequestOutput


class DataParallelAsyncLLM:
    def __init__(self, replicas: list[AsyncLLM]):
        self.replicas = replicas
        first = replicas[0]
        self.model_config = first.model_config
        self.processor = first.processor  # validation and tokenization: the same for every replica
        self.tokenizer = first.tokenizer
        self.stats: SchedulerStats | None = None
        self._stats: list[SchedulerStats | None] = [None] * len(replicas)
        self._on_stats = None
        self._turn = itertools.count()
        for index, replica in enumerate(replicas):
            replica.on_stats = lambda stats, i=index: self._record(i, stats)

    # --- what the serving layer sets and reads ---------------------------------------------------
    def get_tokenizer(self):
        return self.tokenizer

    @property
    def on_stats(self):
        return self._on_stats

    @on_stats.setter
    def on_stats(self, callback) -> None:
        self._on_stats = callback

    def set_inter_token_hook(self, hook) -> None:
        for replica in self.replicas:
            replica.set_inter_token_hook(hook)

    @property
    def scheduling_policy(self) -> str:
        return self.replicas[0].scheduling_policy

    @scheduling_policy.setter
    def scheduling_policy(self, policy: str) -> None:
        for replica in self.replicas:
            replica.scheduling_policy = policy

    @property
    def dead_reason(self) -> str | None:
        """None while any replica serves."""
        reasons = [r.dead_reason for r in self.replicas]
        return None if None in reasons else reasons[0]

    @property
    def loras(self):
        return self.replicas[0].loras

    def start(self) -> None:
        for replica in self.replicas:
            replica.start()

    def shutdown(self) -> None:
        for replica in self.replicas:
            replica.shutdown()

    # --- requests ---------------------------------------------------------------------------
    def _pick(self) -> AsyncLLM:
        live = [r for r in self.replicas if r.dead_reason is None] or self.replicas
        turn = next(self._turn)
        order = sorted(range(len(live)), key=lambda i: (len(live[i].queues), (i - turn) % len(live)))
        return live[order[0]]

    async def generate(
        self,
        request_id: str,
        request: ProcessedRequest,
        arrival_time: float | None = None,
        kind: RequestOutputKind = RequestOutputKind.DELTA,
        kv_transfer: KVTransferParams | None = None,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        replica = self._pick()
        if lora_request is not None:  # the chosen replica's own id for the adapter
            lora_request = await replica.resolve_lora(lora_request.lora_name) or lora_request
        outputs = replica.generate(request_id, request, arrival_time, kind, kv_transfer, lora_request, priority)
        async for output in outputs:
            yield output

    async def abort(self, request_ids: list[str]) -> None:
        for replica in self.replicas:  # each aborts only the ids it holds
            await replica.abort(request_ids)

    async def abort_client_requests(self, client_request_ids: list[str]) -> None:
        for replica in self.replicas:
            await replica.abort_client_requests(client_request_ids)

    async def release_kv_leases(self, core_request_ids: list[str]) -> None:
        raise RuntimeError("PD instances run one engine replica: --data-parallel-size is refused with --pd-role.")

    def try_reserve_queue_slot(self, limit: int) -> bool:
        """Admission control over all replicas' waiting requests (as last reported, plus those sent
        since); the slot is counted on the replica the request will most likely go to."""
        queued = sum((r.stats.num_waiting if r.stats else 0) + r.sent_since_stats for r in self.replicas)
        if queued >= limit:
            return False
        self._pick().sent_since_stats += 1
        return True

    async def check_health(self, timeout: float) -> bool:
        for replica in self.replicas:
            if not await replica.check_health(timeout):
                return False
        return True

    # --- calls every replica answers ------------------------------------------------------------
    async def lora_call(self, op: str, name: str = "", path: str = "", base_model_name: str | None = None) -> LoRAReply:
        replies = [await r.lora_call(op, name, path, base_model_name) for r in self.replicas]
        return next((reply for reply in replies if reply.error), replies[0])

    async def resolve_lora(self, name: str):
        return await self.replicas[0].resolve_lora(name)

    async def sleep_call(self, op: str, level: int = 1, model_path: str = "", load_format: str = "auto") -> SleepReply:
        replies = [await r.sleep_call(op, level, model_path, load_format) for r in self.replicas]
        return next((reply for reply in replies if reply.error), replies[0])

    # --- stats --------------------------------------------------------------------------------
    def _record(self, index: int, stats: SchedulerStats) -> None:
        self._stats[index] = stats
        known = [s for s in self._stats if s is not None]
        self.stats = merge_stats(known)
        if self._on_stats is not None:
            self._on_stats(self.stats)


def merge_stats(parts: list[SchedulerStats]) -> SchedulerStats:
    """The replicas' stats as one engine's: counts and counters summed, KV cache usage averaged, the
    oldest time taken (a stuck replica shows), kv_blocks_held known only when every replica's is."""
    first = parts[0]
    held = [p.kv_blocks_held for p in parts]
    return msgspec.structs.replace(
        first,
        num_running=sum(p.num_running for p in parts),
        num_waiting=sum(p.num_waiting for p in parts),
        kv_cache_usage=sum(p.kv_cache_usage for p in parts) / len(parts),
        num_preemptions=sum(p.num_preemptions for p in parts),
        prefix_cache_queries=sum(p.prefix_cache_queries for p in parts),
        prefix_cache_hits=sum(p.prefix_cache_hits for p in parts),
        lora_version=sum(p.lora_version for p in parts),
        kv_cache_bytes=sum(p.kv_cache_bytes for p in parts),
        kv_cache_resident_bytes=sum(p.kv_cache_resident_bytes for p in parts),
        kv_blocks_held=None if None in held else sum(held),
        taken_at=min(p.taken_at for p in parts),
        spec_decoding=_sum_structs([p.spec_decoding for p in parts], SpecDecodingStats),
        kv_offload=_sum_structs([p.kv_offload for p in parts], KVOffloadStats),
        generation_tokens=sum(p.generation_tokens for p in parts),
        running_loras=_sum_counts([p.running_loras for p in parts]),
        waiting_loras=_sum_counts([p.waiting_loras for p in parts]),
    )


def _sum_counts(parts: list[dict[str, int] | None]) -> dict[str, int] | None:
    """Counts by name summed over the replicas; None when no replica has any (LoRA off)."""
    if all(p is None for p in parts):
        return None
    total: dict[str, int] = {}
    for part in parts:
        for name, count in (part or {}).items():
            total[name] = total.get(name, 0) + count
    return total


def _sum_structs(parts: list, cls):
    """Field-wise sums of counter structs (lists summed element-wise); None when no replica has one."""
    parts = [p for p in parts if p is not None]
    if not parts:
        return None
    total = cls()
    for field in cls.__struct_fields__:
        values = [getattr(p, field) for p in parts]
        if isinstance(values[0], list):
            width = max(len(v) for v in values)
            setattr(total, field, [sum(v[i] for v in values if i < len(v)) for i in range(width)])
        else:
            setattr(total, field, sum(values))
    return total
