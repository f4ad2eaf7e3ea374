"""The pairwise matrix's model kinds: a vision model and an embedding model, each with the deployment
features that change how its requests run (tests/parity/test_feature_matrix.py holds the text
generation columns and the MoE model).

Vision (the tiny LLaVA): rows with one image, two images and none in one batch, greedy with
logprobs, prompt logprobs through the image's tokens, n and best_of, a seed, a guided regex, a stop
token, beam search over an image prompt; then sleep and wake. Pooling (the tiny chat model as an
embedding model): embeddings of prompts short and long (chunked over steps), with `dimensions`
cut and not normalized, and score's cosine similarities. Each column is an engine started with one
feature; where the feature does not change the numbers its answers are the plain engine's exactly,
otherwise they must be valid (and close, for embeddings). A column the compatibility table refuses
must be refused at start-up in the table's words. `--matrix-pairs` adds columns run apart from the
suite."""

from __future__ import annotations

import re

import pytest
import torch

from splitserve import BeamSearchParams, GuidedDecodingParams, SamplingParams
from splitserve.engine.compatibility import CombinationRefused
from splitserve.pooling_params import PoolingParams
from tests.helpers.feature_matrix import NGRAM, Column, close, engine, refusal
from tests.helpers.multimodal import random_image

pytestmark = pytest.mark.slow  # a dozen engines, some with worker processes

MAX_TOKENS = 8
REGEX = r"[0-9]{3}-[a-z]{2}"
ONE = "USER: <image>\nWhat is in this picture?\nASSISTANT:"
TWO = "USER: Compare <image> with <image> please.\nASSISTANT:"
TEXT = "USER: no picture here, just words.\nASSISTANT:"

# The features that change how an image prompt runs: drafts over its tokens, steps ahead, its blocks
# uncached or computed over several steps (split inside the image), sharded, paged out and back.
VISION_COLUMNS = [
    Column("speculative", {"speculative_config": NGRAM}, True),
    Column("async_scheduling", {"async_scheduling": True}, True),
    Column("no_prefix_caching", {"enable_prefix_caching": False}, True),
    Column("small_step_budget", {"max_num_batched_tokens": 24, "max_num_seqs": 4}, False),
    Column("tensor_parallel", {"tensor_parallel_size": 2}, False),
    Column("kv_offloading", {"kv_offloading_size": 0.001}, True),
]
VISION_EXTRA = [
    Column("pipeline_parallel", {"pipeline_parallel_size": 2}, True),
    Column("data_parallel", {"data_parallel_size": 2}, True),
    Column("kv_int8", {"kv_cache_dtype": "int8"}, False),
    Column("priority", {"scheduling_policy": "priority"}, True),
    Column("swap_preemption", {"preemption_mode": "swap", "swap_space": 0.01}, True),
    Column("batch_invariant", {"batch_invariant": True}, False),
    Column("int8_weights", {"quantization": "weight_only_int8"}, False),
]
POOLING_COLUMNS = [
    Column("small_step_budget", {"max_num_batched_tokens": 16, "max_num_seqs": 4}, True),
    Column("no_prefix_caching", {"enable_prefix_caching": False}, True),
    Column("tensor_parallel", {"tensor_parallel_size": 2}, False),
    Column("data_parallel", {"data_parallel_size": 2}, True),
    Column("speculative", {"speculative_config": NGRAM}, True),
]
POOLING_EXTRA = [
    Column("pipeline_parallel", {"pipeline_parallel_size": 2}, True),
    Column("kv_int8", {"kv_cache_dtype": "int8"}, False),
    Column("priority", {"scheduling_policy": "priority"}, True),
    Column("batch_invariant", {"batch_invariant": True}, False),
    Column("int8_weights", {"quantization": "weight_only_int8"}, False),
    Column("async_scheduling", {"async_scheduling": True}, True),
]


def pytest_generate_tests(metafunc):
    extra = metafunc.config.getoption("--matrix-pairs")
    for name, columns, more in (
        ("vision_column", VISION_COLUMNS, VISION_EXTRA),
        ("pooling_column", POOLING_COLUMNS, POOLING_EXTRA),
    ):
        if name in metafunc.fixturenames:
            chosen = columns + (more if extra else [])
            metafunc.parametrize(name, chosen, ids=[c.name for c in chosen])


def _started(model: str, column: Column | None, **args):
    """The column's engine; None when the table refuses it (checked here: at start-up, in its words)."""
    args = {**args, **(column.args if column else {})}
    rule = refusal(args)
    if rule is not None:
        with pytest.raises(CombinationRefused, match=re.escape(rule.message())):
            engine(model, **args)
        return None
    return engine(model, **args)


# --- vision --------------------------------------------------------------------------------------------
def _image(text: str, *seeds: int) -> dict:
    if not seeds:
        return {"prompt": text}
    return {"prompt": text, "multi_modal_data": {"image": [random_image(s) for s in seeds]}}


def _vision_answers(llm) -> dict:
    base = {"max_tokens": MAX_TOKENS, "ignore_eos": True}
    greedy = SamplingParams(temperature=0, logprobs=2, **base)
    first = llm.generate([_image(ONE, 1)], greedy, use_tqdm=False)[0].outputs[0]
    rows = {
        "greedy_one_image": (_image(ONE, 1), greedy),
        "greedy_two_images": (_image(TWO, 2, 3), greedy),
        "greedy_no_image": (_image(TEXT), greedy),
        "prompt_logprobs": (_image(ONE, 4), SamplingParams(temperature=0, prompt_logprobs=1, **base)),
        "n_best_of": (_image(ONE, 1), SamplingParams(temperature=1.0, n=2, best_of=3, seed=3, **base)),
        "seed": (_image(TWO, 2, 3), SamplingParams(temperature=1.0, top_p=0.9, seed=7, **base)),
        "structured": (
            _image(ONE, 5),
            SamplingParams(temperature=0, max_tokens=12, guided_decoding=GuidedDecodingParams(regex=REGEX)),
        ),
        "stop_token": (_image(ONE, 1), SamplingParams(temperature=0, stop_token_ids=[first.token_ids[4]], **base)),
    }
    outputs = llm.generate([p for p, _ in rows.values()], [s for _, s in rows.values()], use_tqdm=False)
    answers = {}
    for (kind, (_, params)), out in zip(rows.items(), outputs):
        _check_vision(kind, params, out)
        answers[kind] = _summary(out)
    beam = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
    beams = llm.beam_search([_image(ONE, 1), _image(ONE, 9)], beam)
    answers["beam_search"] = [[seq.tokens for seq in b.sequences] for b in beams]
    assert answers["beam_search"][0] != answers["beam_search"][1]  # each searched with its own image
    llm.sleep(1)
    llm.wake_up()
    again = llm.generate([_image(ONE, 1)], greedy, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == first.token_ids
    return answers


def _check_vision(kind: str, params: SamplingParams, out) -> None:
    samples = out.outputs
    assert len(samples) == params.n, kind
    s = samples[0]
    if kind.startswith("greedy"):
        assert len(s.token_ids) == MAX_TOKENS and all(t in lp for t, lp in zip(s.token_ids, s.logprobs)), kind
    elif kind == "prompt_logprobs":
        assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] is None
    elif kind == "structured":
        assert s.finish_reason == "stop" and re.fullmatch(REGEX, s.text), s.text
    elif kind == "stop_token":
        stop = params.stop_token_ids[0]
        assert stop not in s.token_ids[:-1] and (s.token_ids[-1] == stop) == (s.finish_reason == "stop"), kind


def _summary(out) -> tuple:
    samples = tuple((s.token_ids, s.text, s.finish_reason, _rounded(s.logprobs)) for s in out.outputs)
    return samples, _rounded(out.prompt_logprobs[1:] if out.prompt_logprobs else None)


def _rounded(logprobs):
    if logprobs is None:
        return None
    return tuple(tuple(sorted((t, round(lp.logprob, 3)) for t, lp in entry.items())) for entry in logprobs)


@pytest.fixture(scope="module")
def vision_plain(tiny_llava) -> dict:
    llm = engine(tiny_llava, enable_lora=False)
    try:
        return _vision_answers(llm)
    finally:
        close(llm)


def test_every_request_kind_on_a_vision_model(tiny_llava, vision_plain, vision_column):
    llm = _started(tiny_llava, vision_column, enable_lora=False)
    if llm is None:
        return
    try:
        answers = _vision_answers(llm)
    finally:
        close(llm)
    if vision_column.exact:
        for kind, expected in vision_plain.items():
            assert answers[kind] == expected, f"{vision_column.name} x {kind}"


# --- pooling -------------------------------------------------------------------------------------------
POOLED = [{"prompt_token_ids": list(range(3, 60))}, {"prompt_token_ids": [7] * 33}, "Paris is in France", "a"]
QUERY, DOCS = "What is the capital of France?", ["Paris is the capital of France.", "Berlin is in Germany."]


def _pooling_answers(llm) -> dict:
    plain = [o.outputs.embedding for o in llm.embed(POOLED, use_tqdm=False)]
    for vector in plain:
        assert abs(torch.tensor(vector).norm().item() - 1) < 1e-4
    cut = llm.embed(POOLED[:2], PoolingParams(dimensions=16, normalize=False), use_tqdm=False)
    assert [len(o.outputs.embedding) for o in cut] == [16, 16]
    scores = [o.outputs.score for o in llm.score(QUERY, DOCS, use_tqdm=False)]
    assert all(-1 <= s <= 1 for s in scores)
    return {"embed": plain, "embed_cut": [o.outputs.embedding for o in cut], "score": scores}


@pytest.fixture(scope="module")
def pooling_plain(tiny_chat_model) -> dict:
    llm = engine(tiny_chat_model, runner="pooling", enable_lora=False, pooler_config=_MATRYOSHKA)
    try:
        return _pooling_answers(llm)
    finally:
        close(llm)


_MATRYOSHKA = {"matryoshka_dimensions": [16, 32]}  # `dimensions` is taken only for these


def test_every_request_kind_on_an_embedding_model(tiny_chat_model, pooling_plain, pooling_column):
    llm = _started(tiny_chat_model, pooling_column, runner="pooling", enable_lora=False, pooler_config=_MATRYOSHKA)
    if llm is None:
        return
    try:
        answers = _pooling_answers(llm)
    finally:
        close(llm)
    for kind, expected in pooling_plain.items():
        got, want = torch.tensor(answers[kind]), torch.tensor(expected)
        if pooling_column.exact:
            assert torch.equal(got, want), f"{pooling_column.name} x {kind}"
        elif kind == "score":
            assert torch.allclose(got, want, atol=0.02), f"{pooling_column.name} x {kind}: {got} != {want}"
        else:  # quantized or resharded numbers: each vector pointing where the plain engine's points
            similarity = torch.nn.functional.cosine_similarity(got, want, dim=-1)
            assert similarity.min() > 0.99, f"{pooling_column.name} x {kind}: cosine {similarity.tolist()}"
