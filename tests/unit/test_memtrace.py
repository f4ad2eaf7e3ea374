"""SPLITSERVE_TRACEMALLOC: the engine's report of where its Python memory grows."""

from __future__ import annotations

import logging
import tracemalloc

import pytest

from splitserve.engine.core.memtrace import MemoryTrace


def test_off_unless_asked(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_TRACEMALLOC", raising=False)
    assert MemoryTrace.from_env() is None


@pytest.mark.parametrize("frames, interval", [("x", "60"), ("0", "60"), ("2", "-1")])
def test_bad_values_are_refused(monkeypatch, frames, interval):
    monkeypatch.setenv("SPLITSERVE_TRACEMALLOC", frames)
    monkeypatch.setenv("SPLITSERVE_TRACEMALLOC_INTERVAL_S", interval)
    with pytest.raises(ValueError, match="SPLITSERVE_TRACEMALLOC"):
        MemoryTrace.from_env()
    tracemalloc.stop()


def test_reports_the_call_site_that_grew(monkeypatch, caplog):
    monkeypatch.setenv("SPLITSERVE_TRACEMALLOC", "1")
    monkeypatch.setenv("SPLITSERVE_TRACEMALLOC_INTERVAL_S", "0.001")
    caplog.set_level(logging.INFO, logger="splitserve.engine.core.memtrace")
    trace = MemoryTrace.from_env()
    try:
        trace.last_report = 0.0
        trace.maybe_report()  # the first report is the baseline
        kept = [bytearray(4096) for _ in range(1000)]  # 4 MB that stays
        trace.last_report = 0.0
        trace.maybe_report()
    finally:
        tracemalloc.stop()
    assert len(kept) == 1000
    report = caplog.records[-1].getMessage()
    assert "most growth since the first report" in report
    assert f"{__file__.rsplit('/', 1)[-1]}:" in report.splitlines()[1] and "+3.9" in report.splitlines()[1]
