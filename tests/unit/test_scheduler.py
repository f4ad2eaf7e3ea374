"""The scheduler driven by a fake model loop: every request that completes its tokens in a step
gets one sampled token. `check_invariants()` runs after every step."""

from __future__ import annotations

import pytest

from splitserve.config import SchedulerConfig
from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.request import Request, RequestStatus
from splitserve.engine.core.scheduler import Scheduler
from splitserve.sampling_params import SamplingParams
from tests.helpers.scheduling import BS, add, make_sched, plan, run_step, step

EOS = 2


def req(rid: str, prompt, max_tokens: int = 4, **params) -> Request:
    return Request(
        rid, list(prompt), SamplingParams(max_tokens=max_tokens, **params), eos_token_id=EOS, max_tokens=max_tokens
    )


def run_all(sched: Scheduler, max_steps: int = 200) -> list[list[tuple[str, int]]]:
    plans = []
    while sched.has_unfinished_requests():
        assert len(plans) < max_steps, "scheduler made no progress"
        plans.append(plan(step(sched)))
    return plans


def assert_all_blocks_free(sched: Scheduler) -> None:
    assert sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
    assert sched.kv.req_to_blocks == {}


# --- token budget and chunked prefill -------------------------------------------------------
def test_chunked_prefill_splits_a_prompt_by_the_budget_then_decodes_one_token_at_a_time():
    sched = make_sched(budget=4)
    a = req("a", range(10, 20), max_tokens=3)
    add(sched, a)
    out = step(sched)
    assert plan(out) == [("a", 4)] and out.total_num_scheduled_tokens == 4
    assert a.num_computed_tokens == 4 and a.output_token_ids == []
    assert plan(step(sched)) == [("a", 4)]
    assert a.output_token_ids == []
    assert plan(step(sched)) == [("a", 2)]
    assert a.num_computed_tokens == 10 and a.output_token_ids == [7]
    assert run_all(sched) == [[("a", 1)], [("a", 1)]]
    assert a.output_token_ids == [7, 7, 7]
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert_all_blocks_free(sched)
    assert sched.schedule().is_empty


def test_budget_is_never_exceeded_and_every_request_gets_its_tokens():
    sched = make_sched(budget=6, max_num_seqs=4)
    requests = [
        req(f"r{i}", range(100 * i, 100 * i + n), max_tokens=m)
        for i, (n, m) in enumerate([(1, 3), (3, 1), (5, 4), (7, 2), (9, 5), (11, 1), (13, 3)])
    ]
    add(sched, *requests)
    plans = run_all(sched)
    totals = [sum(n for _, n in p) for p in plans]
    assert max(totals) == 6 and all(t >= 1 for t in totals)
    assert sched.num_preemptions == 0
    for r in requests:
        assert r.num_output_tokens == r.max_tokens
        assert r.output_token_ids == [7] * r.max_tokens
        # Tokens computed = prompt + every output but the last (which is never fed back).
        assert sum(n for p in plans for rid, n in p if rid == r.request_id) == r.num_prompt_tokens + r.max_tokens - 1
    assert_all_blocks_free(sched)


def test_decodes_are_scheduled_first_and_share_the_step_with_a_prompt_chunk():
    sched = make_sched(budget=4)
    a, b = req("a", [10, 11, 12], max_tokens=5), req("b", range(20, 26), max_tokens=2)
    add(sched, a)
    assert plan(step(sched)) == [("a", 3)]
    add(sched, b)
    assert plan(step(sched)) == [("a", 1), ("b", 3)]
    assert plan(step(sched)) == [("a", 1), ("b", 3)]
    assert b.output_token_ids == [7]
    assert plan(step(sched)) == [("a", 1), ("b", 1)]
    assert b.is_finished() and not a.is_finished()
    assert run_all(sched) == [[("a", 1)]]


def test_an_unfinished_prompt_chunk_goes_before_new_prompts():
    sched = make_sched(budget=4)
    a, b = req("a", range(10, 20), max_tokens=1), req("b", range(20, 25), max_tokens=1)
    add(sched, a)
    assert plan(step(sched)) == [("a", 4)]
    add(sched, b)
    assert plan(step(sched)) == [("a", 4)]
    assert plan(step(sched)) == [("a", 2), ("b", 2)]
    assert a.is_finished()
    assert run_all(sched) == [[("b", 3)]]


def test_max_num_seqs_caps_running_requests():
    sched = make_sched(max_num_seqs=2)
    a, b, c = (req(x, [5, 6], max_tokens=2) for x in "abc")
    add(sched, a, b, c)
    assert plan(step(sched)) == [("a", 2), ("b", 2)]
    assert sched.num_running == 2 and list(sched.waiting) == [c]
    assert plan(step(sched)) == [("a", 1), ("b", 1)]  # both finish here; c admitted next step
    assert plan(step(sched)) == [("c", 2)]
    assert plan(step(sched)) == [("c", 1)]
    assert not sched.has_unfinished_requests()


def test_without_chunked_prefill_a_prompt_over_the_remaining_budget_waits():
    sched = make_sched(budget=8, max_model_len=8, chunked=False)
    a, b = req("a", range(10, 15), max_tokens=2), req("b", range(20, 25), max_tokens=2)
    add(sched, a, b)
    assert plan(step(sched)) == [("a", 5)]
    assert b.status == RequestStatus.WAITING and b.num_computed_tokens == 0
    assert plan(step(sched)) == [("a", 1), ("b", 5)]
    assert plan(step(sched)) == [("b", 1)]
    assert not sched.has_unfinished_requests()

    chunked = make_sched(budget=8, max_model_len=8, chunked=True)
    add(chunked, req("a", range(10, 15), max_tokens=2), req("b", range(20, 25), max_tokens=2))
    assert plan(step(chunked)) == [("a", 5), ("b", 3)]


def test_config_without_chunked_prefill_needs_a_budget_of_max_model_len():
    with pytest.raises(ValueError, match="max_num_batched_tokens"):
        SchedulerConfig(max_num_batched_tokens=8, max_model_len=16, enable_chunked_prefill=False).verify()
    SchedulerConfig(max_num_batched_tokens=8, max_model_len=16, enable_chunked_prefill=True).verify()


def test_long_prefill_token_threshold_caps_each_chunk():
    sched = make_sched(budget=16, threshold=3)
    a, b = req("a", range(10, 20), max_tokens=2), req("b", range(20, 25), max_tokens=1)
    add(sched, a, b)
    assert plan(step(sched)) == [("a", 3), ("b", 3)]
    assert plan(step(sched)) == [("a", 3), ("b", 2)]
    assert run_all(sched) == [[("a", 3)], [("a", 1)], [("a", 1)]]
    assert a.output_token_ids == [7, 7] and b.output_token_ids == [7]


def test_a_prompt_cut_short_by_a_few_tokens_finishes_in_the_same_step():
    """prompt_tail_tokens: b's last 3 tokens fit the allowance of 4, so the step takes 19 tokens and b
    samples its first token now; c, whose cut would leave 9, is chunked at the budget as before."""
    sched = make_sched(budget=16, tail=4)
    a, b = req("a", range(10, 20), max_tokens=2), req("b", range(20, 29), max_tokens=2)
    add(sched, a, b)
    out = step(sched)
    assert plan(out) == [("a", 10), ("b", 9)]
    assert a.output_token_ids == [7] and b.output_token_ids == [7]
    c = req("c", range(30, 45), max_tokens=1)
    add(sched, c)
    assert plan(step(sched)) == [("a", 1), ("b", 1), ("c", 15)]  # 14 left in the budget, 1 past it
    sched2 = make_sched(budget=16, tail=4)
    d, e = req("d", range(10, 20), max_tokens=1), req("e", range(20, 35), max_tokens=1)
    add(sched2, d, e)
    assert plan(step(sched2)) == [("d", 10), ("e", 6)]  # 9 would be left: more than the allowance


def test_the_tail_allowance_is_shared_by_the_prompts_of_a_step():
    sched = make_sched(budget=8, tail=3)
    a, b = req("a", range(10, 20), max_tokens=1), req("b", range(20, 22), max_tokens=1)
    add(sched, a, b)
    assert plan(step(sched)) == [("a", 10)]  # 2 past the budget: nothing left for b this step
    assert plan(step(sched)) == [("b", 2)]
    off = make_sched(budget=8, tail=0)
    add(off, req("c", range(10, 20), max_tokens=1))
    assert plan(step(off)) == [("c", 8)]


def test_the_prefill_threshold_still_caps_a_chunk_with_a_tail():
    sched = make_sched(budget=16, tail=8, threshold=6)
    add(sched, req("a", range(10, 18), max_tokens=1))
    assert plan(step(sched)) == [("a", 6)]


def test_prompt_tail_tokens_must_not_be_negative():
    with pytest.raises(ValueError, match="prompt_tail_tokens"):
        SchedulerConfig(prompt_tail_tokens=-1).verify()
    assert SchedulerConfig(max_num_batched_tokens=64, prompt_tail_tokens=4).max_step_tokens == 68
    assert (
        SchedulerConfig(
            max_model_len=64, max_num_batched_tokens=64, prompt_tail_tokens=4, enable_chunked_prefill=False
        ).max_step_tokens
        == 64
    )


# --- preemption -----------------------------------------------------------------------------
def test_preemption_evicts_the_last_running_request_and_it_resumes_later():
    sched = make_sched(num_blocks=4)
    a = req("a", range(10, 17), max_tokens=3)
    b = req("b", range(20, 27), max_tokens=3)
    add(sched, a, b)
    assert plan(step(sched)) == [("a", 7), ("b", 7)]
    assert sched.kv.get_block_ids("a") == [0, 1] and sched.kv.get_block_ids("b") == [2, 3]
    assert plan(step(sched)) == [("a", 1), ("b", 1)]  # tokens 8 still fit in 2 blocks
    c = req("c", [40], max_tokens=1)
    add(sched, c)

    out = step(sched)  # a needs a third block: none free
    assert plan(out) == [("a", 1)]
    assert out.preempted == [b]
    assert b.status == RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_preemptions == 1 and sched.num_preemptions == 1
    assert sched.kv.get_block_ids("b") == []
    assert list(sched.waiting) == [b, c]  # at the front, before c
    assert b.output_token_ids == [7, 7]  # its outputs are kept
    assert sched.kv.get_block_ids("a") == [] and a.output_token_ids == [7, 7, 7]  # a got block 3, then finished

    # b resumes: its first block is still cached (block 2), the rest is recomputed.
    out = sched.schedule()
    assert plan(out) == [("b", 5), ("c", 1)]
    assert b.status == RequestStatus.RUNNING and b.num_computed_tokens == 4
    assert sched.kv.get_block_ids("b") == [2, 3, 1] and sched.kv.get_block_ids("c") == [0]
    run_step(sched, out, {"b": [7], "c": [7]})
    sched.check_invariants()
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert b.output_token_ids == [7, 7, 7]
    assert b.num_cached_tokens == 0  # set at first admission only
    assert c.output_token_ids == [7]
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


def test_preemption_skips_admitting_new_requests_that_step():
    sched = make_sched(num_blocks=4)
    a, b = req("a", range(10, 17), max_tokens=4), req("b", range(20, 27), max_tokens=4)
    add(sched, a, b)
    step(sched)
    step(sched)
    add(sched, req("c", [40], max_tokens=1))
    out = step(sched)
    assert out.preempted == [b] and plan(out) == [("a", 1)]
    # b freed blocks 3 and 2, a took block 3: block 2 is free and c fits, yet c waits.
    assert sched.kv.pool.num_free_blocks == 1 and not a.is_finished()
    assert [r.request_id for r in sched.waiting] == ["b", "c"]


def test_the_last_running_request_is_the_victim_not_the_one_needing_a_block():
    sched = make_sched(num_blocks=4)
    a = req("a", range(10, 17), max_tokens=3)  # 2 blocks, needs a 3rd at step 3
    b = req("b", [20, 21], max_tokens=5)  # 1 block, fits to the end of step 3
    c = req("c", [30, 31], max_tokens=5)
    add(sched, a, b, c)
    assert plan(step(sched)) == [("a", 7), ("b", 2), ("c", 2)]
    assert [sched.kv.get_block_ids(x) for x in "abc"] == [[0, 1], [2], [3]]
    step(sched)
    out = step(sched)
    assert plan(out) == [("a", 1), ("b", 1)]
    assert out.preempted == [c] and c.status == RequestStatus.PREEMPTED
    assert b.status == RequestStatus.RUNNING and sched.running == [b]  # a finished
    assert run_all(sched) == [[("b", 1), ("c", 4)], [("b", 1), ("c", 1)], [("c", 1)]]
    assert b.output_token_ids == [7] * 5 and c.output_token_ids == [7] * 5
    assert sched.num_preemptions == 1


def test_a_request_that_is_last_in_line_preempts_itself():
    sched = make_sched(num_blocks=4)
    a, c = req("a", [10, 11], max_tokens=3), req("c", [30, 31], max_tokens=3)
    b = req("b", range(20, 27), max_tokens=3)  # needs a 3rd block at step 3
    add(sched, a, c, b)
    assert plan(step(sched)) == [("a", 2), ("c", 2), ("b", 7)]
    assert plan(step(sched)) == [("a", 1), ("c", 1), ("b", 1)]
    out = step(sched)
    assert plan(out) == [("a", 1), ("c", 1)]
    assert out.preempted == [b] and b.status == RequestStatus.PREEMPTED
    assert sched.num_preemptions == 1 and a.is_finished() and c.is_finished()
    # Both of b's full blocks (2 and 3) are still cached: it resumes computing one token.
    out = step(sched)
    assert plan(out) == [("b", 1)]
    assert sched.prefix_cache_stats.hits == 8
    assert b.output_token_ids == [7, 7, 7] and b.num_preemptions == 1
    assert not sched.has_unfinished_requests()


# --- finishing ------------------------------------------------------------------------------
def _finish(sched: Scheduler, request: Request, tokens: list[int]) -> None:
    add(sched, request)
    for t in tokens:
        assert not request.is_finished()
        step(sched, token=t)


def test_finishes_at_max_tokens():
    sched = make_sched()
    a = req("a", [5, 6, 7], max_tokens=3)
    _finish(sched, a, [9, 9, 9])
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.status.finish_reason == "length"
    assert a.output_token_ids == [9, 9, 9] and a.stop_reason is None
    assert "a" not in sched.requests and sched.running == []
    assert_all_blocks_free(sched)


def test_finishes_at_max_model_len():
    sched = make_sched(max_model_len=8)
    a = req("a", range(10, 15), max_tokens=10)
    _finish(sched, a, [9, 9, 9])
    assert a.num_tokens == 8 and a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not sched.has_unfinished_requests()


def test_eos_stops_unless_ignore_eos():
    sched = make_sched()
    a = req("a", [5, 6, 7], max_tokens=5)
    _finish(sched, a, [EOS])
    assert a.status == RequestStatus.FINISHED_STOPPED and a.status.finish_reason == "stop"
    assert a.output_token_ids == [EOS] and a.stop_reason is None
    assert_all_blocks_free(sched)

    b = req("b", [5, 6, 7], max_tokens=4, ignore_eos=True)
    _finish(sched, b, [EOS] * 4)
    assert b.status == RequestStatus.FINISHED_LENGTH_CAPPED and b.output_token_ids == [EOS] * 4


def test_stop_token_ids_stop_with_stop_reason():
    sched = make_sched()
    a = req("a", [5, 6, 7], max_tokens=8, stop_token_ids=[9, 11])
    _finish(sched, a, [7, 8, 11])
    assert a.status == RequestStatus.FINISHED_STOPPED and a.stop_reason == 11
    assert a.output_token_ids == [7, 8, 11]
    assert not sched.has_unfinished_requests()


def test_min_tokens_delays_eos_and_stop_tokens():
    sched = make_sched()
    a = req("a", [5, 6, 7], max_tokens=8, min_tokens=3)
    _finish(sched, a, [EOS, EOS, EOS])
    assert a.status == RequestStatus.FINISHED_STOPPED and a.output_token_ids == [EOS] * 3

    b = req("b", [5, 6, 7], max_tokens=8, min_tokens=2, stop_token_ids=[9])
    _finish(sched, b, [9, 9])
    assert b.status == RequestStatus.FINISHED_STOPPED and b.stop_reason == 9
    assert b.output_token_ids == [9, 9]


def test_finish_requests_aborts_waiting_and_running_requests():
    sched = make_sched(num_blocks=4, max_num_seqs=1)
    a, b, c = req("a", range(10, 19)), req("b", range(20, 25)), req("c", range(30, 36))
    add(sched, a, b, c)
    step(sched)
    assert sched.running == [a] and list(sched.waiting) == [b, c]
    assert sched.kv.get_block_ids("a") == [0, 1, 2]

    done = sched.finish_requests(["a", "b", "nope", "a"], RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    assert done == [a, b]
    assert a.status == RequestStatus.FINISHED_ABORTED and a.status.finish_reason == "abort"
    assert b.status == RequestStatus.FINISHED_ABORTED
    assert set(sched.requests) == {"c"} and sched.running == [] and list(sched.waiting) == [c]
    assert sched.kv.get_block_ids("a") == [] and sched.kv.pool.num_free_blocks == 4

    assert plan(step(sched)) == [("c", 6)]
    assert sched.kv.get_block_ids("c") == [3, 2]  # a's blocks went back tail first
    sched.finish_requests(["c"], RequestStatus.FINISHED_ABORTED)
    sched.check_invariants()
    assert not sched.has_unfinished_requests()
    assert_all_blocks_free(sched)


def test_finish_requests_aborts_a_preempted_request():
    sched = make_sched(num_blocks=4)
    a, b = req("a", range(10, 17), max_tokens=5), req("b", range(20, 27), max_tokens=3)
    add(sched, a, b)
    step(sched)
    step(sched)
    assert step(sched).preempted == [b]
    assert sched.finish_requests(["b"], RequestStatus.FINISHED_ABORTED) == [b]
    sched.check_invariants()
    assert list(sched.waiting) == [] and set(sched.requests) == {"a"}
    run_all(sched)
    assert a.output_token_ids == [7] * 5


# --- prefix caching at admission ------------------------------------------------------------
def test_prefix_cache_hit_at_admission_sets_cached_and_computed_tokens():
    sched = make_sched()
    prompt = list(range(10, 19))  # 9 tokens: 2 full blocks
    a, b = req("a", prompt), req("b", prompt)
    add(sched, a)
    assert plan(step(sched)) == [("a", 9)]
    assert a.num_cached_tokens == 0
    add(sched, b)
    out = sched.schedule()
    assert plan(out) == [("a", 1), ("b", 1)]
    assert b.num_cached_tokens == 8 and b.num_computed_tokens == 8
    assert sched.kv.get_block_ids("b")[:2] == sched.kv.get_block_ids("a")[:2] == [0, 1]
    run_step(sched, out, {"a": [7], "b": [7]})
    sched.check_invariants()
    assert b.num_computed_tokens == 9 and b.output_token_ids == [7]
    assert (sched.prefix_cache_stats.queries, sched.prefix_cache_stats.hits) == (18, 8)


def test_prefix_cache_hit_within_one_step():
    sched = make_sched()
    prompt = list(range(10, 19))
    a, b = req("a", prompt), req("b", prompt)
    add(sched, a, b)
    assert plan(step(sched)) == [("a", 9), ("b", 1)]
    assert b.num_cached_tokens == 8


def test_no_prefix_cache_hit_when_caching_is_disabled():
    sched = make_sched(caching=False)
    prompt = list(range(10, 19))
    a, b = req("a", prompt), req("b", prompt)
    add(sched, a, b)
    assert plan(step(sched)) == [("a", 9), ("b", 9)]
    assert b.num_cached_tokens == 0
    assert sched.kv.get_block_ids("b") == [3, 4, 5]


def test_eos_on_the_last_allowed_token_is_a_length_finish():
    sched = make_sched()
    a = req("a", [5, 6, 7], max_tokens=2)
    _finish(sched, a, [8, EOS])
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED and a.output_token_ids == [8, EOS]


def test_prefix_cache_stats_count_each_admission_once():
    sched = make_sched(num_blocks=4)
    a = req("a", list(range(10, 19)), max_tokens=3)  # 9 tokens: 3 of the 4 blocks
    b = req("b", list(range(30, 39)), max_tokens=3)  # does not fit beside a
    c = req("c", list(range(10, 19)), max_tokens=3)  # a's prompt again, once a is done
    add(sched, a, b)
    step(sched)
    for _ in range(2):
        assert [r.request_id for r in sched.waiting] == ["b"]
        step(sched)
    assert (sched.prefix_cache_stats.queries, sched.prefix_cache_stats.hits) == (9, 0)
    while sched.has_unfinished_requests():
        step(sched)
    assert (sched.prefix_cache_stats.queries, sched.prefix_cache_stats.hits) == (18, 0)
    add(sched, c)
    step(sched)
    # b reused a's freed blocks tail first (blocks 2 and 1): only a's first block is still cached.
    assert (sched.prefix_cache_stats.queries, sched.prefix_cache_stats.hits) == (27, 4)


def test_kv_cache_ratio_keeps_blocks_for_running_requests():
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, kv_cache_ratio=0.5),
        KVCacheManager(8, 4, True),
    )
    a, b = req("a", list(range(10, 19)), max_tokens=2), req("b", list(range(30, 39)), max_tokens=2)
    add(sched, a, b)
    # a takes 3 of 8 blocks; b would leave 2 free, under the 4 kept for running requests.
    assert plan(step(sched)) == [("a", 9)]
    assert [r.request_id for r in sched.waiting] == ["b"]
    while a.status == RequestStatus.RUNNING:
        step(sched)
    assert plan(step(sched)) == [("b", 9)]  # alone, a prompt may use the whole pool


def test_scheduler_delay_factor_holds_new_prompts_back_while_others_run():
    """vLLM's delay_factor: a new prompt waits until the oldest waiting one has waited delay_factor
    x the last prompt step's latency; with nothing running it goes at once."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, delay_factor=2.0)
    sched = Scheduler(config, KVCacheManager(64, BS, True))
    now = [100.0]
    sched.clock = lambda: now[0]
    first = req("a", range(10, 18), max_tokens=20)
    first.arrival_time = now[0]
    add(sched, first)
    assert plan(step(sched)) == [("a", 8)]  # nothing runs: no delay
    now[0] += 0.5  # that prompt step took 0.5 s
    late = req("b", range(30, 38), max_tokens=4)
    late.arrival_time = now[0]
    add(sched, late)
    assert plan(step(sched)) == [("a", 1)]  # b has waited 0 s, not 2 x 0.5 s
    now[0] += 0.6
    assert plan(step(sched)) == [("a", 1)]  # 0.6 s
    now[0] += 0.5
    assert plan(step(sched)) == [("a", 1), ("b", 8)]  # 1.1 s > 1.0 s
    with pytest.raises(ValueError, match="scheduler_delay_factor"):
        SchedulerConfig(delay_factor=-1).verify()


def test_swap_preemption_copies_blocks_out_and_back_before_waiting_requests():
    """preemption_mode "swap": the preempted request's blocks go to host blocks (swap_out), it keeps
    its computed tokens, and it comes back into fresh blocks (swap_in) before new requests."""
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, preemption_mode="swap")
    config.verify()
    sched = Scheduler(config, KVCacheManager(4, BS, True, num_cpu_blocks=4))
    a = req("a", range(10, 17), max_tokens=3)
    b = req("b", range(20, 27), max_tokens=3)
    add(sched, a, b)
    step(sched)
    step(sched)
    add(sched, req("c", [40], max_tokens=1))
    out = step(sched)  # a needs a third block: b is swapped out
    assert out.preempted == [b] and out.swap_out == [(2, 0), (3, 1)]
    assert b.status == RequestStatus.SWAPPED and b.num_computed_tokens == 8 and list(sched.swapped) == [b]
    assert sched.kv.get_block_ids("b") == [] and [h.block_id for h in sched.kv.req_to_cpu_blocks["b"]] == [0, 1]
    out = step(sched)  # a finished: b comes back first, into fresh blocks for its 8 tokens and 1 more; then c
    assert plan(out) == [("b", 1), ("c", 1)] and out.swap_in == [(0, 2), (1, 3)]
    assert sched.kv.cpu_pool.num_free_blocks == 4 and not sched.swapped
    assert b.output_token_ids == [7, 7, 7] and b.is_finished()  # its third token, without recomputing
    run_all(sched)
    assert_all_blocks_free(sched)


def test_swap_falls_back_to_recompute_when_host_blocks_run_out():
    config = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, max_model_len=64, preemption_mode="swap")
    sched = Scheduler(config, KVCacheManager(4, BS, True, num_cpu_blocks=1))
    a, b = req("a", range(10, 17), max_tokens=3), req("b", range(20, 27), max_tokens=3)
    add(sched, a, b)
    step(sched)
    step(sched)
    out = step(sched)
    assert out.preempted == [b] and not out.swap_out and b.status == RequestStatus.PREEMPTED
    run_all(sched)
    assert_all_blocks_free(sched)
    with pytest.raises(ValueError, match="preemption_mode"):
        SchedulerConfig(preemption_mode="copy").verify()
