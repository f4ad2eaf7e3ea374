"""FastDeploy's scheduler flags of `splitserve serve` (`--scheduler-name local|global|splitwise` and the
global scheduler's Redis settings): their definitions, their checks, and the global scheduler's
configuration from them (engine/global_scheduler.py runs it)."""

from __future__ import annotations

from splitserve.engine import compatibility


def add_scheduler_args(g) -> None:
    """The flags, into the server's argument group `g`."""
    g.add_argument(
        "--scheduler-name",
        default="local",
        help="FastDeploy's scheduler: local (the engine's own queue, with --scheduler-max-size and --scheduler-ttl); "
        "global: instances of one model share one Redis queue, each taking work when its engine has room "
        "(--scheduler-host/port/db/password/topic; needs splitserve[redis]); splitwise is refused: not built",
    )
    g.add_argument("--scheduler-host", default="127.0.0.1", help="the global scheduler's Redis host")
    g.add_argument("--scheduler-port", type=int, default=6379, help="the global scheduler's Redis port")
    g.add_argument("--scheduler-db", type=int, default=0, help="the global scheduler's Redis database number")
    g.add_argument("--scheduler-password", default="", help="the global scheduler's Redis password")
    g.add_argument(
        "--scheduler-topic",
        default="default",
        help="the global scheduler shares work only between instances of one topic (and one served model)",
    )
    g.add_argument(
        "--scheduler-min-load-score",
        type=float,
        default=3.0,
        help="the global scheduler: an idle instance takes queued requests of another only while that one's "
        "load (requests queued plus running) is above this",
    )
    g.add_argument(
        "--scheduler-max-size",
        type=int,
        default=-1,
        help="FastDeploy's LocalScheduler queue length: answer 429 when this many requests wait (-1: no limit; "
        "the same as --max-queued-requests)",
    )


def check_scheduler_args(args) -> None:
    """FastDeploy's scheduler flags: the local scheduler is the engine's own queue; its size limit
    is --max-queued-requests under FastDeploy's name."""
    if args.scheduler_name == "splitwise":
        raise ValueError(
            "--scheduler-name splitwise (FastDeploy's Redis-backed PD scheduler) is not built: run prefill and "
            "decode instances behind `splitserve router` (docs/pd.md), or use global for mixed instances."
        )
    if args.scheduler_name == "global":
        _check_global_scheduler(args)
        return
    if args.scheduler_name != "local":
        raise ValueError(f"--scheduler-name must be local, global or splitwise, got {args.scheduler_name!r}.")
    if args.scheduler_max_size < -1:
        raise ValueError(f"--scheduler-max-size must be -1 (no limit) or >= 0, got {args.scheduler_max_size}.")
    if args.scheduler_max_size >= 0:
        if args.max_queued_requests not in (None, args.scheduler_max_size):
            raise ValueError("--scheduler-max-size and --max-queued-requests are one limit: give one of them.")
        args.max_queued_requests = args.scheduler_max_size


def _check_global_scheduler(args) -> None:
    if args.pd is not None:
        raise compatibility.refusal("global_scheduler+pd")
    if args.scheduler_max_size != -1 or args.max_queued_requests is not None:
        raise ValueError(
            "--scheduler-max-size and --max-queued-requests limit the local scheduler's queue: with --scheduler-name "
            "global requests wait in Redis (--scheduler-ttl bounds how long)."
        )
    if args.scheduler_min_load_score < 0:
        raise ValueError(f"--scheduler-min-load-score must be >= 0, got {args.scheduler_min_load_score}.")
    from splitserve.engine.global_scheduler_protocol import check_reachable

    check_reachable(global_scheduler_config(args))


def global_scheduler_config(args):
    from splitserve.engine.global_scheduler_protocol import GlobalSchedulerConfig

    return GlobalSchedulerConfig(
        args.scheduler_host,
        args.scheduler_port,
        args.scheduler_db,
        args.scheduler_password,
        args.scheduler_topic,
        args.scheduler_min_load_score,
    )
