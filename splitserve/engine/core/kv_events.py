"""KV cache events (`--kv-events-config`, vLLM's): what the prefix cache holds, published as it
changes, for routers that send each request where its prefix is cached (llm-d's indexer, Dynamo,
splitserve's own router) and for anyone watching the cache.

Wire format, vLLM's (its `examples/online_serving/kv_events_subscriber.py` reads it unchanged): a
ZMQ PUB socket at `endpoint` sends multipart messages (topic, sequence number as 8 big-endian
bytes, payload), the payload a msgpack `KVEventBatch` (array-like: timestamp, events, and the data
parallel rank when there is one), each event tagged by its class name:

- `BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium)`: full blocks
  that became findable in the prefix cache, a chain: each block's parent is the one before it, the
  first's is `parent_block_hash` (None at the prompt's start); `token_ids` are their tokens;
- `BlockRemoved(block_hashes, medium)`: blocks whose content was evicted (their memory reused);
- `AllBlocksCleared()`: the whole prefix cache was forgotten (reset, sleep, new weights).

Block hashes are splitserve's own (32 bytes, a sha256 chain over the block's tokens: see
engine/core/kv_cache_manager.py), so a subscriber that wants to match prompts computes them with
`hash_block_tokens`. A ROUTER socket at `replay_endpoint` answers a request holding a start
sequence number (8 big-endian bytes) with every buffered batch from there (the last
`buffer_steps` batches), one message each (sequence number, payload), then an end marker
(sequence number -1 and an empty payload), as vLLM's publisher does. One batch per engine step
that changed the cache; off (the default) costs nothing: no events are recorded.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgspec

from splitserve import envs
from splitserve.json_config import config_from_json

logger = logging.getLogger(__name__)

END_SEQ = (-1).to_bytes(8, "big", signed=True)


# --- the wire format (vLLM's names and field order) ----------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """The base of the events; each is tagged with its class name."""


class BlockStored(KVCacheEvent):
    block_hashes: list[bytes]
    parent_block_hash: bytes | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[bytes]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


# --- configuration -------------------------------------------------------------------------------
@dataclass
class KVEventsConfig:
    """vLLM's KVEventsConfig: its keys and defaults."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq", or "null": recorded and dropped
    endpoint: str = "tcp://*:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's send high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publishing thread
    topic: str = ""

    @classmethod
    def from_value(cls, value: dict | str | KVEventsConfig | None) -> KVEventsConfig | None:
        """The config from `--kv-events-config` (JSON) or a dict; None when events are off."""
        if value is None or isinstance(value, KVEventsConfig):
            config = value
        else:
            config = config_from_json(cls, value, "--kv-events-config")
        if config is None or not config.enable_kv_cache_events:
            return None
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"kv-events publisher must be zmq or null, got {config.publisher!r}.")
        if config.buffer_steps < 1 or config.hwm < 1 or config.max_queue_size < 1:
            raise ValueError("kv-events buffer_steps, hwm and max_queue_size must be >= 1.")
        return config

    def for_rank(self, rank: int, tag: str = "dp") -> KVEventsConfig:
        """Replica (or instance) `rank`'s own sockets, by vLLM's rule: offset_endpoint."""
        replay = offset_endpoint(self.replay_endpoint, rank, tag) if self.replay_endpoint else None
        return dataclasses.replace(self, endpoint=offset_endpoint(self.endpoint, rank, tag), replay_endpoint=replay)

    def check_ranks(self, count: int, what: str = "data-parallel ranks") -> None:
        """Refuse `count` ranks whose offset sockets would collide (endpoint 5557 and replay 5558, two ranks)."""
        if self.publisher != "zmq" or count < 2:
            return
        ranks = [self.for_rank(r) for r in range(count)]
        sockets = [e for own in ranks for e in (own.endpoint, own.replay_endpoint) if e]
        if len(set(sockets)) != len(sockets):
            raise ValueError(
                f"--kv-events-config: {count} {what} publish on the endpoint's port + rank, so endpoint "
                f"{self.endpoint} and replay_endpoint {self.replay_endpoint} need at least {count} ports between them."
            )


def offset_endpoint(endpoint: str, rank: int, tag: str = "dp") -> str:
    """vLLM's rule for the sockets of data-parallel rank `rank`: a tcp endpoint's port plus the rank
    (tcp://*:5557 -> tcp://*:5558 for rank 1), an ipc or inproc one with `_dp<rank>` appended."""
    if endpoint.startswith(("ipc://", "inproc://")):
        return f"{endpoint}_{tag}{rank}"
    base, _, port = endpoint.rpartition(":")
    if not endpoint.startswith("tcp://") or not port.isdigit():
        raise ValueError(
            f"--kv-events-config endpoint {endpoint!r}: with several ranks it needs tcp://HOST:PORT or ipc://."
        )
    return f"{base}:{int(port) + rank}"


# --- recording (the KV cache manager's side) -----------------------------------------------------
class KVEventRecorder:
    """The events of the current step, in order, as the block pool makes them."""

    def __init__(self, block_size: int, medium: str):
        self.block_size, self.medium = block_size, medium
        self.events: list[KVCacheEvent] = []

    def stored(self, hashes: list[bytes], parent: bytes | None, token_ids: list[int], lora_id: int) -> None:
        self.events.append(BlockStored(hashes, parent, token_ids, self.block_size, lora_id or None, self.medium))

    def removed(self, block_hash: bytes) -> None:
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):  # evictions of one step travel together
            last.block_hashes.append(block_hash)
        else:
            self.events.append(BlockRemoved([block_hash], self.medium))

    def cleared(self) -> None:
        self.events.append(AllBlocksCleared())

    def take(self) -> list[KVCacheEvent]:
        events, self.events = self.events, []
        return events


# --- publishing (the engine core's side) ---------------------------------------------------------
class ZmqEventPublisher:
    """A thread that sends each batch on the PUB socket, keeps the last `buffer_steps` for replay
    and answers replay requests; the engine only puts batches on its queue (never blocks)."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int | None = None):
        import zmq

        self.config, self.rank = config, data_parallel_rank
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._encoder = msgspec.msgpack.Encoder()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._pub.bind(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._ctx.socket(zmq.ROUTER)
            self._replay.setsockopt(zmq.LINGER, 0)
            self._replay.bind(config.replay_endpoint)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._seq = 0
        self._dropped = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info(
            "KV cache events published on %s (replay: %s, topic %r)",
            config.endpoint,
            config.replay_endpoint or "off",
            config.topic,
        )

    def publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        try:
            self._queue.put_nowait(KVEventBatch(time.time(), events, self.rank))
        except queue.Full:
            self._dropped += 1
            if self._dropped == 1 or self._dropped % 1000 == 0:
                logger.warning("KV events: %d batches dropped (the publishing thread falls behind)", self._dropped)

    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        topic = self.config.topic.encode()
        while not self._stop.is_set() or not self._queue.empty():
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                batch = None
            if batch is not None:
                payload = self._encoder.encode(batch)
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((topic, seq, payload))
                self._buffer.append((self._seq, payload))
                self._seq += 1
            if self._replay is not None and poller.poll(0):
                self._serve_replay()
        self._pub.close()
        if self._replay is not None:
            self._replay.close()
        self._ctx.term()

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", END_SEQ, b""))

    def shutdown(self) -> None:
        """Send what is queued, then close the sockets."""
        self._stop.set()
        self._thread.join(timeout=5)


class NullEventPublisher:
    """publisher "null": events are recorded (their cost measured) and dropped."""

    def publish(self, events: list[KVCacheEvent]) -> None:
        pass

    def shutdown(self) -> None:
        pass


def make_publisher(config: KVEventsConfig | None, data_parallel_rank: int | None = None):
    if config is None:
        return None
    return ZmqEventPublisher(config, data_parallel_rank) if config.publisher == "zmq" else NullEventPublisher()


def attach_events(core, config: KVEventsConfig | None):
    """Events on for an EngineCore (engine/core/engine_core.py): its block pool records them and every
    step (core.step_fn) publishes its batch. Returns the publisher (None when off: nothing attached)."""
    rank = envs.SPLITSERVE_DATA_PARALLEL_RANK  # a data-parallel replica's: its own sockets
    if config is not None and rank is not None:
        config = config.for_rank(rank)
    publisher = make_publisher(config, rank)
    if publisher is None:
        return None
    medium = "GPU" if core.config.device.type == "cuda" else "CPU"
    recorder = KVEventRecorder(core.kv_manager.block_size, medium)
    core.kv_manager.pool.events = recorder
    step = core.step_fn

    def step_and_publish():
        outputs = step()
        publisher.publish(recorder.take())
        return outputs

    core.step_fn = step_and_publish
    return publisher
