"""Speculative decoding's pure-Python parts: the configuration and its errors, the n-gram and suffix
proposers, the counters, and the scheduler's draft tokens on a tiny pool."""

from __future__ import annotations

import pytest

from splitserve.engine.core.request import Request
from splitserve.engine.messages import SpecDecodingStats
from splitserve.sampling_params import SamplingParams
from splitserve.spec_decode.config import SpeculativeConfig
from splitserve.spec_decode.ngram import NgramProposer
from splitserve.spec_decode.suffix import SuffixProposer, SuffixTrie
from tests.helpers.scheduling import add, make_sched, plan, run_step


# --- configuration -------------------------------------------------------------------------------
def test_config_parses_vllm_keys_and_fills_defaults():
    config = SpeculativeConfig.parse('{"method": "ngram", "num_speculative_tokens": 4}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (2, 5)
    assert SpeculativeConfig.parse({"model": "/m", "num_speculative_tokens": 3}).method == "draft_model"
    assert SpeculativeConfig.parse(None) is None


@pytest.mark.parametrize(
    "value, message",
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, "method must be one of"),
        ({"method": "ngram"}, "needs num_speculative_tokens"),
        ({"method": "ngram", "num_speculative_tokens": 0}, "from 1 to 16"),
        ({"method": "ngram", "num_speculative_tokens": 17}, "from 1 to 16"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 3},
            "min <= max",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "speculative_token_tree": "x"}, "unknown keys"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, "needs a 'model'"),
        ({"method": "suffix", "num_speculative_tokens": 2, "model": "/m"}, "takes no 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}, "disable_by_batch_size"),
        ("{not json", "JSON object"),
    ],
)
def test_bad_configs_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.parse(value)


# --- proposers -----------------------------------------------------------------------------------
def test_ngram_drafts_what_followed_the_latest_match():
    proposer = NgramProposer(prompt_lookup_min=2, prompt_lookup_max=4)
    tokens = [1, 2, 3, 4, 5, 9, 9, 1, 2, 3]
    assert proposer.propose("a", tokens, 4) == [4, 5, 9, 9]
    tokens += [4, 5, 9]  # the same request, grown: its index is extended, not rebuilt
    assert proposer.propose("a", tokens, 4) == [9, 1, 2, 3]
    assert proposer.propose("a", tokens, 0) == []
    assert proposer.propose("b", [7, 8, 7], 3) == []  # (8, 7) never occurred before: too short a match
    assert proposer.propose("c", [4, 4, 4, 4], 2) == [4]  # the latest earlier match, cut at the end
    proposer.finish("a", tokens)
    assert "a" not in proposer._indexes


def test_suffix_trie_counts_windows_and_counts_them_out_again():
    trie = SuffixTrie(depth=5)
    sequence = [1, 2, 3, 4, 1, 2, 3, 5]
    trie.add(sequence)
    assert trie._find([1, 2, 3]).count == 2 and sorted(trie._find([1, 2, 3]).children) == [4, 5]
    assert trie._find([1, 2, 3, 4, 1, 2]) is None  # longer than the depth
    # The match [1, 2] (at most depth - 3 long, to leave room for 3 drafts) allows 2 drafts: 3 for
    # certain, then 4 or 5 at even odds.
    assert trie.draft([9, 1, 2], 3, max_spec_factor=1.0, min_prob=0.1) == ([3, 4], 1.5)
    trie.add(sequence, sign=-1)
    assert trie.root.children == {}


def test_suffix_proposer_matches_its_own_request_and_finished_ones():
    prompt = list(range(100, 160))
    proposer = SuffixProposer(max_tree_depth=24, max_cached_requests=1, max_spec_factor=1.0, min_token_prob=0.1)
    assert proposer.propose("a", prompt + [7] + prompt[:20], 8) == prompt[20:28]  # copying its prompt
    proposer.finish("a", prompt + [50, 51, 52, 53, 54, 55], num_prompt_tokens=len(prompt))
    assert proposer.propose("b", [9, 50, 51, 52], 3) == [53, 54, 55]  # an earlier request's output
    proposer.finish("b", [9, 50, 51, 52, 60, 61, 62], num_prompt_tokens=1)  # evicts a's (a cache of 1)
    assert proposer.propose("c", [50, 51, 52], 3) == [60, 61, 62]


def test_stats_count_drafts_and_positions():
    stats = SpecDecodingStats()
    stats.add(4, 2)
    stats.add(3, 3)
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (2, 7, 5)
    assert stats.accepted_per_position == [2, 2, 1, 0]
    assert stats.acceptance_rate == pytest.approx(5 / 7) and stats.mean_acceptance_length == 3.5


# --- scheduling ----------------------------------------------------------------------------------
def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=20), eos_token_id=2, max_tokens=20)


def test_drafts_are_verified_in_the_next_step_and_rejected_ones_leave_the_cache():
    sched = make_sched(budget=64)
    request = _request("r", [10, 11, 12, 13, 14])
    add(sched, request)
    run_step(sched, sched.schedule(), {"r": [20]})
    request.spec_token_ids = [21, 22, 23]
    out = sched.schedule()
    assert plan(out) == [("r", 4)] and out.spec_tokens == {"r": [21, 22, 23]}
    assert request.spec_token_ids == []  # taken: the next step needs fresh ones
    run_step(sched, out, {"r": [21, 30]})  # 21 accepted, 22 rejected: the target said 30
    assert request.output_token_ids == [20, 21, 30] and request.new_token_ids == [21, 30]
    assert request.num_computed_tokens == request.num_tokens - 1  # 22 and 23 are not computed tokens
    sched.check_invariants()


def test_drafts_fit_the_budget_and_a_stop_inside_the_run_ends_it():
    sched = make_sched(budget=3)
    request = _request("r", [10, 11])
    add(sched, request)
    run_step(sched, sched.schedule(), {"r": [20]})
    request.spec_token_ids = [21, 2, 23, 24]
    out = sched.schedule()
    assert plan(out) == [("r", 3)] and out.spec_tokens == {"r": [21, 2]}  # 1 + 2 drafts fill the budget
    run_step(sched, out, {"r": [21, 2, 25]})  # eos (2) accepted: the token after it is dropped
    assert request.output_token_ids == [20, 21, 2] and request.is_finished()
    assert not sched.has_unfinished_requests()
