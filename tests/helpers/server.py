"""Real `splitserve serve` processes on loopback for end-to-end tests, and what the tests read from them."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _session_members(sid: int) -> list[int]:
    """Processes of session `sid` (the server was started as a session leader), read from /proc."""
    members = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid:  # after "pid (comm)": state, ppid, pgrp, session
                members.append(int(entry))
    return members


class RemoteServer:
    """`splitserve serve --model MODEL ARGS` (with entry_point="api_server": `python -m
    splitserve.entrypoints.openai.api_server --model MODEL ARGS`, FastDeploy's command, whose
    requests default to 16 tokens; with model=None, `splitserve ARGS`, e.g. the router) on a free
    port; waits for /health."""

    def __init__(
        self,
        model: str | None,
        *args: str,
        env: dict | None = None,
        port: int | None = None,
        startup_timeout: float = 180.0,
        log_path: str | None = None,
        entry_point: str = "serve",
    ):
        """`log_path`: write the server's output there (default: this process's stdout and stderr)."""
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        if model is None:
            cmd = [sys.executable, "-m", "splitserve.entrypoints.cli", *args]
        elif entry_point == "api_server":
            cmd = [sys.executable, "-m", "splitserve.entrypoints.openai.api_server", "--model", model, *args]
        else:
            cmd = [sys.executable, "-m", "splitserve.entrypoints.cli", "serve", "--model", model, *args]
        cmd += ["--host", "127.0.0.1", "--port", str(self.port)]
        self._log = open(log_path, "wb") if log_path else None  # noqa: SIM115 (closed in close())
        self.proc = subprocess.Popen(
            cmd,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
            start_new_session=True,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log else None,
        )
        self._wait_healthy(startup_timeout)

    def _wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {self.proc.returncode} during start-up")
            try:
                if httpx.get(f"{self.url}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)  # a refused connection costs next to nothing; a server is up sooner
        self.close()
        raise TimeoutError("the server did not become healthy in time")

    def child_pids(self) -> list[int]:
        """Processes started by the server (the engine core, API workers)."""
        return [pid for pid in _session_members(self.proc.pid) if pid != self.proc.pid]

    def close(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()

    def __enter__(self) -> RemoteServer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def metric(server, name: str) -> float:
    """The sum of a metric's series, from a server (or a base URL)."""
    url = server if isinstance(server, str) else server.url
    text = httpx.get(f"{url}/metrics", timeout=10).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def stream_and_kill(url: str, body: dict, pid_to_kill, after: int) -> list[str]:
    """The data of each server-sent event of a streamed /v1/completions, with SIGKILL sent to
    `pid_to_kill()` once `after` events have arrived (a process dying mid-stream)."""
    events = []
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[6:])
                if len(events) == after:
                    os.kill(pid_to_kill(), signal.SIGKILL)
    return events


def read_stream(url: str, body: dict, headers: dict, out: dict, on_chunk=None) -> None:
    """Read a streamed /v1/completions (for a thread): `out` gets the number of chunks so far
    ("chunks"), the last finish_reason ("finish") and the answer's headers; an error event fails.
    `on_chunk(n)`, when given, is called in the reading thread after the n-th chunk (to act at once
    at a point of the stream, before the next token arrives)."""
    out["chunks"], out["finish"] = 0, None
    body = {**body, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, headers=headers, timeout=120) as r:
        out["headers"] = r.headers
        for line in r.iter_lines():
            if line.startswith("data: {"):
                event = json.loads(line[6:])
                assert "error" not in event, event
                out["chunks"] += 1
                out["finish"] = event["choices"][0].get("finish_reason") or out["finish"]
                if on_chunk is not None:
                    on_chunk(out["chunks"])


def engine_pid(server: RemoteServer) -> int:
    """The engine core process: the server's child named splitserve-eng (process_utils.set_process_name)."""
    return named_child(server, "splitserve-eng")


def named_child(server: RemoteServer, name: str) -> int:
    """The one process under the server whose /proc/PID/comm is `name`."""
    found = [p for p in server.child_pids() if comm(p) == name]
    assert len(found) == 1, f"{len(found)} processes named {name} under the server"
    return found[0]


def comm(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
