"""The priority scheduling policy (vLLM's --scheduling-policy priority) on a tiny pool: waiting
requests are admitted by (priority, arrival), the lowest-priority running request is the one
preempted, and a preempted request does not pass a waiting request that goes first."""

from __future__ import annotations

from splitserve.engine.core.request import Request, RequestStatus
from splitserve.sampling_params import SamplingParams
from tests.helpers.scheduling import add, make_sched, plan, step


def req(rid: str, prompt, priority: int = 0, max_tokens: int = 4) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), 2, max_tokens, priority=priority)


def _sched(policy: str, **kwargs):
    return make_sched(policy=policy, **kwargs)


def test_waiting_requests_are_admitted_by_priority_then_arrival():
    sched = _sched("priority", max_num_seqs=1)
    low, high, high_later = req("low", [5, 6], priority=3), req("high", [7, 8], priority=-1), req("high2", [9], -1)
    add(sched, low, high, high_later)
    assert [r.request_id for r in sched.waiting] == ["high", "high2", "low"]
    order = []
    while sched.has_unfinished_requests():
        order += [rid for rid, _ in plan(step(sched)) if rid not in order]
    assert order == ["high", "high2", "low"]
    fcfs = _sched("fcfs", max_num_seqs=1)
    add(fcfs, req("low", [5, 6], priority=3), req("high", [7, 8], priority=-1))
    assert [r.request_id for r in fcfs.waiting] == ["low", "high"]


def test_the_lowest_priority_running_request_is_preempted():
    """b arrived first but has the lower priority (a larger number): when a needs a block, b goes,
    where first come, first served would preempt a, the last admitted."""
    for policy, victim in (("priority", "b"), ("fcfs", "a")):
        sched = _sched(policy, num_blocks=4)
        b, a = req("b", range(20, 27), priority=5, max_tokens=3), req("a", range(10, 17), priority=0, max_tokens=3)
        add(sched, b, a)
        step(sched)
        step(sched)  # 8 tokens each: both fill 2 blocks, the pool is full
        out = step(sched)
        assert [r.request_id for r in out.preempted] == [victim], policy
        preempted = b if victim == "b" else a
        assert preempted.status == RequestStatus.PREEMPTED and preempted.num_computed_tokens == 0


def test_a_preempted_request_does_not_pass_a_waiting_one_that_goes_first():
    sched = _sched("priority", num_blocks=4)
    b, a = req("b", range(20, 27), priority=5, max_tokens=3), req("a", range(10, 17), priority=0, max_tokens=3)
    add(sched, b, a)
    step(sched)
    step(sched)
    c = req("c", [40], priority=1, max_tokens=1)
    add(sched, c)
    out = step(sched)
    assert [r.request_id for r in out.preempted] == ["b"]
    assert [r.request_id for r in sched.waiting] == ["c", "b"]  # c (priority 1) before b (5)
    while sched.has_unfinished_requests():
        step(sched)
    assert all(r.is_finished() for r in (a, b, c))


def test_a_better_waiting_request_takes_the_seat_of_the_worst_running_one():
    """Every seat taken: an urgent request preempts the lowest-priority running one and is admitted
    in the same step; a request of equal priority waits for a seat as before."""
    sched = _sched("priority", max_num_seqs=2)
    low, mid = (
        req("low", range(20, 24), priority=5, max_tokens=20),
        req("mid", range(30, 34), priority=1, max_tokens=20),
    )
    add(sched, low, mid)
    step(sched)
    add(sched, req("same", [50, 51], priority=5, max_tokens=2))
    out = step(sched)
    assert not out.preempted and "same" not in dict(plan(out))
    urgent = req("urgent", [60, 61], priority=-1, max_tokens=2)
    add(sched, urgent)
    out = step(sched)
    assert [r.request_id for r in out.preempted] == ["low"] and "urgent" in dict(plan(out))
    assert low.status == RequestStatus.PREEMPTED
    assert [r.request_id for r in sched.waiting] == ["low", "same"]  # by arrival within priority 5: low came first
    while sched.has_unfinished_requests():
        step(sched)
    assert all(r.is_finished() for r in (low, mid, urgent))


def test_an_urgent_prompt_takes_the_budget_before_a_worse_prompts_next_chunk():
    """A long low-priority prompt is being computed chunk by chunk when an urgent one arrives: the
    next step computes the urgent prompt whole (the decodes run too), the long one waits a step."""
    sched = _sched("priority", budget=16, max_model_len=64)
    decoding = req("decoding", [5, 6], priority=3, max_tokens=20)
    add(sched, decoding)
    step(sched)
    long = req("long", range(100, 140), priority=3, max_tokens=2)
    add(sched, long)
    assert dict(plan(step(sched)))["long"] == 15  # a chunk, beside the decode
    urgent = req("urgent", range(200, 212), priority=-1, max_tokens=2)
    add(sched, urgent)
    out = plan(step(sched))
    assert dict(out) == {"decoding": 1, "urgent": 12}
    assert dict(plan(step(sched)))["long"] == 14  # then it goes on, beside two decodes
    fcfs = _sched("fcfs", budget=16, max_model_len=64)
    add(fcfs, req("long", range(100, 140), max_tokens=2))
    step(fcfs)
    add(fcfs, req("urgent", range(200, 212), priority=0, max_tokens=2))
    assert plan(step(fcfs))[0] == ("long", 16)  # first come, first served


def test_the_prefill_threshold_chunks_only_prompts_worse_than_the_best_priority():
    """--long-prefill-token-threshold under the priority policy: prompts of the best priority the
    engine has seen run whole, worse ones in chunks of the threshold, so that the steps an urgent
    request may arrive during stay short."""
    sched = _sched("priority", budget=64, threshold=8, max_model_len=64)
    add(sched, req("normal", range(100, 120), priority=0, max_tokens=2))
    assert plan(step(sched)) == [("normal", 20)]  # the best priority so far: whole
    add(sched, req("urgent", range(200, 220), priority=-1, max_tokens=2))
    assert dict(plan(step(sched)))["urgent"] == 20
    add(sched, req("normal2", range(300, 320), priority=0, max_tokens=2))
    assert dict(plan(step(sched)))["normal2"] == 8  # worse than the best seen (-1): chunked
    fcfs = _sched("fcfs", budget=64, threshold=8, max_model_len=64)
    add(fcfs, req("a", range(100, 120), priority=0, max_tokens=2))
    assert plan(step(fcfs)) == [("a", 8)]  # first come, first served: every prompt is chunked


def test_waiting_requests_expire_after_the_scheduler_ttl():
    """FastDeploy's LocalScheduler TTL: a request that has waited longer without ever running leaves
    the queue (the engine answers it with an error); running and younger requests stay."""
    sched = _sched("fcfs", max_num_seqs=1)
    sched.config.waiting_ttl = 10.0
    now = [100.0]
    sched.clock = lambda: now[0]
    running, old, young = req("running", [5, 6], max_tokens=20), req("old", [7, 8]), req("young", [9])
    running.arrival_time, old.arrival_time = 99.0, 95.0
    add(sched, running, old)
    step(sched)  # `running` takes the only seat
    now[0] = 104.0  # old has waited 9 s
    young.arrival_time = 103.0
    add(sched, young)
    assert step(sched).expired == [] and [r.request_id for r in sched.waiting] == ["old", "young"]
    now[0] = 106.0  # old 11 s, young 3 s
    out = step(sched)
    assert [r.request_id for r in out.expired] == ["old"] and old.is_finished()
    assert "old" not in sched.requests and [r.request_id for r in sched.waiting] == ["young"]
    now[0] = 120.0  # running arrived 21 s ago, but it runs: only requests that never ran expire
    assert [r.request_id for r in step(sched).expired] == ["young"]
    assert running.status == RequestStatus.RUNNING
