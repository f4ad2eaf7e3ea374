"""The engine supervisor's decisions, on fake engine processes: restart at once after an engine that
served, back off while restarts follow one another, give up after --max-engine-restarts within the
window, and never restart while the server is stopping."""

from __future__ import annotations

import asyncio
import itertools

import pytest

from splitserve.engine import supervisor as sup
from splitserve.engine.supervisor import EngineSupervisor, backoff_seconds

_pids = itertools.count(1000)


class FakeProcess:
    def join(self, timeout=None) -> None:
        pass


class FakeEngine:
    """Alive until `die()`; `fails_start`: wait_ready raises, as for an engine that dies at start."""

    def __init__(self, fails_start: bool = False):
        self.pid = next(_pids)
        self.alive = not fails_start
        self.fails_start = fails_start
        self.process = FakeProcess()
        self.stopped = False

    def is_alive(self) -> bool:
        return self.alive

    def die(self) -> None:
        self.alive = False

    def wait_ready(self, config) -> None:
        if self.fails_start:
            raise RuntimeError("The engine process exited during start-up; see its log above.")

    def shutdown(self) -> None:
        self.stopped = True

    def describe_exit(self) -> str:
        return "killed by signal 9 (SIGKILL)"

    def last_log_lines(self, count: int = 10) -> list[str]:
        return ["INFO engine: the last words"]


@pytest.fixture(autouse=True)
def fast(monkeypatch):
    monkeypatch.setattr(sup, "_POLL_S", 0.001)
    monkeypatch.setattr(sup, "_SHUTDOWN_GRACE_S", 0.0)
    waits = []
    real_sleep = asyncio.sleep

    async def no_sleep(seconds):
        waits.append(seconds)
        await real_sleep(0)

    monkeypatch.setattr(sup.asyncio, "sleep", no_sleep)
    return waits


def test_backoff_grows_and_is_capped():
    assert [backoff_seconds(n) for n in range(1, 8)] == [0, 1, 2, 4, 8, 16, 30]


def _supervisor(starts, max_restarts=5, window_s=600.0):
    first = FakeEngine()
    made = iter(starts)
    restarts = []
    s = EngineSupervisor(first, lambda: next(made), config=None, max_restarts=max_restarts, window_s=window_s)
    s.on_restart = lambda: restarts.append(s.engine.pid)
    return s, first, restarts


async def _until(predicate, task) -> None:
    for _ in range(10000):
        if predicate() or task.done():
            return
        await asyncio.sleep(0.001)
    raise AssertionError("the supervisor did not get there")


def test_a_dead_engine_is_replaced_and_the_workers_told(fast):
    async def main():
        new = FakeEngine()
        s, first, restarts = _supervisor([new])
        task = asyncio.ensure_future(s.run())
        first.die()
        await _until(lambda: restarts, task)
        assert s.engine is new and first.stopped and restarts == [new.pid]
        assert s.watch.pid == new.pid and s.watch.generation == 1
        assert s.gave_up is None and not task.done()
        task.cancel()

    asyncio.run(main())


def test_a_crash_loop_backs_off_then_gives_up(fast):
    async def main():
        s, first, restarts = _supervisor([FakeEngine(fails_start=True) for _ in range(5)], max_restarts=3)
        task = asyncio.ensure_future(s.run())
        first.die()
        await asyncio.wait_for(task, 5)
        assert restarts == [] and s.watch.generation == 0
        assert "died 4 times within 600 s" in s.gave_up and "--max-engine-restarts 3" in s.gave_up
        assert [w for w in fast if w >= 1] == [1.0, 2.0]  # restart 1 at once, then 1 s, then 2 s

    asyncio.run(main())


def test_no_restart_while_the_server_stops(fast):
    async def main():
        s, first, restarts = _supervisor([FakeEngine()])
        s.stopping = lambda: True
        task = asyncio.ensure_future(s.run())
        first.die()
        await asyncio.wait_for(task, 5)
        assert restarts == [] and s.gave_up is None and not first.stopped

    asyncio.run(main())


def test_zero_restarts_gives_up_at_the_first_death(fast):
    async def main():
        s, first, restarts = _supervisor([], max_restarts=0)
        task = asyncio.ensure_future(s.run())
        first.die()
        await asyncio.wait_for(task, 5)
        assert s.gave_up.startswith("the engine died 1 times") and restarts == []

    asyncio.run(main())


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-engine-restarts", "-1"], "--max-engine-restarts must be >= 0"),
        (["--engine-restart-window", "0"], "--engine-restart-window must be > 0"),
        (["--metrics-prefix", "vllm:x"], "--metrics-prefix must be a Prometheus name"),
    ],
)
def test_server_flags_of_restarts_and_metrics_are_checked(flags, message):
    from splitserve.entrypoints.openai.args import make_arg_parser, split_args

    defaults = split_args(make_arg_parser().parse_args([]))[1]
    assert (defaults.max_engine_restarts, defaults.engine_restart_window, defaults.metrics_prefix) == (
        5,
        600.0,
        "splitserve",
    )
    with pytest.raises(ValueError, match=message):
        split_args(make_arg_parser().parse_args(flags))


def test_a_local_pd_deployment_passes_the_restart_flags_to_its_instances():
    from splitserve.entrypoints.openai.args import make_arg_parser, split_args
    from splitserve.entrypoints.serve import instance_flags

    flags = ["--max-engine-restarts", "2", "--engine-restart-window", "60", "--metrics-prefix", "vllm"]
    engine_args, server_args = split_args(make_arg_parser().parse_args(flags))
    passed = instance_flags(engine_args, server_args, "decode")
    for name, value in zip(flags[::2], ("2", "60.0", "vllm")):
        assert passed[passed.index(name) + 1] == value
    assert passed[passed.index("--pd-role") + 1] == "decode"
