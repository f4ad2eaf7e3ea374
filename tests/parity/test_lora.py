"""LoRA adapters through the offline API against transformers with the same PEFT adapter applied
(PeftModel): one batch mixing two adapters and the base model, with prompts chunked over steps,
prefix-cache hits, fewer slots than adapters, tensor parallelism, and the adapters that are refused."""

from __future__ import annotations

import json
import os
import random

import pytest

from splitserve import LLM, LoRARequest, SamplingParams
from tests.helpers.hf_reference import assert_greedy_match, hf_greedy, load_hf_model
from tests.helpers.models import make_peft_adapter

MAX_TOKENS = 8
PROMPTS = [[random.Random(10 + i).randrange(3, 1024) for _ in range(6 + 9 * i)] for i in range(3)]
ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tiny_models) -> str:
    return tiny_models["qwen2"]  # q/k/v biases, GQA, tied embeddings


@pytest.fixture(scope="module")
def adapters(base, tmp_path_factory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("lora")
    full = make_peft_adapter(base, str(root / "full"), ALL_PROJECTIONS, r=8, alpha=16, seed=1)
    qv = make_peft_adapter(base, str(root / "qv"), ["q_proj", "v_proj"], r=4, alpha=8, seed=2, use_rslora=True)
    return {"full": LoRARequest("full", 1, full), "qv": LoRARequest("qv", 2, qv)}


@pytest.fixture(scope="module")
def references(base, adapters) -> dict[str | None, list]:
    """Greedy tokens and logprobs of every prompt under each adapter (and none), from transformers."""
    from peft import PeftModel

    refs = {None: [hf_greedy(load_hf_model(base), p, MAX_TOKENS) for p in PROMPTS]}
    for name, lora in adapters.items():
        model = PeftModel.from_pretrained(load_hf_model(base), lora.lora_path).eval()
        refs[name] = [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]
    return refs


def _llm(base: str, **kwargs) -> LLM:
    settings = dict(
        dtype="float32",
        max_model_len=128,
        num_gpu_blocks_override=64,
        use_tqdm_on_load=False,
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        max_num_batched_tokens=16,  # the longer prompts take several steps
        block_size=16,
    )
    return LLM(base, **{**settings, **kwargs})


def _run_mixed(llm: LLM, adapters: dict[str, LoRARequest], references) -> None:
    """Every prompt under every adapter and the base model, all in one generate call."""
    names = [None, "full", "qv"]
    jobs = [(p, name) for p in range(len(PROMPTS)) for name in names]
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate(
        [{"prompt_token_ids": PROMPTS[p]} for p, _ in jobs],
        params,
        use_tqdm=False,
        lora_request=[adapters[name] if name else None for _, name in jobs],
    )
    for (p, name), out in zip(jobs, outs):
        o = out.outputs[0]
        logprobs = [entry[token].logprob for token, entry in zip(o.token_ids, o.logprobs)]
        # The adapters' large random deltas (A, B ~ 0.3 N(0, 1)) magnify rounding differences: PEFT scales
        # after B, splitserve folds the scaling into B.
        assert_greedy_match(o.token_ids, logprobs, references[name][p], logprob_atol=1e-3)


def test_mixed_batch_matches_peft(base, adapters, references):
    for name in ("full", "qv"):  # the adapters change the outputs
        assert references[name][2].token_ids != references[None][2].token_ids
    llm = _llm(base)
    # The base model first: its prompts' KV blocks are then cached, and must not serve the adapters.
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    _run_mixed(llm, adapters, references)
    hits_before = llm.llm_engine.engine_core.scheduler.prefix_cache_stats.hits
    _run_mixed(llm, adapters, references)  # again: now every adapter's prompt blocks are cached
    assert llm.llm_engine.engine_core.scheduler.prefix_cache_stats.hits > hits_before
    assert llm.list_loras() == {1, 2}


def test_fewer_slots_than_adapters(base, adapters, references):
    """max_loras=1: the scheduler runs one adapter's requests at a time (and the base model's with
    any), and each adapter takes the one slot in turn."""
    _run_mixed(_llm(base, max_loras=1, enable_prefix_caching=False), adapters, references)


@pytest.mark.slow  # tp/pp engines start worker processes
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2", "pp2"])
def test_parallel(base, adapters, references, tp, pp):
    """Each rank holds its share of every slot: B's rows of its heads (column-parallel), A's columns of
    its inputs (row-parallel, the deltas summed with the outputs); each stage its own layers' slots."""
    llm = _llm(base, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        _run_mixed(llm, adapters, references)
    finally:
        llm.llm_engine.shutdown()


def test_remove_and_add_again(base, adapters, references):
    llm = _llm(base, max_loras=1, max_cpu_loras=1)
    _run_mixed(llm, adapters, references)
    assert llm.remove_lora(1) and not llm.remove_lora(1)
    assert llm.list_loras() == {2}
    _run_mixed(llm, adapters, references)  # a request naming it adds it again


def _broken_adapter(adapters, tmp_path, change: dict) -> str:
    directory = tmp_path / "broken"
    directory.mkdir()
    source = adapters["qv"].lora_path
    for name in os.listdir(source):
        (directory / name).write_bytes(open(os.path.join(source, name), "rb").read())
    config = json.loads((directory / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps({**config, **change}))
    return str(directory)


def test_refused_adapters(base, adapters, tmp_path, tiny_models):
    llm = _llm(base, max_lora_rank=4)
    prompt = {"prompt_token_ids": PROMPTS[0]}
    cases = [
        (LoRARequest("missing", 5, str(tmp_path / "nowhere")), "not a directory"),
        (adapters["full"], "rank 8 .* above --max-lora-rank 4"),
        (LoRARequest("dora", 6, _broken_adapter(adapters, tmp_path, {"use_dora": True})), "DoRA"),
        (
            LoRARequest("other", 7, make_peft_adapter(tiny_models["qwen3"], str(tmp_path / "q3"), ["o_proj"], r=2)),
            "another model",
        ),
    ]
    for lora, message in cases:
        with pytest.raises(ValueError, match=message):
            llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False, lora_request=lora)
    assert llm.list_loras() == set()
    out = llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False, lora_request=adapters["qv"])
    assert len(out[0].outputs[0].token_ids) == 2  # the engine is unharmed
    with pytest.raises(ValueError, match="already adapter"):
        llm.add_lora(LoRARequest("other-name", 2, adapters["full"].lora_path))


def test_lora_needs_enable_lora(base, adapters):
    llm = LLM(base, dtype="float32", max_model_len=128, num_gpu_blocks_override=16, use_tqdm_on_load=False)
    with pytest.raises(ValueError, match="--enable-lora"):
        llm.generate(
            {"prompt_token_ids": PROMPTS[0]}, SamplingParams(max_tokens=2), use_tqdm=False, lora_request=adapters["qv"]
        )
