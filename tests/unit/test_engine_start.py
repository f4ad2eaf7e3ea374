"""How a server starts its engine process (engine/engine_process.py): forked from the server on the
CPU once its config is built, unless that process started threads a fork would lose; spawned on GPU
hosts, with data parallelism, or when SPLITSERVE_ENGINE_START_METHOD=spawn."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from splitserve.engine import engine_process


@pytest.mark.parametrize(
    ("method", "nvidia", "dp", "forks"),
    [
        ("auto", False, 1, True),
        ("auto", True, 1, False),  # the engine may run on the GPU: spawned first, imports side by side
        ("auto", False, 2, False),  # each replica sets its share of the cores before importing torch
        ("fork", True, 1, True),
        ("spawn", False, 1, False),
    ],
)
def test_when_the_engine_process_is_forked(monkeypatch, method, nvidia, dp, forks):
    monkeypatch.setenv("SPLITSERVE_ENGINE_START_METHOD", method)
    real_exists = os.path.exists
    monkeypatch.setattr(os.path, "exists", lambda p: nvidia if p == "/dev/nvidiactl" else real_exists(p))
    assert engine_process.fork_wanted(dp) is forks


def test_a_bad_start_method_is_refused(monkeypatch):
    from splitserve import envs

    monkeypatch.setenv("SPLITSERVE_ENGINE_START_METHOD", "thread")
    with pytest.raises(ValueError, match="SPLITSERVE_ENGINE_START_METHOD"):
        _ = envs.SPLITSERVE_ENGINE_START_METHOD


# In a fresh interpreter (this one runs pytest's threads and has run torch ops): the config alone
# leaves the process forkable; a Python thread, or OpenMP's pool started by a parallel op (a forked
# child's next parallel region would hang), started while the config is built makes config_for_fork
# say why the engine must be spawned.
_PROBE = """
import sys, threading, torch
from splitserve.engine.arg_utils import EngineArgs
from splitserve.engine.engine_process import config_for_fork
args = EngineArgs(model=sys.argv[1], max_model_len=64)
config, hazard = config_for_fork(args)
print(config.device.type, hazard)
build = EngineArgs.create_engine_config
def build_and_start(self):
    if sys.argv[2] == "thread":
        threading.Thread(target=threading.Event().wait, daemon=True).start()
    else:
        torch.randn(512, 512) @ torch.randn(512, 512)
    return build(self)
EngineArgs.create_engine_config = build_and_start
print(config_for_fork(args)[1])
"""


@pytest.mark.slow  # a fresh interpreter builds a config
@pytest.mark.parametrize("starter", ["thread", "parallel op"])
def test_threads_started_before_the_fork_make_the_engine_spawned(tiny_chat_model, starter):
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    lines = subprocess.run(
        [sys.executable, "-c", _PROBE, tiny_chat_model, starter], capture_output=True, text=True, check=True, env=env
    ).stdout.splitlines()
    assert lines[0] == "cpu None"
    assert "threads a fork would lose" in lines[1]


@pytest.mark.parametrize("case", ["fork", "engine spawned", "thread started"])
def test_api_workers_are_forked_only_from_a_process_safe_to_fork(caplog, case):
    """serve --workers N forks its API processes where its engine was forked and no thread has started
    since (they start with everything loaded); otherwise they are spawned, and the log says why."""
    import logging
    import threading
    import time

    from splitserve.entrypoints.openai.api_processes import start_api_workers
    from splitserve.process_utils import os_threads

    baseline = None if case == "engine spawned" else os_threads()
    stop = threading.Event()
    if case == "thread started":
        threading.Thread(target=stop.wait, daemon=True).start()
    with caplog.at_level(logging.INFO, logger="splitserve"):
        workers = start_api_workers(time.sleep, lambda i: (0.01 * i,), 2, baseline)
    stop.set()
    for worker in workers:
        worker.join(60)
        assert worker.exitcode == 0
    forked = case == "fork"
    assert f"Started 2 API server processes, {'forked' if forked else 'spawned'}" in caplog.text
    assert ("started 1 threads" in caplog.text) is (case == "thread started")
