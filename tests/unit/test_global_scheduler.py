"""The global scheduler's bookkeeping between nodes, on a real redis-server, with fake engines that
record what they are sent: a node runs its own queue first; an idle node takes work from a loaded
one and sends the outputs back under the origin's ids; aborts reach a request wherever it is
(queued, running here, running elsewhere, taken but not yet announced); queued requests expire
past the TTL; requests running on a node that stops beating fail at their origin."""

from __future__ import annotations

import asyncio

import pytest

from splitserve.engine import global_scheduler_nodes
from splitserve.engine.global_scheduler import GlobalScheduler
from splitserve.engine.global_scheduler_protocol import GlobalSchedulerConfig, InboxMessage
from splitserve.engine.messages import EngineCoreOutput, EngineCoreRequest
from splitserve.lora.request import LoRARequest
from splitserve.sampling_params import SamplingParams
from tests.helpers.redis_server import redis_server


@pytest.fixture(scope="module")
def redis_port():
    with redis_server() as port:
        yield port


class FakeEngine:
    """What the scheduler needs of an AsyncLLM: its last stats, whether it died, and the calls."""

    def __init__(self):
        self.stats, self.dead_reason = None, None
        self.sent: list[EngineCoreRequest] = []
        self.delivered: list[EngineCoreOutput] = []
        self.aborted: list[str] = []
        self.client_aborts: list[list[str]] = []

    async def send_core_request(self, request):
        self.sent.append(request)

    async def deliver(self, outputs):
        self.delivered.extend(outputs)

    async def abort_core_requests(self, ids):
        self.aborted.extend(ids)

    async def abort_engine_client_requests(self, client_ids):
        self.client_aborts.append(list(client_ids))


def _request(rid: str, **kw) -> EngineCoreRequest:
    return EngineCoreRequest(rid, [1, 2, 3], SamplingParams(max_tokens=4), None, 4, 0.0, **kw)


async def _until(condition, timeout: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline
        await asyncio.sleep(0.01)


def _node(port: int, topic: str, capacity: int = 1, ttl: float = 0.0, min_load: float = 0.0):
    config = GlobalSchedulerConfig(port=port, topic=topic, min_load_score=min_load)
    scheduler, engine = GlobalScheduler(config, "m", capacity, ttl), FakeEngine()
    scheduler.start(engine)
    return scheduler, engine


def test_own_queue_first_then_an_idle_node_takes_the_rest(redis_port):
    async def main():
        a, ea = _node(redis_port, "share")
        b = None
        try:
            await a.submit(_request("r0"))
            await _until(lambda: ea.sent)  # alone, A runs its own (B, idle, could otherwise take it first)
            b, eb = _node(redis_port, "share")
            await a.submit(_request("r1"))
            await _until(lambda: len(ea.sent) + len(eb.sent) == 2)
            assert [r.request_id for r in ea.sent] == ["r0"]  # A runs one (its capacity), B takes the other
            taken = eb.sent[0]
            assert taken.request_id.endswith("-r1") and taken.request_id != "r1"  # B's own id for it
            await _until(lambda: a.remote.get("r1") == b.node)

            # B's engine answers: the outputs go to A under A's id, and the request is done on both.
            outputs = [EngineCoreOutput(taken.request_id, [7], finish_reason="length", first_scheduled_time=1.0)]
            assert await b.route_outputs(outputs) == []
            await _until(lambda: ea.delivered)
            assert ea.delivered[0].request_id == "r1" and ea.delivered[0].new_token_ids == [7]
            assert "r1" not in a.remote and not b.foreign

            # A's own request finishing leaves its engine empty.
            mine = [EngineCoreOutput("r0", [5], finish_reason="stop")]
            assert await a.route_outputs(mine) == mine and not a.local
        finally:
            for node in (a, b):
                if node is not None:
                    await node.close()

    asyncio.run(main())


def test_min_load_score_and_pinned_requests(redis_port):
    async def main():
        a, ea = _node(redis_port, "pinned", min_load=5)
        b, eb = _node(redis_port, "pinned", min_load=5)
        try:
            await a.submit(_request("lora", lora_request=LoRARequest("x", 1, "/p")))
            assert [r.request_id for r in ea.sent] == ["lora"]  # never queued: straight to A's engine
            for rid in ("q0", "q1"):
                await a.submit(_request(rid))
            await asyncio.sleep(0.5)
            assert not eb.sent  # A's load (3) is under the min load score: B leaves A's queue alone
        finally:
            for node in (a, b):
                if node is not None:
                    await node.close()

    asyncio.run(main())


def test_aborts_reach_a_request_wherever_it_is(redis_port):
    async def main():
        a, ea = _node(redis_port, "abort")
        b = None
        try:
            await a.submit(_request("here"))
            await _until(lambda: len(ea.sent) == 1)
            b, eb = _node(redis_port, "abort")
            await a.submit(_request("there"))
            await _until(lambda: a.remote.get("there") == b.node)
            # Queued: B is full now (capacity 1), so it stays in A's queue until aborted.
            await a.submit(_request("queued"))
            await asyncio.sleep(0.2)
            assert await a.abort(["here", "there", "queued"]) == ["here"]  # only "here" is A's engine's
            await _until(lambda: eb.aborted)
            assert eb.aborted == [eb.sent[0].request_id] and not b.foreign
            assert await a.redis.llen(a.key("queue", a.node)) == 0 and not a.pending

            # Taken by B but not yet announced when the client went away: the "started" is answered
            # with an abort, and B's engine drops it.
            a.aborted.add("late")
            await a._on_message(InboxMessage("started", b.node, request_ids=["late"]))
            assert "late" not in a.remote and "late" not in a.aborted
        finally:
            for node in (a, b):
                if node is not None:
                    await node.close()

    asyncio.run(main())


def test_abort_by_client_id_reaches_every_node_and_the_queue(redis_port):
    """/abort_requests under the global scheduler: every node's engine aborts by client id (those it
    runs for any origin), and the origin ends its own requests still queued."""

    async def main():
        a, ea = _node(redis_port, "clients")
        b = None
        try:
            await a.submit(_request("here", client_request_id="job"))
            await _until(lambda: len(ea.sent) == 1)
            b, eb = _node(redis_port, "clients")
            await a.submit(_request("there", client_request_id="job"))
            await _until(lambda: a.remote.get("there") == b.node)
            for rid, client in (("queued", "job"), ("kept", "other")):  # both nodes full: they wait
                await a.submit(_request(rid, client_request_id=client))
            await asyncio.sleep(0.2)
            await a.abort_clients(["job"])
            assert ea.client_aborts == [["job"]]
            await _until(lambda: eb.client_aborts == [["job"]])  # through B's inbox
            [ended] = ea.delivered
            assert ended.request_id == "queued" and ended.finish_reason == "abort" and not ended.error
            assert list(a.pending) == ["kept"] and await a.redis.llen(a.key("queue", a.node)) == 1
        finally:
            for node in (a, b):
                if node is not None:
                    await node.close()

    asyncio.run(main())


def test_queued_requests_expire_and_dead_nodes_fail_theirs(redis_port, monkeypatch):
    async def main():
        a, ea = _node(redis_port, "ttl", ttl=0.3)
        try:
            a.local.add("busy")  # A's engine is full: its own request waits in the queue
            await a.submit(_request("waits"))
            await _until(lambda: ea.delivered, timeout=5)
            out = ea.delivered[0]
            assert out.request_id == "waits" and out.error_status == 503 and "--scheduler-ttl" in out.error
            assert not a.pending and await a.redis.llen(a.key("queue", a.node)) == 0

            # A request on a node that never beats (gone) fails here with a 503.
            a.remote["elsewhere"] = "gone-node"
            await a._check_remote_nodes()
            assert ea.delivered[-1].request_id == "elsewhere" and ea.delivered[-1].error_status == 503
            assert "stopped answering" in ea.delivered[-1].error
        finally:
            await a.close()

    monkeypatch.setattr(global_scheduler_nodes, "HEARTBEAT_S", 0.1)
    asyncio.run(main())
