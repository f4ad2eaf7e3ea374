"""Engine flags survive the trip from EngineArgs to the command line of a launched PD instance."""

from __future__ import annotations

import argparse

from splitserve.engine.arg_utils import EngineArgs, add_engine_args, engine_args_from, engine_flags


def test_engine_flags_round_trip():
    args = EngineArgs(
        model="some/model",
        max_num_seqs=7,
        enforce_eager=True,
        cuda_graph_sizes=[8, 16],
        async_scheduling=False,
        enable_prefix_caching=False,
        gpu_memory_utilization=0.5,
    )
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = engine_flags(args)
    assert "--no-async-scheduling" in flags and flags[flags.index("--cuda-graph-sizes") + 1 :][:2] == ["8", "16"]
    assert engine_args_from(parser.parse_args(flags)) == args


def test_async_scheduling_defaults_to_the_device():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert parser.parse_args([]).async_scheduling is None  # resolved per device: on for CUDA, off for CPU
    assert parser.parse_args(["--async-scheduling"]).async_scheduling is True
