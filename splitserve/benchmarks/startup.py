"""`splitserve bench startup`: how long a model takes to be ready, phase by phase.

Each run starts `splitserve serve` (the OpenAI server, in a process of its own) and times it from
the process's start to its first healthy /health answer; then it builds an offline `LLM` in a
fresh interpreter. The processes write their phases (engine/startup.py) to a report directory,
which this command reads. The first run is cold: splitserve's cache of GGUF configs and
tokenizers (SPLITSERVE_CACHE_DIR) starts empty; later runs are warm. The CPU kernels are built
before the first run, as `make setup` does, and each run's cache holds the note of where they are
(kernels/build.py), so that no run pays for compiling them or for torch's build check.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time

import httpx

from splitserve import envs
from splitserve.disagg.launch import SERVER_MODULE
from splitserve.process_utils import free_port

_OFFLINE = (
    "import json, sys; from splitserve import LLM; "
    "LLM(sys.argv[1] or None, use_tqdm_on_load=False, **json.loads(sys.argv[2]))"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="", help="HF directory, hub id or .gguf file (default: the embedded model)")
    parser.add_argument("--server-args", default="", help='extra `splitserve serve` flags, e.g. "--dtype float32"')
    parser.add_argument("--runs", type=int, default=3, help="starts of each kind: the first cold, the others warm")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one start may take")


def _read_reports(directory: str) -> dict[str, dict]:
    return {r["role"]: r for r in (json.load(open(p)) for p in sorted(glob.glob(os.path.join(directory, "*.json"))))}


def time_server(ns: argparse.Namespace, env: dict, report_dir: str) -> tuple[float, dict]:
    """Seconds from starting `splitserve serve` to its first healthy answer, and its processes' phases."""
    port = free_port()
    cmd = [sys.executable, "-m", SERVER_MODULE, "--port", str(port), "--host", "127.0.0.1", "--disable-log-requests"]
    cmd += (["--model", ns.model] if ns.model else []) + shlex.split(ns.server_args)
    start = time.perf_counter()
    process = subprocess.Popen(cmd, env={**env, "SPLITSERVE_STARTUP_REPORT": report_dir}, stderr=subprocess.DEVNULL)
    try:
        while time.perf_counter() - start < ns.timeout:
            if process.poll() is not None:
                raise RuntimeError(f"the server exited with code {process.returncode} during start-up")
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - start, _read_reports(report_dir)
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        raise TimeoutError(f"the server was not healthy within {ns.timeout:.0f} s")
    finally:
        process.terminate()
        process.wait(timeout=60)


def time_offline(ns: argparse.Namespace, env: dict, report_dir: str) -> tuple[float, dict]:
    """Seconds from starting a Python interpreter to a built offline LLM, and its phases."""
    start = time.perf_counter()
    subprocess.run(
        [sys.executable, "-c", _OFFLINE, ns.model, json.dumps(_engine_kwargs(ns.server_args))],
        env={**env, "SPLITSERVE_STARTUP_REPORT": report_dir},
        check=True,
        timeout=ns.timeout,
        stderr=subprocess.DEVNULL,
    )
    return time.perf_counter() - start, _read_reports(report_dir)


def _engine_kwargs(server_args: str) -> dict:
    """The `--flag value` pairs of --server-args as LLM keywords (flags without a value are True)."""
    words, kwargs = shlex.split(server_args), {}
    for i, word in enumerate(words):
        if word.startswith("--"):
            has_value = i + 1 < len(words) and not words[i + 1].startswith("--")
            kwargs[word[2:].replace("-", "_")] = _number_or_text(words[i + 1]) if has_value else True
    return kwargs


def _number_or_text(value: str):
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


def _print_run(kind: str, run: int, seconds: float, reports: dict) -> None:
    print(f"{kind:<8} run {run} ({'cold' if run == 1 else 'warm'}): ready in {seconds:.2f} s")
    for role, record in reports.items():
        phases = ", ".join(f"{name} {s:.2f}" for name, s in record["phases_s"].items())
        print(f"    {role:<16} ready {record['since_process_start_s']:.2f} s after its start: {phases}")


def main(ns: argparse.Namespace) -> dict:
    from splitserve import kernels

    kernels.cpu_ops()  # built (or loaded) here, so that no timed run compiles them
    results: dict[str, list] = {"server": [], "offline": []}
    with tempfile.TemporaryDirectory(prefix="splitserve-startup-") as root:
        for run in range(1, ns.runs + 1):
            for kind, timer in (("server", time_server), ("offline", time_offline)):
                cache = os.path.join(root, f"cache-{kind}")
                if run == 1 and os.path.isdir(notes := os.path.join(envs.cache_root(), "kernels")):
                    shutil.copytree(notes, os.path.join(cache, "kernels"))  # empty but for the kernels' note
                env = {**os.environ, "SPLITSERVE_CACHE_DIR": cache}
                seconds, reports = timer(ns, env, os.path.join(root, f"{kind}-{run}"))
                _print_run(kind, run, seconds, reports)
                results[kind].append({"run": run, "cold": run == 1, "ready_s": seconds, "processes": reports})
    return results
