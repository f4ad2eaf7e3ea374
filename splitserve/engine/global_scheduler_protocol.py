"""The global scheduler's options and what its nodes put in Redis (engine/global_scheduler.py says how
they use it): a queued request, a message to a node's inbox (outputs on their way between nodes), a
node's heartbeat."""

from __future__ import annotations

import dataclasses
import time

import msgspec

from splitserve.engine.messages import EngineCoreOutput, EngineCoreRequest, refused_output


@dataclasses.dataclass
class GlobalSchedulerConfig:
    """FastDeploy's scheduler options (docs/scaling.md "FastDeploy's schedulers")."""

    host: str = "127.0.0.1"
    port: int = 6379
    db: int = 0
    password: str = ""
    topic: str = "default"
    min_load_score: float = 3.0

    def describe(self) -> str:
        return f"redis://{self.host}:{self.port}/{self.db} topic {self.topic!r}"


class QueuedRequest(msgspec.Struct, array_like=True):
    origin: str  # the node whose client sent it (its inbox gets the outputs)
    enqueued_at: float  # time.time() at the origin: nodes do not share a monotonic clock
    model: str
    request: EngineCoreRequest


class InboxMessage(msgspec.Struct, array_like=True, omit_defaults=True):
    kind: str  # "outputs" | "started" | "abort" | "abort_clients"
    sender: str
    request_ids: list[str] = []  # "started", "abort": the origin's core request ids; "abort_clients": client ids
    outputs: list[EngineCoreOutput] = []  # "outputs": with the origin's ids; first_scheduled_time in wall time


class NodeBeat(msgspec.Struct, array_like=True):
    model: str
    running: int
    beat_at: float  # time.time()


def to_wire(out: EngineCoreOutput, origin_id: str) -> EngineCoreOutput:
    """An output of a request run for another node, as its origin gets it: under the origin's id, with
    first_scheduled_time in wall time (nodes do not share a monotonic clock)."""
    fst = out.first_scheduled_time
    if fst is not None:
        fst = time.time() - (time.monotonic() - fst)
    return msgspec.structs.replace(out, request_id=origin_id, first_scheduled_time=fst)


def from_wire(out: EngineCoreOutput) -> EngineCoreOutput:
    """At the origin: first_scheduled_time back on this process's monotonic clock."""
    fst = out.first_scheduled_time
    if fst is not None:
        fst = time.monotonic() - (time.time() - fst)
    return msgspec.structs.replace(out, first_scheduled_time=fst)


def failed_output(request_id: str, why: str) -> EngineCoreOutput:
    """The end of a request that failed on its way between nodes (a 503 at its origin)."""
    return refused_output(request_id, f"The request failed: {why}.")


def check_reachable(config: GlobalSchedulerConfig) -> None:
    """At start-up: Redis answers, or the server does not start (with the reason)."""
    try:
        import redis
    except ImportError:
        raise ValueError("--scheduler-name global needs the redis package: pip install 'splitserve[redis]'.") from None
    client = redis.Redis(host=config.host, port=config.port, db=config.db, password=config.password or None)
    try:
        client.ping()
    except redis.RedisError as exc:
        raise ValueError(
            f"--scheduler-name global: cannot reach Redis at {config.host}:{config.port} db {config.db} "
            f"(--scheduler-host/--scheduler-port/--scheduler-db/--scheduler-password): {exc}"
        ) from None
    finally:
        client.close()
