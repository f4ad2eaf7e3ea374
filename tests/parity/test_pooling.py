"""The pooling runner (embeddings) against transformers' hidden states on tiny random models:
LAST, MEAN and CLS pooling of the final (normed) hidden states, normalized or not, `dimensions`,
prompts chunked over several steps and batched together, a sentence-transformers model's own
pooling config, score's cosine similarities, and the errors of each runner's wrong requests."""

from __future__ import annotations

import json
import os

import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from splitserve.engine.errors import InvalidRequestError
from splitserve.pooling_params import PoolerConfig, PoolingParams

PROMPTS = [[1, 5, 9, 300, 20], list(range(3, 60)), [7] * 33, [11]]
COMMON = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, use_tqdm_on_load=False)


def _reference(path: str, ids: list[int], kind: str, normalize: bool = True, dims: int | None = None):
    model = transformers.AutoModel.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        hidden = model(input_ids=torch.tensor([ids])).last_hidden_state[0]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[kind][:dims]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


@pytest.mark.parametrize("kind", ["LAST", "MEAN", "CLS"])
def test_embeddings_match_transformers(tiny_models, kind):
    """Prompts of 1 to 57 tokens, chunked 16 tokens a step and batched four at a time."""
    path = tiny_models["qwen3"]
    llm = LLM(path, runner="pooling", pooler_config={"pooling_type": kind}, **COMMON)
    outputs = llm.embed([{"prompt_token_ids": p} for p in PROMPTS], use_tqdm=False)
    for ids, output in zip(PROMPTS, outputs):
        assert output.prompt_token_ids == ids and output.finished
        expected = _reference(path, ids, kind)
        torch.testing.assert_close(torch.tensor(output.outputs.embedding), expected, atol=1e-4, rtol=1e-4)
    assert llm.llm_engine.config.cache_config.enable_prefix_caching == (kind == "LAST")


def test_normalize_dimensions_and_text_prompts(tiny_models):
    path = tiny_models["llama"]
    llm = LLM(path, task="embed", pooler_config={"matryoshka_dimensions": [16, 32]}, **COMMON)
    raw, cut = llm.embed(
        [{"prompt_token_ids": PROMPTS[1]}] * 2,
        [PoolingParams(normalize=False), PoolingParams(dimensions=16)],
        use_tqdm=False,
    )
    torch.testing.assert_close(torch.tensor(raw.outputs.embedding), _reference(path, PROMPTS[1], "LAST", False))
    assert cut.outputs.hidden_size == 16
    torch.testing.assert_close(
        torch.tensor(cut.outputs.embedding), _reference(path, PROMPTS[1], "LAST", dims=16), atol=1e-4, rtol=1e-4
    )
    with pytest.raises(InvalidRequestError, match="dimensions must be one of"):
        llm.embed({"prompt_token_ids": [5, 6]}, PoolingParams(dimensions=20), use_tqdm=False)


def test_text_prompts_and_score_is_the_cosine_of_embeddings(tiny_chat_model):
    llm = LLM(tiny_chat_model, runner="pooling", **COMMON)
    (text,) = llm.embed("Paris is the capital of France", use_tqdm=False)
    ids = llm.get_tokenizer()("Paris is the capital of France").input_ids
    expected = _reference(tiny_chat_model, ids, "LAST")
    torch.testing.assert_close(torch.tensor(text.outputs.embedding), expected, atol=1e-4, rtol=1e-4)
    query, docs = "What is the capital of France?", ["Paris is in France.", "Bananas are yellow.", "Rome"]
    scores = llm.score(query, docs, use_tqdm=False)
    embeddings = [torch.tensor(o.outputs.embedding) for o in llm.embed([query, *docs], use_tqdm=False)]
    assert len(scores) == len(docs)
    for output, emb in zip(scores, embeddings[1:]):
        assert output.outputs.score == pytest.approx(float(torch.dot(embeddings[0], emb)), abs=1e-5)
    pairwise = llm.score(docs[:2], docs[1:], use_tqdm=False)
    assert pairwise[0].outputs.score == pytest.approx(float(torch.dot(embeddings[1], embeddings[2])), abs=1e-5)
    with pytest.raises(ValueError, match="one to one"):
        llm.score(docs[:2], docs, use_tqdm=False)


def test_each_runner_refuses_the_others_requests(tiny_models):
    pooling = LLM(tiny_models["llama"], runner="pooling", max_model_len=64, **COMMON)
    with pytest.raises(InvalidRequestError, match="pooling runner"):
        pooling.generate({"prompt_token_ids": [5, 6]}, SamplingParams(max_tokens=2), use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="at most 63"):
        pooling.embed({"prompt_token_ids": [5] * 64}, use_tqdm=False)
    generate = LLM(tiny_models["llama"], **COMMON)
    with pytest.raises(InvalidRequestError, match="--runner pooling"):
        generate.embed({"prompt_token_ids": [5, 6]}, use_tqdm=False)
    with pytest.raises(ValueError, match="pooling_type must be one of"):
        LLM(tiny_models["llama"], runner="pooling", pooler_config={"pooling_type": "MAX"}, **COMMON)
    with pytest.raises(ValueError, match="--pooler-config is for the pooling runner"):
        LLM(tiny_models["llama"], pooler_config={"pooling_type": "MEAN"}, **COMMON)


def test_sentence_transformers_files_set_the_pooling(tmp_path):
    """modules.json + 1_Pooling/config.json (mean tokens, a Normalize module) as sentence-transformers writes them."""
    (tmp_path / "1_Pooling").mkdir()
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"},
    ]
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    config = PoolerConfig.resolve(str(tmp_path), object(), None)
    assert (config.pooling_type, config.normalize) == ("MEAN", True)
    os.remove(tmp_path / "modules.json")
    assert PoolerConfig.resolve(str(tmp_path), object(), '{"normalize": false}') == PoolerConfig("LAST", False)
