"""`--profile DIR` of `splitserve bench throughput`: the timed run under torch.profiler, with a
Chrome trace written to DIR (open it in Perfetto or chrome://tracing) and a summary printed: how
busy the GPU was (the union of its kernels' time over the run's wall time), the kernels that took
most of it, and the host operators that took most of the CPU. The profiler slows the run down
(a few percent on a GPU, more on the host side), so figures of a profiled run are not reported as
speed."""

from __future__ import annotations

import contextlib
import logging
import os
import time

logger = logging.getLogger(__name__)


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals: the time at least one of them was running."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total


@contextlib.contextmanager
def profiled(directory: str | None, cuda: bool):
    """Profiles the block when directory is set (else does nothing); then writes the trace and
    prints the summary."""
    if not directory:
        yield
        return
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    os.makedirs(directory, exist_ok=True)
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        yield
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - start
    path = os.path.join(directory, f"splitserve-trace-{os.getpid()}.json")
    prof.export_chrome_trace(path)
    print(summary(prof, wall, cuda))
    print(f"Chrome trace: {path}")


def summary(prof, wall: float, cuda: bool, rows: int = 15) -> str:
    """The summary of a finished profile (see the module's docstring)."""
    averages = prof.key_averages()
    lines = [f"Profiled run: {wall:.2f} s of wall time"]
    if cuda:
        kernels = [
            (e.time_range.start / 1e6, e.time_range.end / 1e6)
            for e in prof.events()
            if getattr(e, "device_type", None) is not None and e.device_type.name == "CUDA"
        ]
        busy = busy_seconds(kernels)
        lines.append(
            f"GPU busy {busy:.2f} s ({100 * busy / wall:.0f}% of the run; idle {wall - busy:.2f} s): "
            f"{len(kernels)} kernels and copies"
        )
        lines.append(averages.table(sort_by="self_device_time_total", row_limit=rows))
    lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    return "\n".join(lines)
