"""The scheduler's PD decode side: a request whose prompt KV is pulled from a prefill instance, with
and without the prefill's first token, with exact block ids on a tiny pool."""

from __future__ import annotations

from splitserve.engine.core.request import Request, RequestStatus
from splitserve.engine.messages import KVTransferParams
from splitserve.sampling_params import SamplingParams
from tests.helpers.scheduling import BS, add, make_sched, plan, step

PROMPT = list(range(10, 20))  # 10 tokens: blocks of 4, 4 and 2


def decode_request(rid: str, first_token: int | None, max_tokens: int = 4, eos: int = 2) -> Request:
    kv = KVTransferParams(
        do_remote_prefill=True, remote_host="h", remote_port=1, remote_request_id="p-" + rid, first_token_id=first_token
    )
    params = SamplingParams(max_tokens=max_tokens)
    return Request(rid, list(PROMPT), params, eos_token_id=eos, max_tokens=max_tokens, kv_transfer=kv)


def test_without_a_first_token_all_but_the_last_prompt_token_is_pulled():
    sched = make_sched()
    add(sched, decode_request("d", None))
    out = sched.schedule()
    assert plan(out) == [] and [(r.request_id, first, dest) for r, first, dest in out.kv_pulls] == [("d", 0, [0, 1, 2])]
    assert sched.finish_remote_prefill("d", ok=True) is None
    assert plan(step(sched)) == [("d", 1)]  # the last prompt token, computed here for its logits
    assert sched.requests["d"].output_token_ids == [7]


def test_with_the_prefill_first_token_every_prompt_token_is_pulled_and_decoding_starts_from_it():
    sched = make_sched()
    add(sched, decode_request("d", 42))
    out = sched.schedule()
    assert [(first, dest) for _, first, dest in out.kv_pulls] == [(0, [0, 1, 2])]
    request = sched.finish_remote_prefill("d", ok=True)
    assert request is sched.requests["d"] and request.output_token_ids == [42]
    assert request.num_computed_tokens == len(PROMPT) and request.status == RequestStatus.RUNNING
    out = step(sched)
    assert plan(out) == [("d", 1)]  # the first token at position 10, as a mixed instance's first decode
    assert request.output_token_ids == [42, 7]
    sched.check_invariants()


def test_a_first_token_that_ends_the_request_frees_it_at_once():
    sched = make_sched()
    add(sched, decode_request("eos", 2), decode_request("one", 42, max_tokens=1))
    sched.schedule()
    for rid, reason in (("eos", "stop"), ("one", "length")):
        request = sched.finish_remote_prefill(rid, ok=True)
        assert request.is_finished() and request.status.finish_reason == reason
    assert not sched.has_unfinished_requests() and sched.kv.pool.num_free_blocks == sched.kv.pool.num_blocks
    sched.check_invariants()


def test_local_prefix_hits_leave_only_the_missing_blocks_to_pull():
    sched = make_sched()
    plain = Request("warm", list(PROMPT), SamplingParams(max_tokens=1), eos_token_id=2, max_tokens=1)
    add(sched, plain)
    while sched.has_unfinished_requests():
        step(sched)
    add(sched, decode_request("d", 42))
    out = sched.schedule()
    ((_, first, dest),) = out.kv_pulls
    assert first == 2 and len(dest) == 1  # blocks 0-1 (8 tokens) hit; the partial block 2 is pulled
    assert sched.finish_remote_prefill("d", ok=True).num_computed_tokens == len(PROMPT)
    assert sched.requests["d"].num_cached_tokens == 2 * BS


def test_a_failed_pull_computes_the_prompt_here():
    sched = make_sched()
    add(sched, decode_request("d", 42))
    sched.schedule()
    assert sched.finish_remote_prefill("d", ok=False) is None
    request = sched.requests["d"]
    assert request.kv_transfer is None and request.output_token_ids == [] and request.num_computed_tokens == 0
    assert plan(step(sched)) == [("d", len(PROMPT))]
