"""CPU steps in one C++ call (executor/cpu_decode_stack.py, kernels/decode_stack.cpp) give
exactly what the model's Python modules give: the same greedy tokens and the same logprobs, bit for
bit, in float32 and bfloat16, with dense weights (biased q/k/v, tied and untied heads, a sliding
window, Qwen3's per-head q/k norms) and with the default model's GGUF blocks, at batch sizes with
and without padded rows, in decode steps and in steps with prompt tokens (chunks next to decodes,
cached prefixes); and the stack is built only where it can be exact, the log saying why not."""

from __future__ import annotations

import logging

import pytest

from splitserve import LLM, SamplingParams
from splitserve.executor.cpu_decode_stack import CPUDecodeStack

PROMPTS = [[(7 * i + 3 * j) % 1000 + 3 for j in range(3 + 2 * i)] for i in range(20)]


def _runner(llm: LLM):
    return llm.llm_engine.engine_core.executor.runner


def _llm(model: str, monkeypatch, stack: bool, **kwargs) -> LLM:
    monkeypatch.setenv("SPLITSERVE_CPU_DECODE_STACK", "1" if stack else "0")
    kwargs = {"max_model_len": 256, "use_tqdm_on_load": False, "enable_prefix_caching": False, **kwargs}
    llm = LLM(model or None, **kwargs)
    assert (_runner(llm).decode_stack is not None) == stack
    return llm


def _outputs(llm: LLM, prompts, max_tokens: int):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=3)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [
        (o.outputs[0].token_ids, [sorted((t, lp.logprob) for t, lp in step.items()) for step in o.outputs[0].logprobs])
        for o in outs
    ]


@pytest.fixture
def stack_calls(monkeypatch):
    """Counts the steps the stack ran ("n"), and those with prompt tokens among them ("prompts")."""
    calls = {"n": 0, "prompts": 0}
    original = CPUDecodeStack.forward

    def counting(self, input_ids, positions, meta):
        calls["n"] += 1
        calls["prompts"] += meta.num_decodes < meta.num_reqs
        return original(self, input_ids, positions, meta)

    monkeypatch.setattr(CPUDecodeStack, "forward", counting)
    return calls


@pytest.mark.parametrize("arch", ["llama", "llama_tied", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_dense_models_equal_the_modules(tiny_models, monkeypatch, stack_calls, arch, dtype):
    # 20 requests: decode batches of 20 (padded to 32 rows for oneDNN) down to 1 as they finish.
    prompts = PROMPTS if arch == "llama" else PROMPTS[:5]
    lengths = [6 + i % 7 for i in range(len(prompts))]
    results = []
    for stack in (False, True):
        llm = _llm(tiny_models[arch], monkeypatch, stack, dtype=dtype)
        params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=3) for n in lengths]
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, _logprob_steps(o.outputs[0])) for o in outs])
    assert results[0] == results[1]
    assert stack_calls["n"] >= max(lengths) - 1


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_prompt_and_mixed_steps_equal_the_modules(tiny_models, monkeypatch, stack_calls, arch, dtype):
    """Steps with prompt tokens: prompt chunks of a 16-token budget next to running decodes, a
    prompt whose prefix is cached, a sliding window (mistral) longer prompts cross; the prompt
    logprobs (every prompt row's hidden state) and the answers are the modules' bit for bit."""
    shared = PROMPTS[6] * 2  # 30 tokens
    prompts = [p * 3 for p in PROMPTS[:6]] + [shared + [11, 12, 13], shared + [14]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    results = []
    for stack in (False, True):
        llm = _llm(
            tiny_models[arch], monkeypatch, stack, dtype=dtype, max_num_batched_tokens=16, enable_prefix_caching=True
        )
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append(
            [
                (o.outputs[0].token_ids, _logprob_steps(o.outputs[0]), _logprob_steps_of(o.prompt_logprobs[1:]))
                for o in outs
            ]
        )
    assert results[0] == results[1]
    assert stack_calls["prompts"] >= 10  # the prompts' chunks went through the stack


@pytest.fixture(scope="module")
def biased_llama(tmp_path_factory, smollm_tokenizer) -> str:
    """A tiny Llama with every linear biased (attention_bias, mlp_bias): the row-parallel products'
    bias goes after the sum over the ranks."""
    import torch
    import transformers

    from tests.helpers.models import TINY_CONFIG

    directory = str(tmp_path_factory.mktemp("biased_llama"))
    config = transformers.LlamaConfig(**TINY_CONFIG, attention_bias=True, mlp_bias=True, tie_word_embeddings=False)
    config.bos_token_id, config.eos_token_id = 1, 2
    torch.manual_seed(3)
    transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(directory)
    smollm_tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.slow  # tensor-parallel engines start worker processes
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tensor_parallel_ranks_equal_the_modules(biased_llama, monkeypatch, capfd, dtype):
    """Two tensor-parallel ranks, each with its stack: the row-parallel products are summed inside
    the call; prompt and decode steps give the modules' tokens and logprobs bit for bit."""
    prompts = [p * 2 for p in PROMPTS[:6]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=3)
    results = []
    for stack in (False, True):
        monkeypatch.setenv("SPLITSERVE_CPU_DECODE_STACK", "1" if stack else "0")
        llm = LLM(
            biased_llama, dtype=dtype, max_model_len=256, use_tqdm_on_load=False, tensor_parallel_size=2,
            max_num_batched_tokens=16,
        )  # fmt: skip
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        results.append([(o.outputs[0].token_ids, _logprob_steps(o.outputs[0])) for o in outs])
        llm.llm_engine.engine_core.shutdown()
        logged = capfd.readouterr().err
        assert ("CPU steps run their 3 decoder layers in one C++ call" in logged) == stack, logged[-2000:]
    assert results[0] == results[1]


def _logprob_steps_of(steps):
    return [sorted((t, lp.logprob) for t, lp in step.items()) for step in steps]


def _logprob_steps(completion):
    return _logprob_steps_of(completion.logprobs)


@pytest.mark.slow  # loads the default model
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_model_in_its_gguf_blocks_equals_the_modules(monkeypatch, stack_calls, dtype):
    prompts = PROMPTS[:3]
    plain = _outputs(_llm("", monkeypatch, False, dtype=dtype), prompts, 12)
    stacked = _outputs(_llm("", monkeypatch, True, dtype=dtype), prompts, 12)
    assert plain == stacked
    assert stack_calls["n"] >= 11


def test_where_the_stack_is_not_built_the_log_says_why(tiny_models, monkeypatch, caplog):
    cases = [
        (tiny_models["llama"], {"kv_cache_dtype": "int8"}, "the KV cache is quantized"),
        (tiny_models["llama"], {"quantization": "weight_only_int8"}, "quantized with"),
        (tiny_models["llama"], {"enable_lora": True}, "LoRA adapters"),
    ]
    for model, kwargs, reason in cases:
        caplog.clear()
        monkeypatch.setenv("SPLITSERVE_CPU_DECODE_STACK", "1")
        with caplog.at_level(logging.INFO, logger="splitserve.executor.cpu_decode_stack"):
            llm = LLM(model, dtype="float32", max_model_len=256, use_tqdm_on_load=False, **kwargs)
        assert _runner(llm).decode_stack is None
        assert any(reason in r.getMessage() for r in caplog.records), (reason, [r.getMessage() for r in caplog.records])
    # Turned off on purpose: said so too.
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="splitserve.executor.cpu_decode_stack"):
        _llm(tiny_models["llama"], monkeypatch, False, dtype="float32")
    assert any("SPLITSERVE_CPU_DECODE_STACK=0" in r.getMessage() for r in caplog.records)


def test_the_stack_kernels_are_profiler_events_inside_it(tiny_models, monkeypatch, stack_calls):
    """Under torch.profiler each kernel the stack calls is an event of its own, inside the stack's,
    so that `bench throughput --profile` counts each in its category (benchmarks/profiling.py) and
    leaves the stack only its C++ between them."""
    from torch.profiler import ProfilerActivity, profile

    from splitserve.benchmarks.profiling import categorize

    llm = _llm(tiny_models["qwen3"], monkeypatch, True, dtype="bfloat16")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        _outputs(llm, PROMPTS[:3], 4)
    assert stack_calls["prompts"] >= 1 and stack_calls["n"] > stack_calls["prompts"]
    inside = {
        e.name
        for e in prof.events()
        if e.cpu_parent is not None and e.cpu_parent.name == "splitserve_cpu::decode_stack_forward"
    }
    for kernel in ("rms_norm", "add_rms_norm", "rotary", "write_kv", "decode_attention", "prefill_attention"):
        assert f"splitserve_cpu::{kernel}" in inside, (kernel, sorted(inside))
        assert not categorize(f"splitserve_cpu::{kernel}").startswith("fused layer stack")
    assert "splitserve_cpu::silu_and_mul" in inside


def test_prompt_attention_on_onednn_block_kernels_inside_the_stack(tiny_models, monkeypatch, stack_calls):
    """bfloat16 prompt attention through oneDNN's block kernels (what a CPU with AMX runs, on AMX
    tiles; float32 products where bfloat16 is not native) inside the stack: prompts past the
    kernels' blocks of 64 rows and 64 keys, whole and in chunks after a cached prefix, stay as close
    to the float32 model's prompt logprobs as the vector loops' bfloat16 does."""
    from splitserve import kernels

    shared = [t for p in PROMPTS[10:14] for t in p]  # 112 tokens
    prompts = [shared + PROMPTS[1], PROMPTS[19] * 5, shared + PROMPTS[2] * 20]
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1)
    runs = {}
    for name, dtype, brgemm in (
        ("float32", "float32", False),
        ("vector", "bfloat16", False),
        ("tiles", "bfloat16", True),
    ):
        old = kernels.set_prompt_attention_brgemm(brgemm, brgemm)
        try:
            llm = _llm(tiny_models["qwen3"], monkeypatch, True, dtype=dtype, enable_prefix_caching=True)
            outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        finally:
            kernels.set_prompt_attention_brgemm(*old)
        runs[name] = [
            lp for o, p in zip(outs, prompts) for lp in (s[t].logprob for s, t in zip(o.prompt_logprobs[1:], p[1:]))
        ]
    assert stack_calls["prompts"] >= 3

    def error(name):
        diffs = [abs(a - b) for a, b in zip(runs[name], runs["float32"])]
        return max(diffs), sum(diffs) / len(diffs)

    (vector_max, vector_mean), (tiles_max, tiles_mean) = error("vector"), error("tiles")
    assert tiles_max <= 1.2 * vector_max + 0.02 and tiles_mean <= 1.2 * vector_mean + 0.005, (
        error("vector"),
        error("tiles"),
    )
