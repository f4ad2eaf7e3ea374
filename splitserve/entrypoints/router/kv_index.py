"""What each instance has in its prefix cache, as the router knows it from the instances' own KV
cache events (engine/core/kv_events.py, vLLM's format): the `cache_aware` policy's index. Exact, not a
guess from prompt text: a block counts as cached on an instance from its BlockStored event until its
BlockRemoved (or an AllBlocksCleared). An instance says where it publishes in its /pd_role answer; a
gap in its sequence numbers (messages dropped, or the instance started again) empties its index
until new events fill it, so the router only ever under-counts."""

from __future__ import annotations

import asyncio
import logging
from urllib.parse import urlsplit

import msgspec

from splitserve.disagg.policies import Upstream
from splitserve.engine.core.kv_cache_manager import hash_block_tokens
from splitserve.engine.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger("splitserve.router")


def reachable_endpoint(endpoint: str, instance_url: str) -> str:
    """The instance's publishing address as the router reaches it: a wildcard host (`*`, 0.0.0.0)
    becomes the host of the instance's URL."""
    scheme, _, rest = endpoint.partition("://")
    if scheme != "tcp":  # ipc://, inproc://: a path on the instance's own machine
        return endpoint
    host, _, port = rest.rpartition(":")
    if host in ("*", "0.0.0.0", "", "[::]"):
        host = urlsplit(instance_url).hostname or "127.0.0.1"
    return f"{scheme}://{host}:{port}"


def prompt_block_hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    """The chain of the prompt's full blocks, as the instances' prefix caches name them."""
    hashes: list[bytes] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        hashes.append(hash_block_tokens(hashes[-1] if hashes else None, token_ids[start : start + block_size]))
    return hashes


def apply_events(inst: Upstream, batch: KVEventBatch) -> None:
    for event in batch.events:
        if isinstance(event, BlockStored):
            inst.cached.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            inst.cached.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            inst.cached.clear()


class KVEventIndex:
    """One subscription per instance that publishes its events; their tasks run on the router's loop."""

    def __init__(self) -> None:
        self._tasks: dict[int, asyncio.Task] = {}
        self._ctx = None

    def watch(self, inst: Upstream, info: dict) -> None:
        """Subscribe to `inst`'s events (its /pd_role answer says where: one endpoint, or a list of
        its data-parallel replicas', whose events fill one index), once."""
        endpoint = info.get("kv_events_endpoint")
        endpoints = [endpoint] if isinstance(endpoint, str) else endpoint
        valid = isinstance(endpoints, list) and endpoints and all(isinstance(e, str) for e in endpoints)
        if id(inst) in self._tasks or not valid:
            return
        if inst.cached is None:
            inst.cached = set()
        inst.block_size = int(info.get("block_size") or 16)
        addresses = [reachable_endpoint(e, inst.url) for e in endpoints]
        topic = str(info.get("kv_events_topic") or "")
        follows = (self._follow(inst, address, topic) for address in addresses)
        self._tasks[id(inst)] = asyncio.ensure_future(asyncio.gather(*follows))
        logger.info("cache_aware: following the KV cache events of %s at %s", inst.url, ", ".join(addresses))

    async def _follow(self, inst: Upstream, address: str, topic: str) -> None:
        import zmq
        import zmq.asyncio

        if self._ctx is None:
            self._ctx = zmq.asyncio.Context()
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.connect(address)
        sub.setsockopt_string(zmq.SUBSCRIBE, topic)
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        last = None
        try:
            while True:
                frames = await sub.recv_multipart()
                if len(frames) != 3:
                    continue
                seq = int.from_bytes(frames[1], "big")
                if last is not None and seq != last + 1:
                    logger.warning(
                        "cache_aware: %s's KV events skipped from %d to %d: its index starts over", inst.url, last, seq
                    )
                    inst.cached.clear()
                last = seq
                try:
                    apply_events(inst, decoder.decode(frames[2]))
                except msgspec.DecodeError as exc:
                    logger.warning("cache_aware: an unreadable KV event batch from %s: %s", inst.url, exc)
        finally:
            sub.close()

    async def stop(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        self._tasks.clear()
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None
