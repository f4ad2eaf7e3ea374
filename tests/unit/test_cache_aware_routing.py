"""The router's cache_aware policy on its own: the index an instance's KV cache events build, the
prompt's block hashes (the engine's own chain), the publishing address as the router reaches it,
and the choice: the longest cached prefix, load among equals and when nothing is cached, and no
pile-up on a hot prefix."""

from __future__ import annotations

from splitserve.disagg.policies import CacheAwarePolicy, Upstream, cached_prefix_blocks
from splitserve.engine.core.kv_cache_manager import update_block_hashes
from splitserve.engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch
from splitserve.engine.core.request import Request
from splitserve.entrypoints.router.kv_index import apply_events, prompt_block_hashes, reachable_endpoint
from splitserve.sampling_params import SamplingParams


def _inst(url: str, cached=()) -> Upstream:
    inst = Upstream(url, "prefill")
    inst.cached = set(cached)
    return inst


def test_the_prompt_hashes_are_the_engines_chain():
    tokens = list(range(3, 3 + 40))
    request = Request("r", tokens, SamplingParams(max_tokens=1), 2, 1)
    assert prompt_block_hashes(tokens, 16) == update_block_hashes(request, 16)  # two full blocks
    assert len(prompt_block_hashes(tokens[:15], 16)) == 0


def test_events_build_the_index():
    inst = _inst("http://a:1")
    h = prompt_block_hashes(list(range(64)), 16)
    apply_events(inst, KVEventBatch(0.0, [BlockStored(h, None, list(range(64)), 16, None, "CPU")]))
    assert cached_prefix_blocks(inst, h) == 4
    apply_events(inst, KVEventBatch(0.0, [BlockRemoved([h[2]], "CPU")]))
    assert cached_prefix_blocks(inst, h) == 2  # the prefix breaks where a block is gone
    apply_events(inst, KVEventBatch(0.0, [AllBlocksCleared()]))
    assert cached_prefix_blocks(inst, h) == 0 and not inst.cached


def test_a_wildcard_endpoint_is_reached_at_the_instances_host():
    assert reachable_endpoint("tcp://*:5557", "http://10.0.0.7:8000") == "tcp://10.0.0.7:5557"
    assert reachable_endpoint("tcp://0.0.0.0:5557", "http://host-b:8000") == "tcp://host-b:5557"
    assert reachable_endpoint("tcp://10.1.1.1:6000", "http://10.0.0.7:8000") == "tcp://10.1.1.1:6000"


def test_the_longest_cached_prefix_wins_then_load():
    h = prompt_block_hashes(list(range(80)), 16)
    a, b, c = _inst("http://a", h[:2]), _inst("http://b", h[:4]), _inst("http://c")
    policy = CacheAwarePolicy()
    assert policy.choose([a, b, c], {}, h) is b
    b.in_flight, c.in_flight = 1, 1
    assert policy.choose([a, b, c], {}, h) is b  # 1 in flight is no skew
    b.in_flight = 3
    assert policy.choose([a, b, c], {}, h) is a  # past twice the least loaded's: load decides
    assert policy.choose([a, b, c], {}, None) is a  # no hashes (a tokenizing failure): load
    other = prompt_block_hashes(list(range(500, 532)), 16)
    assert policy.choose([b, c], {}, other) is c  # nothing cached anywhere: the least loaded
    d = Upstream("http://d", "prefill")  # publishes no events: never preferred for a prefix
    assert policy.choose([d, a], {}, h) is a
