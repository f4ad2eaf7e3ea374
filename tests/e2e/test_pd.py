"""Prefill/decode disaggregation end to end: real instances and routers on loopback.

Greedy outputs through the router must be token for token those of a single mixed engine; faults
(a killed prefill or decode engine, client aborts) must end every request and leak no block."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import pytest

from splitserve import LLM, BeamSearchParams, SamplingParams
from tests.helpers.otlp import EXPORTER_ENV, OtlpCollector
from tests.helpers.pd import COMMON, idle, wait_for
from tests.helpers.server import RemoteServer, alive, engine_pid, free_port, metric, read_stream

pytestmark = pytest.mark.slow  # starts PD deployments (prefill, decode, router)

PROMPTS = [
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a dragon who " * 3,
    "def fibonacci(n):",
]


@pytest.fixture(scope="module")
def offline(tiny_chat_model) -> LLM:
    return LLM(tiny_chat_model, dtype="float32", max_model_len=512, use_tqdm_on_load=False)


def _expected(offline: LLM, prompt: str, n: int = 12) -> str:
    return offline.generate([prompt], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)[0].outputs[0].text


def _stream_text(url: str, body: dict) -> str:
    text = ""
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                text += json.loads(line[6:])["choices"][0]["text"]
    return text


def _check_parity(url: str, offline: LLM) -> None:
    for prompt in PROMPTS:
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        expected = _expected(offline, prompt)
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"] == expected
        assert _stream_text(url, body) == expected


# --- one command ------------------------------------------------------------------------------
def test_one_command_1p1d_matches_a_mixed_instance(tiny_chat_model, offline):
    """Also with tracing on: one request's spans, exported over OTLP by the router and both
    instances, form one trace with the phases of each instance under the router's calls."""
    collector = OtlpCollector()
    tracing = ("--otlp-traces-endpoint", collector.endpoint)
    with collector, RemoteServer(tiny_chat_model, *COMMON, "--pd", "1p1d", *tracing, env=EXPORTER_ENV) as router:
        _check_parity(router.url, offline)
        _check_trace(router.url, collector)
        client = openai.OpenAI(base_url=f"{router.url}/v1", api_key="none", max_retries=0)
        chat = client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0
        )
        direct = (
            offline.chat(
                [{"role": "user", "content": "Hi"}], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False
            )[0]
            .outputs[0]
            .text
        )
        assert chat.choices[0].message.content == direct
        # vLLM's native /generate through the router: prefill, KV transfer, decode, as for completions.
        native = httpx.post(
            f"{router.url}/generate", json={"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}, timeout=120
        ).json()
        assert native["text"] == [PROMPTS[0] + _expected(offline, PROMPTS[0])]
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        assert 'role="prefill"' in metrics and "splitserve_router:fallbacks_total 0.0" in metrics


def test_one_command_2p2d_matches_a_mixed_instance(tiny_chat_model, offline):
    # With overlap scheduling in every engine (the GPU default; off on CPU), against a plain instance.
    with RemoteServer(
        tiny_chat_model, *COMMON, "--pd", "2p2d", "--policy", "least_load", "--async-scheduling"
    ) as router:
        _check_parity(router.url, offline)


def test_one_command_1p1d_with_two_ranks_per_instance(tiny_chat_model, offline):
    """Prefill and decode instances of tensor-parallel size 2: each decode rank pulls its own KV
    heads from the prefill rank of the same index, and the tokens are a mixed instance's."""
    with RemoteServer(tiny_chat_model, *COMMON, "--pd", "1p1d", "--tensor-parallel-size", "2") as router:
        _check_parity(router.url, offline)
        metrics = httpx.get(f"{router.url}/metrics", timeout=10).text
        assert "splitserve_router:fallbacks_total 0.0" in metrics


def test_one_command_1p1d_serves_an_moe_model_with_expert_parallelism(tiny_moe_chat_model):
    """An ERNIE 4.5 MoE, each instance's experts split over two ranks (--enable-expert-parallel):
    through prefill, the KV transfer and decode, the tokens of a mixed single-rank instance."""
    offline = LLM(tiny_moe_chat_model, dtype="float32", max_model_len=512, use_tqdm_on_load=False)
    args = ("--pd", "1p1d", "--tensor-parallel-size", "2", "--enable-expert-parallel")
    with RemoteServer(tiny_moe_chat_model, *COMMON, *args) as router:
        _check_parity(router.url, offline)


def _check_trace(url: str, collector: OtlpCollector) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0, "min_tokens": 6}
    assert httpx.post(f"{url}/v1/chat/completions", json=body, headers={"X-Request-Id": "traced"}).status_code == 200
    spans = collector.wait_for_trace("traced", 10)
    by_id = {s.span_id: s for s in spans}

    def tree(span) -> tuple:
        children = sorted((tree(s) for s in spans if s.parent_span_id == span.span_id), key=str)
        return (span.service, span.name, *children)

    [root] = [s for s in spans if not s.parent_span_id]
    assert tree(root) == (
        "splitserve-router",
        "POST /v1/chat/completions",
        (
            "splitserve-router",
            "decode",
            (
                "splitserve-decode",
                "llm_request",
                ("splitserve-decode", "decode"),
                ("splitserve-decode", "kv_transfer"),
                ("splitserve-decode", "queue"),
            ),
        ),
        (
            "splitserve-router",
            "prefill",
            ("splitserve-prefill", "llm_request", ("splitserve-prefill", "prefill"), ("splitserve-prefill", "queue")),
        ),
    )
    decode_request = next(s for s in spans if s.name == "llm_request" and s.service == "splitserve-decode")
    assert decode_request.attributes["gen_ai.usage.completion_tokens"] == 6
    for span in spans:  # every child lies within its parent (one clock for the host's processes)
        parent = by_id.get(span.parent_span_id)
        if parent is not None:
            assert parent.start_ns - 1_000_000 <= span.start_ns <= span.end_ns <= parent.end_ns + 1_000_000


# --- instances started by hand, with a separate router ----------------------------------------
def _cluster(model: str, prefill_flags: list[list[str]], router_flags: list[str]):
    """Two prefill instances (each with its own extra flags), one decode instance, and a router."""
    prefill = [RemoteServer(model, *COMMON, "--pd-role", "prefill", *flags) for flags in prefill_flags]
    decode = RemoteServer(model, *COMMON, "--pd-role", "decode")
    router_args = [*sum((["--prefill", p.url] for p in prefill), []), "--decode", decode.url]
    router = RemoteServer(None, "router", *router_args, "--health-interval", "0.5", *router_flags)
    return prefill, decode, router


@contextlib.contextmanager
def _short_lease_cluster(model: str):
    """Two prefill instances, one decode instance (short leases), and a router."""
    prefill, decode, router = _cluster(model, [["--kv-lease-seconds", "3"]] * 2, [])
    try:
        yield prefill, decode, router
    finally:
        for server in (router, decode, *prefill):
            server.close()


@pytest.fixture
def pd_cluster(tiny_chat_model):
    """A cluster of its own, for a test that kills one of its engines."""
    with _short_lease_cluster(tiny_chat_model) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shared_pd_cluster(tiny_chat_model):
    """One cluster for the tests that leave it as they found it (starting one takes about 12 s):
    they read counters as differences and wait until every instance is idle again."""
    with _short_lease_cluster(tiny_chat_model) as cluster:
        yield cluster


def test_cache_aware_routing_follows_the_instances_kv_events(tiny_chat_model):
    """--policy cache_aware: each prefill instance publishes its KV cache events; a prompt whose
    blocks one instance holds goes there every time (its prefix-cache hits grow, the other's do
    not), a chat prompt too (tokenized by an instance's /tokenize), and a new prompt goes by load."""
    events = [
        ["--kv-events-config", json.dumps({"enable_kv_cache_events": True, "publisher": "zmq",
                                           "endpoint": f"tcp://*:{free_port()}"})]
        for _ in range(2)
    ]  # fmt: skip
    prefill, decode, router = _cluster(tiny_chat_model, events, ["--policy", "cache_aware"])
    try:
        wait_for(lambda: httpx.get(f"{router.url}/health", timeout=5).status_code == 200, what="the router")
        time.sleep(1.0)  # the router subscribes to the events at its first health checks
        prompt = list(range(10, 10 + 80))  # five full blocks of 16
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=120).status_code == 200
        time.sleep(0.5)  # the instance's BlockStored reaches the router
        hits = [metric(p, "splitserve:prefix_cache_hits_total") for p in prefill]
        for _ in range(4):  # round robin would alternate; the blocks are on one instance
            assert httpx.post(f"{router.url}/v1/completions", json=body, timeout=120).status_code == 200
        gained = [metric(p, "splitserve:prefix_cache_hits_total") - h for p, h in zip(prefill, hits)]
        assert sorted(gained) == [0, 4 * 64], gained  # 4 of the 5 blocks: the last token is always computed
        chat = {"messages": [{"role": "user", "content": "Tell me a long story about a dragon " * 6}], "max_tokens": 2}
        assert httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=120).status_code == 200
        time.sleep(0.5)
        hits = [metric(p, "splitserve:prefix_cache_hits_total") for p in prefill]
        assert httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=120).status_code == 200
        gained = [metric(p, "splitserve:prefix_cache_hits_total") - h for p, h in zip(prefill, hits)]
        assert min(gained) == 0 and max(gained) >= 16, gained
    finally:
        for server in (router, decode, *prefill):
            server.close()


def test_prefix_cache_hits_pull_only_missing_blocks(shared_pd_cluster, offline):
    prefill, decode, router = shared_pd_cluster
    prompt = "A prompt no other test of the shared cluster sends, long enough to fill some blocks. " * 3
    body = {"prompt": prompt, "max_tokens": 4, "temperature": 0}
    start = metric(decode.url, "splitserve:kv_transfer_blocks_received_total")
    first = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    received = metric(decode.url, "splitserve:kv_transfer_blocks_received_total") - start
    assert received > 0
    second = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120).json()["choices"][0]["text"]
    # The decode instance now holds the prompt's full blocks: nothing (or only the partial tail) moves.
    assert metric(decode.url, "splitserve:kv_transfer_blocks_received_total") - start - received < received
    assert first == second == _expected(offline, prompt, 4)


def test_beam_search_and_best_of_through_the_router(shared_pd_cluster, offline):
    """A beam search runs whole on a decode instance and answers as a mixed engine does; a best_of
    > n request's prefill leases one KV pull per sample and every one is pulled: nothing is left to
    expire on the prefill instances."""
    prefill, decode, router = shared_pd_cluster
    counters = ("kv_transfer_lease_expiries_total", "kv_transfer_leases_active")
    before = {(p.url, name): metric(p.url, f"splitserve:{name}") for p in prefill for name in counters}
    failures = metric(decode.url, "splitserve:kv_transfer_pull_failures_total")
    prompt_ids = [5, 6, 7, 8]
    beam = {"prompt": prompt_ids, "max_tokens": 6, "temperature": 0, "use_beam_search": True, "n": 2, "best_of": 3}
    r = httpx.post(f"{router.url}/v1/completions", json={**beam, "return_token_ids": True}, timeout=120)
    assert r.status_code == 200, r.text
    expected = offline.beam_search([{"prompt_token_ids": prompt_ids}], BeamSearchParams(beam_width=3, max_tokens=6))
    assert [c["token_ids"] for c in r.json()["choices"]] == [s.tokens[4:] for s in expected[0].sequences[:2]]
    sampled = {
        "prompt": PROMPTS[0],
        "max_tokens": 4,
        "temperature": 1.0,
        "n": 1,
        "best_of": 3,
        "seed": 3,
        "ignore_eos": True,
    }
    r = httpx.post(f"{router.url}/v1/completions", json=sampled, timeout=120)
    assert r.status_code == 200 and len(r.json()["choices"]) == 1 and r.json()["usage"]["completion_tokens"] == 12
    time.sleep(4)  # past the prefill instances' 3 s leases: an unpulled one would have expired
    for instance in prefill:
        for name in counters:
            assert metric(instance.url, f"splitserve:{name}") == before[instance.url, name], name
    assert metric(decode.url, "splitserve:kv_transfer_pull_failures_total") == failures


def test_prompt_logprobs_and_echo_through_the_router(shared_pd_cluster, offline):
    """A request that scores its prompt (evaluation harnesses: prompt_logprobs, echo with logprobs)
    gets the prompt's logprobs through the router, as a mixed engine computes them."""
    prefill, decode, router = shared_pd_cluster
    prompt = PROMPTS[1]
    reference = offline.generate(
        [prompt], SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=0, logprobs=0), use_tqdm=False
    )[0]
    expected = [None] + [max(d.values(), key=lambda lp: lp.logprob).logprob for d in reference.prompt_logprobs[1:]]
    body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{router.url}/v1/completions", json={**body, "prompt_logprobs": 0}, timeout=120)
    assert r.status_code == 200, r.text
    got = r.json()["choices"][0]["prompt_logprobs"]
    assert len(got) == len(expected) and got[0] is None
    for entry, want in zip(got[1:], expected[1:]):
        assert max(v["logprob"] for v in entry.values()) == pytest.approx(want, abs=1e-4)
    r = httpx.post(f"{router.url}/v1/completions", json={**body, "echo": True, "logprobs": 0}, timeout=120)
    assert r.status_code == 200, r.text
    logprobs = r.json()["choices"][0]["logprobs"]
    num_prompt = len(reference.prompt_token_ids)
    assert len(logprobs["token_logprobs"]) == num_prompt + 2 and logprobs["token_logprobs"][0] is None
    assert logprobs["token_logprobs"][1:num_prompt] == pytest.approx(expected[1:], abs=1e-4)


def test_pd_instances_sleep_and_wake_and_answer_as_before(shared_pd_cluster, offline):
    """Sleep mode on PD instances: the router's /sleep puts every idle prefill and decode instance
    to sleep (its KV connector lets go of the released cache), /wake_up wakes them with a new cache
    that pulls and leases use, and the router's answers are what a mixed engine gives."""
    prefill, decode, router = shared_pd_cluster
    instances = [*prefill, decode]
    for level in (1, 2):
        wait_for(lambda: all(idle(i.url) for i in instances), 30, "idle instances (leases ended)")
        answer = httpx.post(f"{router.url}/sleep", params={"level": level}, timeout=60)  # every instance
        assert answer.status_code == 200 and answer.json() == {"is_sleeping": True, "level": level}, answer.text
        for instance in instances:
            assert httpx.get(f"{instance.url}/is_sleeping", timeout=60).json()["is_sleeping"] is True
        assert httpx.post(f"{router.url}/wake_up", timeout=60).json()["is_sleeping"] is False
        assert httpx.get(f"{router.url}/is_sleeping", timeout=60).json()["is_sleeping"] is False
        body = {"prompt": PROMPTS[2], "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == _expected(offline, PROMPTS[2]), r.text
    wait_for(lambda: all(idle(i.url) for i in instances), 30, "idle instances after the requests")


def test_responses_api_through_the_router(shared_pd_cluster):
    """/v1/responses at the router: the answer of the same chat request through prefill and
    decode, stored, continued by previous_response_id, streamed."""
    prefill, decode, router = shared_pd_cluster
    chat = {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 8, "temperature": 0}
    r = httpx.post(f"{router.url}/v1/chat/completions", json=chat, timeout=120)
    expected = r.json()["choices"][0]["message"]["content"]
    body = {"input": "Name a colour.", "max_output_tokens": 8, "temperature": 0}
    r = httpx.post(f"{router.url}/v1/responses", json=body, timeout=120)
    assert r.status_code == 200, r.text
    first = r.json()
    assert [i for i in first["output"] if i["type"] == "message"][0]["content"][0]["text"] == expected
    assert first["model"] == httpx.get(f"{router.url}/v1/models", timeout=30).json()["data"][0]["id"]
    follow = {"input": "Another one.", "previous_response_id": first["id"], "max_output_tokens": 4, "stream": True}
    r = httpx.post(f"{router.url}/v1/responses", json=follow, timeout=120)
    assert r.status_code == 200 and r.text.rstrip().splitlines()[0] == "event: response.created", r.text
    assert "event: response.completed" in r.text or "event: response.incomplete" in r.text, r.text
    instances = [*prefill, decode]
    wait_for(lambda: all(idle(i.url) for i in instances), 30, "idle instances after the responses")


def test_killed_prefill_engine_is_survived(pd_cluster, offline):
    prefill, decode, router = pd_cluster
    os.kill(engine_pid(prefill[0]), signal.SIGKILL)
    for prompt in PROMPTS:  # retried on the other prefill instance, or decoded from scratch
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        r = httpx.post(f"{router.url}/v1/completions", json=body, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == _expected(offline, prompt)


def test_killed_decode_engine_fails_requests_and_frees_prefill_blocks(pd_cluster):
    prefill, decode, router = pd_cluster
    os.kill(engine_pid(decode), signal.SIGKILL)
    r = httpx.post(f"{router.url}/v1/completions", json={"prompt": PROMPTS[0], "max_tokens": 8}, timeout=60)
    assert r.status_code >= 500 and r.json()["error"]["message"]
    # Whatever the prefill side leased for the dead decode instance expires and is freed.
    for p in prefill:
        wait_for(lambda url=p.url: idle(url), what=f"{p.url} to free its blocks")


def test_client_aborts_free_both_sides(shared_pd_cluster):
    prefill, decode, router = shared_pd_cluster
    for _ in range(4):
        with pytest.raises(httpx.TimeoutException):  # 400 tokens take far longer than 0.15 s
            httpx.post(
                f"{router.url}/v1/completions",
                timeout=0.15,
                json={"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True},
            )
    for server in (decode, *prefill):
        wait_for(lambda url=server.url: idle(url), what=f"{server.url} to free its blocks")
    # /abort_requests at the router, by the id the client gave: it reaches every instance. It is sent
    # from the reading thread at the first chunk: a tiny model decodes 400 tokens in about 0.4 s.
    run: dict = {}
    answers: list = []

    def abort_at_first_chunk(n: int) -> None:
        if n == 1:
            answers.append(httpx.post(f"{router.url}/abort_requests", json={"request_ids": ["pd-job"]}, timeout=30))

    body = {"prompt": PROMPTS[1], "max_tokens": 400, "ignore_eos": True}
    read_stream(router.url, body, {"X-Request-Id": "pd-job"}, run, on_chunk=abort_at_first_chunk)
    assert len(answers) == 1 and answers[0].status_code == 200, answers
    assert run["finish"] == "abort" and run["chunks"] < 400
    for server in (decode, *prefill):
        wait_for(lambda url=server.url: idle(url), what=f"{server.url} to free its blocks")


# --- the rank-table environment -----------------------------------------------------------------
def test_rank_table_environment_startup(tmp_path, tiny_chat_model, offline):
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        pytest.skip("needs two CPU cores: one for the prefill instance, one for the decode instance")
    save = tmp_path / "tables"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "splitserve.entrypoints.cli",
            "ranktable",
            "gen",
            "--prefill-server-list",
            str(cores[0]),
            "--decode-server-list",
            str(cores[-1]),
            "--api-server",
            "--server-ip",
            "127.0.0.1",
            "--save-dir",
            str(save),
        ],
        check=True,
    )
    glob_env = {"GLOBAL_RANK_TABLE_FILE_PATH": str(save / "global_ranktable_127.0.0.1.json")}
    ports = [free_port(), free_port()]
    servers = []
    try:
        for device, port in zip((cores[0], cores[-1]), ports):
            env = {
                **glob_env,
                "RANK_TABLE_FILE_PATH": str(save / f"local_ranktable_127.0.0.1_{device}.json"),
                "NODE_PORTS": f"{ports[0]},{ports[1]}",
            }
            servers.append(RemoteServer(tiny_chat_model, *COMMON, env=env, port=port))
        env = {
            **glob_env,
            "RANK_TABLE_FILE_PATH": str(save / "local_ranktable_127.0.0.1_host.json"),
            "NODE_PORTS": f"{ports[0]},{ports[1]}",
        }
        servers.append(RemoteServer(tiny_chat_model, *COMMON, env=env))
        body = {"prompt": PROMPTS[0], "max_tokens": 12, "temperature": 0}
        out = httpx.post(f"{servers[-1].url}/v1/completions", json=body, timeout=120).json()
        assert out["choices"][0]["text"] == _expected(offline, PROMPTS[0])
        assert metric(servers[1].url, "splitserve:kv_transfer_blocks_received_total") > 0
    finally:
        for server in servers:
            server.close()


# --- no orphans -----------------------------------------------------------------------------------
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGKILL])
def test_one_command_deployment_leaves_no_process_behind(tiny_chat_model, sig):
    """`serve --pd 1p1d` sent a signal (to the launcher alone, as `kill PID` does): every process of
    the deployment (instances, their engines, the resource trackers) is gone shortly after, read from
    /proc. SIGKILL leaves no time to clean up: the instances' parent-death signal stops them."""
    with RemoteServer(tiny_chat_model, *COMMON, "--pd", "1p1d") as launcher:
        processes = launcher.child_pids()
        assert len(processes) >= 4  # two instances and their engines at least
        os.kill(launcher.proc.pid, sig)
        launcher.proc.wait(timeout=60)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and [p for p in processes if alive(p)]:
            time.sleep(0.2)
        assert not [p for p in processes if alive(p)], f"left behind after {sig!r}"
