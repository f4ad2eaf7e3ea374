"""`--profile DIR` of `splitserve bench throughput`: the timed run under torch.profiler, with a
Chrome trace written to DIR (open it in Perfetto or chrome://tracing) and a summary printed: how
busy the GPU was (the union of its kernels' time over the run's wall time), the kernels that took
most of it, and the host operators that took most of the CPU. On a CPU the summary starts with the
run's breakdown (`cpu_breakdown`): its wall time split into matmuls, attention, KV-cache writes,
norms and rotary, activations, sampling, the fused layer stack (decoder layers in one C++ call,
whose kernels are profiler events of their own and count in their categories: what is left to it
is its C++ between them), other operators, and the time outside every operator (Python,
scheduling, detokenizing), so the share outside the matmuls is visible on every host. The
profiler slows the run down (a few percent on a GPU, more on the host side), so figures of a
profiled run are not reported as speed."""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time

logger = logging.getLogger(__name__)


# Operator name (without its namespace) -> category of the CPU breakdown: the first match wins.
CPU_CATEGORIES: tuple[tuple[str, re.Pattern], ...] = tuple(
    (category, re.compile(pattern))
    for category, pattern in (
        ("fused layer stack (its C++ between the kernels)", r"decode_stack"),
        ("attention", r"prefill_attention|decode_attention|scaled_dot_product|flash_attention"),
        ("KV-cache writes", r"write_kv|index_put|index_copy"),
        ("matmuls", r"(^|_)(b|add|baddb)?mm($|_)|linear|matmul|einsum|moe_experts"),
        ("norms and rotary", r"rms_norm|rotary|layer_norm"),
        ("activations", r"silu|gelu"),
        ("sampling", r"sample|topk|argmax|softmax|multinomial|^sort$|cumsum"),
    )
)
OTHER_OPS = "other operators"
OUTSIDE_OPS = "outside operators (Python, scheduling, detokenizing)"


def categorize(name: str) -> str:
    short = name.rsplit("::", 1)[-1]
    for category, pattern in CPU_CATEGORIES:
        if pattern.search(short):
            return category
    return OTHER_OPS


def cpu_breakdown(op_self_seconds: dict[str, float], wall: float) -> str:
    """The run's wall time by category, from each operator's self time (its own time, children
    excluded, so nothing counts twice): a table of seconds and shares, largest first."""
    totals: dict[str, float] = {}
    for name, seconds in op_self_seconds.items():
        category = categorize(name)
        totals[category] = totals.get(category, 0.0) + seconds
    totals[OUTSIDE_OPS] = max(wall - sum(totals.values()), 0.0)
    width = max(len(c) for c in totals)
    lines = [f"{'where the time went':<{width}}  {'seconds':>8}  {'share':>6}"]
    for category, seconds in sorted(totals.items(), key=lambda kv: -kv[1]):
        lines.append(f"{category:<{width}}  {seconds:8.3f}  {100 * seconds / wall:5.1f}%")
    return "\n".join(lines)


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
    else:
        lines.append(cpu_breakdown({e.key: e.self_cpu_time_total / 1e6 for e in averages}, wall))
    lines.append(averages.table(sort_by="self_cpu_time_total", row_limit=rows))
    return "\n".join(lines)
