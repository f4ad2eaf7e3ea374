"""The client side of `splitserve bench soak`: one stream of mixed requests, each classified.

Outcomes counted: `completed` (a 200 that ended with a finish reason), `aborted` (the client
closed the stream on purpose), `refused as expected` (an invalid request answered with a 4xx),
`unexpected 4xx` (a valid request refused), `5xx naming the cause` (a 5xx, or a stream's error
event, whose error body says what failed: what a dying engine gives), `5xx` (without such a body),
and `failed` (connection errors, broken streams, an invalid request that was accepted). Each valid
request's start and end are kept (`Timeline`), so that a soak that kills engines can tell how long
the deployment took to serve again.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections import Counter

from splitserve.benchmarks.serve_client import SSEBuffer

_WORDS = "the of and a to in is you that it he was for on are as with his they at be this have from".split()

# Invalid requests and the route each goes to; every one must be answered with a 4xx.
_INVALID = [
    ("/v1/completions", {"prompt": "hello", "max_tokens": -1}),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}),
    ("/v1/completions", {"prompt": "hello", "temperature": "hot"}),
    ("/v1/completions", {"model": "no-such-model", "prompt": "hello"}),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}),
    ("/v1/completions", b'{"prompt": "unterminated'),
]


def _prompt(rng: random.Random, max_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, max(4, max_words))))


def _valid_request(rng: random.Random, ns: argparse.Namespace, stream: bool) -> tuple[str, dict]:
    """A completion or a chat, greedy or sampled, of random lengths."""
    body = {
        "max_tokens": rng.randint(1, ns.max_output_len),
        "temperature": rng.choice([0.0, 0.7, 1.0]),
        "ignore_eos": rng.random() < 0.5,
        "stream": stream,
    }
    if rng.random() < 0.5:
        return "/v1/completions", {**body, "prompt": _prompt(rng, ns.max_input_len)}
    return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": _prompt(rng, ns.max_input_len)}]}


_CAUSED = "5xx naming the cause"


def _names_cause(body: bytes | str | dict) -> bool:
    """An OpenAI error body with a message."""
    try:
        error = (json.loads(body) if not isinstance(body, dict) else body).get("error")
    except (ValueError, AttributeError):
        return False
    return isinstance(error, dict) and bool(error.get("message"))


def _status_outcome(status: int, valid: bool) -> str | None:
    """The outcome a status decides on its own, or None for a 200 to a valid request."""
    if status >= 500:
        return "5xx"
    if status >= 400:
        return "unexpected 4xx" if valid else "refused as expected"
    return None if valid else "failed"


async def _stream_outcome(response) -> str:
    """completed: a streamed answer carried a finish reason and ended with [DONE]; an error event that
    names its cause counts as such a 5xx; anything else failed."""
    buffer, finished = SSEBuffer(), False
    async for chunk in response.content.iter_any():
        for payload in buffer.feed(chunk):
            if payload == "[DONE]":
                return "completed" if finished else "failed"
            event = json.loads(payload)
            if "error" in event or event.get("object") == "error":
                return _CAUSED if _names_cause(event) else "failed"
            finished = finished or any(c.get("finish_reason") for c in event.get("choices") or [])
    return "failed"


async def _complete(session, base_url: str, route: str, body: dict) -> str:
    async with session.post(base_url + route, json=body) as response:
        if (outcome := _status_outcome(response.status, valid=True)) is not None:
            data = await response.read()
            return _CAUSED if outcome == "5xx" and _names_cause(data) else outcome
        if body["stream"]:
            return await _stream_outcome(response)
        answer = await response.json()
        return "completed" if all(c.get("finish_reason") for c in answer.get("choices") or [None]) else "failed"


async def _abort(session, base_url: str, route: str, body: dict, chunks: int) -> str:
    """Read `chunks` pieces of a long streamed answer, then drop the connection."""
    async with session.post(base_url + route, json=body) as response:
        if (outcome := _status_outcome(response.status, valid=True)) is not None:
            data = await response.read()
            return _CAUSED if outcome == "5xx" and _names_cause(data) else outcome
        seen, buffer = 0, SSEBuffer()
        async for chunk in response.content.iter_any():
            for payload in buffer.feed(chunk):
                if payload != "[DONE]" and "error" in (event := json.loads(payload)):
                    return _CAUSED if _names_cause(event) else "failed"
            seen += 1
            if seen >= chunks:
                response.close()  # the server sees the client go away: an abort
                return "aborted"
    return "completed"  # the answer ended first (a short one): nothing to abort


async def _invalid(session, base_url: str, rng: random.Random) -> str:
    route, body = rng.choice(_INVALID)
    payload = (
        {"data": body, "headers": {"Content-Type": "application/json"}} if isinstance(body, bytes) else {"json": body}
    )
    async with session.post(base_url + route, **payload) as response:
        data = await response.read()
        outcome = _status_outcome(response.status, valid=False) or "failed"
        return _CAUSED if outcome == "5xx" and _names_cause(data) else outcome


async def _one(session, base_url: str, ns: argparse.Namespace, rng: random.Random) -> str:
    pick = rng.random()
    if pick < ns.error_fraction:
        return await _invalid(session, base_url, rng)
    if pick < ns.error_fraction + ns.abort_fraction:
        route, body = _valid_request(rng, ns, stream=True)
        body.update(max_tokens=max(ns.max_output_len, 64), ignore_eos=True)
        return await _abort(session, base_url, route, body, chunks=rng.randint(1, 8))
    route, body = _valid_request(rng, ns, stream=rng.random() < 0.7)
    return await _complete(session, base_url, route, body)


async def run_stream(
    session,
    base_url: str,
    ns: argparse.Namespace,
    rng: random.Random,
    deadline: float,
    counts: Counter,
    timeline: list | None = None,
) -> None:
    """Requests one after another until `deadline` (time.monotonic()), each outcome counted (and,
    with a `timeline`, appended to it as (start, end, outcome))."""
    while time.monotonic() < deadline:
        start = time.monotonic()
        try:
            outcome = await _one(session, base_url, ns, rng)
        except Exception as exc:  # noqa: BLE001 - a broken connection is an outcome to count, not a crash
            outcome = "failed"
            print(f"[soak] request failed: {type(exc).__name__}: {exc}", flush=True)
        counts[outcome] += 1
        if timeline is not None:
            timeline.append((start, time.monotonic(), outcome))
