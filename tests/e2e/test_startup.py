"""Start-up: `splitserve bench startup` times a server and an offline engine phase by phase; on the
CPU the server forks its engine process once its config is built (the engine must not keep the
server's port), and spawned (SPLITSERVE_ENGINE_START_METHOD=spawn, GPU hosts) the engine process
builds its own config from the server's arguments; an engine process whose arguments are bad says why
without hanging."""

from __future__ import annotations

import os

import httpx
import pytest

from splitserve.benchmarks import startup
from splitserve.engine.arg_utils import EngineArgs
from splitserve.engine.engine_process import DeferredEngineConfig, EngineProcess
from splitserve.entrypoints.cli import build_parser
from tests.helpers.server import RemoteServer, engine_pid

pytestmark = pytest.mark.slow  # starts servers and engine processes


def test_bench_startup_reports_every_process_phase_by_phase(tiny_chat_model, capsys):
    ns = build_parser().parse_args(
        ["bench", "startup", "--model", tiny_chat_model, "--runs", "1", "--server-args", "--max-model-len 128"]
    )
    results = startup.main(ns)  # one run of each kind (cold): the warm runs are the same code with a filled cache
    assert [r["cold"] for r in results["server"]] == [True]
    for run in results["server"]:
        engine, server = run["processes"]["engine"], run["processes"]["server"]
        # Forked from the server, which read the model config, the engine times only its own phases.
        assert {"weights", "KV cache", "warm-up"} <= set(engine["phases_s"])
        assert "model config" not in engine["phases_s"]
        assert {"model config", "tokenizer", "engine process"} <= set(server["phases_s"])
        assert 0 < engine["since_process_start_s"] < server["since_process_start_s"] <= run["ready_s"] + 1
    for run in results["offline"]:
        assert {"model config", "weights", "KV cache"} <= set(run["processes"]["offline engine"]["phases_s"])
    out = capsys.readouterr().out
    assert "server   run 1 (cold): ready in" in out and "offline  run 1 (cold): ready in" in out


def test_an_engine_process_with_bad_arguments_says_why(tiny_chat_model):
    args = EngineArgs(model=tiny_chat_model, max_model_len=128, quantization="no-such-method")
    engine = EngineProcess(DeferredEngineConfig(args, health_timeout=30.0))
    try:
        with pytest.raises(RuntimeError, match="The engine failed to start: .*no-such-method"):
            engine.wait_ready(None)
    finally:
        engine.shutdown()


def _listening_inode(port: int) -> str:
    with open("/proc/net/tcp") as f:
        for line in f.read().splitlines()[1:]:
            fields = line.split()
            if int(fields[1].split(":")[1], 16) == port and fields[3] == "0A":  # LISTEN
                return fields[9]
    raise AssertionError(f"nothing listens on port {port}")


def _sockets(pid: int) -> set[str]:
    fds = f"/proc/{pid}/fd"
    return {os.readlink(os.path.join(fds, fd)) for fd in os.listdir(fds)}


@pytest.mark.parametrize("method", ["auto", "spawn"])
def test_the_engine_process_forked_or_spawned_serves_and_leaves_the_port_to_the_server(
    tiny_chat_model, tmp_path, method
):
    log = tmp_path / "server.log"
    env = {"SPLITSERVE_ENGINE_START_METHOD": method}
    with RemoteServer(tiny_chat_model, "--max-model-len", "128", env=env, log_path=str(log)) as server:
        listening = f"socket:[{_listening_inode(server.port)}]"
        assert listening in _sockets(server.proc.pid)
        assert listening not in _sockets(engine_pid(server))  # else the port outlives a dead server
        body = {"model": tiny_chat_model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        answer = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60).json()
        assert answer["usage"]["completion_tokens"] == 4
    text = log.read_text()
    said = "forked from this one" if method == "auto" else "Engine ready"
    assert said in text and ("forked" in text) == (method == "auto")
