"""Start-up: `splitserve bench startup` times a server and an offline engine phase by phase, the
engine process builds its own config from the server's arguments (so that the two processes'
imports overlap), and an engine process whose arguments are bad says why without hanging."""

from __future__ import annotations

import pytest

from splitserve.benchmarks import startup
from splitserve.engine.arg_utils import EngineArgs
from splitserve.engine.engine_process import DeferredEngineConfig, EngineProcess
from splitserve.entrypoints.cli import build_parser

pytestmark = pytest.mark.slow  # starts servers and engine processes


def test_bench_startup_reports_every_process_phase_by_phase(tiny_chat_model, capsys):
    ns = build_parser().parse_args(
        ["bench", "startup", "--model", tiny_chat_model, "--runs", "1", "--server-args", "--max-model-len 128"]
    )
    results = startup.main(ns)  # one run of each kind (cold): the warm runs are the same code with a filled cache
    assert [r["cold"] for r in results["server"]] == [True]
    for run in results["server"]:
        engine, server = run["processes"]["engine"], run["processes"]["server"]
        # The engine process reads the model config itself, while the server reads its own copy.
        assert {"model config", "weights", "KV cache", "warm-up"} <= set(engine["phases_s"])
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
