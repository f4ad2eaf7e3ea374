"""`scripts/gpu_check.sh --dry-run`: the GPU check's every step (environment report, `pytest -m gpu`,
the benchmarks with their rooflines, the summary) on the CPU at tiny sizes, so that the script a GPU
lease runs cannot rot between leases; and the roofline arithmetic it prints next to each figure."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from splitserve.benchmarks.gpu_check import format_table
from splitserve.benchmarks.rooflines import decode_seconds

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow  # runs the whole GPU check script dry (about 45 s)
def test_dry_run_ends_well_and_writes_its_report(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "GPU_CHECK_SITE": str(tmp_path / "site")}
    run = subprocess.run(
        ["bash", os.path.join(REPO, "scripts", "gpu_check.sh"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    with open(out / "gpu_check.json") as f:
        report = json.load(f)
    assert report["dry_run"] and report["ok"]
    assert {"date", "env", "steps", "tests", "bench"} <= set(report)
    assert [s["name"] for s in report["steps"]] == ["install", "env", "tests", "bench"]
    assert all(s["rc"] == 0 for s in report["steps"])
    assert report["env"]["torch"] and report["env"]["import_failures"] == {}
    # pytest -m gpu ran: on the CPU every GPU test is collected and skipped, none fails.
    tests = report["tests"]
    assert tests["ran"] and tests["tests"] > 0 and tests["skipped"] == tests["tests"] and not tests["failed"]
    bench = report["bench"]
    assert bench["dry_run"] and bench["bandwidth"]["bytes_per_s"] > 0
    assert bench["model"]["weight_bytes"] > 0 and bench["model"]["kv_bytes_per_token"] > 0
    by_key = {b["key"]: b for b in bench["benchmarks"]}
    assert {"nano_vllm", "batch64", "single_stream", "serve"} <= set(by_key)
    for key in ("nano_vllm", "batch64", "single_stream", "serve"):
        entry = by_key[key]
        assert entry["status"] == "ok", entry
        assert entry["figures"]["output_tok_s"] > 0 and entry["roofline"]["output_tok_s"] > 0
        assert entry["command"].startswith("splitserve bench ")
    assert by_key["batch64"]["figures"]["hf_output_tok_s"] > 0
    assert by_key["serve"]["figures"]["median_ttft_ms"] > 0
    assert by_key["nano_vllm"]["target"]["met"] is None  # a dry run judges no target
    # What comes back from a device run: a few files, none of them deeper than $OUT itself.
    assert sorted(os.listdir(out)) == ["bench.log", "gpu_check.json", "gpu_check.log", "junit.xml", "pytest.log"]
    assert "Benchmarks on cpu (DRY RUN" in run.stdout and "=== OK" in run.stdout


def test_decode_roofline_counts_weights_per_step_and_each_context():
    # Two requests at once: 3 steps; contexts 10, 11, 12 and 5, then 6 (it ends after 2 tokens).
    seconds = decode_seconds([(10, 3), (5, 2)], 2, weights=100, kv_token=1, bw=1.0)
    assert seconds == 3 * 100 + (10 + 11 + 12) + (5 + 6)
    # One at a time: 5 steps.
    assert decode_seconds([(10, 3), (5, 2)], 1, 100, 1, 1.0) == 5 * 100 + 33 + 11


def test_table_reports_failures_and_targets():
    report = {
        "dry_run": False,
        "bandwidth": {"device": "NVIDIA H100 80GB HBM3", "bytes_per_s": 3.35e12, "source": "data sheet"},
        "benchmarks": [
            {
                "key": "single_stream",
                "title": "single stream",
                "status": "ok",
                "figures": {"ms_per_token": 2.5, "output_tok_s": 400.0},
                "roofline": {"ms_per_token": 0.4, "output_tok_s": 2500.0},
                "target": {"op": "<=", "bound": 2.0, "unit": "ms/token", "met": False},
            },
            {"key": "serve", "title": "serve, concurrency 64", "status": "timeout", "error": "timed out after 120 s"},
        ],
    }
    table = format_table(report)
    assert "2.500 ms/token" in table and "0.400 ms/token" in table and "16%" in table and "NOT met" in table
    assert "timeout" in table and "timed out after 120 s" in table and "3,350 GB/s" in table
