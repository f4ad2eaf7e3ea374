"""The GPU checks of docs/gpu.md ("Running the GPU check"): every test here needs CUDA, is marked `gpu`
and is skipped without it (`scripts/gpu_check.sh` runs `pytest -m gpu` on a lent GPU machine). Tiny
models keep the whole of `pytest -m gpu` within a couple of minutes on an H100.

- greedy parity with transformers on the same GPU for every tiny architecture, ERNIE 4.5, the
  default model's shape and the default model itself (when its weights travelled: the GPU check
  carries its tokenizer only): in float32 the same tokens; in float16 and bfloat16 at least as close
  to float32 as transformers in that dtype is (tests/helpers/hf_reference.py,
  assert_as_accurate_as_reference: two correct 16-bit computations that round at different places
  drift apart, so 16-bit tokens are not compared one for one);
- the Triton attention backend against the torch backend on the GPU: decode split-K, varlen
  prefill, sliding windows, int8/fp8 KV caches, block sizes 16 to 128, GQA groups 1 to 8;
- CUDA graphs on vs off and overlap scheduling on vs off give the same tokens (up to a near tie:
  the best two logits within a few 16-bit rounding steps);
- chunked prefill with prefix-cache hits, the KV offloading tier (host memory and disk), LoRA,
  structured output and beam search on the GPU.
"""

from __future__ import annotations

import gc
import json
import os
import random
import re

import pytest
import torch

if not torch.cuda.is_available():
    # As in the other Triton test modules: whichever imports triton first decides (nothing here does).
    os.environ.setdefault("TRITON_INTERPRET", "1")

from splitserve import LLM, BeamSearchParams, GuidedDecodingParams, LoRARequest, SamplingParams  # noqa: E402
from tests.helpers.hf_reference import (  # noqa: E402
    assert_as_accurate_as_reference,
    assert_greedy_match,
    hf_greedy,
    load_hf_model,
    teacher_forced_logprobs,
)
from tests.helpers.models import TINY_ARCHS, make_peft_adapter  # noqa: E402
from tests.helpers.moe_models import build_moe  # noqa: E402
from tests.helpers.parity import MAX_TOKENS, PROMPTS, SHAPE, build  # noqa: E402
from tests.helpers.spec_oracle import PROMPTS as SPEC_PROMPTS
from tests.helpers.spec_oracle import OracleProposer  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DEVICE = "cuda"  # every engine and model here; only a scratch run on the CPU would change it
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# Near ties (best two logits this close) may go either way: CUDA graphs / overlap on and off, and
# float32 against transformers (logprobs within LOGPROB_ATOL there; 1.2e-4 apart at most on the CPU).
TIE_GAP = {"float16": 0.1, "bfloat16": 0.75, "float32": 1e-3}
LOGPROB_ATOL = {"float32": 1e-3}
# Parity in 16 bits is judged against float32 (greedy_parity, assert_as_accurate_as_reference): the
# bounds are multiples of transformers' own error in that dtype, plus this. On an H100 (2026-11-26),
# sequence by sequence, transformers' error on the worst step was 0.01-0.39 in float16 and 0.11-4.3 in
# bfloat16, and ours 0.35-1.8x (float16) and 0.38-2.7x (bfloat16) of it, 0.94x and 1.01x on average.
SLACK = {"float16": 0.02, "bfloat16": 0.1}


@pytest.fixture(autouse=True)
def _release_gpu_memory():
    """Engines hold reference cycles: collect them after each test, so that the next one (and the
    memory-profiling tests of test_gpu_paths.py after this module) finds the GPU's memory free."""
    yield
    gc.collect()
    torch.cuda.empty_cache()


class _OnDevice:
    """A transformers model that takes the CPU input ids of hf_greedy and runs them on its device."""

    def __init__(self, model):
        self.model = model

    def __call__(self, input_ids, **kwargs):
        return self.model(input_ids=input_ids.to(self.model.device), **kwargs)


def _engine(path: str, dtype: str = "float32", **kwargs) -> LLM:
    settings = dict(
        dtype=dtype,
        device=DEVICE,
        max_model_len=256,
        max_num_seqs=16,
        cuda_graph_sizes=[1, 2, 4, 8, 16],
        num_gpu_blocks_override=256,  # no profiling pass: fast, and independent of the other tests
        use_tqdm_on_load=False,
    )
    return LLM(path, **{**settings, **kwargs})


def _generate(llm: LLM, prompts, max_tokens: int = MAX_TOKENS, logprobs: int = 0, lengths=None, **kwargs):
    lengths = lengths or [max_tokens] * len(prompts)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs) for n in lengths]
    return [
        o.outputs[0] for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False, **kwargs)
    ]


def greedy_parity(path: str, dtype: str, prompts=PROMPTS, max_tokens: int = MAX_TOKENS, gguf_file=None, **engine):
    """splitserve's greedy tokens and logprobs against transformers' on the GPU: in float32 the same
    tokens; in float16 / bfloat16 at least as close to float32 as transformers in that dtype is
    (hf_reference.assert_as_accurate_as_reference), along our own tokens."""
    llm = _engine(os.path.join(path, gguf_file) if gguf_file else path, dtype, **engine)
    if DEVICE == "cuda":
        assert llm.llm_engine.engine_core.executor.runner.backend.name == "triton"
    completions = _generate(llm, prompts, max_tokens)
    del llm
    gc.collect()
    ours = [(c.token_ids, [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]) for c in completions]
    if dtype == "float32":
        model = load_hf_model(path, gguf_file=gguf_file).to(DEVICE)
        for (ids, logprobs), prompt in zip(ours, prompts):
            ref = hf_greedy(_OnDevice(model), prompt, max_tokens)
            assert_greedy_match(ids, logprobs, ref, LOGPROB_ATOL[dtype], TIE_GAP[dtype])
        return
    exact, same_dtype = (
        _OnDevice(load_hf_model(path, dtype=DTYPES[d], gguf_file=gguf_file).to(DEVICE)) for d in ("float32", dtype)
    )
    figures = assert_as_accurate_as_reference(
        ours,
        [teacher_forced_logprobs(exact, prompt, ids) for (ids, _), prompt in zip(ours, prompts)],
        [teacher_forced_logprobs(same_dtype, prompt, ids) for (ids, _), prompt in zip(ours, prompts)],
        SLACK[dtype],
    )
    print(f"{os.path.basename(path)} {dtype}: {figures}")


def _assert_same_tokens(first, second, tie_gap: float, label: str = "") -> None:
    """Identical greedy tokens, up to a step where `first`'s best two logprobs are within tie_gap."""
    for a, b in zip(first, second):
        for step, (x, y) in enumerate(zip(a.token_ids, b.token_ids)):
            if x != y:
                top = sorted((lp.logprob for lp in a.logprobs[step].values()), reverse=True)
                assert top[0] - top[1] < tie_gap, f"{label} diverged at step {step}: {a.token_ids} vs {b.token_ids}"
                break
        else:
            assert len(a.token_ids) == len(b.token_ids)


# --- greedy parity with transformers on the GPU, float16 and bfloat16 -------------------------------
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("arch", list(TINY_ARCHS))
def test_tiny_models_match_transformers(tiny_models, arch, dtype):
    greedy_parity(tiny_models[arch], dtype)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_ernie4_5_matches_transformers(tmp_path, smollm_tokenizer, dtype):
    """Interleaved rotary, biases on every linear."""
    import transformers

    config = transformers.Ernie4_5Config(**SHAPE, num_key_value_heads=2, head_dim=16, use_bias=True)
    build(config, seed=11).save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    greedy_parity(str(tmp_path), dtype)


@pytest.fixture(scope="module")
def default_shape(tmp_path_factory, smollm_tokenizer) -> str:
    """SmolLM2-135M's config (30 layers, 9 query heads on 3 KV heads, head_dim 64) with random weights
    large enough (std 0.1) that the best logits are usually well apart."""
    import transformers

    from splitserve.loader.known_configs import load_builtin_config

    config = load_builtin_config("HuggingFaceTB/SmolLM2-135M-Instruct")
    config.initializer_range = 0.1
    torch.manual_seed(0)
    directory = str(tmp_path_factory.mktemp("default_shape"))
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.save_pretrained(directory)
    smollm_tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_default_model_shape_matches_transformers(default_shape, dtype):
    greedy_parity(default_shape, dtype, prompts=PROMPTS[:4], max_tokens=16)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_default_model_matches_transformers(default_gguf, dtype):
    if os.path.getsize(default_gguf) < 50 << 20:
        pytest.skip("only the default model's tokenizer is here (its 98 MB GGUF does not fit a device call)")
    prompts = [[1, *range(100, 100 + 7 * i)] for i in range(1, 5)]
    directory, name = os.path.split(default_gguf)
    greedy_parity(directory, dtype, prompts, 24, gguf_file=name, quantization="none", max_model_len=512)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_gguf_4bit_blocks_run_in_the_w4a16_kernel(tiny_models, tmp_path, dtype):
    """--quantization gguf on CUDA: a tiny Llama's Q4_0 matrices in the Triton W4A16 kernel (levels
    and scales as the file has them), judged against transformers on the same dequantized weights."""
    from splitserve.loader.resolve import default_model_path
    from splitserve.quantization.gguf import INT4
    from tests.helpers.gguf_files import write_gguf

    write_gguf(tiny_models["llama"], str(tmp_path / "model.gguf"), "Q4_0", default_model_path())
    llm = _engine(str(tmp_path / "model.gguf"), dtype, quantization="gguf")
    runs = [r for m in llm.llm_engine.engine_core.executor.runner.model.modules() for r in getattr(m, "gguf_runs", [])]
    assert runs and all(kind == INT4 for kind, _, _ in runs), runs
    del llm
    greedy_parity(str(tmp_path), dtype, PROMPTS[:4], 16, gguf_file="model.gguf", quantization="gguf")


# --- Triton attention against the torch backend on the GPU ------------------------------------------
KV_HEADS, NUM_BLOCKS = 2, 160
DECODES = [(1, 1), (17, 1), (300, 1), (3000, 1)]  # (seq_len, query_len); 3000 keys: several splits
PREFILLS = [(37, 37), (52, 20), (63, 40), (150, 150), (230, 130)]  # fresh, prefix hit, chunks, tiles
ATTENTION_TOL = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def _attention_step(requests, dtype, group, head_dim, window, cache_dtype, block_size):
    """Two identical layers (one per backend) with each request's context written to a random,
    scattered block table, and the step's q, k, v and metadata for the new tokens."""
    from splitserve.executor.attention import AttentionMetadata
    from splitserve.executor.attention.torch_ref import write_kv, write_quantized_kv
    from splitserve.layers.attention import Attention
    from splitserve.quantization.kv_cache import SCALE_DTYPE, kv_cache_spec

    gen = torch.Generator().manual_seed(0)
    spec = kv_cache_spec(cache_dtype, dtype)
    shape = (2, KV_HEADS, NUM_BLOCKS * 128 // block_size, block_size, head_dim)
    free = torch.randperm(shape[2], generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-seq_len // block_size))] for seq_len, _ in requests]

    def randn(*size):
        return torch.randn(*size, generator=gen).to(dtype).to(DEVICE)

    def slots(table, positions):
        return torch.tensor(
            [table[p // block_size] * block_size + p % block_size for p in positions], dtype=torch.long, device=DEVICE
        )

    layer = Attention(KV_HEADS * group, KV_HEADS, head_dim, head_dim**-0.5, window)
    layer.kv_cache = torch.zeros(shape, dtype=spec.storage_dtype, device=DEVICE)
    if spec.quantized:
        layer.kv_scales = torch.zeros(*shape[:-1], spec.num_scale_fields, dtype=SCALE_DTYPE, device=DEVICE)
    for table, (seq_len, query_len) in zip(tables, requests):
        context = seq_len - query_len
        k, v, where = (
            randn(context, KV_HEADS, head_dim),
            randn(context, KV_HEADS, head_dim),
            slots(table, range(context)),
        )
        if spec.quantized:
            write_quantized_kv(layer.kv_cache, layer.kv_scales, k, v, where)
        else:
            write_kv(layer.kv_cache[0], layer.kv_cache[1], k, v, where)
    reference = Attention(KV_HEADS * group, KV_HEADS, head_dim, head_dim**-0.5, window)
    reference.kv_cache = layer.kv_cache.clone()
    reference.kv_scales = None if layer.kv_scales is None else layer.kv_scales.clone()
    tokens = sum(n for _, n in requests)
    q, k, v = (
        randn(tokens, KV_HEADS * group, head_dim),
        randn(tokens, KV_HEADS, head_dim),
        randn(tokens, KV_HEADS, head_dim),
    )
    starts = [0]
    for _, n in requests:
        starts.append(starts[-1] + n)
    width = max(map(len, tables))
    meta = AttentionMetadata(
        backend=None,
        num_decodes=sum(1 for _, n in requests if n == 1),
        query_start_loc=starts,
        seq_lens=[s for s, _ in requests],
        seq_lens_tensor=torch.tensor([s for s, _ in requests], dtype=torch.int32, device=DEVICE),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE),
        slot_mapping=torch.cat([slots(t, range(s - n, s)) for t, (s, n) in zip(tables, requests)]),
        block_size=block_size,
    )
    return layer, reference, q, k, v, meta


def _check_attention(requests, dtype, group=4, head_dim=128, window=None, cache_dtype="auto", block_size=16):
    from splitserve.executor.attention.torch_ref import TorchAttentionBackend
    from splitserve.executor.attention.triton_attn import TritonAttentionBackend

    step = _attention_step(requests, dtype, group, head_dim, window, cache_dtype, block_size)
    layer, reference, q, k, v, meta = step
    out = TritonAttentionBackend().forward(layer, q, k, v, meta)
    expected = TorchAttentionBackend().forward(reference, q, k, v, meta)
    tol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(out, expected, rtol=tol, atol=tol)
    assert torch.equal(layer.kv_cache.view(torch.uint8), reference.kv_cache.view(torch.uint8))


@pytest.mark.parametrize(
    "block_size,dtype",
    [(16, torch.float16), (32, torch.bfloat16), (64, torch.float16), (128, torch.bfloat16)],
    ids=["16-float16", "32-bfloat16", "64-float16", "128-bfloat16"],
)
@pytest.mark.parametrize(
    "requests,group,head_dim,window",
    [
        pytest.param(DECODES, 8, 128, None, id="decode-split-k"),
        pytest.param(PREFILLS, 3, 64, None, id="varlen-prefill"),
        pytest.param(DECODES[:3] + PREFILLS, 1, 256, 100, id="mixed-sliding-window"),
    ],
)
def test_triton_attention_matches_torch(requests, group, head_dim, window, block_size, dtype):
    _check_attention(requests, dtype, group, head_dim, window, block_size=block_size)


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["float16", "bfloat16"])
def test_triton_attention_quantized_cache(cache_dtype, dtype):
    if cache_dtype == "fp8_e4m3" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("Triton has float8 e4m3 only from compute capability 8.9")
    _check_attention(DECODES[1:] + PREFILLS[1:3], dtype, 2, 128, None, cache_dtype, block_size=32)


def test_decode_splits_with_a_long_context():
    from splitserve.executor.attention.triton_decode import num_decode_splits

    assert num_decode_splits(3000, KV_HEADS, torch.cuda.get_device_properties(0).multi_processor_count) > 1
    _check_attention([(3000, 1)], torch.bfloat16, 4, 128)


# --- mixture of experts and speculative decoding ----------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("name", ["qwen3_moe_norm_top2", "qwen2_moe_shared", "mixtral"])
def test_moe_models_match_transformers(tmp_path, smollm_tokenizer, name, dtype):
    """Routing, shared experts and the experts' products on the GPU: by default the Triton fused-MoE
    kernels (one launch per projection) under CUDA graphs, in both dtypes (tests/unit/test_triton_moe.py
    compares the backends on the GPU directly)."""
    build_moe(name).save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    llm = _engine(str(tmp_path), dtype)
    assert llm.llm_engine.engine_core.executor.runner.graph_runner is not None
    del llm
    gc.collect()
    greedy_parity(str(tmp_path), dtype)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_decoding_gives_the_target_tokens(tiny_models, dtype):
    """Drafts verified on the GPU, CUDA graphs on for the plain decodes: an oracle in the n-gram
    proposer's place (the target's own output with every third draft corrupted; the last prompt drafts
    nothing) and a draft model (the target itself: nearly every draft accepted). Both give the
    target's greedy tokens, up to near ties."""
    path = tiny_models["llama"]
    expected = _generate(_engine(path, dtype), SPEC_PROMPTS, 40, logprobs=2)
    for config in ({"method": "ngram", "num_speculative_tokens": 4}, {"model": path, "num_speculative_tokens": 3}):
        llm = _engine(path, dtype, speculative_config=config)
        core = llm.llm_engine.engine_core
        if "method" in config:
            references = {tuple(p): o.token_ids for p, o in zip(SPEC_PROMPTS[:3], expected)}
            core.speculator.proposer = OracleProposer(references, vocab=1024)
        _assert_same_tokens(expected, _generate(llm, SPEC_PROMPTS, 40), TIE_GAP[dtype], f"{config}:")
        stats = core.speculator.stats
        assert stats.num_drafts > 0, config
        assert (0 < stats.acceptance_rate < 1) if "method" in config else stats.acceptance_rate >= 0.8, (config, stats)
        del llm, core
        gc.collect()


# --- CUDA graphs and overlap scheduling: the same tokens --------------------------------------------
def _count_replays(graph_runner) -> list[int]:
    """The padded size of every decode step that replays a graph, from now on."""
    sizes, replay = [], graph_runner.replay

    def counting(size, n):
        sizes.append(size)
        return replay(size, n)

    graph_runner.replay = counting
    return sizes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_graphs_and_overlap_give_the_same_tokens(tiny_models, dtype):
    """Requests of staggered lengths, so that decode batches shrink through the padded graph sizes."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randrange(3, 40))] for _ in range(10)]
    lengths = [30, 3, 17, 9, 24, 2, 12, 30, 5, 20]
    runs = {}
    for eager, overlap in [(True, False), (False, False), (True, True), (False, True)]:
        llm = _engine(tiny_models["qwen3"], dtype, enforce_eager=eager, async_scheduling=overlap)
        graph_runner = llm.llm_engine.engine_core.executor.runner.graph_runner
        assert (graph_runner is None) == eager
        replayed = [] if eager else _count_replays(graph_runner)
        runs[eager, overlap] = _generate(llm, prompts, logprobs=2, lengths=lengths)
        assert eager or len(set(replayed)) >= 4, f"too few graph sizes replayed: {replayed}"
    reference = runs[True, False]
    for (eager, overlap), outputs in runs.items():
        _assert_same_tokens(reference, outputs, TIE_GAP[dtype], f"enforce_eager={eager} async_scheduling={overlap}:")


# --- chunked prefill and prefix-cache hits ----------------------------------------------------------
def test_chunked_prefill_and_prefix_hits_match_transformers(tiny_models):
    path = tiny_models["llama"]
    model = load_hf_model(path).to(DEVICE)
    refs = [hf_greedy(_OnDevice(model), p, MAX_TOKENS) for p in PROMPTS]
    llm = _engine(path, max_num_batched_tokens=16, block_size=16)  # prompts of up to 40 tokens: chunked
    scheduler = llm.llm_engine.engine_core.scheduler
    for attempt in range(2):  # the second time the prompts' full blocks are cached
        hits = scheduler.prefix_cache_stats.hits
        for completion, ref in zip(_generate(llm, PROMPTS), refs):
            logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
            assert_greedy_match(completion.token_ids, logprobs, ref, LOGPROB_ATOL["float32"])
        assert attempt == 0 or scheduler.prefix_cache_stats.hits > hits


# --- the KV offloading tier -------------------------------------------------------------------------
def test_kv_offloading_tier_matches_transformers(tiny_models, tmp_path):
    """Prefix blocks evicted from a small GPU pool come back from pinned host memory, then (a new
    engine on the same directory) from disk: the same tokens as transformers each time."""
    from tests.parity.test_kv_offload import PROMPTS as TIER_PROMPTS

    path = tiny_models["qwen3"]
    model = load_hf_model(path).to(DEVICE)
    refs = [hf_greedy(_OnDevice(model), p, MAX_TOKENS) for p in TIER_PROMPTS]
    small = dict(block_size=4, num_gpu_blocks_override=24, max_model_len=64, max_num_seqs=1, cuda_graph_sizes=[1])
    for tiers in ({"kv_offloading_size": 0.001, "kv_cache_dir": str(tmp_path)}, {"kv_cache_dir": str(tmp_path)}):
        llm = _engine(path, **small, **tiers)
        for prompt, ref in [*zip(TIER_PROMPTS, refs)] * 2:  # the second pass finds its prefix evicted
            (completion,) = _generate(llm, [prompt], logprobs=0)
            logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
            assert_greedy_match(completion.token_ids, logprobs, ref, LOGPROB_ATOL["float32"])
        stats = llm.llm_engine.engine_core.stats().kv_offload
        assert (stats.host_hit_blocks if "kv_offloading_size" in tiers else stats.disk_hit_blocks) > 0
        llm.llm_engine.engine_core.shutdown()  # the disk writes finish: the next engine reads them
        del llm


# --- LoRA, structured output, beam search -----------------------------------------------------------
def test_lora_matches_peft(tiny_models, tmp_path):
    from peft import PeftModel

    base = tiny_models["qwen2"]
    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    adapter = LoRARequest("full", 1, make_peft_adapter(base, str(tmp_path / "full"), projections, r=8, seed=1))
    prompts = PROMPTS[:4]
    hf = PeftModel.from_pretrained(load_hf_model(base), adapter.lora_path).eval().to(DEVICE)
    refs = [hf_greedy(_OnDevice(hf), p, 8) for p in prompts]
    base_refs = [hf_greedy(_OnDevice(load_hf_model(base).to(DEVICE)), p, 8) for p in prompts]
    llm = _engine(base, enable_lora=True, max_loras=1, max_lora_rank=8)
    outs = _generate(llm, prompts * 2, 8, lora_request=[adapter] * 4 + [None] * 4)
    for completion, ref in zip(outs, refs + base_refs):
        logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert_greedy_match(completion.token_ids, logprobs, ref, LOGPROB_ATOL["float32"])


def test_structured_output(tiny_chat_model):
    """The token masks applied on the GPU: every output parses as its guide asks, ended by the grammar."""
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
    llm = _engine(tiny_chat_model, max_model_len=256)
    prompts = ["Describe a knight:", "Pick a colour", "Write something", "Hello"]
    guides = [
        GuidedDecodingParams(json=schema, whitespace_pattern=""),
        GuidedDecodingParams(regex=r"[A-Z][a-z]{2,5}-\d{3}"),
        GuidedDecodingParams(choice=["red", "green", "blue"]),
    ]
    for guide in guides:
        params = SamplingParams(temperature=1.0, seed=0, n=2, max_tokens=120, guided_decoding=guide)
        for completion in [c for o in llm.generate(prompts, params, use_tqdm=False) for c in o.outputs]:
            assert completion.finish_reason == "stop", completion.text
            if guide.json is not None:
                value = json.loads(completion.text)
                assert set(value) == {"name", "age"} and isinstance(value["age"], int)
            elif guide.regex is not None:
                assert re.fullmatch(guide.regex, completion.text)
            else:
                assert completion.text in guide.choice


def test_beam_search_matches_transformers(tiny_models):
    path, width, max_tokens = tiny_models["llama"], 3, 10
    prompts = [[5 + i + 3 * j for j in range(6 + 2 * i)] for i in range(3)]
    llm = _engine(path)
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(width, max_tokens))
    model = load_hf_model(path).to(DEVICE)
    for prompt, output in zip(prompts, outputs):
        rows = model.generate(
            torch.tensor([prompt], device=DEVICE),
            num_beams=width,
            num_return_sequences=width,
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=2,
            pad_token_id=2,
        ).tolist()
        expected = []
        for row in rows:  # a hypothesis that ended with eos is padded after it
            generated = row[len(prompt) :]
            end = next((i + 1 for i, t in enumerate(generated) if t == 2), len(generated))
            expected.append(prompt + generated[:end])
        assert [s.tokens for s in output.sequences] == expected


@pytest.mark.parametrize("family", ["llava", "qwen2_vl"])
def test_vision_language_models_match_transformers(tiny_llava, tiny_qwen2_vl, family):
    """LLaVA and Qwen2-VL in float32 on the GPU (TF32 off on both sides), images chunked through and
    M-RoPE decodes under CUDA graphs: the tokens transformers computes from the same pixels there."""
    from tests.parity import test_multimodal, test_qwen2_vl

    module, directory = (test_multimodal, tiny_llava) if family == "llava" else (test_qwen2_vl, tiny_qwen2_vl)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, False
    try:
        expected = module.hf_greedy(directory, module.PROMPTS, device=DEVICE)
        llm = LLM(directory, **module.COMMON)
        params = SamplingParams(max_tokens=module.MAX_TOKENS, temperature=0.0, ignore_eos=True)
        outputs = llm.generate([module.request(*p) for p in module.PROMPTS], params, use_tqdm=False)
        assert [list(o.outputs[0].token_ids) for o in outputs] == expected
    finally:
        torch.backends.cudnn.allow_tf32 = True
