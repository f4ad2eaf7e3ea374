"""Every deployment feature with every request feature, offline on a tiny model: each pair runs, its
answer is valid for the request's feature, and where the deployment does not change the numbers it
is the plain engine's answer exactly.

A deployment (a column) is an engine started with one feature (speculative decoding with n-gram or a
draft model, async scheduling, no prefix caching, a small step budget, no chunked prefill, swap
preemption, KV offloading to host memory or disk, KV events, priority scheduling, a quantized KV
cache or quantized weights (quantized while loading, AWQ / GPTQ / compressed-tensors checkpoints, a
GGUF file), batch-invariant kernels, tensor/pipeline/data parallelism); each takes every request
kind (a row: stop strings and tokens, seeds, penalties, logprobs, prompt logprobs, n and best_of,
structured output, min_tokens, allowed tokens, a LoRA adapter, beam search) in one batch, then
sleeps and wakes, and has its weights updated from its own checkpoint. Requests of a batch are
independent, so the plain engine answers the same batch for the exact columns. A combination that
is refused must be in docs/compatibility.md (the table in engine/compatibility.py);
`--matrix-pairs` adds every pair of columns, run apart from the suite. The server-level pairs (PD,
--workers, the APIs) are in tests/e2e/test_server_matrix.py, the vision and embedding models' in
test_feature_matrix_models.py. The rows also run on a tiny mixture-of-experts model, plain, with
expert parallelism, speculation and async scheduling (LoRA is refused there, with its reason).
"""

from __future__ import annotations

import re

import pytest

from splitserve import LLM, BeamSearchParams, GuidedDecodingParams, LoRARequest, SamplingParams
from splitserve.engine.compatibility import CombinationRefused
from splitserve.loader.resolve import default_model_path
from tests.helpers.feature_matrix import NGRAM, Column, refusal
from tests.helpers.feature_matrix import close as _close
from tests.helpers.feature_matrix import engine as _engine
from tests.helpers.gguf_files import write_gguf
from tests.helpers.models import make_peft_adapter
from tests.helpers.quant_layouts import write_quantized_checkpoint

pytestmark = pytest.mark.slow  # about fifteen engines, three of them with worker processes

PROMPT = {"prompt_token_ids": list(range(40, 75))}  # two full blocks of 16 and a tail
MAX_TOKENS = 10
REGEX = r"[0-9]{3}-[a-z]{2}"
ALLOWED = list(range(300, 340))


COLUMNS = [
    Column("speculative", {"speculative_config": NGRAM}, True),
    Column("draft_model", {"speculative_config": "draft"}, True),
    Column("speculative_async", {"speculative_config": NGRAM, "async_scheduling": True}, True),
    Column("draft_model_async", {"speculative_config": "draft", "async_scheduling": True}, True),
    Column("no_prefix_caching", {"enable_prefix_caching": False}, True),
    Column("small_step_budget", {"max_num_batched_tokens": 16, "max_num_seqs": 4}, False),
    Column("async_scheduling", {"async_scheduling": True}, True),
    Column("kv_offloading", {"kv_offloading_size": 0.001}, True),
    Column("kv_disk_tier", {"kv_cache_dir": "tmp"}, True),
    Column("kv_events", {"kv_events_config": {"enable_kv_cache_events": True, "publisher": "null"}}, True),
    Column("priority", {"scheduling_policy": "priority"}, True),
    Column("kv_int8", {"kv_cache_dtype": "int8"}, False),
    Column("kv_fp8", {"kv_cache_dtype": "fp8"}, False),
    Column("batch_invariant", {"batch_invariant": True}, False),
    Column("tensor_parallel", {"tensor_parallel_size": 2}, False),
    Column("pipeline_parallel", {"pipeline_parallel_size": 2}, True),
    Column("data_parallel", {"data_parallel_size": 2}, True),
    Column("no_chunked_prefill", {"enable_chunked_prefill": False}, True),
    Column("swap_preemption", {"preemption_mode": "swap", "swap_space": 0.01}, True),
    Column("fp8_weights", {"quantization": "fp8"}, False),
    Column("int8_weights", {"quantization": "weight_only_int8"}, False),
    # 4-bit checkpoints written by the tests (tests/helpers/quant_layouts.py): AutoAWQ's, AutoGPTQ's
    # with act-order, llm-compressor's W4A16 (compressed-tensors)
    Column("awq_checkpoint", {"checkpoint": "awq"}, False),
    Column("gptq_checkpoint", {"checkpoint": "gptq"}, False),
    Column("compressed_tensors_checkpoint", {"checkpoint": "compressed-tensors"}, False),
    # llama.cpp's format: the tiny Llama (with the whole vocabulary its tokenizer metadata needs) in Q4_0
    Column("gguf_q4_0", {"checkpoint": "gguf"}, False),
]


# Deployments a checkpoint refuses by what it holds (not a pair of features, so not in the table):
# act-order groups cannot be split over tensor-parallel ranks.
MODEL_REFUSALS = {"tensor_parallel+gptq_checkpoint": "quantized with act-order"}


def _rows(greedy) -> dict[str, SamplingParams]:
    """The request kinds; the stops come from this engine's own greedy answer (`greedy`)."""
    base = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    return {
        "greedy": SamplingParams(temperature=0, logprobs=2, **base),
        "stop_string": SamplingParams(temperature=0, stop=[greedy.text[6:9]], **base),
        "stop_string_kept": SamplingParams(
            temperature=0, stop=[greedy.text[6:9]], include_stop_str_in_output=True, **base
        ),
        "stop_token": SamplingParams(temperature=0, stop_token_ids=[greedy.token_ids[5]], **base),
        "seed": SamplingParams(temperature=1.0, top_p=0.9, seed=7, **base),
        "penalties": SamplingParams(
            temperature=0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.5, **base
        ),
        "prompt_logprobs": SamplingParams(temperature=0, prompt_logprobs=1, **base),
        "n_best_of": SamplingParams(temperature=1.0, n=2, best_of=3, seed=3, **base),
        "structured": SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, guided_decoding=GuidedDecodingParams(regex=REGEX)
        ),
        "min_tokens": SamplingParams(temperature=0, max_tokens=MAX_TOKENS, min_tokens=4),
        "allowed_tokens": SamplingParams(temperature=0, allowed_token_ids=ALLOWED, **base),
    }


def _check_valid(kind: str, params: SamplingParams, out) -> None:
    """What the request's feature promises, whatever the deployment's numbers."""
    samples = out.outputs
    assert len(samples) == params.n, kind
    for s in samples:
        assert s.finish_reason in ("stop", "length"), (kind, s.finish_reason)
        assert len(s.token_ids) <= (params.max_tokens or MAX_TOKENS), kind
    s = samples[0]
    if kind == "greedy":
        assert len(s.token_ids) == MAX_TOKENS and len(s.logprobs) == MAX_TOKENS
        assert all(t in lp for t, lp in zip(s.token_ids, s.logprobs))
    elif kind.startswith("stop_string"):
        stop = params.stop[0]
        if s.finish_reason == "stop":
            assert s.text.endswith(stop) if params.include_stop_str_in_output else stop not in s.text, (kind, s.text)
    elif kind == "stop_token":
        stop = params.stop_token_ids[0]
        assert stop not in s.token_ids[:-1] and (s.token_ids[-1] == stop) == (s.finish_reason == "stop"), kind
    elif kind == "prompt_logprobs":
        assert len(out.prompt_logprobs) == len(PROMPT["prompt_token_ids"]) and out.prompt_logprobs[0] is None
    elif kind == "structured":
        assert s.finish_reason == "stop" and re.fullmatch(REGEX, s.text), s.text
    elif kind == "allowed_tokens":
        assert set(s.token_ids) <= set(ALLOWED)


def _answers(llm: LLM, adapter: LoRARequest | None, served: str) -> dict:
    """Every row's answer from one engine: the greedy answer first (the stops come from it), then
    every row in one batch (a LoRA adapter's greedy answer among them, when there is one), then a
    beam search."""
    plain_greedy = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    greedy = llm.generate([PROMPT], plain_greedy, use_tqdm=False)[0].outputs[0]
    rows = _rows(greedy)
    loras = [None] * len(rows) + ([adapter] if adapter is not None else [])
    params = [*rows.values(), plain_greedy][: len(loras)]
    outputs = llm.generate([PROMPT] * len(loras), params, lora_request=loras, use_tqdm=False)
    answers = {}
    if adapter is not None:
        assert outputs[-1].outputs[0].token_ids != greedy.token_ids  # the adapter changes the answer
        answers["lora"] = _summary(outputs[-1])
    for (kind, params), out in zip(rows.items(), outputs):
        _check_valid(kind, params, out)
        answers[kind] = _summary(out)
    beams = llm.beam_search([PROMPT], BeamSearchParams(beam_width=2, max_tokens=6, ignore_eos=True))
    assert len(beams[0].sequences) == 2
    answers["beam_search"] = [seq.tokens for seq in beams[0].sequences]
    llm.sleep(1)  # sleep mode: asleep and awake again, the engine answers as before
    assert llm.is_sleeping()
    llm.wake_up()
    assert llm.generate([PROMPT], plain_greedy, use_tqdm=False)[0].outputs[0].token_ids == greedy.token_ids
    llm.update_weights(served)  # weights updated (from the same checkpoint): the same answer again
    assert llm.generate([PROMPT], plain_greedy, use_tqdm=False)[0].outputs[0].token_ids == greedy.token_ids
    return answers


def _summary(out) -> tuple:
    samples = tuple(
        (s.token_ids, s.text, s.finish_reason, None if s.logprobs is None else _rounded(s.logprobs))
        for s in out.outputs
    )
    prompt = None if out.prompt_logprobs is None else _rounded(out.prompt_logprobs[1:])
    return samples, prompt


def _rounded(logprobs) -> tuple:
    return tuple(tuple(sorted((t, round(lp.logprob, 3)) for t, lp in entry.items())) for entry in logprobs)


@pytest.fixture(scope="module")
def model(tiny_models) -> str:
    return tiny_models["llama"]


@pytest.fixture(scope="module")
def adapter(model, tmp_path_factory) -> LoRARequest:
    path = make_peft_adapter(model, str(tmp_path_factory.mktemp("matrix_lora")), ["q_proj", "v_proj", "down_proj"])
    return LoRARequest("matrix", 1, path)


@pytest.fixture(scope="module")
def plain(model, adapter) -> dict:
    llm = _engine(model)
    try:
        return _answers(llm, adapter, model)
    finally:
        _close(llm)


def _pairs() -> list[Column]:
    """Every two columns in one engine (`pytest --matrix-pairs`, run apart from the suite): exact
    when both are; pairs that set one argument twice are left out."""
    pairs = []
    for i, first in enumerate(COLUMNS):
        for second in COLUMNS[i + 1 :]:
            # A 16-token step cannot hold a prompt without chunking: two values that contradict, refused
            # by the scheduler config's own check, not a pair of features.
            if {first.name, second.name} == {"small_step_budget", "no_chunked_prefill"}:
                continue
            # Quantizing while loading a checkpoint already quantized: two quantizations, refused as such.
            if {"quantization", "checkpoint"} <= set(first.args) | set(second.args):
                continue
            if not set(first.args) & set(second.args):
                pairs.append(
                    Column(f"{first.name}+{second.name}", {**first.args, **second.args}, first.exact and second.exact)
                )
    return pairs


def pytest_generate_tests(metafunc):
    if "column" in metafunc.fixturenames:
        columns = COLUMNS + (_pairs() if metafunc.config.getoption("--matrix-pairs") else [])
        metafunc.parametrize("column", columns, ids=[c.name for c in columns])


def test_every_request_kind_on_every_deployment(model, adapter, plain, column, tmp_path, tiny_chat_model):
    """`column`: each deployment (and with --matrix-pairs each pair of them)."""
    method = column.args.get("checkpoint")
    base = tiny_chat_model if method == "gguf" else model  # a GGUF needs a tokenizer: the chat model's
    args = _resolved(column.args, base, tmp_path)  # a draft model drafts for the base it was made from
    args.pop("checkpoint", None)
    served = _checkpoint(method, base, tmp_path)
    if column.name in MODEL_REFUSALS:  # the checkpoint's own format refuses the deployment, before it loads
        with pytest.raises(ValueError, match=MODEL_REFUSALS[column.name]):
            _engine(served, **args)
        return
    refused = refusal(args)
    if refused is not None:  # a combination the table refuses: refused at start-up, in its words
        with pytest.raises(CombinationRefused, match=re.escape(refused.message())):
            _engine(served, **args)
        return
    llm = _engine(served, **args)
    try:
        answers = _answers(llm, adapter, served)
    finally:
        _close(llm)
    if column.exact:
        for kind, expected in plain.items():
            assert answers[kind] == expected, f"{column.name} x {kind}"


def _resolved(args: dict, model: str, tmp_path) -> dict:
    args = dict(args)
    if args.get("speculative_config") == "draft":  # the model drafts for itself
        args["speculative_config"] = {"model": model, "num_speculative_tokens": 3}
    if args.get("kv_cache_dir") == "tmp":  # a directory of its own: no blocks of another column's run
        args["kv_cache_dir"] = str(tmp_path / "kv")
    return args


def _checkpoint(method: str | None, model: str, tmp_path) -> str:
    """The model a column serves: `model`, or a copy of it quantized in `method`'s checkpoint layout
    (act-order for gptq) that its LoRA adapter still fits."""
    if method is None:
        return model
    if method == "gguf":
        return write_gguf(model, str(tmp_path / "model.gguf"), "Q4_0", default_model_path())
    out = str(tmp_path / method)
    write_quantized_checkpoint(model, out, method, group_size=32, act_order=method == "gptq")
    return out


# --- a mixture-of-experts model ---------------------------------------------------------------------
# The same rows on the tiny ERNIE 4.5 MoE (8 experts, top-2, a shared expert), plain and with the
# features that change how its experts run: expert parallelism over two ranks (tensor parallel
# attention, the experts split between the ranks), speculation and async scheduling, and an AWQ
# checkpoint (every expert in 4 bits) with speculation and expert parallelism. LoRA adapters
# are refused on MoE models (their experts are no LoRA targets), with that reason.
MOE_COLUMNS = [
    Column("moe_expert_parallel", {"tensor_parallel_size": 2, "enable_expert_parallel": True}, False),
    Column("moe_speculative", {"speculative_config": NGRAM}, True),
    Column("moe_async_scheduling", {"async_scheduling": True}, True),
    # every expert in 4 bits (AutoAWQ's per-expert layout), with n-gram drafts and with expert parallelism
    Column("moe_awq_speculative", {"checkpoint": "awq", "speculative_config": NGRAM}, False),
    Column(
        "moe_awq_expert_parallel",
        {"checkpoint": "awq", "tensor_parallel_size": 2, "enable_expert_parallel": True},
        False,
    ),
]


def _moe_engine(model: str, **args) -> LLM:
    return _engine(model, enable_lora=False, **args)


@pytest.fixture(scope="module")
def moe_plain(tiny_moe_chat_model) -> dict:
    llm = _moe_engine(tiny_moe_chat_model)
    try:
        return _answers(llm, None, tiny_moe_chat_model)
    finally:
        _close(llm)


@pytest.mark.parametrize("moe_column", MOE_COLUMNS, ids=[c.name for c in MOE_COLUMNS])
def test_every_request_kind_on_an_moe_model(tiny_moe_chat_model, moe_plain, moe_column, tmp_path):
    args = dict(moe_column.args)
    served = _checkpoint(args.pop("checkpoint", None), tiny_moe_chat_model, tmp_path)
    llm = _moe_engine(served, **args)
    try:
        answers = _answers(llm, None, served)
    finally:
        _close(llm)
    if moe_column.exact:
        for kind, expected in moe_plain.items():
            assert answers[kind] == expected, f"{moe_column.name} x {kind}"


def test_lora_on_an_moe_model_is_refused_with_its_reason(tiny_moe_chat_model):
    with pytest.raises(ValueError, match="LoRA adapters on mixture-of-experts models are not supported yet"):
        _engine(tiny_moe_chat_model)
