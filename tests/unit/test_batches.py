"""The Batch API without a model: the streaming runner holds at most its concurrency window of lines
over a 10,000-line file, and the /v1/files + /v1/batches routes (through the official `openai` SDK
on an in-process app, over fake handlers) store, run, cancel, list and refuse as OpenAI's do."""

from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import time
from types import SimpleNamespace

import openai
import pytest
from fastapi import FastAPI
from fastapi.responses import JSONResponse
from fastapi.testclient import TestClient

from splitserve.entrypoints.http import APIError, install_error_handlers
from splitserve.entrypoints.openai import batch_runner
from splitserve.entrypoints.openai.args import ServerArgs
from splitserve.entrypoints.openai.batch_protocol import BatchObject, new_id
from splitserve.entrypoints.openai.batch_runner import BatchJob, run_line, run_lines
from splitserve.entrypoints.openai.batch_store import BatchStore, process_identity
from splitserve.entrypoints.openai.serving_batches import BATCH_PRIORITY, BatchServing, add_batch_routes, batch_serving


def test_run_lines_holds_at_most_the_window_over_10000_lines():
    read = finished = held_most = in_flight_most = 0
    in_flight = 0
    numbers = []

    def lines():
        nonlocal read, held_most
        for number in range(1, 10_001):
            read += 1
            held_most = max(held_most, read - finished)
            yield number, f"line {number}"

    async def handle(number: int, line: str) -> dict:
        nonlocal in_flight, in_flight_most
        in_flight += 1
        in_flight_most = max(in_flight_most, in_flight)
        await asyncio.sleep(0 if number % 3 else 0.0001)
        in_flight -= 1
        return {"number": number}

    def done(result: dict) -> None:
        nonlocal finished
        finished += 1
        numbers.append(result["number"])

    asyncio.run(run_lines(lines(), handle, done, concurrency=4))
    assert sorted(numbers) == list(range(1, 10_001)) and finished == read == 10_000
    assert held_most <= 4 and in_flight_most == 4


def test_run_lines_stops_reading_when_asked_and_lets_the_in_flight_finish():
    read, results = [], []

    def lines():
        for number in range(1, 1000):
            read.append(number)
            yield number, "x"

    async def handle(number: int, line: str) -> dict:
        await asyncio.sleep(0.001)
        return {"number": number}

    asyncio.run(run_lines(lines(), handle, lambda r: results.append(r["number"]), 3, lambda: len(results) >= 10))
    assert len(read) <= 13 and sorted(results) == read  # every line read was answered


# --- the routes, over fake handlers -----------------------------------------------------------
def _line(custom_id, body, url="/v1/completions") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body}) + "\n"


class FakeHandlers:
    """Answers like the completions route: 200 with the prompt echoed, a 400 for max_tokens < 1."""

    def __init__(self, delay: float = 0.0):
        self.delay = delay
        self.bodies: list[dict] = []

    async def __call__(self, body: dict, raw) -> JSONResponse:
        self.bodies.append(dict(body))
        await asyncio.sleep(self.delay)
        if body.get("max_tokens", 1) < 1:
            raise APIError("max_tokens must be >= 1", param="max_tokens")
        return JSONResponse({"object": "text_completion", "choices": [{"text": body["prompt"].upper()}]})


@pytest.fixture
def make_client(tmp_path):
    clients = []

    def make(handler=None, **kw):
        handler = handler or FakeHandlers()
        kw.setdefault("concurrency", 2)
        serving = BatchServing({"/v1/completions": handler}, str(tmp_path), kw.pop("max_file_bytes", 1 << 20), **kw)
        app = FastAPI()
        install_error_handlers(app, "server")
        add_batch_routes(app, serving)
        http = TestClient(app).__enter__()
        clients.append(http)
        return openai.OpenAI(base_url="http://testserver/v1", api_key="x", http_client=http), serving

    yield make
    for http in clients:
        http.__exit__(None, None, None)


def _wait(client, batch_id: str, statuses=("completed", "failed", "cancelled"), timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses or time.monotonic() > deadline:
            return batch
        time.sleep(0.02)


def test_a_batch_runs_through_the_sdk(make_client, caplog):
    handler = FakeHandlers()
    client, _ = make_client(handler, concurrency=2, priority_scheduling=True)
    text = _line("a", {"prompt": "hi"}) + "\n" + _line("b", {"prompt": "yo", "priority": 3}) + "{not json\n"
    text += _line("c", {"prompt": "no", "max_tokens": 0}) + _line("d", {"prompt": "x"}, url="/v1/embeddings")
    text += json.dumps({"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}) + "\n"
    upload = client.files.create(file=("in.jsonl", io.BytesIO(text.encode())), purpose="batch")
    assert upload.id.startswith("file-") and upload.bytes == len(text.encode()) and upload.filename == "in.jsonl"
    assert client.files.retrieve(upload.id).purpose == "batch"
    with caplog.at_level(logging.INFO, logger="splitserve.batches"):
        batch = client.batches.create(
            input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h", metadata={"k": "v"}
        )
        assert batch.id.startswith("batch_") and batch.status == "validating" and batch.metadata == {"k": "v"}
        batch = _wait(client, batch.id)
    assert batch.status == "completed" and batch.completed_at and batch.in_progress_at and batch.finalizing_at
    assert batch.request_counts.model_dump() == {"total": 6, "completed": 2, "failed": 4}
    assert f"batch {batch.id}: 6/6 requests done (4 failed)" in caplog.text
    assert sorted(b.get("priority") for b in handler.bodies) == [3, BATCH_PRIORITY, BATCH_PRIORITY]
    output = [json.loads(line) for line in client.files.content(batch.output_file_id).text.splitlines()]
    assert {r["custom_id"]: r["response"]["body"]["choices"][0]["text"] for r in output} == {"a": "HI", "b": "YO"}
    errors = [json.loads(line) for line in client.files.content(batch.error_file_id).text.splitlines()]
    assert all(r["response"]["body"] is None and r["error"]["message"] for r in errors)
    assert sorted((r["custom_id"] or "", r["response"]["status_code"], r["error"]["param"] or "") for r in errors) == [
        ("", 400, ""),  # the line that is not JSON
        ("", 400, "custom_id"),  # the line without a custom_id
        ("c", 400, "max_tokens"),
        ("d", 404, "url"),
    ]
    assert client.files.retrieve(batch.output_file_id).purpose == "batch_output"


def test_fcfs_batches_keep_the_default_priority(make_client):
    handler = FakeHandlers()
    client, _ = make_client(handler, concurrency=1)
    upload = client.files.create(file=("in.jsonl", _line("a", {"prompt": "hi"}).encode()), purpose="batch")
    batch = _wait(
        client, client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h").id
    )
    assert batch.status == "completed" and "priority" not in handler.bodies[0]
    assert batch.error_file_id is None  # no failed line: no error file


def test_cancel_stops_sending_lines_and_keeps_what_was_done(make_client):
    client, _ = make_client(FakeHandlers(delay=0.05), concurrency=2)
    text = "".join(_line(f"r{i}", {"prompt": "p"}) for i in range(200))
    upload = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    batch = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    _wait(client, batch.id, ("in_progress",))
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled") and cancelling.cancelling_at
    batch = _wait(client, batch.id)
    done = batch.request_counts.completed
    assert batch.status == "cancelled" and batch.cancelled_at and 0 < done < 200
    assert len(client.files.content(batch.output_file_id).text.splitlines()) == done
    with pytest.raises(openai.BadRequestError):
        client.batches.cancel(_wait(client, _new_batch(client, "x")).id)  # completed: not cancellable


def _new_batch(client, custom_id):
    upload = client.files.create(file=("one.jsonl", _line(custom_id, {"prompt": "p"}).encode()), purpose="batch")
    return client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h").id


def test_lists_page_newest_first(make_client):
    client, _ = make_client(concurrency=1)
    ids = [_new_batch(client, f"c{i}") for i in range(3)]
    for batch_id in ids:
        _wait(client, batch_id)
    page = client.batches.list(limit=2)
    assert [b.id for b in page.data] == ids[::-1][:2] and page.has_more
    assert [b.id for b in client.batches.list(limit=2)] == ids[::-1]  # the SDK follows the cursor
    inputs = [f.id for f in client.files.list(purpose="batch")]
    assert len(inputs) == 3 and inputs == sorted(inputs, reverse=True)
    assert len(client.files.list(purpose="batch_output").data) == 3
    assert [f.id for f in client.files.list(purpose="batch", order="asc")] == inputs[::-1]


def test_refusals_have_openai_error_bodies(make_client):
    client, serving = make_client(max_file_bytes=100)
    for call in (
        lambda: client.files.retrieve("file-nope"),
        lambda: client.files.content("../../etc/passwd"),
        lambda: client.files.delete("file-0000000000000000deadbeef"),
        lambda: client.batches.retrieve("batch_nope"),
        lambda: client.batches.cancel("batch_nope"),
        lambda: client.batches.create(input_file_id="file-x", endpoint="/v1/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["type"] == "not_found_error" and info.value.status_code == 404
    with pytest.raises(openai.APIStatusError) as info:
        client.files.create(file=("big.jsonl", b"x" * 101), purpose="batch")
    assert info.value.status_code == 413
    with pytest.raises(openai.BadRequestError) as info:
        client.files.create(file=("a.jsonl", b"x"), purpose="fine-tune")
    assert info.value.body["param"] == "purpose"
    upload = client.files.create(file=("a.jsonl", b"{}\n"), purpose="batch")
    with pytest.raises(openai.BadRequestError) as info:
        client.batches.create(input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h")
    assert info.value.body["param"] == "endpoint"
    http = client._client
    assert http.post("/v1/batches", json={"input_file_id": upload.id, "endpoint": "/v1/completions"}).status_code == 400
    assert http.post("/v1/files", data={"purpose": "batch"}).json()["error"]["param"] == "file"
    assert http.get("/v1/batches?limit=0").status_code == 400
    assert client.files.delete(upload.id).deleted
    with pytest.raises(openai.NotFoundError):
        client.files.retrieve(upload.id)


@pytest.mark.parametrize(
    "owner, running",
    [
        (lambda: process_identity(os.getppid()), True),  # another worker, alive
        (lambda: f"{2**22 + 12345}@1", False),  # gone
        (lambda: f"{os.getppid()}@1", False),  # its pid now names another process
        (process_identity, False),  # this worker, which does not run it
    ],
)
def test_a_batch_whose_worker_is_gone_shows_failed(make_client, owner, running):
    client, serving = make_client()
    batch = BatchObject(
        id="batch_00000000000000000000abcd", endpoint="/v1/completions", input_file_id="f", created_at=1
    )
    serving.store.put_batch(batch.model_copy(update={"status": "in_progress"}), owner())
    shown = client.batches.retrieve(batch.id)
    if running:
        assert shown.status == "in_progress" and shown.errors is None
    else:
        assert shown.status == "failed" and shown.errors.data[0].code == "interrupted"
        assert serving.store.batch(batch.id)[0].status == "failed"


def test_an_empty_input_file_fails_the_batch(make_client):
    client, _ = make_client()
    upload = client.files.create(file=("empty.jsonl", b"\n\n"), purpose="batch")
    batch = _wait(
        client, client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h").id
    )
    assert batch.status == "failed" and batch.errors.data[0].code == "empty_file"


def test_progress_is_persisted_for_other_workers(make_client, monkeypatch):
    monkeypatch.setattr(batch_runner, "PERSIST_EVERY_S", 0.0)
    client, serving = make_client(FakeHandlers(delay=0.01), concurrency=1)
    text = "".join(_line(f"r{i}", {"prompt": "p"}) for i in range(30))
    upload = client.files.create(file=("in.jsonl", text.encode()), purpose="batch")
    batch_id = client.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h").id
    deadline = time.monotonic() + 10
    while serving.store.batch(batch_id)[0].request_counts.completed < 5 and time.monotonic() < deadline:
        time.sleep(0.01)
    stored, owner = serving.store.batch(batch_id)
    assert stored.status == "in_progress" and stored.request_counts.total == 30 and 5 <= stored.request_counts.completed
    _wait(client, batch_id)


def test_a_10000_line_file_runs_with_the_window_in_flight(tmp_path):
    in_flight = most = 0

    async def handler(body: dict, raw) -> JSONResponse:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await asyncio.sleep(0)
        in_flight -= 1
        return JSONResponse({"n": body["n"]})

    store = BatchStore(str(tmp_path))
    text = "".join(_line(f"r{n}", {"n": n}) for n in range(10_000))
    upload = store.save(io.BytesIO(text.encode()), "big.jsonl", "batch")
    batch = BatchObject(id=new_id("batch_"), endpoint="/v1/completions", input_file_id=upload.id, created_at=1)

    async def line(number: int, text: str) -> dict:
        return await run_line(number, text, {"/v1/completions": handler})

    asyncio.run(BatchJob(batch, store, line, concurrency=5).run())
    assert batch.status == "completed" and batch.request_counts.completed == 10_000 and most == 5
    with open(store.data_path(batch.output_file_id)) as f:
        assert sorted(json.loads(row)["response"]["body"]["n"] for row in f) == list(range(10_000))


def test_the_server_batches_the_routes_its_runner_serves(tmp_path):
    routes = SimpleNamespace(create_completion="c", create_chat_completion="chat", create_embedding="e")
    args = ServerArgs(batch_files_dir=str(tmp_path))
    for runner, endpoints in (
        ("generate", ["/v1/chat/completions", "/v1/completions"]),
        ("pooling", ["/v1/embeddings"]),
    ):
        config = SimpleNamespace(
            model_config=SimpleNamespace(runner_type=runner, served_model_name="m"),
            scheduler_config=SimpleNamespace(policy="priority"),
        )
        serving = batch_serving(routes, routes, routes, config, args)
        assert list(serving.handlers) == endpoints and serving.priority_scheduling
        assert serving.concurrency == 8 and serving.max_file_bytes == 200 << 20
