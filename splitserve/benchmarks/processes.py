"""Benchmark commands in processes of their own (the GPU check's, splitserve/benchmarks/gpu_check.py):
each `splitserve ...` runs in a session (process group) of its own with a timeout, and whatever it
started is ended with it, so that a crash or a hang costs that benchmark only and frees the GPU."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

CLI = [sys.executable, "-m", "splitserve.entrypoints.cli"]  # `splitserve`, without installing the package


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, proc: subprocess.Popen, deadline: float) -> None:
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with code {proc.returncode} while starting")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the server did not answer /health in time")


def _group_gone(proc: subprocess.Popen, seconds: float) -> bool:
    """Whether nothing is left of the process group that `proc` leads, waiting up to `seconds`."""
    deadline = time.monotonic() + seconds
    while True:
        proc.poll()  # reaps the leader: a zombie would keep the group alive
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def stop_group(proc: subprocess.Popen) -> None:
    """Ends what is left of the process group that `proc` leads (a server's engine process too):
    SIGTERM, then SIGKILL after 8 s, so that nothing holds the GPU for the next benchmark."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        if _group_gone(proc, 8.0):
            break
    proc.wait()


def run_splitserve(argv: list[str], log, timeout: float, env: dict[str, str] | None = None) -> None:
    """`splitserve ARGV` in a session of its own, so that a timeout (or an interrupt) ends whatever it
    started too."""
    log.write(f"\n$ {''.join(f'{k}={v} ' for k, v in (env or {}).items())}splitserve {' '.join(argv)}\n")
    log.flush()
    env = {**os.environ, **env} if env else None
    proc = subprocess.Popen(CLI + argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    try:
        code = proc.wait(timeout=timeout)
    finally:
        stop_group(proc)
    if code != 0:
        raise RuntimeError(f"`splitserve {argv[0]} {argv[1]}` exited with code {code} (see bench.log)")
