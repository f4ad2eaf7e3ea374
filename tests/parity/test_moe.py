"""Mixture-of-experts models against transformers on tiny random-weight models: Qwen3-MoE (with and
without norm_topk_prob, top-1 and top-4), Qwen2-MoE (a gated shared expert, a dense layer),
Mixtral, Granite MoE (softmax over the top-k, Granite's multipliers) and ERNIE 4.5 MoE (shared
experts, a corrected router, MoE from layer 1); then tensor parallelism with the experts' channels
split and with whole experts per rank (--enable-expert-parallel), pipeline parallelism, and the
errors a user can meet."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.moe_models import CONFIGS, build_moe
from tests.helpers.parity import generate_and_check, llm, references


@pytest.fixture(scope="module")
def saved(tmp_path_factory, smollm_tokenizer):
    """name -> (checkpoint directory, transformers' greedy references)."""
    cache = {}

    def get(name: str):
        if name not in cache:
            model = build_moe(name)
            path = tmp_path_factory.mktemp(name)
            model.save_pretrained(path)
            smollm_tokenizer.save_pretrained(path)
            cache[name] = (str(path), references(model))
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_moe_models_match_transformers(saved, name):
    path, refs = saved(name)
    generate_and_check(llm(path), refs)  # one batch of every prompt, prefix hits included
    generate_and_check(llm(path, max_num_batched_tokens=16), refs)  # chunked prefill, decodes mixed in


def test_a_decode_step_runs_only_the_chosen_experts(saved):
    from splitserve.layers.moe import FusedMoE

    path, _ = saved("qwen3_moe_norm_top2")
    engine = llm(path)
    layers = [m for m in engine.llm_engine.engine_core.executor.runner.model.modules() if isinstance(m, FusedMoE)]
    calls = []
    for layer in layers:
        original = layer.experts

        def counting(x, weights, ids, original=original):
            calls.append((x.shape[0], len(set(ids.flatten().tolist()))))
            return original(x, weights, ids)

        layer.experts = counting
    from splitserve import SamplingParams

    engine.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    decode_calls = [distinct for tokens, distinct in calls if tokens == 1]
    assert decode_calls and all(distinct == 2 for distinct in decode_calls)


@pytest.mark.slow
@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp-channels", "expert-parallel"])
@pytest.mark.parametrize("name", ["qwen2_moe_shared", "ernie4_5_moe", "mixtral"])
def test_tensor_parallel_moe(saved, name, expert_parallel):
    path, refs = saved(name)
    generate_and_check(llm(path, tensor_parallel_size=2, enable_expert_parallel=expert_parallel), refs)


@pytest.mark.slow
def test_pipeline_parallel_moe(saved):
    path, refs = saved("qwen3_moe_norm_top2")
    generate_and_check(llm(path, pipeline_parallel_size=2), refs)


def test_experts_that_do_not_divide_over_the_ranks_are_refused(saved):
    path, _ = saved("qwen2_moe_shared")  # 6 experts
    with pytest.raises(ValueError, match="6 experts do not divide over the 4 tensor-parallel ranks"):
        llm(path, tensor_parallel_size=4, enable_expert_parallel=True)


def test_lora_on_an_moe_model_is_refused_with_the_reason(saved):
    path, _ = saved("mixtral")
    with pytest.raises(ValueError, match="LoRA adapters on mixture-of-experts models"):
        llm(path, enable_lora=True)


def test_batch_invariant_numerics_on_an_moe_model_are_refused_with_the_reason(saved):
    path, _ = saved("mixtral")
    with pytest.raises(ValueError, match="--batch-invariant does not cover mixture-of-experts layers"):
        llm(path, batch_invariant=True)


@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_tokens_per_expert_are_counted_for_the_load_balance(saved, tp):
    """Each forwarded token counts once for each of its top-k experts in every MoE layer; with
    expert parallelism the ranks' answers merge into one count per layer. `bench` prints them."""
    from splitserve import SamplingParams
    from splitserve.benchmarks.throughput import expert_load_summary

    path, _ = saved("qwen3_moe_norm_top2")
    engine = llm(path, tensor_parallel_size=tp, enable_expert_parallel=tp > 1, enable_prefix_caching=False)
    before = engine.llm_engine.expert_load()
    engine.generate({"prompt_token_ids": list(range(5, 15))}, SamplingParams(max_tokens=5, ignore_eos=True))
    after = engine.llm_engine.expert_load()
    assert sorted(after) == [0, 1, 2] and all(len(c) == 8 for c in after.values())
    for layer, counts in after.items():
        assert sum(counts) - sum(before[layer]) == (10 + 4) * 2  # 10 prompt + 4 decoded tokens forwarded, top-2
    assert "busiest expert / mean" in expert_load_summary(after)


def test_the_expert_counter_stays_on_the_host_when_the_weights_do_not():
    """A model loaded on a GPU builds its layers under that default device; the per-expert token counter
    is host-side (the counts are read on the host each step), so a CUDA step could add them (the H200
    check's fault). "meta" stands in for the GPU here."""
    from splitserve.layers.moe import FusedMoE, RouterRule

    with torch.device("meta"):
        layer = FusedMoE(4, 16, 8, RouterRule(top_k=2), torch.float32)
    assert layer.w13.device.type == "meta"
    assert layer.tokens_per_expert.device.type == "cpu"
    layer.tokens_per_expert += torch.tensor([1, 0, 2, 0])
    assert layer.tokens_per_expert.tolist() == [1, 0, 2, 0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_match_the_experts_one_by_one(dtype):
    """The GPU's capturable path (two grouped GEMMs over the pairs sorted by expert) against the
    expert-by-expert loop, on the CPU (torch's grouped GEMM runs there too): the same sums, with one
    expert that no token chose, and the same tokens per expert."""
    from splitserve.layers.moe import FusedMoE, RouterRule, grouped_experts

    torch.manual_seed(0)
    layer = FusedMoE(6, 32, 16, RouterRule(top_k=2, renormalize=True), dtype)
    with torch.no_grad():
        layer.w13.normal_(0.0, 0.2)
        layer.w2.normal_(0.0, 0.2)
        layer.gate.normal_(0.0, 0.2)
    x = torch.randn(9, 32, dtype=dtype)
    weights, ids = layer.route(x)
    ids[ids == 5] = 4  # expert 5 gets no token
    got, counts = grouped_experts(x, weights, ids, layer.w13, layer.w2)
    expected = layer.experts(x, weights, ids)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, atol=tolerance, rtol=tolerance)
    assert counts.tolist() == torch.bincount(ids.reshape(-1), minlength=6).tolist()
    assert counts[5] == 0


def test_grouped_experts_never_wait_for_the_host(monkeypatch):
    """Under fake tensors (shapes only, no values) every step must still run: no operation whose output
    shape depends on the values (as bincount's or a .tolist() of the counts does), so a CUDA graph can
    capture the layer. The expert-by-expert loop fails this. (SiLU-and-mul in torch ops here: the C++
    kernel cannot take fake tensors; on a GPU it is a Triton kernel, which a graph captures.)"""
    from torch._subclasses.fake_tensor import DynamicOutputShapeException, FakeTensorMode

    from splitserve.layers import moe_backends
    from splitserve.layers.moe import FusedMoE, RouterRule, grouped_experts

    monkeypatch.setattr(
        moe_backends, "silu_and_mul", lambda h: torch.nn.functional.silu(h.chunk(2, -1)[0]) * h.chunk(2, -1)[1]
    )

    layer = FusedMoE(4, 16, 8, RouterRule(top_k=2), torch.bfloat16)
    x, ids, weights = torch.randn(3, 16, dtype=torch.bfloat16), torch.tensor([[0, 1], [1, 3], [3, 0]]), torch.rand(3, 2)
    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (x, weights, ids, layer.w13, layer.w2)]
        out, counts = grouped_experts(*fake)
        assert out.shape == (3, 16) and counts.shape == (4,)
        with pytest.raises(DynamicOutputShapeException):
            layer.experts(fake[0], fake[1], fake[2])
    assert not layer.grouped(torch.device("cpu"), torch.bfloat16)  # the CPU keeps its own kernels


def test_the_grouped_gemm_is_probed_once_and_a_failure_is_logged(monkeypatch, caplog):
    from splitserve.layers import moe

    moe.grouped_mm_works.cache_clear()
    assert moe.grouped_mm_works("cpu")

    def broken(*args, **kwargs):
        raise RuntimeError("no kernel for this device")

    monkeypatch.setattr(torch, "_grouped_mm", broken)
    moe.grouped_mm_works.cache_clear()
    try:
        assert not moe.grouped_mm_works("cpu")
        assert "run expert by expert" in caplog.text and "no kernel for this device" in caplog.text
    finally:
        moe.grouped_mm_works.cache_clear()
