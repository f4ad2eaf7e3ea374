"""What `splitserve bench soak` reads off a running deployment: the processes under its root process
and their resident memory (from /proc), the instances behind a PD router, and each instance's load
(from its Prometheus metrics)."""

from __future__ import annotations

import asyncio
import os
import re
import time

import httpx

# Gauges of an instance that are all 0 once it has nothing left to do.
IDLE_GAUGES = (
    "splitserve:num_requests_running",
    "splitserve:num_requests_waiting",
    "splitserve:kv_cache_usage_perc",
    "splitserve:kv_transfer_leases_active",
)
_INSTANCE_LINE = re.compile(r'^splitserve_router:instance_healthy\{instance="([^"]+)",role="([^"]+)"\}', re.M)


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/PID/stat after "pid (comm)": state, ppid, ...; None for a process gone meanwhile."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def process_tree(root: int) -> list[int]:
    """`root` and every live process descended from it, read from /proc (parents first)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(int(entry))) is not None and fields[0] != "Z":
            children.setdefault(int(fields[1]), []).append(int(entry))
    tree, pending = [], [root]
    while pending:
        pid = pending.pop(0)
        if _stat_fields(pid) is not None:
            tree.append(pid)
            pending.extend(sorted(children.get(pid, [])))
    return tree


def engine_processes(root: int) -> list[int]:
    """The engine processes under `root` (named splitserve-eng: process_utils.set_process_name)."""
    found = []
    for pid in process_tree(root):
        try:
            with open(f"/proc/{pid}/comm") as f:
                if f.read().strip() == "splitserve-eng":
                    found.append(pid)
        except OSError:
            pass
    return found


def parent_of(pid: int) -> int | None:
    fields = _stat_fields(pid)
    return int(fields[1]) if fields is not None else None


def rss_bytes(pid: int) -> int | None:
    """Resident memory of a process (VmRSS), None once it is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return 0  # a kernel thread or a zombie: no user memory


def describe(pid: int) -> str:
    """A short name an operator recognises: the PD role or server module for a server, else the
    process's own name (the engine core, an API worker, a rank)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
        with open(f"/proc/{pid}/comm") as f:
            comm = f.read().strip()
    except OSError:
        return "gone"
    if "--pd-role" in argv and argv.index("--pd-role") + 1 < len(argv):
        return f"{argv[argv.index('--pd-role') + 1]} server"
    if "--pd" in argv:
        return "PD launcher and router"
    if any(arg.endswith(("api_server", "entrypoints.serve")) or arg == "serve" for arg in argv):
        return "server"
    if any("multiprocessing" in arg for arg in argv):
        return f"child of a server ({comm})"
    return comm


async def stopped_within(stop, seconds: float) -> bool:
    """Wait `seconds` (for the soak's periodic helpers): True as soon as `stop` (an asyncio.Event) is set."""

    try:
        await asyncio.wait_for(stop.wait(), timeout=seconds)
        return True
    except asyncio.TimeoutError:
        return False


def metric_value(text: str, name: str) -> float | None:
    """The first sample of metric `name` in a Prometheus text page (`splitserve:x` also matches the
    same metric under another prefix, e.g. `vllm:x` from a server run with --metrics-prefix vllm)."""
    base = re.escape(name.split(":", 1)[-1])
    match = re.search(rf"^(?:[a-zA-Z_][a-zA-Z0-9_]*:)?{base}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(match[1]) if match else None


def router_instances(router_url: str) -> list[tuple[str, str]]:
    """(url, role) of every instance a PD router sends requests to, from its metrics."""
    text = httpx.get(f"{router_url}/metrics", timeout=10).text
    return _INSTANCE_LINE.findall(text)


def instance_load(url: str) -> dict[str, float | None]:
    """The idle gauges of one instance (None where it does not export one)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return {name.split(":", 1)[1]: metric_value(text, name) for name in IDLE_GAUGES}


def wait_health(url: str, timeout: float) -> bool:
    """Until `url`/health answers 200 (True), or `timeout` seconds (False)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                return True
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return False


def kv_resident_bytes(url: str) -> int:
    """How much of an instance's KV cache is resident (on CPU the cache is mapped lazily: it
    becomes resident as blocks are first used, which is not a leak)."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    return int(metric_value(text, "splitserve:kv_cache_resident_bytes") or 0)


def is_idle(load: dict[str, float | None]) -> bool:
    return all(not value for value in load.values())
