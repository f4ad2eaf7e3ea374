"""Engine flags survive the trip from EngineArgs to the command line of a launched PD instance."""

from __future__ import annotations

import argparse

import pytest
import torch

from splitserve.engine.arg_flags import add_engine_args, engine_args_from, engine_flags
from splitserve.engine.arg_utils import EngineArgs


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


def _parse(*flags: str) -> EngineArgs:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    return engine_args_from(parser.parse_args(list(flags)))


def test_aiak_table_flags_are_recognised():
    """Every server flag of the AIAK parameter table parses: it works, or it is refused with a reason."""
    args = _parse("-q", "awq", "--max-seq-len-to-capture", "4096", "--scheduler-delay-factor", "0.5")
    assert args.quantization == "awq" and args.max_seq_len_to_capture == 4096 and args.scheduler_delay_factor == 0.5
    assert _parse("--disable-async-output-proc").disable_async_output_proc
    assert _parse("--num-scheduler-steps", "1").num_scheduler_steps == 1


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--num-scheduler-steps", "8"], "multi-step decoding is not implemented"),
        (["--tokenizer-extension-path", "/x/vllm_extension.py"], "--tokenizer"),
        (["--enable-mm"], "has no vision encoder"),
        (["--async-scheduling", "--disable-async-output-proc"], "turns off the overlap that the first asks for"),
        (["--max-seq-len-to-capture", "0"], "max_seq_len_to_capture"),
    ],
)
def test_flags_that_cannot_be_honoured_are_refused(flags, message):
    with pytest.raises(ValueError, match=message):
        _parse(*flags).create_engine_config()


def test_disable_async_output_proc_turns_overlap_off():
    args = _parse("--disable-async-output-proc")
    assert args._async_scheduling(torch.device("cuda"), None, None) is False


def test_fastdeploy_scheduler_flags():
    from splitserve.entrypoints.openai.args import ServerArgs, check_server_args

    args = ServerArgs(scheduler_max_size=3)
    check_server_args(args)
    assert args.max_queued_requests == 3  # FastDeploy's name for the same limit
    with pytest.raises(ValueError, match="one limit"):
        check_server_args(ServerArgs(scheduler_max_size=3, max_queued_requests=5))
    with pytest.raises(ValueError, match="Redis-backed"):
        check_server_args(ServerArgs(scheduler_name="splitwise"))
    with pytest.raises(ValueError, match="must be local"):
        check_server_args(ServerArgs(scheduler_name="nope"))


def test_api_server_count_defaults_to_the_host(monkeypatch, caplog):
    """--api-server-count (--workers): 1 on a CPU host; on a GPU host one per 8 cores, at most 4, logged."""
    from splitserve.entrypoints.openai import api_processes
    from splitserve.entrypoints.openai.args import make_arg_parser, split_args

    caplog.set_level("INFO", logger=api_processes.__name__)
    assert api_processes.default_api_server_count("cpu", cores=64) == 1
    assert [api_processes.default_api_server_count("cuda", cores=n) for n in (2, 8, 16, 24, 64, 192)] == [
        1,
        1,
        2,
        3,
        4,
        4,
    ]
    assert "API server processes: 2 (a GPU host with 16 CPU cores" in caplog.text
    monkeypatch.setattr(api_processes.os.path, "exists", lambda path: path == "/dev/nvidiactl")
    assert api_processes.is_gpu_host("auto") and api_processes.is_gpu_host("cuda:1")
    assert not api_processes.is_gpu_host("cpu")
    monkeypatch.setattr(api_processes.os, "sched_getaffinity", lambda pid: set(range(32)))
    parser = make_arg_parser()
    _, server = split_args(parser.parse_args(["some/model"]))
    assert server.workers == 4  # auto device on a GPU host with 32 cores
    _, server = split_args(parser.parse_args(["some/model", "--device", "cpu"]))
    assert server.workers == 1
    _, server = split_args(parser.parse_args(["some/model", "--api-server-count", "3"]))
    assert server.workers == 3  # given: kept
