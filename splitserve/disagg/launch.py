"""Starting PD deployments: `serve --pd XpYd` on one machine, and the rank-table environment.

One machine, one command: X prefill and Y decode instances (ordinary `serve` processes with a
--pd-role) on free loopback ports, each pinned to its share of the CPU cores (or to one CUDA
device each), then the router on the requested port. Across machines, each process reads its
role, devices and peers from the rank-table files named by the environment (ranktable.py).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
import socket
import subprocess
import sys
import time

import httpx

from splitserve.config import EngineArgs
from splitserve.engine.core_proc import CPU_CORES_ENV

logger = logging.getLogger("splitserve.pd")

_STARTUP_TIMEOUT_S = 600.0


def parse_pd_spec(spec: str) -> tuple[int, int]:
    """"1p1d" -> (1, 1): the number of prefill and decode instances."""
    match = re.fullmatch(r"(\d+)p(\d+)d", spec.strip().lower())
    if not match or int(match[1]) < 1 or int(match[2]) < 1:
        raise ValueError(f"--pd must look like 1p1d or 2p2d (at least one of each), got {spec!r}.")
    return int(match[1]), int(match[2])


def split_devices(count: int) -> list[dict[str, str]]:
    """Environment for each of `count` instances: one CUDA device each when there are enough, else
    disjoint shares of this process's CPU cores (shared round-robin when there are too few)."""
    import torch

    if torch.cuda.is_available():
        n = torch.cuda.device_count()
        if n < count:
            raise ValueError(f"{count} instances need {count} CUDA devices; {n} are visible.")
        return [{"CUDA_VISIBLE_DEVICES": str(i)} for i in range(count)]
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < count:
        logger.warning("%d instances share %d CPU cores: they will slow each other down", count, len(cores))
        return [{CPU_CORES_ENV: str(cores[i % len(cores)])} for i in range(count)]
    share = len(cores) // count
    return [{CPU_CORES_ENV: ",".join(map(str, cores[i * share:(i + 1) * share]))} for i in range(count)]


def engine_flags(args: EngineArgs) -> list[str]:
    """EngineArgs as `serve` flags (only what differs from the defaults)."""
    flags = []
    for field in dataclasses.fields(EngineArgs):
        value = getattr(args, field.name)
        if value == field.default or field.name in ("pd_role", "kv_port"):
            continue
        flag = "--" + field.name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, list):
            flags += [flag, *map(str, value)]
        else:
            flags += [flag, str(value)]
    return flags


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclasses.dataclass
class Instance:
    role: str
    url: str
    process: subprocess.Popen


def launch_local(engine_args: EngineArgs, server_args, spec: str) -> None:
    """`serve --pd XpYd`: start the instances, wait until they are healthy, then run the router."""
    from splitserve.disagg.router import RouterConfig, run_router

    num_prefill, num_decode = parse_pd_spec(spec)
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    instances = []
    try:
        for role, env in zip(roles, split_devices(len(roles))):
            instances.append(_start_instance(engine_args, server_args, role, env))
        wait_healthy(instances)
        config = RouterConfig(prefill_urls=[i.url for i in instances if i.role == "prefill"],
                              decode_urls=[i.url for i in instances if i.role == "decode"],
                              policy=server_args.policy, api_key=server_args.api_key)
        logger.info("PD deployment %s ready: router on port %d", spec, server_args.port)
        run_router(config, server_args.host, server_args.port)
    finally:
        for instance in instances:
            instance.process.terminate()
        for instance in instances:
            try:
                instance.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                instance.process.kill()


def _start_instance(engine_args: EngineArgs, server_args, role: str, env: dict[str, str]) -> Instance:
    port = free_port()
    cmd = [sys.executable, "-m", "splitserve.entrypoints.openai.api_server", *engine_flags(engine_args),
           "--pd-role", role, "--host", "127.0.0.1", "--port", str(port)]
    for flag in ("chat_template", "reasoning_parser", "max_queued_requests"):
        value = getattr(server_args, flag)
        if value is not None:
            cmd += ["--" + flag.replace("_", "-"), str(value)]
    if server_args.disable_log_requests:
        cmd.append("--disable-log-requests")
    logger.info("Starting %s instance on port %d (%s)", role, port, ", ".join(f"{k}={v}" for k, v in env.items()))
    process = subprocess.Popen(cmd, env={**os.environ, **env})
    return Instance(role, f"http://127.0.0.1:{port}", process)


def wait_healthy(instances: list[Instance]) -> None:
    deadline = time.monotonic() + _STARTUP_TIMEOUT_S
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


def device_env(device_ids: list[int]) -> dict[str, str]:
    """The rank table's device ids for this instance: CUDA devices on NVIDIA machines, CPU cores
    otherwise (ids that are not cores of this machine are refused)."""
    import torch

    if torch.cuda.is_available():
        if len(device_ids) > 1:
            raise ValueError(f"This instance has devices {device_ids}: more than one needs tensor parallelism, "
                             "which is not supported yet; give each instance one device.")
        return {"CUDA_VISIBLE_DEVICES": str(device_ids[0])}
    cores = os.sched_getaffinity(0)
    missing = sorted(set(device_ids) - cores)
    if missing:
        raise ValueError(f"The rank table gives this instance devices {device_ids}, but {missing} are not CPU cores "
                         f"of this machine (it has {sorted(cores)}); on CPU machines device ids name cores.")
    return {CPU_CORES_ENV: ",".join(map(str, device_ids))}


def serve(engine_args: EngineArgs, server_args) -> None:
    """`splitserve serve`: one instance, a local PD deployment (--pd), or the role the rank-table
    environment gives this process (a prefill or decode instance, or the router)."""
    from splitserve.disagg.ranktable import resolve_pd_environment
    from splitserve.disagg.router import RouterConfig, run_router
    from splitserve.entrypoints.openai.api_server import run_server

    if server_args.pd:
        return launch_local(engine_args, server_args, server_args.pd)
    launch = resolve_pd_environment()
    if launch is None:
        return run_server(engine_args, server_args)
    if launch.role == "router":
        logger.info("Rank table: router for prefill %s and decode %s", launch.prefill_urls, launch.decode_urls)
        config = RouterConfig(prefill_urls=launch.prefill_urls, decode_urls=launch.decode_urls,
                              policy=server_args.policy, api_key=server_args.api_key)
        return run_router(config, server_args.host, server_args.port)
    logger.info("Rank table: %s instance %d on %s, devices %s", launch.role, launch.instance_index,
                launch.server_ip, launch.device_ids)
    os.environ.update(device_env(launch.device_ids))
    engine_args.pd_role, engine_args.kv_host = launch.role, launch.server_ip
    return run_server(engine_args, server_args)
