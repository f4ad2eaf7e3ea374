"""Classification models (`*ForSequenceClassification`) on the pooling runner against transformers'
own: a cross-encoder reranker of one label (LLM.score on (query, document) pairs read together,
the sigmoid of its logit) and a classifier of three labels (LLM.classify, the softmax of its
logits), prompts chunked over several steps and batched; and what such a model refuses."""

from __future__ import annotations

import pytest
import torch
import transformers

from splitserve import LLM, SamplingParams
from splitserve.engine.errors import InvalidRequestError
from splitserve.pooling_params import PoolingParams
from tests.helpers.models import TINY_ARCHS, TINY_CONFIG

COMMON = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=16, use_tqdm_on_load=False)
QUERY = "What is the capital of France?"
DOCUMENTS = [
    "Paris is the capital and largest city of France, on the Seine.",
    "The mitochondria is the powerhouse of the cell.",
    "Berlin",
]


def make_classifier(directory: str, tokenizer, num_labels: int, arch: str = "qwen3") -> str:
    """A tiny random decoder with a classification head, with the whole SmolLM2 vocabulary (text inputs)."""
    config_name, extra = TINY_ARCHS[arch]
    config = getattr(transformers, config_name)(
        **{**TINY_CONFIG, "vocab_size": len(tokenizer)}, **extra, num_labels=num_labels, pad_token_id=0
    )
    if num_labels > 1:
        config.id2label = {i: f"class_{i}" for i in range(num_labels)}
        config.label2id = {v: k for k, v in config.id2label.items()}
    torch.manual_seed(5)
    model = transformers.AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, smollm_tokenizer) -> str:
    return make_classifier(str(tmp_path_factory.mktemp("reranker")), smollm_tokenizer, 1)


@pytest.fixture(scope="module")
def classifier(tmp_path_factory, smollm_tokenizer) -> str:
    return make_classifier(str(tmp_path_factory.mktemp("classifier")), smollm_tokenizer, 3, arch="llama")


def _hf_logits(path: str, ids: list[int]) -> torch.Tensor:
    model = transformers.AutoModelForSequenceClassification.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        return model(input_ids=torch.tensor([ids])).logits[0]


def test_reranker_scores_match_transformers(reranker, smollm_tokenizer):
    llm = LLM(reranker, **COMMON)  # runner auto: a classifier runs the pooling runner
    assert llm.llm_engine.config.model_config.runner_type == "pooling"
    outputs = llm.score(QUERY, DOCUMENTS, use_tqdm=False)
    for document, output in zip(DOCUMENTS, outputs):
        ids = smollm_tokenizer(QUERY, document).input_ids
        assert output.prompt_token_ids == ids  # the pair, encoded as the tokenizer encodes a pair
        expected = torch.sigmoid(_hf_logits(reranker, ids))[0].item()
        assert output.outputs.score == pytest.approx(expected, abs=1e-5)
    # Token ids are joined as they are; many queries against as many documents, pairwise.
    pairs = llm.score([{"prompt_token_ids": [5, 6, 7]}] * 2, [{"prompt_token_ids": [8, 9]}, {"prompt_token_ids": [9]}])
    assert pairs[1].prompt_token_ids == [5, 6, 7, 9]
    expected = torch.sigmoid(_hf_logits(reranker, [5, 6, 7, 9]))[0].item()
    assert pairs[1].outputs.score == pytest.approx(expected, abs=1e-5)


def test_classifier_probabilities_match_transformers(classifier):
    llm = LLM(classifier, task="classify", **COMMON)
    prompts = [list(range(3, 60)), [7, 8], [11] * 20]
    outputs = llm.classify([{"prompt_token_ids": p} for p in prompts], use_tqdm=False)
    for ids, output in zip(prompts, outputs):
        assert output.outputs.num_classes == 3
        expected = torch.softmax(_hf_logits(classifier, ids), -1)
        torch.testing.assert_close(torch.tensor(output.outputs.probs), expected, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cross-encoder of one label"):
        llm.score("a", "b", use_tqdm=False)
    with pytest.raises(ValueError, match="classification model"):
        llm.embed("a", use_tqdm=False)
    with pytest.raises(InvalidRequestError, match="dimensions"):
        llm.llm_engine.processor.process_pooling("a", PoolingParams(dimensions=2))
    with pytest.raises(InvalidRequestError, match="pooling runner"):
        llm.generate("a", SamplingParams(max_tokens=2), use_tqdm=False)


def test_a_classifier_cannot_run_the_generate_runner(classifier):
    with pytest.raises(ValueError, match="cannot generate"):
        LLM(classifier, runner="generate", **COMMON)
