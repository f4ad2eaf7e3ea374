"""Keeping a server's engine process running: when it dies (killed, crashed, or one of its ranks
died, which ends it too), the EngineSupervisor logs why, starts a new one with the same arguments
and tells the API workers (through an EngineWatch) where it is, so that serving resumes by itself.

Restarts back off: a restart is immediate after an engine that served for STABLE_S seconds; while
engines die sooner than that (or fail to start), the next restarts wait 1 s, 2 s, 4 s ... (at most
MAX_BACKOFF_S). After `max_restarts` restarts within `window_s` seconds the supervisor gives up, and
the server exits non-zero so that an outer supervisor (systemd, Kubernetes) takes over. A failed
start (the new engine dies before it is ready) counts as a restart.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import time
from collections import deque
from collections.abc import Callable

from splitserve.config import EngineConfig
from splitserve.engine.engine_process import EngineProcess
from splitserve.engine.pd_role import PDRoleState, for_config

logger = logging.getLogger("splitserve.api_server")

MAX_BACKOFF_S = 30.0
STABLE_S = 30.0  # an engine that served this long resets the backoff
_POLL_S = 0.1  # how often the supervisor looks at the engine process
_SHUTDOWN_GRACE_S = 0.2


def backoff_seconds(streak: int) -> float:
    """The wait before the `streak`-th restart in a row of engines that died within STABLE_S."""
    return 0.0 if streak <= 1 else min(2.0 ** (streak - 2), MAX_BACKOFF_S)


class EngineWatch:
    """What the API workers know of the engine process: its pid and a generation number that grows
    with each restart (0: the first engine), and the instance's PD role (engine/pd_role.py), which
    outlives restarts. Shared memory, so that it reaches spawned workers."""

    def __init__(self, pid: int, pd_role: PDRoleState | None = None):
        ctx = multiprocessing.get_context("spawn")  # one writer (the supervisor): no lock, no semaphore
        self._pid = ctx.RawValue("q", pid)
        self._generation = ctx.RawValue("q", 0)
        self.pd_role = pd_role

    @property
    def pid(self) -> int:
        return self._pid.value

    @property
    def generation(self) -> int:
        return self._generation.value

    def publish(self, pid: int) -> None:
        """A new engine is ready at the same address (the pid is written first: a reader that sees
        the new generation sees its pid)."""
        self._pid.value = pid
        self._generation.value += 1


class EngineSupervisor:
    """Restarts the engine process of one server. `start` makes a new EngineProcess (not yet ready);
    `on_restart` is called after each successful restart (the metrics count it)."""

    def __init__(
        self,
        engine: EngineProcess,
        start: Callable[[], EngineProcess],
        config: EngineConfig,
        max_restarts: int,
        window_s: float,
        on_restart: Callable[[], None] | None = None,
        stopping: Callable[[], bool] = lambda: False,
    ):
        self.engine = engine
        self.start = start
        self.config = config
        self.max_restarts = max_restarts
        self.window_s = window_s
        self.on_restart = on_restart
        self.stopping = stopping  # True once the server is shutting down: its engine stops with it
        self.watch = EngineWatch(engine.pid, for_config(config))
        self.restarts: deque[float] = deque()  # when each restart of the window began
        self.streak = 0  # restarts in a row, each after an engine that died within STABLE_S
        self.ready_at = time.monotonic()  # when the current engine became ready
        self.gave_up: str | None = None  # why, once the supervisor has stopped restarting

    async def run(self) -> None:
        """Watch the engine and restart it when it dies; returns only once it has given up."""
        while True:
            await asyncio.sleep(_POLL_S)
            if self.engine.is_alive():
                continue
            # A signal to the whole process group (Ctrl-C, a service manager's stop) ends the engine
            # and the server together: that is no failure, so the server's own handler goes first.
            await asyncio.sleep(_SHUTDOWN_GRACE_S)
            if self.stopping():
                return
            cause = self._cause(self.engine)
            logger.error("The engine process died (%s)", cause)
            while not await self._restart(cause):  # a new engine that died at start: again
                cause = self._cause(self.engine)
            if self.gave_up is not None:
                return

    async def _restart(self, cause: str) -> bool:
        """One restart attempt: True when a new engine is ready (or the supervisor gave up)."""
        now = time.monotonic()
        while self.restarts and now - self.restarts[0] > self.window_s:
            self.restarts.popleft()
        if len(self.restarts) >= self.max_restarts:
            self.gave_up = (
                f"the engine died {len(self.restarts) + 1} times within {self.window_s:.0f} s "
                f"(--max-engine-restarts {self.max_restarts}); last: {cause}"
            )
            logger.error("Not restarting the engine again: %s. The server exits.", self.gave_up)
            return True
        self.restarts.append(now)
        self.streak = 1 if now - self.ready_at >= STABLE_S else self.streak + 1
        delay = backoff_seconds(self.streak)
        logger.warning(
            "Restarting the engine (restart %d of at most %d within %.0f s)%s",
            len(self.restarts),
            self.max_restarts,
            self.window_s,
            f" in {delay:.0f} s" if delay else "",
        )
        await asyncio.sleep(delay)
        await asyncio.to_thread(self.engine.shutdown)  # reaps it, removes its socket file and log copy
        started = time.monotonic()
        self.engine = await asyncio.to_thread(self.start)
        try:
            await asyncio.to_thread(self.engine.wait_ready, self.config)
        except RuntimeError as exc:
            logger.error("The new engine failed to start: %s", exc)
            await asyncio.to_thread(self.engine.process.join, 5)
            return False
        self.ready_at = time.monotonic()
        self.watch.publish(self.engine.pid)
        if self.on_restart is not None:
            self.on_restart()
        logger.info(
            "The engine is serving again (pid %d, ready in %.1f s)", self.engine.pid, time.monotonic() - started
        )
        return True

    @staticmethod
    def _cause(engine: EngineProcess) -> str:
        lines = engine.last_log_lines()
        tail = "".join(f"\n    | {line}" for line in lines)
        return engine.describe_exit() + (f"; its last log lines:{tail}" if tail else "; it logged nothing")
