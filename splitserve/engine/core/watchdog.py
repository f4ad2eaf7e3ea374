"""A watchdog over the engine loop: a step that runs longer than the health timeout is logged, in
words and with the engine thread's stack, so that an operator sees what it was doing while
/health answers 503 (the API server's health check finds the engine silent: entrypoints/openai/app.py).

It is a daemon thread in the engine process that only reads the loop's progress; a stuck step
cannot be interrupted from Python, so the watchdog reports and the orchestrator decides.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

from splitserve import envs

logger = logging.getLogger("splitserve.engine.core.watchdog")


class StepWatchdog:
    def __init__(self, timeout: float, describe, poll_s: float = 0.5):
        """`describe()`: a line saying what the engine holds (requests running, waiting, ...)."""
        self.timeout, self.describe, self.poll_s = timeout, describe, poll_s
        self.step = 0
        self.started: float | None = None  # when the step in progress began
        self.reported_step = -1
        self.thread_id = threading.get_ident()  # the engine loop's thread
        self._stall_s = envs.SPLITSERVE_FAULT_STEP_STALL_S or 0.0
        self._thread = threading.Thread(target=self._watch, name="splitserve-watchdog", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        self.step += 1
        self.started = time.monotonic()
        if self._stall_s > 0:  # fault injection for tests: one stuck step
            stall, self._stall_s = self._stall_s, 0.0
            logger.warning(
                "Fault injection (SPLITSERVE_FAULT_STEP_STALL_S): the engine loop sleeps %.1f s in step %d",
                stall,
                self.step,
            )
            time.sleep(stall)

    def end(self) -> None:
        if self.reported_step == self.step and self.started is not None:
            logger.warning(
                "Engine step %d finished after %.1f s: the engine is making progress again",
                self.step,
                time.monotonic() - self.started,
            )
        self.started = None

    def _watch(self) -> None:
        while True:
            time.sleep(self.poll_s)
            started, step = self.started, self.step
            if started is None or self.reported_step == step:
                continue
            elapsed = time.monotonic() - started
            if elapsed > self.timeout:
                self.reported_step = step
                frame = sys._current_frames().get(self.thread_id)
                where = "".join(traceback.format_stack(frame)) if frame is not None else "(no stack)"
                logger.error(
                    "Engine step %d has run for %.1f s, longer than the health timeout (%.1f s): /health "
                    "answers 503 until it returns. The engine holds %s. The engine thread is at:\n%s",
                    step,
                    elapsed,
                    self.timeout,
                    self.describe(),
                    where,
                )
