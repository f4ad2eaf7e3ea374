"""KV cache events (engine/core/kv_events.py, vLLM's format): the block pool records BlockStored chains,
BlockRemoved evictions and AllBlocksCleared resets on a tiny pool; an engine publishes them over ZMQ,
read by a subscriber whose message types are written here from vLLM's published wire format (not
imported from splitserve), and its replay socket sends buffered batches again."""

from __future__ import annotations

import time
from typing import Any

import msgspec
import pytest
import zmq

from splitserve import LLM, SamplingParams
from splitserve.engine.core.kv_cache_manager import hash_block_tokens
from splitserve.engine.core.kv_events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventRecorder,
    KVEventsConfig,
)
from splitserve.engine.core.request import Request
from splitserve.process_utils import free_port
from tests.helpers.scheduling import BS, add, make_sched, step


# --- vLLM's wire format, as its subscriber example declares it --------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class VBlockRemoved(KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None


class VAllBlocksCleared(KVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(EventBatch):
    events: list[VBlockStored | VBlockRemoved | VAllBlocksCleared]


def _chain(tokens: list[int], block_size: int) -> list[bytes]:
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, tokens[start : start + block_size]))
    return hashes


def req(rid: str, prompt, max_tokens: int = 1) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), 2, max_tokens)


# --- recording -----------------------------------------------------------------------------------
def test_the_pool_records_stored_chains_evictions_and_resets():
    sched = make_sched(num_blocks=6, budget=64)
    recorder = KVEventRecorder(BS, "CPU")
    sched.kv.pool.events = recorder
    prompt = list(range(10, 22))  # 3 full blocks of 4
    add(sched, req("a", prompt))
    while sched.has_unfinished_requests():
        step(sched)
    events = recorder.take()
    stored = [e for e in events if isinstance(e, BlockStored)]
    assert [h for e in stored for h in e.block_hashes] == _chain(prompt, BS)
    assert stored[0].parent_block_hash is None and stored[0].token_ids == prompt[: 4 * len(stored[0].block_hashes)]
    assert stored[0].block_size == BS and stored[0].medium == "CPU" and stored[0].lora_id is None
    # A second prompt sharing the first two blocks stores only its own third one, chained to them.
    add(sched, req("b", prompt[:8] + [90, 91, 92, 93]))
    while sched.has_unfinished_requests():
        step(sched)
    [event] = [e for e in recorder.take() if isinstance(e, BlockStored)]
    assert event.parent_block_hash == _chain(prompt, BS)[1] and event.token_ids == [90, 91, 92, 93]
    # Filling the pool with other blocks evicts cached ones: BlockRemoved names them.
    add(sched, req("c", range(200, 220)))
    while sched.has_unfinished_requests():
        step(sched)
    removed = [h for e in recorder.take() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert removed and set(removed) <= set(_chain(prompt, BS)) | {event.block_hashes[0]}
    assert sched.kv.pool.reset_prefix_cache()
    assert recorder.take() == [AllBlocksCleared()]


def test_bad_configs_are_refused():
    assert KVEventsConfig.from_value(None) is None
    assert KVEventsConfig.from_value('{"enable_kv_cache_events": false}') is None
    with pytest.raises(ValueError, match="unknown keys"):
        KVEventsConfig.from_value({"enable_kv_cache_events": True, "endpoint_typo": "x"})
    with pytest.raises(ValueError, match="publisher"):
        KVEventsConfig.from_value({"enable_kv_cache_events": True, "publisher": "kafka"})
    with pytest.raises(ValueError, match="must be a JSON object"):
        KVEventsConfig.from_value("{nope")


# --- publishing ----------------------------------------------------------------------------------
@pytest.mark.slow  # an engine and a subscriber
def test_an_engine_publishes_vllm_format_events_with_replay(tiny_models):
    port, replay_port = free_port(), free_port()
    config = {
        "enable_kv_cache_events": True,
        "publisher": "zmq",
        "endpoint": f"tcp://127.0.0.1:{port}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay_port}",
        "topic": "kv-events",
    }
    llm = LLM(tiny_models["llama"], dtype="float32", block_size=16, kv_events_config=config, use_tqdm_on_load=False)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(f"tcp://127.0.0.1:{port}")
    sub.setsockopt_string(zmq.SUBSCRIBE, "kv-events")
    time.sleep(0.5)  # a SUB socket hears only what is sent after it joined
    prompt = list(range(5, 5 + 40))  # two full blocks of 16
    llm.generate([{"prompt_token_ids": prompt}], SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
    assert llm.reset_prefix_cache()
    llm.generate([{"prompt_token_ids": [7, 8, 9]}], SamplingParams(max_tokens=1), use_tqdm=False)  # publishes the reset
    decoder = msgspec.msgpack.Decoder(VKVEventBatch)
    received: list[tuple[int, bytes]] = []
    while sub.poll(2000):
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"kv-events"
        received.append((int.from_bytes(seq, "big"), payload))
    events = [e for _, payload in received for e in decoder.decode(payload).events]
    stored = [h for e in events if isinstance(e, VBlockStored) for h in e.block_hashes]
    assert stored[:2] == _chain(prompt, 16)
    assert isinstance(events[-1], VAllBlocksCleared)
    assert [seq for seq, _ in received] == list(range(received[0][0], received[0][0] + len(received)))
    # Replay from the first batch heard: the same batches again, then the end marker.
    replay = ctx.socket(zmq.DEALER)
    replay.connect(f"tcp://127.0.0.1:{replay_port}")
    replay.send_multipart([b"", received[0][0].to_bytes(8, "big")])
    replayed = []
    while replay.poll(2000):
        _, seq, payload = replay.recv_multipart()
        if not payload:
            assert int.from_bytes(seq, "big", signed=True) == -1
            break
        replayed.append((int.from_bytes(seq, "big"), payload))
    assert replayed == received
    sub.close(0)
    replay.close(0)
    ctx.term()
    llm.llm_engine.engine_core.shutdown()
