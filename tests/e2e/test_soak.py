"""`splitserve bench soak`: a short soak against a real server (every outcome kind occurs, nothing
fails, the server ends idle, every process is sampled), and its memory arithmetic and /proc reading
on their own. The 30-minute figures of docs/serving.md come from the same command, run by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from splitserve.benchmarks import soak, soak_probe, soak_report
from splitserve.entrypoints.cli import build_parser

pytestmark = pytest.mark.slow  # soaks a real server (and all of tests/e2e is slow)


def _sample(t: float, **rss_mb: float) -> dict:
    processes = {pid: {"name": "p", "rss_bytes": int(mb * 2**20)} for pid, mb in rss_mb.items()}
    return {"t_s": t, "total_rss_bytes": sum(p["rss_bytes"] for p in processes.values()), "processes": processes}


def test_memory_growth_is_measured_from_the_first_sample_after_warmup():
    samples = [_sample(0, a=100, b=1000), _sample(60, a=400, b=3000), _sample(120, a=410, b=3030)]
    growth = soak_report.memory_growth(samples, warmup=60)
    assert growth["baseline_t_s"] == 60 and growth["growth_bytes"] == 40 * 2**20
    assert growth["allowed_bytes"] == 68 * 2**20  # 2% of 3400 MB beats 50 MB
    assert growth["within_goal"] and growth["per_process_growth_bytes"] == {"a": 10 * 2**20, "b": 30 * 2**20}
    small = soak_report.memory_growth([_sample(0, a=100), _sample(10, a=149)], warmup=0)
    assert small["allowed_bytes"] == 50 * 2**20 and small["within_goal"]
    assert not soak_report.memory_growth([_sample(0, a=100), _sample(10, a=151)], warmup=0)["within_goal"]


def test_process_tree_finds_children_and_their_memory():
    script = "import time; print('up', flush=True); time.sleep(30)"
    child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline() == "up\n"  # the interpreter runs: its memory is more than exec's
        tree = soak_probe.process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree
        assert soak_probe.rss_bytes(child.pid) > 1 << 20
    finally:
        child.kill()
        child.wait()
        child.stdout.close()
    assert child.pid not in soak_probe.process_tree(os.getpid())
    assert soak_probe.rss_bytes(child.pid) is None


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--base-url", "http://x"], "--pid"),
        (["--base-url", "http://x", "--pid", "1", "--pd", "1p1d"], "do not apply"),
        (["--warmup", "100", "--duration", "50"], "shorter than --duration"),
        (["--abort-fraction", "0.7", "--error-fraction", "0.5"], "add up to at most 1"),
    ],
)
def test_bad_flags_are_refused(flags, message):
    ns = build_parser().parse_args(["bench", "soak", *flags])
    with pytest.raises(ValueError, match=message):
        soak.check_arguments(ns)


def test_short_soak_against_a_server_whose_engine_is_killed(tiny_chat_model, tmp_path):
    """Every outcome kind occurs and nothing fails but what the engine's death explains: the engine
    is killed once (--kill-engine-every), requests fail only with a 5xx that names the cause, a
    request begun after the kill completes, the server ends idle, every process is sampled, and no
    process is left once the soak has stopped the server."""
    result_path = tmp_path / "soak.json"
    server_args = "--dtype float32 --max-model-len 512 --num-gpu-blocks-override 128"
    cmd = [sys.executable, "-m", "splitserve.entrypoints.cli", "bench", "soak", "--model", tiny_chat_model]
    cmd += ["--server-args", server_args, "--duration", "14", "--concurrency", "3", "--sample-interval", "4"]
    cmd += ["--warmup", "4", "--max-input-len", "48", "--max-output-len", "16", "--abort-fraction", "0.2"]
    cmd += ["--error-fraction", "0.2", "--kill-engine-every", "6", "--idle-timeout", "60"]
    cmd += ["--save-result", str(result_path)]
    subprocess.run(cmd, check=False, timeout=300)
    result = json.loads(result_path.read_text())
    counts = result["requests"]
    assert counts.get("completed", 0) > 0 and counts.get("aborted", 0) > 0
    assert counts.get("refused as expected", 0) > 0
    assert not {"5xx", "failed", "unexpected 4xx"} & set(counts), counts
    assert len(result["kills"]) == 1 and result["kills"][0]["served_again_after_s"] is not None
    assert all(soak_probe.is_idle(load) for load in result["idle"].values()), result["idle"]
    assert len(result["samples"]) >= 3
    names = {p["name"] for p in result["samples"][-1]["processes"].values()}
    assert "server" in names and len(result["samples"][-1]["processes"]) >= 2  # the server and its engine
    assert result["leftovers"] == [] and result["passed"], result["problems"]
