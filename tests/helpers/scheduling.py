"""A Scheduler over a real KV cache manager, driven step by step by a fake model loop."""

from __future__ import annotations

from splitserve.config import SchedulerConfig
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.request import Request
from splitserve.engine.core.schedule_plan import SchedulePlan
from splitserve.engine.core.scheduler import Scheduler

BS = 4


def make_sched(
    num_blocks=64,
    max_num_seqs=8,
    budget=64,
    max_model_len=64,
    chunked=True,
    threshold=0,
    caching=True,
    tail=0,
    policy="fcfs",
    **config_fields,
) -> Scheduler:
    config = SchedulerConfig(
        policy=policy,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len,
        enable_chunked_prefill=chunked,
        long_prefill_token_threshold=threshold,
        prompt_tail_tokens=tail,
        **config_fields,
    )
    config.verify()
    return Scheduler(config, KVCacheManager(num_blocks, BS, caching))


def add(sched: Scheduler, *requests: Request) -> None:
    for r in requests:
        sched.add_request(r)


def run_step(sched: Scheduler, out: SchedulePlan, sampled: dict[str, list[int]]) -> None:
    """What the engine does with a planned step: launch it (advance), then record its samples."""
    sched.advance(out)
    sched.record_samples(out, sampled)


def step(sched: Scheduler, token: int = 7) -> SchedulePlan:
    out = sched.schedule()
    sampled = {r.request_id: [token] for r, n in out.scheduled if r.num_computed_tokens + n == r.num_tokens}
    run_step(sched, out, sampled)
    sched.check_invariants()
    return out


def plan(out: SchedulePlan) -> list[tuple[str, int]]:
    return [(r.request_id, n) for r, n in out.scheduled]
