"""LoRA adapters through the OpenAI server: the adapter is chosen by the `model` field, /v1/models
lists adapters with their parent, adapters load and unload at run time (seen by every API worker),
unknown adapters are a 404 like unknown models, and a PD deployment serves an adapter's tokens."""

from __future__ import annotations

import httpx
import openai
import pytest

from splitserve import LLM, LoRARequest, SamplingParams
from tests.helpers.models import make_peft_adapter
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts servers

COMMON = ["--dtype", "float32", "--max-model-len", "256", "--num-gpu-blocks-override", "128", "--disable-log-requests"]
LORA = ["--enable-lora", "--max-loras", "2", "--max-lora-rank", "8"]
PROMPT = "The capital of France is"
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def adapters(tiny_chat_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("served_lora")
    return {
        "sql": make_peft_adapter(tiny_chat_model, str(root / "sql"), PROJECTIONS, r=8, seed=3),
        "chat": make_peft_adapter(tiny_chat_model, str(root / "chat"), ["q_proj", "v_proj"], r=4, seed=4),
    }


@pytest.fixture(scope="module")
def expected(tiny_chat_model, adapters) -> dict[str | None, str]:
    """Each adapter's (and the base model's) greedy completion of PROMPT, from the offline API."""
    llm = LLM(tiny_chat_model, dtype="float32", max_model_len=256, use_tqdm_on_load=False, **_offline_lora())
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    loras = [None, LoRARequest("sql", 1, adapters["sql"]), LoRARequest("chat", 2, adapters["chat"])]
    outs = llm.generate([PROMPT] * 3, params, use_tqdm=False, lora_request=loras)
    texts = {name: out.outputs[0].text for name, out in zip([None, "sql", "chat"], outs)}
    assert len(set(texts.values())) == 3  # the adapters change the output
    llm.llm_engine.shutdown()
    return texts


def _offline_lora() -> dict:
    return dict(enable_lora=True, max_loras=2, max_lora_rank=8, num_gpu_blocks_override=128)


@pytest.fixture(scope="module")
def server(tiny_chat_model, adapters):
    modules = ["--lora-modules", f"sql={adapters['sql']}"]
    with RemoteServer(tiny_chat_model, *COMMON, *LORA, *modules, "--workers", "2") as s:
        yield s


def _complete(url: str, model: str) -> httpx.Response:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    return httpx.post(f"{url}/v1/completions", json=body, timeout=60)


def test_the_model_field_picks_the_adapter(server, expected):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)
    for model, name in (("sql", "sql"), ("default", None)):
        out = client.completions.create(
            model=model, prompt=PROMPT, max_tokens=12, temperature=0, extra_body={"ignore_eos": True}
        )
        assert out.choices[0].text == expected[name]
    stream = client.completions.create(
        model="sql", prompt=PROMPT, max_tokens=12, temperature=0, stream=True, extra_body={"ignore_eos": True}
    )
    assert "".join(chunk.choices[0].text for chunk in stream) == expected["sql"]
    chat = client.chat.completions.create(model="sql", messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    assert chat.model == "sql" and chat.choices[0].message.content is not None


def test_models_lists_adapters_with_their_parent(server, adapters):
    data = httpx.get(f"{server.url}/v1/models", timeout=10).json()["data"]
    base, sql = data[0], next(card for card in data if card["id"] == "sql")
    assert sql["parent"] == base["id"] and sql["root"] == adapters["sql"]


def test_unknown_adapter_is_a_404(server):
    r = _complete(server.url, "no-such-adapter")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    assert "'sql'" in r.json()["error"]["message"]


def test_load_and_unload_at_run_time(server, adapters, expected):
    load = {"lora_name": "chat", "lora_path": adapters["chat"]}
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=60)
    assert r.status_code == 200, r.text
    # Requests land on either API worker: both must know the adapter loaded through one of them.
    for _ in range(6):
        r = _complete(server.url, "chat")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["chat"]
    again = httpx.post(f"{server.url}/v1/load_lora_adapter", json=load, timeout=60)
    assert again.status_code == 200  # the same adapter again: nothing to do
    taken = {"lora_name": "chat", "lora_path": adapters["sql"]}
    r = httpx.post(f"{server.url}/v1/load_lora_adapter", json=taken, timeout=60)
    assert r.status_code == 400 and "already loaded" in r.json()["error"]["message"]
    bad = httpx.post(f"{server.url}/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": "/nowhere"}, timeout=60)
    assert bad.status_code == 400 and "not a directory" in bad.json()["error"]["message"]
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=60)
    assert r.status_code == 200, r.text
    for _ in range(6):
        assert _complete(server.url, "chat").status_code == 404
    r = httpx.post(f"{server.url}/v1/unload_lora_adapter", json={"lora_name": "chat"}, timeout=60)
    assert r.status_code == 404
    assert _complete(server.url, "sql").json()["choices"][0]["text"] == expected["sql"]


def test_lora_routes_need_enable_lora(tiny_chat_model, adapters):
    with RemoteServer(tiny_chat_model, *COMMON) as s:
        r = httpx.post(f"{s.url}/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": adapters["sql"]})
        assert r.status_code == 400 and "--enable-lora" in r.json()["error"]["message"]


def test_pd_deployment_serves_the_adapter(tiny_chat_model, adapters, expected):
    modules = ["--lora-modules", f"sql={adapters['sql']}"]
    with RemoteServer(tiny_chat_model, *COMMON, *LORA, *modules, "--pd", "1p1d") as router:
        r = _complete(router.url, "sql")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["sql"]
        load = {"lora_name": "chat", "lora_path": adapters["chat"]}
        assert httpx.post(f"{router.url}/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
        assert _complete(router.url, "chat").json()["choices"][0]["text"] == expected["chat"]
        assert _complete(router.url, "nope").status_code == 404


def test_pd_instances_with_different_adapters_give_a_clear_error(tiny_chat_model, adapters, expected):
    """Only the prefill instance has the adapter: the decode instance's 404 reaches the client,
    saying that prefill and decode must serve the same adapters; loading it through the router fixes it."""
    modules = ["--lora-modules", f"sql={adapters['sql']}"]
    prefill = RemoteServer(tiny_chat_model, *COMMON, *LORA, *modules, "--pd-role", "prefill", "--kv-lease-seconds", "2")
    decode = RemoteServer(tiny_chat_model, *COMMON, *LORA, "--pd-role", "decode")
    router = RemoteServer(None, "router", "--prefill", prefill.url, "--decode", decode.url)
    try:
        r = _complete(router.url, "sql")
        assert r.status_code == 404, r.text
        message = r.json()["error"]["message"]
        assert "'sql'" in message and "must serve the same model and LoRA adapters" in message
        load = {"lora_name": "sql", "lora_path": adapters["sql"]}
        # The prefill instance has it already (the same path: nothing to do), the decode one loads it.
        assert httpx.post(f"{router.url}/v1/load_lora_adapter", json=load, timeout=60).status_code == 200
        r = _complete(router.url, "sql")
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == expected["sql"]
    finally:
        for server in (router, decode, prefill):
            server.close()
