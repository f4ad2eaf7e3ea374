"""FastDeploy's global scheduler (`--scheduler-name global`): several API servers of one model share
their work through Redis, each instance taking more when its engine has room.

Every instance (each API worker is one node) puts the core requests it receives in its own queue in
Redis instead of sending them to its engine. Each node pulls from its own queue while its engine has
room; a node whose own queue is empty and whose engine has room takes requests from the queue of the
most loaded other node of the same topic and model whose load (queued plus running requests) is
above `--scheduler-min-load-score`, runs them on its engine, and pushes their raw outputs to the
origin's inbox; the origin detokenizes and answers its client as if its own engine had run them.
Aborts (a client gone, a stop string met at the origin) follow the request to wherever it runs;
/abort_requests (by the ids clients gave) reaches every node of the topic: each engine aborts those
it runs, and each origin those still queued.

Keys, under `splitserve:{topic}:`: `queue:{node}` (a list of QueuedRequest), `inbox:{node}` (a list
of InboxMessage: outputs of its requests run elsewhere, "started" when another node took one,
aborts of requests this node runs for others, /abort_requests' client ids), `nodes` (a hash: node
-> its heartbeat). A node that has not beaten for HEARTBEAT_TIMEOUT_S is taken for dead: nobody
steals from it, and requests it was running for others fail with a 503 at their origins.

`--scheduler-ttl` is the engine's own: a request that has waited longer, in the Redis queue and the
engine's queue together, is dropped with a 503 before it runs. Requests with a LoRA adapter or
images run on their origin's engine (another instance may lack the adapter; images stay local).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import time
import uuid
from typing import NamedTuple

import msgspec

from splitserve.engine.global_scheduler_nodes import HEARTBEAT_TIMEOUT_S, INBOX_WAIT_S, NodeMessaging
from splitserve.engine.global_scheduler_protocol import (
    GlobalSchedulerConfig,
    InboxMessage,
    NodeBeat,
    QueuedRequest,
    failed_output,
    to_wire,
)
from splitserve.engine.messages import EngineCoreOutput, EngineCoreRequest

logger = logging.getLogger(__name__)

POLL_S = 0.01  # how often a node whose engine is full looks whether it has room again
IDLE_WAIT_S = 0.1  # how often an idle node looks at the other nodes' queues


class RemoteRun(NamedTuple):
    """On the executing node: a request run for another node."""

    origin: str
    origin_id: str


class GlobalScheduler(NodeMessaging):
    """One node's side: queue, pull, steal, forward. `engine` is this API worker's front-end, a
    GlobalSchedulerAsyncLLM (engine/global_frontend.py); it calls submit(), route_outputs(), abort()
    and engine_failed(), and gets outputs of its requests run elsewhere through deliver()."""

    def __init__(self, config: GlobalSchedulerConfig, model: str, capacity: int, ttl: float = 0.0):
        import redis.asyncio

        self.config = config
        self.model = model
        self.capacity = capacity  # core requests this node keeps in its engine at most (max_num_seqs)
        self.ttl = ttl  # --scheduler-ttl (0: no limit)
        self.node = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.redis = redis.asyncio.Redis(
            host=config.host, port=config.port, db=config.db, password=config.password or None
        )
        self._prefix = f"splitserve:{config.topic}:"
        self.engine = None
        self.local: set[str] = set()  # this node's own core requests in its engine
        # Own core requests in the Redis queue: (as pushed, when, the id its client gave).
        self.pending: dict[str, tuple[bytes, float, str | None]] = {}
        self.remote: dict[str, str] = {}  # own core requests another node runs -> that node
        self.aborted: set[str] = set()  # own requests aborted before the node that took them said so
        self.foreign: dict[str, RemoteRun] = {}  # local engine id -> a request run for another node
        self._foreign_ids = itertools.count()
        self._encoder = msgspec.msgpack.Encoder()
        self._queued_decoder = msgspec.msgpack.Decoder(QueuedRequest)
        self._inbox_decoder = msgspec.msgpack.Decoder(InboxMessage)
        self._beat_decoder = msgspec.msgpack.Decoder(NodeBeat)
        self._stats_seen = None
        self._tasks: list[asyncio.Task] = []
        self._closing = False
        self._stop = asyncio.Event()
        self.on_stolen = lambda: None  # called for each request this node takes from another's queue
        self.on_remote = lambda: None  # called for each request of this node's that another one runs

    def key(self, kind: str, node: str | None = None) -> str:
        return self._prefix + (kind if node is None else f"{kind}:{node}")

    # --- life -----------------------------------------------------------------------------------
    def start(self, engine) -> None:
        """Start pulling, reading the inbox and beating (in the running event loop)."""
        if self._tasks:
            return
        self.engine = engine
        loop = asyncio.get_running_loop()
        for body in (self._beat_loop, self._pull_loop, self._inbox_loop):
            self._tasks.append(loop.create_task(self._guard(body)))
        logger.info("Global scheduler: node %s on %s", self.node, self.config.describe())

    async def _guard(self, body) -> None:
        """A Redis outage must not end the loop: log it and try again (until close())."""
        while not self._closing:
            try:
                await body()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # noqa: BLE001 (connection errors of every kind)
                if self._closing:  # redis-py may turn the cancellation of a blocking read into an error
                    return
                logger.error("Global scheduler: %s failed (%s); retrying in 1 s", body.__name__, exc)
                await asyncio.sleep(1.0)

    async def close(self) -> None:
        """Stop the loops (they end by themselves within a blocking read's timeout: redis-py can hang
        when a blocking read is cancelled), leave the topic, and drop this node's queue and inbox."""
        self._closing = True
        self._stop.set()
        if self._tasks:
            _, stuck = await asyncio.wait(self._tasks, timeout=INBOX_WAIT_S + 2)
            for task in stuck:
                task.cancel()
        try:
            await self.redis.hdel(self.key("nodes"), self.node)
            await self.redis.delete(self.key("queue", self.node), self.key("inbox", self.node))
        finally:
            await self.redis.aclose()

    # --- the origin's side ----------------------------------------------------------------------
    @staticmethod
    def runs_anywhere(request: EngineCoreRequest) -> bool:
        """Requests other instances may take: not those with a LoRA adapter, images or PD KV."""
        return request.lora_request is None and not request.mm_features and request.kv_transfer is None

    async def submit(self, request: EngineCoreRequest) -> None:
        """A request of this node's clients: into this node's queue, or to its own engine when no
        other instance may run it."""
        if not self.runs_anywhere(request):
            self.local.add(request.request_id)
            await self.engine.send_core_request(request)
            return
        queued = QueuedRequest(self.node, time.time(), self.model, request)
        data = self._encoder.encode(queued)
        self.pending[request.request_id] = (data, time.monotonic(), request.client_request_id)
        await self.redis.rpush(self.key("queue", self.node), data)

    async def abort(self, core_ids: list[str]) -> list[str]:
        """Abort own core requests wherever they are; returns those the local engine must abort."""
        local, by_node = [], {}
        for rid in core_ids:
            if rid in self.local:
                self.local.discard(rid)
                local.append(rid)
            elif rid in self.remote:
                by_node.setdefault(self.remote.pop(rid), []).append(rid)
            elif rid in self.pending:
                data = self.pending.pop(rid)[0]
                if not await self.redis.lrem(self.key("queue", self.node), 1, data):
                    self.aborted.add(rid)  # taken meanwhile: its "started" will come
        for node, rids in by_node.items():
            await self._post(node, InboxMessage("abort", self.node, request_ids=rids))
        return local

    async def abort_clients(self, client_ids: list[str]) -> None:
        """/abort_requests: every node of the topic aborts the requests whose clients gave these ids."""
        message = InboxMessage("abort_clients", self.node, request_ids=list(client_ids))
        for node in {n.decode() for n in await self.redis.hkeys(self.key("nodes"))} - {self.node}:
            await self._post(node, message)
        await self._abort_clients(client_ids)

    async def _abort_clients(self, client_ids: list[str]) -> None:
        """This node's engine aborts those it runs (for this node or another: their outputs, finish
        reason "abort", go to their origins); its own still queued leave the queue and end here."""
        await self.engine.abort_engine_client_requests(client_ids)
        wanted = set(client_ids)
        queued = [rid for rid, (_, _, client) in self.pending.items() if client in wanted]
        if queued:
            await self.abort(queued)  # one taken meanwhile is aborted where it lands ("started")
            await self.engine.deliver([EngineCoreOutput(rid, [], finish_reason="abort") for rid in queued])

    def _finished(self, outputs: list[EngineCoreOutput]) -> None:
        for out in outputs:
            if out.finished:
                self.local.discard(out.request_id)
                self.remote.pop(out.request_id, None)

    # --- the executing side ---------------------------------------------------------------------
    def has_room(self) -> bool:
        stats = self.engine.stats
        running = len(self.local) + len(self.foreign)
        return running < self.capacity and (stats is None or stats.num_waiting == 0)

    async def _pull_loop(self) -> None:
        own_queue = self.key("queue", self.node)
        while not self._closing:
            stats = self.engine.stats
            # One pull per engine report (what was pulled shows in the next one's counts); an engine
            # that has never reported (nothing sent to it yet) is empty.
            fresh = stats is not self._stats_seen or (stats is None and not self.local and not self.foreign)
            if self.engine.dead_reason is not None or not fresh or not self.has_room():
                await asyncio.sleep(POLL_S)
                continue
            room = self.capacity - len(self.local) - len(self.foreign)
            taken = await self.redis.lpop(own_queue, room) or []
            if len(taken) < room:
                taken += await self._steal(room - len(taken))
            if not taken:  # idle: wake at once for own work, look at the others' queues every IDLE_WAIT_S
                item = await self.redis.blpop([own_queue], timeout=IDLE_WAIT_S)
                if item is None:
                    continue
                taken = [item[1], *(await self.redis.lpop(own_queue, room - 1) or [] if room > 1 else [])]
            self._stats_seen = stats
            for data in taken:
                await self._run(self._queued_decoder.decode(data))

    async def _steal(self, count: int) -> list[bytes]:
        """From the most loaded live node of this topic and model above the min load score."""
        beats = await self.redis.hgetall(self.key("nodes"))
        now, best, best_load = time.time(), None, self.config.min_load_score
        for raw_node, raw_beat in beats.items():
            node = raw_node.decode()
            beat = self._beat_decoder.decode(raw_beat)
            if node == self.node or beat.model != self.model or now - beat.beat_at > HEARTBEAT_TIMEOUT_S:
                continue
            queued = await self.redis.llen(self.key("queue", node))
            if queued and beat.running + queued > best_load:
                best, best_load = node, beat.running + queued
        if best is None:
            return []
        return await self.redis.lpop(self.key("queue", best), count) or []

    async def _run(self, queued: QueuedRequest) -> None:
        request = queued.request
        # The engine's queue-time and TTL clocks are its own monotonic clock: the time spent in the
        # Redis queue (wall clock, nodes agree on it) is carried over.
        waited = max(0.0, time.time() - queued.enqueued_at)
        origin_id = request.request_id
        if queued.origin == self.node:
            self.pending.pop(origin_id, None)
            if origin_id in self.aborted:  # aborted between the pull and now
                self.aborted.discard(origin_id)
                return
            self.local.add(origin_id)
        else:
            local_id = f"gs{next(self._foreign_ids)}-{origin_id}"
            self.foreign[local_id] = RemoteRun(queued.origin, origin_id)
            await self._post(queued.origin, InboxMessage("started", self.node, request_ids=[origin_id]))
            if local_id not in self.foreign:  # aborted while "started" was on its way
                return
            request = msgspec.structs.replace(request, request_id=local_id)
            self.on_stolen()
        request = msgspec.structs.replace(request, arrival_time=time.monotonic() - waited)
        try:
            await self.engine.send_core_request(request)
        except Exception as exc:  # noqa: BLE001 (the engine died meanwhile: the origin must hear)
            failed = failed_output(origin_id, f"this instance's engine could not take it ({exc})")
            if queued.origin == self.node:
                self.local.discard(origin_id)
                await self.engine.deliver([failed])
            elif self.foreign.pop(request.request_id, None) is not None:
                await self._post(queued.origin, InboxMessage("outputs", self.node, outputs=[failed]))

    async def route_outputs(self, outputs: list[EngineCoreOutput]) -> list[EngineCoreOutput]:
        """The engine's outputs: those of requests run for other nodes go to their origins; this
        node's own are returned."""
        if not self.foreign:
            self._finished(outputs)
            return outputs
        own, by_origin = [], {}
        for out in outputs:
            run = self.foreign.get(out.request_id)
            if run is None:
                own.append(out)
                continue
            if out.finished:
                del self.foreign[out.request_id]
            by_origin.setdefault(run.origin, []).append(to_wire(out, run.origin_id))
        for origin, outs in by_origin.items():
            await self._post(origin, InboxMessage("outputs", self.node, outputs=outs))
        self._finished(own)
        return own

    async def engine_failed(self, reason: str) -> None:
        """This node's engine died, and with it every request of this node's clients (the front-end
        fails them all): those queued or running elsewhere go too, and the requests this node ran for
        others fail at their origins."""
        runs, self.foreign = self.foreign, {}
        remote, self.remote = self.remote, {}
        self.local.clear()
        self.pending.clear()
        await self.redis.delete(self.key("queue", self.node))
        for node in set(remote.values()):
            await self._post(
                node, InboxMessage("abort", self.node, request_ids=[r for r, n in remote.items() if n == node])
            )
        by_origin = {}
        for run in runs.values():
            by_origin.setdefault(run.origin, []).append(
                failed_output(run.origin_id, f"the instance running it failed ({reason})")
            )
        for origin, outs in by_origin.items():
            await self._post(origin, InboxMessage("outputs", self.node, outputs=outs))
