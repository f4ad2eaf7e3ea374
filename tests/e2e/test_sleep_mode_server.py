"""Sleep mode through the server (vLLM's routes): POST /sleep?level=1|2, GET /is_sleeping, requests
refused with a 503 while asleep, POST /wake_up, the same greedy answer after, POST
/reset_prefix_cache, and a 400 for a bad level; POST /update_weights (and SGLang's
/update_weights_from_disk): another checkpoint's answer, then the first one's again."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.models import perturbed_copy
from tests.helpers.server import RemoteServer

pytestmark = pytest.mark.slow  # starts a server

BODY = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def server(tiny_models):
    with RemoteServer(tiny_models["llama"], "--dtype", "float32", "--disable-log-requests", "--workers", "2") as s:
        yield s


def test_sleep_wake_and_the_same_answer(server):
    url = server.url
    before = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    for level in (1, 2):
        assert httpx.post(f"{url}/sleep", params={"level": level}, timeout=60).json() == {
            "is_sleeping": True,
            "level": level,
        }
        assert httpx.get(f"{url}/is_sleeping", timeout=60).json()["is_sleeping"] is True
        refused = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60)
        assert refused.status_code == 503 and "asleep" in refused.json()["error"]["message"]
        assert httpx.post(f"{url}/wake_up", timeout=60).json() == {"is_sleeping": False, "level": 0}
        after = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
        assert after == before
    assert httpx.post(f"{url}/reset_prefix_cache", timeout=60).status_code == 200
    bad = httpx.post(f"{url}/sleep", params={"level": 3}, timeout=60)
    assert bad.status_code == 400 and "level" in bad.json()["error"]["message"]


def test_update_weights_from_disk(server, tiny_models, tmp_path):
    url = server.url
    before = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    updated = perturbed_copy(tiny_models["llama"], str(tmp_path / "step1"), seed=3)
    answer = httpx.post(f"{url}/update_weights", json={"model_path": updated}, timeout=120)
    assert answer.status_code == 200 and answer.json()["success"] is True
    after = httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"]
    assert after != before
    back = httpx.post(f"{url}/update_weights_from_disk", json={"model_path": tiny_models["llama"]}, timeout=120)
    assert back.status_code == 200
    assert httpx.post(f"{url}/v1/completions", json=BODY, timeout=60).json()["choices"][0]["text"] == before
    missing = httpx.post(f"{url}/update_weights", json={"model_path": str(tmp_path / "none")}, timeout=60)
    assert missing.status_code == 400 and "does not exist" in missing.json()["error"]["message"]
    assert httpx.post(f"{url}/update_weights", json={"path": updated}, timeout=60).status_code == 400
