"""The pooling runner behind the OpenAI-compatible server: /v1/embeddings through the official
`openai` SDK (floats and base64, the same vectors as the offline LLM.embed), /score, /rerank (and
their /v1, /v2 paths) as cosine similarities, and 400s with OpenAI's error body for what this
runner does not serve."""

from __future__ import annotations

import base64
import struct

import httpx
import openai
import pytest

from splitserve import LLM
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts a server

ARGS = ["--runner", "pooling", "--dtype", "float32", "--max-model-len", "256", "--disable-log-requests"]
TEXTS = ["Paris is the capital of France.", "Bananas are yellow.", "The Eiffel tower is in Paris."]


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    with RemoteServer(tiny_chat_model, *ARGS, "--pooler-config", '{"pooling_type": "MEAN"}') as s:
        yield s


@pytest.fixture(scope="module")
def offline(tiny_chat_model):
    llm = LLM(
        tiny_chat_model, runner="pooling", dtype="float32", max_model_len=256, pooler_config={"pooling_type": "MEAN"}
    )
    return [o.outputs.embedding for o in llm.embed(TEXTS, use_tqdm=False)]


def _dot(a, b):
    return sum(x * y for x, y in zip(a, b))


def test_embeddings_through_the_openai_sdk(server, offline):
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    response = client.embeddings.create(model="default", input=TEXTS)
    assert [d.index for d in response.data] == [0, 1, 2]
    for data, expected in zip(response.data, offline):
        assert data.embedding == pytest.approx(expected, abs=1e-5)
    assert response.usage.prompt_tokens == response.usage.total_tokens > len(TEXTS)
    # base64 (the SDK's default when it has numpy; asked for here): little-endian float32
    raw = client.embeddings.with_raw_response.create(model="default", input=TEXTS[0], encoding_format="base64")
    encoded = raw.http_response.json()["data"][0]["embedding"]
    decoded = struct.unpack(f"<{len(offline[0])}f", base64.b64decode(encoded))
    assert list(decoded) == pytest.approx(offline[0], abs=1e-5)
    ids = client.embeddings.create(model="default", input=[[1, 2, 3, 4]]).data[0].embedding
    assert len(ids) == len(offline[0])


def test_score_and_rerank(server, offline):
    score = httpx.post(server.url + "/score", json={"text_1": TEXTS[0], "text_2": TEXTS[1:]}).json()
    assert [d["score"] for d in score["data"]] == pytest.approx([_dot(offline[0], e) for e in offline[1:]], abs=1e-4)
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        body = {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 1}
        answer = httpx.post(server.url + path, json=body).json()
        best = max((1, 2), key=lambda i: _dot(offline[0], offline[i]))
        assert [r["index"] for r in answer["results"]] == [best - 1]
        assert answer["results"][0]["document"]["text"] == TEXTS[best]


@pytest.mark.parametrize(
    "path,body,message",
    [
        ("/v1/embeddings", {"input": "hi", "dimensions": 8}, "matryoshka"),
        ("/v1/embeddings", {"input": []}, "'input' must be"),
        ("/v1/embeddings", {"input": "hi " * 300}, "at most 255"),
        ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "one to one"),
        ("/rerank", {"query": "a", "documents": "b"}, "'documents' must be a list"),
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, "pooling runner"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "pooling runner"),
    ],
)
def test_errors_are_400s(server, path, body, message):
    response = httpx.post(server.url + path, json={"model": "default", **body})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert message in error["message"] and error["type"] == "invalid_request_error"


def test_a_cross_encoder_and_a_classifier_served(tmp_path, smollm_tokenizer):
    """A reranker (one label) answers /score and /rerank with its sigmoid, as LLM.score does
    offline; /classify answers its probabilities; /v1/embeddings is a 400 on it."""
    from tests.parity.test_classification import DOCUMENTS, QUERY, make_classifier

    path = make_classifier(str(tmp_path / "reranker"), smollm_tokenizer, 1)
    offline = [o.outputs.score for o in LLM(path, dtype="float32", max_model_len=256).score(QUERY, DOCUMENTS)]
    with RemoteServer(path, "--dtype", "float32", "--max-model-len", "256", "--disable-log-requests") as s:
        score = httpx.post(f"{s.url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS}, timeout=60).json()
        assert [d["score"] for d in score["data"]] == pytest.approx(offline, abs=1e-5)
        rerank = httpx.post(f"{s.url}/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS}, timeout=60).json()
        assert [r["index"] for r in rerank["results"]] == sorted(range(3), key=lambda i: -offline[i])
        classify = httpx.post(f"{s.url}/classify", json={"input": [QUERY, "Berlin"]}, timeout=60).json()
        assert [len(d["probs"]) for d in classify["data"]] == [1, 1] and classify["data"][0]["label"] == "LABEL_0"
        refused = httpx.post(f"{s.url}/v1/embeddings", json={"input": "x"}, timeout=60)
        assert refused.status_code == 400 and "classification model" in refused.json()["error"]["message"]
