"""The global scheduler's options and what its nodes put in Redis (engine/global_scheduler.py says how
they use it): a queued request, a message to a node's inbox, a node's heartbeat."""

from __future__ import annotations

import dataclasses

import msgspec

from splitserve.engine.messages import EngineCoreOutput, EngineCoreRequest


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
