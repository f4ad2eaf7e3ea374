"""SPLITSERVE_TRACEMALLOC=N: where the engine process's Python memory grows, for leak hunts.

With the variable set, the engine process starts `tracemalloc` keeping N frames per allocation
(1 is cheap enough for a soak; more frames slow every allocation) and, every
SPLITSERVE_TRACEMALLOC_INTERVAL_S seconds (default 60), logs the total traced size and the ten
call sites whose allocations grew most since the first report. tracemalloc sees what Python's
allocators hand out (objects, bytes, lists); memory that torch or other native code takes with
malloc does not appear, so a growing RSS with a flat traced total points at native memory.
"""

from __future__ import annotations

import logging
import time
import tracemalloc

from splitserve import envs

logger = logging.getLogger(__name__)

_TOP = 10


class MemoryTrace:
    def __init__(self, frames: int, interval_s: float):
        tracemalloc.start(frames)
        self.interval_s = interval_s
        self.first: tracemalloc.Snapshot | None = None
        self.last_report = time.monotonic()
        logger.info("tracemalloc on (%d frames); growth by call site every %.0f s", frames, interval_s)

    @classmethod
    def from_env(cls) -> MemoryTrace | None:
        frames = envs.SPLITSERVE_TRACEMALLOC
        if frames is None:
            return None
        interval = envs.SPLITSERVE_TRACEMALLOC_INTERVAL_S
        if frames < 1 or interval <= 0:
            raise ValueError("SPLITSERVE_TRACEMALLOC needs at least 1 frame and a positive interval.")
        return cls(frames, interval)

    def maybe_report(self) -> None:
        now = time.monotonic()
        if now - self.last_report < self.interval_s:
            return
        self.last_report = now
        snapshot = tracemalloc.take_snapshot().filter_traces([tracemalloc.Filter(False, tracemalloc.__file__)])
        traced, peak = tracemalloc.get_traced_memory()
        if self.first is None:
            self.first = snapshot
            logger.info(
                "tracemalloc: %.1f MB traced (peak %.1f MB); later reports compare with this",
                traced / 2**20,
                peak / 2**20,
            )
            return
        grown = snapshot.compare_to(self.first, "traceback")[:_TOP]
        lines = [
            f"  {stat.size_diff / 2**20:+8.2f} MB {stat.count_diff:+8d} blocks  "
            + " <- ".join(f"{frame.filename}:{frame.lineno}" for frame in stat.traceback)
            for stat in grown
        ]
        logger.info(
            "tracemalloc: %.1f MB traced (peak %.1f MB); most growth since the first report:\n%s",
            traced / 2**20,
            peak / 2**20,
            "\n".join(lines),
        )
