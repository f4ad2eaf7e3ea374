"""What the PD end-to-end tests share: the instances' flags, waiting for a condition, idleness.

Idle: an instance runs nothing and holds no KV block, by its /metrics (the usage gauge and the
engine's own invariant check)."""

from __future__ import annotations

import math
import time

from tests.helpers.server import metric

COMMON = ["--dtype", "float32", "--max-model-len", "512", "--num-gpu-blocks-override", "256", "--disable-log-requests"]


def wait_for(predicate, timeout: float = 30.0, what: str = "condition") -> float:
    """Seconds until `predicate()` held; AssertionError after `timeout`."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")


def idle(url: str, since: float = 0.0) -> bool:
    """Nothing runs and no KV block is held: the usage gauge (the free queue's length) and the count
    the engine takes, block by block, in its invariant check while idle (NaN while requests run),
    both from engine stats taken after `since` (Unix time: an engine held up in a step still shows
    the stats from before it)."""
    held = metric(url, "splitserve:kv_cache_blocks_held")
    return (
        metric(url, "splitserve:engine_stats_time_seconds") > since
        and metric(url, "splitserve:kv_cache_usage_perc") == 0
        and metric(url, "splitserve:num_requests_running") == 0
        and metric(url, "splitserve:kv_transfer_leases_active") == 0
        and not math.isnan(held)
        and held == 0
    )
