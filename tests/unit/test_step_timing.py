"""The host's time per engine step by phase (splitserve/step_timing.py), as `bench throughput
--step-breakdown` prints it."""

import time

from splitserve import step_timing


def test_laps_charge_the_time_since_the_previous_lap_to_their_phase():
    timer = step_timing.start()
    try:
        time.sleep(0.02)
        step_timing.lap("scheduling")
        time.sleep(0.04)
        step_timing.lap("forward")
        step_timing.count_step(4)
        step_timing.lap("update")
        step_timing.count_step(2)
    finally:
        assert step_timing.stop() is timer
    assert 0.02 <= timer.seconds["scheduling"] < 0.04 <= timer.seconds["forward"] < 0.2
    assert timer.seconds["update"] < 0.01 and timer.seconds["sampling"] == 0.0
    assert timer.steps == 2 and timer.rows == 6
    report = timer.report()
    assert "2 steps, 3.0 requests per step" in report
    (forward,) = [line for line in report.splitlines() if line.startswith("forward ")]
    ms_per_step, us_per_request, share = forward.split()[1:]
    assert abs(float(ms_per_step) - 1e3 * timer.seconds["forward"] / 2) < 0.01
    assert abs(float(us_per_request) - 1e6 * timer.seconds["forward"] / 6) < 0.1
    assert 50 < float(share.rstrip("%")) < 100


def test_laps_are_free_when_timing_is_off():
    assert step_timing.stop() is None
    step_timing.lap("forward")  # nothing to charge: no error, no state
    step_timing.count_step(3)
    assert step_timing.stop() is None


def test_bench_throughput_refuses_a_breakdown_of_data_parallel_replicas():
    import pytest

    from splitserve.benchmarks import throughput
    from splitserve.entrypoints.cli import build_parser, engine_args_from

    ns = build_parser().parse_args(["bench", "throughput", "--step-breakdown", "--data-parallel-size", "2"])
    with pytest.raises(ValueError, match="--step-breakdown .* replicas' processes"):
        throughput.main(ns, engine_args_from(ns))
