"""How the global scheduler's nodes talk to and watch each other (a mixin of GlobalScheduler,
engine/global_scheduler.py): each node's inbox in Redis (requests it started for another node,
aborts, outputs of its requests run elsewhere, /abort_requests' client ids), and its heartbeat, by
which a node learns that another stopped (its requests there fail with a 503) and expires its own
queued requests past --scheduler-ttl."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from splitserve.engine.global_scheduler_protocol import InboxMessage, NodeBeat, failed_output, from_wire
from splitserve.engine.messages import queue_ttl_expired

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
HEARTBEAT_TIMEOUT_S = 10.0  # a node silent this long is taken for dead
INBOX_WAIT_S = 0.5  # BLPOP timeout (seconds): how long the inbox reader blocks before it looks again


class NodeMessaging:
    # --- messages between nodes -----------------------------------------------------------------
    async def _post(self, node: str, message: InboxMessage) -> None:
        await self.redis.rpush(self.key("inbox", node), self._encoder.encode(message))

    async def _inbox_loop(self) -> None:
        while not self._closing:
            item = await self.redis.blpop([self.key("inbox", self.node)], timeout=INBOX_WAIT_S)
            if item is not None:
                await self._on_message(self._inbox_decoder.decode(item[1]))

    async def _on_message(self, message: InboxMessage) -> None:
        if message.kind == "started":
            for rid in message.request_ids:
                self.pending.pop(rid, None)
                if rid in self.aborted:
                    self.aborted.discard(rid)
                    await self._post(message.sender, InboxMessage("abort", self.node, request_ids=[rid]))
                else:
                    self.remote[rid] = message.sender
                    self.on_remote()
        elif message.kind == "abort":
            ids = [
                lid
                for lid, run in self.foreign.items()
                if run.origin == message.sender and run.origin_id in message.request_ids
            ]
            for lid in ids:
                del self.foreign[lid]
            if ids:
                await self.engine.abort_core_requests(ids)
        elif message.kind == "abort_clients":
            await self._abort_clients(message.request_ids)
        elif message.kind == "outputs":
            # Those not in self.remote were aborted here meanwhile.
            outputs = [from_wire(out) for out in message.outputs if out.request_id in self.remote]
            self._finished(outputs)
            await self.engine.deliver(outputs)

    async def _beat_loop(self) -> None:
        while not self._closing:
            beat = NodeBeat(self.model, len(self.local) + len(self.foreign), time.time())
            await self.redis.hset(self.key("nodes"), self.node, self._encoder.encode(beat))
            await self._check_remote_nodes()
            if self.ttl > 0:
                await self._expire_pending()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stop.wait(), HEARTBEAT_S)

    async def _expire_pending(self) -> None:
        """Own requests still queued past --scheduler-ttl leave the queue with a 503 (those already
        taken are the engine's to expire: it counts their time in the queue too)."""
        deadline = time.monotonic() - self.ttl
        expired = []
        for rid, (data, queued_at, _) in list(self.pending.items()):
            if queued_at < deadline and await self.redis.lrem(self.key("queue", self.node), 1, data):
                del self.pending[rid]
                expired.append(queue_ttl_expired(rid, self.ttl))
        if expired:
            await self.engine.deliver(expired)

    async def _check_remote_nodes(self) -> None:
        """Own requests on a node that stopped beating fail with a 503 here."""
        if not self.remote:
            return
        beats = await self.redis.hgetall(self.key("nodes"))
        now, failed = time.time(), []
        for rid, node in list(self.remote.items()):
            raw = beats.get(node.encode())
            if raw is None or now - self._beat_decoder.decode(raw).beat_at > HEARTBEAT_TIMEOUT_S:
                del self.remote[rid]
                failed.append(failed_output(rid, f"the instance running it ({node}) stopped answering"))
        if failed:
            logger.error("Global scheduler: %d requests failed: the instance running them stopped", len(failed))
            await self.engine.deliver(failed)
