"""Where a process's start-up time goes, phase by phase.

The engine and the API server time their phases (model config, tokenizer, weights, KV cache, CPU
kernels, warm-up, waiting for the engine process) and log them in one line when they are ready,
with the time since the process started (interpreter and imports included). With
SPLITSERVE_STARTUP_REPORT=DIR each process also writes them to DIR/<role>-<pid>.json, which
`splitserve bench startup` reads.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time

from splitserve import envs

logger = logging.getLogger(__name__)

_phases: dict[str, float] = {}


@contextlib.contextmanager
def phase(name: str):
    start = time.perf_counter()
    try:
        yield
    finally:
        _phases[name] = _phases.get(name, 0.0) + time.perf_counter() - start


def forget() -> None:
    """Drop the phases timed so far: a process forked from one that timed its own (a forked engine)."""
    _phases.clear()


def seconds_since_process_start() -> float:
    """From the kernel's record of when this process started (/proc), so imports count too."""
    with open("/proc/self/stat") as f:
        start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
    with open("/proc/uptime") as f:
        uptime = float(f.read().split()[0])
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


def report(role: str) -> dict:
    """Log this process's phases and, with SPLITSERVE_STARTUP_REPORT, write them; then start over
    (a later engine in the same process reports its own)."""
    total = seconds_since_process_start()
    phases = dict(_phases)
    _phases.clear()
    shown = ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items())
    logger.info("%s ready %.2f s after its process started (%s)", role.capitalize(), total, shown or "no phase timed")
    record = {"role": role, "pid": os.getpid(), "since_process_start_s": total, "phases_s": phases}
    directory = envs.SPLITSERVE_STARTUP_REPORT
    if directory:
        os.makedirs(directory, exist_ok=True)
        with open(os.path.join(directory, f"{role}-{os.getpid()}.json"), "w") as f:
            json.dump(record, f)
    return record
