"""Images through the OpenAI-compatible server, started as the FastDeploy document starts it
(`python -m splitserve.entrypoints.openai.api_server --enable-mm`), on a tiny random LLaVA: the
official `openai` client's image_url parts as data URIs, files under --allowed-local-media-path and
http URLs give the offline engine's greedy answer, whole and streamed; /tokenize counts an image's
tokens; and every bad image is a 400 naming its part, the server serving on after it."""

from __future__ import annotations

import base64
import http.server
import io
import threading

import httpx
import openai
import pytest

from splitserve import LLM, BeamSearchParams, SamplingParams
from splitserve.multimodal import chat as chat_images
from splitserve.multimodal.media import encode_data_uri
from splitserve.tokenizer import apply_chat_template
from tests.helpers.multimodal import LLAVA_IMAGE_TOKENS, random_image
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts a server

QUESTION = "What is in this picture?"
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("media")
    random_image(11).save(directory / "eleven.png")
    random_image(12).save(directory / "twelve.gif")
    return directory


@pytest.fixture(scope="module")
def server(tiny_llava, media_dir):
    args = ["--enable-mm", "--dtype", "float32", "--max-num-batched-tokens", "32", "--disable-log-requests"]
    args += ["--allowed-local-media-path", str(media_dir), "--limit-mm-per-prompt", '{"image": 2}']
    with RemoteServer(tiny_llava, *args, entry_point="api_server") as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none")


@pytest.fixture(scope="module")
def image_server(media_dir):
    """A loopback http server of the media directory."""
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(media_dir))  # noqa: E731
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def messages(*urls: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": url}} for url in urls]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


def ask(client, *urls: str, stream: bool = False) -> str:
    out = client.chat.completions.create(
        model="default", messages=messages(*urls), max_tokens=MAX_TOKENS, temperature=0.0, stream=stream
    )
    if not stream:
        return out.choices[0].message.content
    return "".join(chunk.choices[0].delta.content or "" for chunk in out if chunk.choices)


@pytest.fixture(scope="module")
def offline_answers(tiny_llava) -> dict:
    """The offline engine's greedy chat answer about image 11, and its beam search (2 beams) of the
    same rendered prompt with image 11, then 13."""
    llm = LLM(tiny_llava, dtype="float32", use_tqdm_on_load=False)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    answer = llm.chat(messages(encode_data_uri(random_image(11))), params, use_tqdm=False)[0].outputs[0].text
    beams = []
    for seed in (11, 13):
        conversation, images = llm._chat_images(messages(encode_data_uri(random_image(seed))), None)
        text = apply_chat_template(llm.get_tokenizer(), conversation, None, True)
        beam = BeamSearchParams(beam_width=2, max_tokens=4, ignore_eos=True)
        found = llm.beam_search([chat_images.rendered_prompt(text, images)], beam)[0].sequences
        beams.append([seq.text for seq in found])
    llm.llm_engine.shutdown()
    return {"greedy": answer, "beams": beams}


@pytest.fixture(scope="module")
def offline_answer(offline_answers) -> str:
    return offline_answers["greedy"]


def test_beam_search_searches_with_the_image(server, offline_answers):
    """use_beam_search on a chat with an image: each step's one-token requests carry the image."""
    for seed, expected in zip((11, 13), offline_answers["beams"]):
        body = {"model": "default", "messages": messages(encode_data_uri(random_image(seed))), "max_tokens": 4}
        body.update(use_beam_search=True, n=2, ignore_eos=True)
        r = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert [c["message"]["content"] for c in r.json()["choices"]] == expected
    assert offline_answers["beams"][0] != offline_answers["beams"][1]


def test_image_urls_of_every_kind_give_the_offline_answer(client, media_dir, image_server, offline_answer):
    data_uri = encode_data_uri(random_image(11))
    assert ask(client, data_uri) == offline_answer
    assert ask(client, data_uri, stream=True) == offline_answer
    assert ask(client, f"file://{media_dir / 'eleven.png'}") == offline_answer
    assert ask(client, f"{image_server}/eleven.png") == offline_answer
    other = ask(client, encode_data_uri(random_image(13)))
    assert isinstance(other, str)


def test_responses_and_anthropic_messages_take_images(server, offline_answer):
    uri = encode_data_uri(random_image(11))
    content = [{"type": "input_image", "image_url": uri}, {"type": "input_text", "text": QUESTION}]
    body = {"model": "default", "input": [{"role": "user", "content": content}], "max_output_tokens": MAX_TOKENS}
    response = httpx.post(server.url + "/v1/responses", json={**body, "temperature": 0.0}, timeout=60).json()
    assert response["output"][0]["content"][0]["text"] == offline_answer
    source = {"type": "base64", "media_type": "image/png", "data": uri.split(",", 1)[1]}
    blocks = [{"type": "image", "source": source}, {"type": "text", "text": QUESTION}]
    body = {
        "model": "default",
        "max_tokens": MAX_TOKENS,
        "temperature": 0.0,
        "messages": [{"role": "user", "content": blocks}],
    }
    message = httpx.post(server.url + "/v1/messages", json=body, timeout=60).json()
    assert message["content"][0]["text"] == offline_answer


def test_tokenize_counts_the_image_tokens(server):
    body = {"model": "default", "messages": messages(encode_data_uri(random_image(11)))}
    with_image = httpx.post(server.url + "/tokenize", json=body).json()
    text_only = httpx.post(server.url + "/tokenize", json={**body, "messages": messages()}).json()
    assert with_image["count"] - text_only["count"] == LLAVA_IMAGE_TOKENS + 1  # the image's tokens and its newline


def _encoded(format: str, keep: int | None = None) -> str:
    buffer = io.BytesIO()
    random_image(3).save(buffer, format=format)
    return f"data:image/{format.lower()};base64," + base64.b64encode(buffer.getvalue()[:keep]).decode()


def _gif_uri() -> str:
    return _encoded("GIF")


def _truncated_png_uri() -> str:
    return _encoded("PNG", keep=120)


@pytest.mark.parametrize(
    "urls, words",
    [
        ([_truncated_png_uri()], "decoded"),
        (["data:image/png;base64,@@@"], "base64"),
        ([_gif_uri()], "GIF is not supported"),
        (["file:///etc/hostname"], "outside the allowed local media path"),
        (["http://127.0.0.1:9/none.png"], "failed"),
    ],
)
def test_a_bad_image_is_a_400_naming_its_part(client, server, urls, words, offline_answer):
    with pytest.raises(openai.BadRequestError) as info:
        ask(client, *urls)
    error = info.value.body
    assert words in error["message"] and error["param"] == "messages[0].content[0]"
    assert ask(client, encode_data_uri(random_image(11))) == offline_answer  # served on, unaffected


def test_more_images_than_the_limit_and_a_missing_file(client, media_dir):
    uri = encode_data_uri(random_image(1))
    with pytest.raises(openai.BadRequestError, match="at most 2 per prompt"):
        ask(client, uri, uri, uri)
    with pytest.raises(openai.BadRequestError, match="cannot be read"):
        ask(client, f"file://{media_dir / 'missing.png'}")


def test_pd_1p1d_gives_the_mixed_answer(tiny_qwen2_vl):
    """`serve --pd 1p1d` with Qwen2-VL: the prefill instance loads and encodes the image and tells the
    decode instance where it lies (no pixels); the decode instance pulls the KV and continues with
    M-RoPE's offset, answering as one instance does."""
    from tests.helpers.pd import COMMON as PD_COMMON

    model = tiny_qwen2_vl
    urls = [encode_data_uri(random_image(31)), encode_data_uri(random_image(32, (40, 40)))]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    llm = LLM(model, dtype="float32", use_tqdm_on_load=False)
    expected = [llm.chat(messages(url), params, use_tqdm=False)[0].outputs[0].text for url in urls]
    del llm
    with RemoteServer(model, *PD_COMMON, "--pd", "1p1d") as router:
        pd_client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)
        assert [ask(pd_client, url) for url in urls] == expected
        assert ask(pd_client, urls[0], stream=True) == expected[0]
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        assert "splitserve_router:fallbacks_total 0.0" in metrics
