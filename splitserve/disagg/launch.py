"""Starting the processes of a PD deployment on one machine, and giving each its devices.

`splitserve serve --pd XpYd` starts X prefill and Y decode instances (ordinary `serve` processes
with a --pd-role) on free loopback ports, each pinned to its share of the CPU cores (or to one
CUDA device each). Across machines, each process reads its role and devices from the rank-table
environment (ranktable.py); `device_env` turns those device ids into this process's environment.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import subprocess
import sys
import time

import httpx

from splitserve.executor.cpu_binding import CPU_CORES_ENV, split_cores
from splitserve.process_utils import exit_with_parent, free_port

logger = logging.getLogger("splitserve.pd")

_STARTUP_TIMEOUT_S = 600.0
SERVER_MODULE = "splitserve.entrypoints.openai.api_server"  # what an instance process runs


def parse_pd_spec(spec: str) -> tuple[int, int]:
    """ "1p1d" -> (1, 1): the number of prefill and decode instances."""
    match = re.fullmatch(r"(\d+)p(\d+)d", spec.strip().lower())
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise ValueError(f"--pd must look like 1p1d or 2p2d (at least one of each), got {spec!r}.")
    return int(match[1]), int(match[2])


def split_devices(count: int, devices_per_instance: int = 1) -> list[dict[str, str]]:
    """Environment for each of `count` instances: `devices_per_instance` CUDA devices each (one per
    rank) when there are enough, else disjoint shares of this process's CPU cores (shared
    round-robin when there are too few), which the instance splits among its own ranks."""
    import torch

    if torch.cuda.is_available():
        n, need = torch.cuda.device_count(), count * devices_per_instance
        if n < need:
            raise ValueError(
                f"{count} instances of {devices_per_instance} ranks need {need} CUDA devices; {n} are visible."
            )
        per = devices_per_instance
        return [{"CUDA_VISIBLE_DEVICES": ",".join(str(i * per + d) for d in range(per))} for i in range(count)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        logger.warning("%d instances share %d CPU cores: they will slow each other down", count, len(cores))
    return [{CPU_CORES_ENV: ",".join(map(str, share))} for share in split_cores(count, cores)]


def device_env(device_ids: list[int]) -> dict[str, str]:
    """The rank table's device ids for this instance: CUDA devices on NVIDIA machines; on CPU
    machines, cores. Ids that are all cores of this machine name those cores; otherwise they are
    slots, mapped onto the cores that exist in order: id i takes core number i mod (number of cores)
    (so the guide's devices 4,5 and 6,7 run on a 2-core machine, sharing its cores), with one warning."""
    import torch

    if torch.cuda.is_available():
        return {"CUDA_VISIBLE_DEVICES": ",".join(map(str, device_ids))}
    cores = sorted(os.sched_getaffinity(0))
    if set(device_ids) <= set(cores):
        return {CPU_CORES_ENV: ",".join(map(str, device_ids))}
    mapped = [cores[i % len(cores)] for i in device_ids]
    logger.warning(
        "Rank table devices %s are not all CPU cores of this machine (it has %s): as slots they run on cores %s "
        "(device id mod %d)",
        device_ids,
        cores,
        mapped,
        len(cores),
    )
    return {CPU_CORES_ENV: ",".join(map(str, mapped))}


@dataclasses.dataclass
class LocalInstance:
    """A server process this launcher started on loopback."""

    role: str
    url: str
    process: subprocess.Popen

    def stop(self, timeout: float = 15.0) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


def start_instance(role: str, flags: list[str], env: dict[str, str] | None = None) -> LocalInstance:
    """A server process (`python -m SERVER_MODULE FLAGS`) on a free loopback port."""
    port = free_port()
    cmd = [sys.executable, "-m", SERVER_MODULE, *flags, "--host", "127.0.0.1", "--port", str(port)]
    env = env or {}
    logger.info("Starting %s instance on port %d%s", role, port, "".join(f", {k}={v}" for k, v in env.items()))
    # The instance gets SIGTERM from the kernel if this launcher dies, however it dies (kill -9 too).
    arm = functools.partial(exit_with_parent, os.getpid())
    process = subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=arm)  # noqa: PLW1509
    return LocalInstance(role, f"http://127.0.0.1:{port}", process)


def stop_all(instances: list[LocalInstance]) -> None:
    """Ask every instance to stop at once, then wait for each (killing the ones that linger)."""
    for instance in instances:
        instance.process.terminate()
    for instance in instances:
        instance.stop()


def wait_healthy(instances: list[LocalInstance], timeout: float = _STARTUP_TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    pending = list(instances)
    while pending:
        for instance in list(pending):
            if instance.process.poll() is not None:
                raise RuntimeError(f"The {instance.role} instance at {instance.url} exited during start-up.")
            try:
                if httpx.get(f"{instance.url}/health", timeout=2).status_code == 200:
                    pending.remove(instance)
            except httpx.HTTPError:
                pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(pending)} PD instances did not become healthy in time.")
        time.sleep(0.5)
