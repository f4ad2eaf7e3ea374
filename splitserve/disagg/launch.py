"""Starting the processes of a PD deployment on one machine, and giving each its devices.

`splitserve serve --pd XpYd` starts X prefill and Y decode instances (ordinary `serve` processes
with a --pd-role) on free loopback ports, each pinned to its share of the CPU cores (or to one
CUDA device each). Across machines, each process reads its role and devices from the rank-table
environment (ranktable.py); `device_env` turns those device ids into this process's environment.
An InstanceKeeper starts an instance again, on the same port, when its process exits.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
import subprocess
import sys
import threading
import time

import httpx

from splitserve.executor.cpu_binding import CPU_CORES_ENV, split_cores
from splitserve.process_utils import exit_with_parent, free_port, nvidia_driver_present

logger = logging.getLogger("splitserve.pd")

_STARTUP_TIMEOUT_S = 600.0
SERVER_MODULE = "splitserve.entrypoints.openai.api_server"  # FastDeploy's server command
# What an instance process runs: `splitserve serve`'s defaults (SERVER_MODULE's --default-max-tokens
# differs), so that the launcher's flags mean the same there.
INSTANCE_MODULE = "splitserve.entrypoints.serve"


def parse_pd_spec(spec: str) -> tuple[int, int]:
    """ "1p1d" -> (1, 1): the number of prefill and decode instances."""
    match = re.fullmatch(r"(\d+)p(\d+)d", spec.strip().lower())
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise ValueError(f"--pd must look like 1p1d or 2p2d (at least one of each), got {spec!r}.")
    return int(match[1]), int(match[2])


def _cuda_visible() -> bool:
    """Whether CUDA devices are visible, asking torch only on a host with NVIDIA's driver: the launcher
    of a CPU deployment then starts its instances without importing torch (a second of its start-up)."""
    if not nvidia_driver_present():
        return False
    import torch

    return torch.cuda.is_available()


def split_devices(count: int, devices_per_instance: int = 1) -> list[dict[str, str]]:
    """Environment for each of `count` instances: `devices_per_instance` CUDA devices each (one per
    rank) when there are enough, else disjoint shares of this process's CPU cores (shared
    round-robin when there are too few), which the instance splits among its own ranks."""
    if _cuda_visible():
        import torch

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
    if _cuda_visible():
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
    """A server process this launcher started on loopback (`cmd` and `env` start it again)."""

    role: str
    url: str
    process: subprocess.Popen
    cmd: list[str] = dataclasses.field(default_factory=list)
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    stopped: bool = False  # it exited because it was told to: not started again

    def stop(self, timeout: float = 15.0) -> None:
        self.process.terminate()
        try:
            self.process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    def restart(self) -> None:
        self.process = _popen(self.cmd, self.env)


def start_instance(role: str, flags: list[str], env: dict[str, str] | None = None) -> LocalInstance:
    """A server process (`python -m INSTANCE_MODULE FLAGS`) on a free loopback port."""
    port = free_port()
    cmd = [sys.executable, "-m", INSTANCE_MODULE, *flags, "--host", "127.0.0.1", "--port", str(port)]
    env = env or {}
    shown = "".join(f", {k}={v}" for k, v in env.items() if "KEY" not in k)  # not the API key
    logger.info("Starting %s instance on port %d%s", role, port, shown)
    return LocalInstance(role, f"http://127.0.0.1:{port}", _popen(cmd, env), cmd, env)


def _popen(cmd: list[str], env: dict[str, str]) -> subprocess.Popen:
    # The instance gets SIGTERM from the kernel if this launcher dies, however it dies (kill -9 too).
    arm = functools.partial(exit_with_parent, os.getpid())
    return subprocess.Popen(cmd, env={**os.environ, **env}, preexec_fn=arm)  # noqa: PLW1509


# How an instance ends when told to stop: exit code 0, or a stop signal (SIGHUP, SIGINT, SIGTERM), as
# the signal itself or as the server's exit code for it (128 + signal).
_STOPPED_CODES = {0, *(s for n in (1, 2, 15) for s in (-n, 128 + n))}


class InstanceKeeper:
    """Starts an instance again when its process exits (its server gave up on its engine, or the
    process was killed or crashed; not when a stop signal ended it), on the same port, so that the
    router, which checks its /health, admits it again by itself. Restarts in a row back off (1 s,
    2 s, 4 s ... at most MAX_BACKOFF_S); an instance that ran for STABLE_S seconds starts over at once."""

    MAX_BACKOFF_S = 30.0
    STABLE_S = 30.0

    def __init__(self, instances: list[LocalInstance]):
        self.instances = instances
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pd-instance-keeper", daemon=True)
        self.restarts = 0

    def start(self) -> InstanceKeeper:
        self._thread.start()
        return self

    def stop(self) -> None:
        """No restart after this returns (call it before stopping the instances)."""
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        started = {id(i): time.monotonic() for i in self.instances}
        streak = {id(i): 0 for i in self.instances}
        while not self._stop.wait(0.2):
            for inst in self.instances:
                code = inst.process.poll()
                if code is None or inst.stopped:
                    continue
                how = f"killed by signal {-code}" if code < 0 else f"exit code {code}"
                if code in _STOPPED_CODES:  # told to stop (the launcher's own process group was)
                    logger.info("The %s instance at %s stopped (%s); not starting it again", inst.role, inst.url, how)
                    inst.stopped = True
                    continue
                lived = time.monotonic() - started[id(inst)]
                streak[id(inst)] = 1 if lived >= self.STABLE_S else streak[id(inst)] + 1
                delay = 0.0 if streak[id(inst)] <= 1 else min(2.0 ** (streak[id(inst)] - 2), self.MAX_BACKOFF_S)
                logger.error(
                    "The %s instance at %s exited (%s) after %.0f s; starting it again%s",
                    inst.role,
                    inst.url,
                    how,
                    lived,
                    f" in {delay:.0f} s" if delay else "",
                )
                if self._stop.wait(delay):
                    return
                inst.restart()
                started[id(inst)] = time.monotonic()
                self.restarts += 1


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
        time.sleep(0.2)
