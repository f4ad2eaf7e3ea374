"""Offline data parallelism (`LLM(data_parallel_size=N)`, engine/dp_client.py): replicas in their own
engine processes give one engine's greedy tokens, share the work, and refuse what they lack by name."""

from __future__ import annotations

import socket
import time

import msgspec
import pytest
import zmq

from splitserve import LLM, SamplingParams
from splitserve.engine.arg_utils import EngineArgs
from splitserve.engine.core.kv_events import KVEventBatch
from splitserve.entrypoints.openai.server import refuse_data_parallel

PROMPTS = [{"prompt_token_ids": [(7 * i + 13 * j) % 900 + 5 for j in range(12 + 3 * i)]} for i in range(8)]


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", max_model_len=128, use_tqdm_on_load=False, **kwargs)


@pytest.mark.slow  # starts replica processes
def test_two_replicas_give_one_engines_tokens(tiny_models):
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True, logprobs=1) for i in range(8)]
    one = _llm(tiny_models["qwen3"])
    expected = one.generate(PROMPTS, params, use_tqdm=False)
    one.llm_engine.shutdown()
    dp = _llm(tiny_models["qwen3"], data_parallel_size=2)
    try:
        outputs = dp.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outputs] == [o.outputs[0].token_ids for o in expected]
        for got, want in zip(outputs, expected):
            for a, b in zip(got.outputs[0].logprobs, want.outputs[0].logprobs):  # other batches: float32 rounding
                assert a.keys() == b.keys()
                assert [a[t].logprob for t in a] == pytest.approx([b[t].logprob for t in a], abs=1e-4)
        client = dp.llm_engine.engine_core
        assert all(n > 0 for n in client.num_requests) and client.in_flight == [0, 0]
        # n > 1 and chat go through the same client
        (sampled,) = dp.generate(PROMPTS[:1], SamplingParams(n=3, max_tokens=4, seed=1), use_tqdm=False)
        assert len(sampled.outputs) == 3
        # Sleep mode acts on every replica; a refusal names the replica and where the call took effect.
        dp.sleep(1)
        assert dp.is_sleeping()
        with pytest.raises(ValueError, match="Data-parallel replica 0: The engine is already asleep"):
            dp.sleep(1)
        dp.wake_up()
        assert not dp.is_sleeping() and dp.reset_prefix_cache()
        again = dp.generate(PROMPTS, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in expected]
        with pytest.raises(NotImplementedError, match="expert load"):
            dp.llm_engine.expert_load()
    finally:
        dp.llm_engine.shutdown()


def test_data_parallel_size_is_checked():
    with pytest.raises(ValueError, match="data_parallel_size must be >= 1"):
        EngineArgs(data_parallel_size=0)._parallel_config(None)
    with pytest.raises(ValueError, match="run-batch drives one engine replica"):
        refuse_data_parallel(EngineArgs(data_parallel_size=2))
    with pytest.raises(ValueError, match="data_parallel_backend must be 'mp' or 'ray'"):
        EngineArgs(data_parallel_backend="nccl")._parallel_config(None)
    with pytest.raises(ValueError, match="not with --distributed-executor-backend mp"):
        EngineArgs(data_parallel_backend="ray", distributed_executor_backend="mp")._parallel_config(None)
    ray = EngineArgs(data_parallel_size=2, data_parallel_backend="ray")._parallel_config(None)
    assert ray.distributed_executor_backend == "ray"


def _two_free_ports() -> int:
    """A port P with P + 1 free too (replica 1 publishes on P + 1)."""
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no two adjacent free ports")


@pytest.mark.slow  # starts replica processes
def test_each_replica_publishes_kv_events_on_its_own_port(tiny_models):
    """vLLM's rule: replica r publishes on the endpoint's port + r (both binding one port crashed)."""
    port = _two_free_ports()
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{port}"}
    dp = _llm(tiny_models["qwen3"], data_parallel_size=2, kv_events_config=events, block_size=16)
    ctx = zmq.Context()
    try:
        subs = []
        for rank in (0, 1):
            sub = ctx.socket(zmq.SUB)
            sub.connect(f"tcp://127.0.0.1:{port + rank}")
            sub.setsockopt_string(zmq.SUBSCRIBE, "")
            subs.append(sub)
        time.sleep(0.5)  # a SUB socket hears only what is sent after it joined
        prompts = [{"prompt_token_ids": [5 + i] * 40} for i in range(4)]  # two full blocks each
        dp.generate(prompts, SamplingParams(max_tokens=2, temperature=0), use_tqdm=False)
        decoder = msgspec.msgpack.Decoder(KVEventBatch)
        for rank, sub in enumerate(subs):
            assert sub.poll(5000), f"no KV events from replica {rank}"
            batch = decoder.decode(sub.recv_multipart()[2])
            assert batch.data_parallel_rank == rank and batch.events
            sub.close(0)
    finally:
        ctx.term()
        dp.llm_engine.shutdown()
