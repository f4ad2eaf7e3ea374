"""The GPU paths of the engine: CUDA-graph decode, memory sizing from a profiling pass, and parity
with transformers on a real GPU.

Without a GPU the graph logic (capture ladder, static buffers, padding rows, the padding block,
the fixed decode split count) still runs: the Triton backend in Triton's interpreter, and graphs
"captured" by a stand-in that records the forward and reruns it on replay, reading the same static
buffers a CUDA graph would. The memory sizing runs its profiling pass on CPU with torch.cuda's
memory queries replaced by fakes.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    # Triton reads it when it is first imported (its own helpers are kernels too), so: before that.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from splitserve import LLM, SamplingParams  # noqa: E402
from splitserve.executor import cuda_graph, gpu_memory  # noqa: E402
from splitserve.executor.cuda_graph import capture_sizes  # noqa: E402
from splitserve.executor.gpu_memory import MemoryProfile  # noqa: E402
from splitserve.executor.model_runner import ModelRunner  # noqa: E402
from tests.helpers.hf_reference import assert_greedy_match, hf_greedy, load_hf_model  # noqa: E402


# --- capture sizes ---------------------------------------------------------------------------------
def test_capture_sizes_follow_vllm():
    assert capture_sizes(None, 256)[:6] == [1, 2, 4, 8, 16, 24] and capture_sizes(None, 256)[-1] == 256
    assert capture_sizes(None, 1024)[-1] == 512
    assert capture_sizes([20], 256) == [1, 2, 4, 8, 16, 20]
    assert capture_sizes([3], 256) == [1, 2, 3]
    assert capture_sizes([64, 1, 8, 8], 256) == [1, 8, 64]
    assert capture_sizes([64, 1, 8], 10) == [1, 8]  # never more than max_num_seqs
    assert capture_sizes(None, 5) == [1, 2, 4, 5]
    with pytest.raises(ValueError, match="positive"):
        capture_sizes([0, 8], 256)


def test_cuda_graph_sizes_are_validated():
    from splitserve.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="cuda_graph_sizes"):
        EngineArgs(model="x", cuda_graph_sizes=[-1]).create_engine_config()


# --- CUDA graphs, emulated on CPU -------------------------------------------------------------------
class _ReplayingPool:
    """Stands in for CudaGraphPool on CPU: "capture" runs fn once, replay reruns it and copies the
    result into the captured output, so the output tensor is refreshed in place as a graph's is."""

    captures: list = []

    def capture(self, fn):
        output = fn()
        graph = _Replay(fn, output)
        self.captures.append(graph)
        return graph, output


class _Replay:
    def __init__(self, fn, output):
        self.fn, self.output, self.replays = fn, output, 0

    def replay(self):
        self.output.copy_(self.fn())
        self.replays += 1


@pytest.fixture
def emulated_graphs(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setenv("SPLITSERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setattr(ModelRunner, "_use_cuda_graphs", lambda self: not self.config.enforce_eager)
    monkeypatch.setattr(cuda_graph, "CudaGraphPool", _ReplayingPool)
    _ReplayingPool.captures = []
    return _ReplayingPool


def _staggered_run(llm: LLM, prompts, lengths):
    """Requests that finish at different steps, so decode batches shrink through padded sizes."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.slow  # without CUDA: many decode steps in Triton's interpreter
def test_cuda_graph_decode_matches_eager(tiny_models, emulated_graphs):
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randrange(3, 20))] for _ in range(6)]
    lengths = [9, 3, 7, 5, 12, 2]
    kwargs = dict(
        dtype="float32",
        max_model_len=128,
        cuda_graph_sizes=[1, 2, 4, 8],
        max_num_seqs=8,
        use_tqdm_on_load=False,
        num_gpu_blocks_override=64,
    )
    graphs = LLM(tiny_models["qwen3"], **kwargs)
    runner = graphs.llm_engine.engine_core.executor.runner
    assert sorted(runner.graph_runner.captured) == [1, 2, 4, 8]
    # The padding block is one past the block manager's blocks.
    assert runner.kv_caches[0].shape[2] == 65 and runner.graph_runner.pad_block == 64
    got = _staggered_run(graphs, prompts, lengths)
    replays = sum(g.replays for g in emulated_graphs.captures)
    assert replays > 10, "decode steps should have replayed captured graphs"
    eager = LLM(tiny_models["qwen3"], enforce_eager=True, **kwargs)
    assert eager.llm_engine.engine_core.executor.runner.graph_runner is None
    assert got == _staggered_run(eager, prompts, lengths)


@pytest.mark.slow  # without CUDA: many decode steps in Triton's interpreter
def test_cuda_graph_decode_with_overlap_scheduling(tiny_models, emulated_graphs, monkeypatch):
    """Overlap scheduling: a decode's last token is still being sampled when its step is staged, so
    the graph's input buffer takes it on the device: the same rows in the same order (one copy), or
    others once a request in the middle has ended (an indexed copy). Both happen here."""
    kwargs = dict(dtype="float32", max_model_len=64, cuda_graph_sizes=[1, 2, 4], max_num_seqs=4)
    kwargs.update(use_tqdm_on_load=False, num_gpu_blocks_override=32)
    prompts, lengths = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16]], [9, 4, 12, 6]
    graphs = LLM(tiny_models["qwen3"], async_scheduling=True, **kwargs)
    graph_runner = graphs.llm_engine.engine_core.executor.runner.graph_runner
    orders, take = [], graph_runner._take_pending
    monkeypatch.setattr(graph_runner, "_take_pending", lambda rows, sources, tokens: (
        orders.append(rows == sources), take(rows, sources, tokens)))  # fmt: skip
    got = _staggered_run(graphs, prompts, lengths)
    assert True in orders and False in orders, orders
    eager = LLM(tiny_models["qwen3"], enforce_eager=True, **kwargs)
    assert got == _staggered_run(eager, prompts, lengths)


@pytest.mark.slow  # without CUDA: many decode steps in Triton's interpreter
def test_sequences_past_max_seq_len_to_capture_run_eagerly(tiny_models, emulated_graphs):
    """vLLM's --max-seq-len-to-capture: a decode step whose longest sequence exceeds it runs without
    the graph, and the tokens are the same."""
    kwargs = dict(dtype="float32", max_model_len=64, cuda_graph_sizes=[1, 2], max_num_seqs=2)
    kwargs.update(use_tqdm_on_load=False, num_gpu_blocks_override=32)
    prompts, lengths = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15]], [12, 12]
    capped = LLM(tiny_models["qwen3"], max_seq_len_to_capture=10, **kwargs)
    got = _staggered_run(capped, prompts, lengths)
    # Sequences reach 8 + 12 = 20 tokens: only decode steps with every sequence at <= 10 tokens replay.
    replays = sum(g.replays for g in emulated_graphs.captures)
    assert 0 < replays < 6
    eager = LLM(tiny_models["qwen3"], enforce_eager=True, **kwargs)
    assert got == _staggered_run(eager, prompts, lengths)


@pytest.mark.slow  # without CUDA: many decode steps in Triton's interpreter
def test_cuda_graph_decode_with_dynamic_ntk_rope(tmp_path, smollm_tokenizer, emulated_graphs):
    """A dynamic NTK rope reads each token's scaling length (AttentionMetadata.rope_lengths): the
    graphs take it from a static buffer, as they take positions, and give eager's tokens past
    max_position_embeddings (32)."""
    from tests.helpers.parity import ROPE_PROMPTS, dynamic_llama

    dynamic_llama().save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    kwargs = dict(dtype="float32", max_model_len=96, cuda_graph_sizes=[1, 2, 4], max_num_seqs=4)
    kwargs.update(use_tqdm_on_load=False, num_gpu_blocks_override=64)
    prompts, lengths = ROPE_PROMPTS[2:6], [20, 6, 14, 10]  # 31 to 40 prompt tokens
    graphs = LLM(str(tmp_path), **kwargs)
    assert graphs.llm_engine.engine_core.executor.runner.graph_runner.rope_lengths is not None
    got = _staggered_run(graphs, prompts, lengths)
    assert sum(g.replays for g in emulated_graphs.captures) > 10
    eager = LLM(str(tmp_path), enforce_eager=True, **kwargs)
    assert got == _staggered_run(eager, prompts, lengths)


def test_padding_rows_never_touch_request_blocks(tiny_models, emulated_graphs):
    """A batch of 3 replayed in the size-4 graph after a batch of 4: the stale fourth row must
    write into the padding block, not into the finished request's (freed, maybe reused) block."""
    llm = LLM(
        tiny_models["llama"],
        dtype="float32",
        max_model_len=64,
        cuda_graph_sizes=[4],
        max_num_seqs=4,
        use_tqdm_on_load=False,
        num_gpu_blocks_override=32,
    )
    graph_runner = llm.llm_engine.engine_core.executor.runner.graph_runner
    prompts = [[5, 6, 7], [8, 9, 10, 11], [12, 13], [14, 15, 16]]
    _staggered_run(llm, prompts, [6, 6, 6, 3])
    pad_slot = graph_runner.pad_block * graph_runner.block_size
    assert graph_runner.slot_mapping[3].item() == pad_slot and graph_runner.seq_lens[3].item() == 1
    assert torch.all(graph_runner.block_tables[3] == graph_runner.pad_block)


# --- memory sizing from a profiling pass -------------------------------------------------------------
def test_memory_profile_budget_and_error():
    gib = 1 << 30
    profile = MemoryProfile(
        total=80 * gib, free=78 * gib, weights=1 * gib, activation_peak=2 * gib, utilization=0.9, num_tokens=8192
    )
    assert profile.kv_cache_budget == 78 * gib - 8 * gib - 2 * gib
    assert "68.00 GiB for the KV cache" in profile.describe()
    profile.check(bytes_per_block=1 << 20)
    full = MemoryProfile(
        total=80 * gib, free=10 * gib, weights=60 * gib, activation_peak=3 * gib, utilization=0.9, num_tokens=8192
    )
    with pytest.raises(ValueError, match="No GPU memory is left for the KV cache.*--gpu-memory-utilization"):
        full.check(bytes_per_block=1 << 20)


def test_profile_run_sizes_the_cache_from_measured_peak(tiny_models, monkeypatch):
    """The profiling pass runs the largest step (on CPU here) and the cache gets what is left."""
    gib = 1 << 30
    allocated = {"now": 3 * gib}
    fake = {
        "synchronize": lambda device=None: None,
        "empty_cache": lambda: None,
        "reset_peak_memory_stats": lambda device=None: None,
        "memory_allocated": lambda device=None: allocated["now"],
        "max_memory_allocated": lambda device=None: allocated["now"] + gib // 2 + allocated["cache"],
        "mem_get_info": lambda device=None: (70 * gib, 80 * gib),
    }
    for name, fn in fake.items():
        monkeypatch.setattr(torch.cuda, name, fn)
    llm = LLM(
        tiny_models["llama"],
        dtype="float32",
        max_model_len=64,
        max_num_seqs=5,
        max_num_batched_tokens=100,
        use_tqdm_on_load=False,
        num_gpu_blocks_override=32,
    )
    runner = llm.llm_engine.engine_core.executor.runner
    original = runner.profile_run
    seen = {}

    def profile_run():
        num_tokens, cache_bytes = original()
        allocated["cache"] = cache_bytes
        seen.update(tokens=num_tokens, cache=cache_bytes)
        return num_tokens, cache_bytes

    runner.profile_run = profile_run
    profile = gpu_memory.profile_cuda_memory(runner)
    # the budget and the prompt tails a step may finish past it (1/16 of it): 5 x 21-22 tokens
    assert seen["tokens"] == 106 and seen["cache"] == 5 * 2 * runner.kv_bytes_per_block()
    assert profile.weights == 3 * gib and profile.activation_peak == gib // 2
    assert profile.kv_cache_budget == 70 * gib - 8 * gib - gib // 2
    # The throwaway cache is gone and the engine still generates what a fresh one does.
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    after = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0].outputs[0].token_ids
    fresh = LLM(
        tiny_models["llama"], dtype="float32", max_model_len=64, use_tqdm_on_load=False, num_gpu_blocks_override=32
    )
    assert after == fresh.generate([{"prompt_token_ids": [5, 6, 7, 8]}], params, use_tqdm=False)[0].outputs[0].token_ids


# --- the whole engine on a GPU ----------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(
    not HAS_CUDA,
    reason="needs a CUDA GPU: runs the Triton backend, fused kernels and CUDA graphs against transformers on the GPU",
)
@pytest.mark.parametrize("arch", ["llama", "qwen3", "mistral"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_gpu_engine_matches_transformers(tiny_models, arch, enforce_eager):
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randrange(4, 60))] for _ in range(8)]
    model = load_hf_model(tiny_models[arch])  # the reference runs on CPU, in float32
    refs = [hf_greedy(model, p, 24) for p in prompts]
    llm = LLM(
        tiny_models[arch],
        dtype="float32",
        max_model_len=256,
        enforce_eager=enforce_eager,
        use_tqdm_on_load=False,
        gpu_memory_utilization=0.3,
    )
    runner = llm.llm_engine.engine_core.executor.runner
    assert runner.backend.name == "triton" and (runner.graph_runner is None) == enforce_eager
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outs, refs):
        completion = out.outputs[0]
        logprobs = [lp[tok].logprob for lp, tok in zip(completion.logprobs, completion.token_ids)]
        assert_greedy_match(completion.token_ids, logprobs, ref, 1e-3)
    print(
        f"GPU parity ({arch}, enforce_eager={enforce_eager}) on {torch.cuda.get_device_name()}: "
        f"{len(prompts)} prompts x 24 tokens match",
        flush=True,
    )
