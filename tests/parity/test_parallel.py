"""Tensor and pipeline parallelism through the offline API, each rank a worker process (the `mp`
executor, the default for several ranks on one machine): greedy tokens and logprobs match
transformers on tiny float32 models of every architecture, with GQA (2 KV heads) split over 2 ranks
and replicated over 4, tied and untied embeddings, quantized checkpoints; a rank that dies fails
the engine with a message naming it and leaves no process behind."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest

from splitserve import LLM, SamplingParams
from tests.helpers.hf_reference import assert_greedy_match, hf_greedy, load_hf_model
from tests.helpers.quant_layouts import write_quantized_checkpoint

pytestmark = pytest.mark.slow  # tp/pp engines start worker processes

MAX_TOKENS = 8
PROMPTS = [[random.Random(i).randrange(3, 1024) for _ in range(5 + 7 * i)] for i in range(3)]


def _llm(path: str, tp: int = 1, pp: int = 1, **kwargs) -> LLM:
    return LLM(
        path,
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=64,
        use_tqdm_on_load=False,
        tensor_parallel_size=tp,
        pipeline_parallel_size=pp,
        **kwargs,
    )


def _generate(llm: LLM) -> list:
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _check_against_transformers(path: str, outputs, logprob_atol: float = 1e-4) -> None:
    model = load_hf_model(path)
    for prompt, out in zip(PROMPTS, outputs):
        logprobs = [entry[token].logprob for token, entry in zip(out.token_ids, out.logprobs)]
        assert_greedy_match(out.token_ids, logprobs, hf_greedy(model, prompt, MAX_TOKENS), logprob_atol)


def _worker_pids(llm: LLM) -> list[int]:
    return [p.pid for p in llm.llm_engine.engine_core.executor.processes]


def _gone(pids: list[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(os.path.exists(f"/proc/{pid}") and _state(pid) != "Z" for pid in pids):
            return True
        time.sleep(0.2)
    return False


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ", 1)[1][0]
    except OSError:
        return "X"


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel_matches_transformers(tiny_models, arch, tp, pp):
    llm = _llm(tiny_models[arch], tp, pp)
    assert llm.llm_engine.engine_core.executor.world_size == 2
    _check_against_transformers(tiny_models[arch], _generate(llm))
    llm.llm_engine.engine_core.shutdown()


def test_more_ranks_than_kv_heads_and_both_kinds(tiny_models):
    """tp=4 over 2 KV heads: each KV head is held by two ranks. Then tp=2 x pp=2 (4 ranks on the
    2 cores of the test machine: slow, but the same tokens)."""
    for tp, pp in [(4, 1), (2, 2)]:
        llm = _llm(tiny_models["qwen3"], tp, pp)
        _check_against_transformers(tiny_models["qwen3"], _generate(llm))
        llm.llm_engine.engine_core.shutdown()


@pytest.mark.parametrize("method", ["awq", "gptq", "weight_only_int8"])
def test_quantized_checkpoint_split_over_ranks(tiny_models, tmp_path, method):
    """Int4 groups and int8 rows split with the layers: tp=2 gives tp=1's tokens."""
    path = str(tmp_path / method)
    write_quantized_checkpoint(tiny_models["llama"], path, method, group_size=32, act_order=False)
    single = _generate(_llm(path))
    split = _llm(path, tp=2)
    for a, b in zip(single, _generate(split)):
        assert a.token_ids == b.token_ids
        assert all(abs(x[t].logprob - y[t].logprob) < 1e-3 for t, x, y in zip(a.token_ids, a.logprobs, b.logprobs))
    split.llm_engine.engine_core.shutdown()


def test_killed_rank_fails_the_engine_and_leaves_no_process(tiny_models):
    llm = _llm(tiny_models["llama"], tp=2)
    engine = llm.llm_engine
    pids = _worker_pids(llm)
    params = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)
    engine.add_request("r", {"prompt_token_ids": PROMPTS[0]}, params)
    engine.step()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(RuntimeError, match="rank 1 .*killed by signal 9"):
        for _ in range(100):
            engine.step()
    engine.engine_core.shutdown()
    assert _gone(pids)


def test_a_taken_meeting_port_is_given_up_for_another(tiny_models, monkeypatch, caplog):
    """The ranks meet on a port found free; when another process holds it by the time rank 0 listens,
    the ranks start again on another port (before: the engine failed with EADDRINUSE)."""
    import socket

    from splitserve.executor import multiproc_executor

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    ports = iter([taken.getsockname()[1]])
    real = multiproc_executor.free_port
    monkeypatch.setattr(multiproc_executor, "free_port", lambda: next(ports, None) or real())
    try:
        with caplog.at_level("WARNING", logger="splitserve"):
            llm = _llm(tiny_models["llama"], tp=2)
        assert "took the ranks' meeting port" in caplog.text
        assert len(_generate(llm)) == len(PROMPTS)
        llm.llm_engine.engine_core.shutdown()
    finally:
        taken.close()
