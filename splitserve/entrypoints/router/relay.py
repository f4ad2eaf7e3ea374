"""The PD router's upstream side: the bodies it sends to prefill and decode instances, one request open
on an instance (counted, and released exactly once), the response that relays a decode stream, waiting
on an instance while watching for the client to leave, and upstream failures in words."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from fastapi import Request
from fastapi.responses import StreamingResponse

from splitserve.disagg.policies import Upstream
from splitserve.entrypoints.http import error_body

UPSTREAM_ERRORS = (aiohttp.ClientError, asyncio.TimeoutError, OSError)
_DISCONNECT_POLL_S = 0.5


# --- request bodies ----------------------------------------------------------------------------
def prefill_request_body(body: dict) -> dict:
    """The prefill instance's copy: one token, no streaming, and the ask to keep the KV for a remote
    decode. Its first token starts the decode, so it is sampled under the client's rules: min_tokens
    (also metadata.min_tokens) becomes 1 when it was more, and max_completion_tokens goes, since both
    would contradict max_tokens=1 and turn a good request into a 400."""
    out = {k: v for k, v in body.items() if k not in ("stream_options", "max_completion_tokens")}
    if _positive(out.get("min_tokens")):
        out["min_tokens"] = 1
    metadata = out.get("metadata")
    if isinstance(metadata, dict) and _positive(metadata.get("min_tokens")):
        out["metadata"] = {**metadata, "min_tokens": 1}
    out["max_tokens"] = 1
    out["stream"] = False
    out["kv_transfer_params"] = {"do_remote_decode": True}
    return out


def _positive(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0


def decode_request_body(body: dict, prefill_kv: dict) -> dict:
    """The client's body plus where the prefill instance keeps the KV."""
    return {**body, "kv_transfer_params": {**prefill_kv, "do_remote_prefill": True}}


def fallback_request_body(body: dict) -> dict:
    """The client's body without any kv_transfer_params: the decode instance computes the prompt."""
    return {k: v for k, v in body.items() if k != "kv_transfer_params"}


def is_batch(body: dict) -> bool:
    """A completion request holding several prompts (a list of texts or of token-id lists)."""
    prompt = body.get("prompt")
    return isinstance(prompt, list) and len(prompt) > 1 and isinstance(prompt[0], (str, list))


def scores_the_prompt(body: dict) -> bool:
    """A request that asks for its prompt's logprobs: `prompt_logprobs` (0 included: the prompt's own
    tokens), or a completion's `echo` with `logprobs`."""

    def asked(field: str) -> bool:  # 0 asks too (the chosen tokens alone); `in (None, False)` would take it for False
        return body.get(field) is not None and body.get(field) is not False

    return asked("prompt_logprobs") or (body.get("echo") is True and asked("logprobs"))


def kv_params(data: bytes) -> dict | None:
    """The kv_transfer_params of a prefill answer; None when it has none, so that the instance counts as failed."""
    try:
        parsed = json.loads(data)
    except ValueError:
        return None
    kv = parsed.get("kv_transfer_params") if isinstance(parsed, dict) else None
    return kv if isinstance(kv, dict) else None


# --- errors ------------------------------------------------------------------------------------
class ClientGone(Exception):
    """The client closed its connection while the router waited on an instance."""


def sse_error_event(message: str) -> bytes:
    body = error_body(message, "service_unavailable", None, 503)
    return f"data: {json.dumps(body)}\n\n".encode()


def describe_error(exc: BaseException, timeout: float | None = None) -> str:
    """An upstream failure in words an operator understands."""
    if isinstance(exc, aiohttp.ClientConnectorError):
        if isinstance(exc.os_error, ConnectionRefusedError):
            return "connection refused"
        return f"cannot connect ({exc.os_error.strerror or exc.os_error})"
    if isinstance(exc, asyncio.TimeoutError):  # aiohttp's timeouts derive from it
        return f"no answer within {timeout:g} s" if timeout else "timed out"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "it closed the connection"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "the connection closed before the answer was complete"
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def status_reason(status: int, data: bytes) -> str:
    """'answered HTTP 500 (the instance's own message)'."""
    try:
        message = json.loads(data)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = data[:200].decode("utf-8", "replace").strip()
    return f"answered HTTP {status}" + (f" ({message})" if message else "")


# --- one open request --------------------------------------------------------------------------
async def until_disconnected(request: Request | None, awaitable: Awaitable):
    """Await `awaitable` while checking every half second whether the client went away (as
    serving_base.py's _collect does); if it did, cancel the wait (closing the upstream request) and raise
    ClientGone. Without this, a non-streamed request whose client gave up would keep an instance
    busy, and its KV blocks taken, until the answer was complete."""
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
            if done:
                return task.result()
            if request is not None and await request.is_disconnected():
                raise ClientGone()
    except BaseException:
        if not task.done():
            task.cancel()
        elif not task.cancelled() and task.exception() is None and isinstance(task.result(), aiohttp.ClientResponse):
            task.result().close()
        raise


class OpenRequest:
    """One request open on an instance: counted in its in-flight number, and its connection given
    back (answer read to the end) or closed (anything else: the instance then sees a disconnect and
    aborts) exactly once, however the request ends."""

    def __init__(self, instance: Upstream):
        self.instance = instance
        self.resp: aiohttp.ClientResponse | None = None
        self.on_release: Callable[[], None] | None = None  # called once, after the release
        self._released = False
        instance.in_flight += 1

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self.instance.in_flight -= 1
        if self.resp is not None:
            if self.resp.content.at_eof():
                self.resp.release()
            else:
                self.resp.close()
        if self.on_release is not None:
            self.on_release()


class RelayResponse(StreamingResponse):
    """A StreamingResponse that releases its open request even when its body is never iterated (the
    client left between the headers and the first chunk), where a generator's `finally` never runs."""

    def __init__(self, content: AsyncIterator, open_request: OpenRequest, **kwargs):
        super().__init__(content, **kwargs)
        self.open_request = open_request

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.open_request.release()


async def first_chunk(resp: aiohttp.ClientResponse) -> bytes:
    """The first bytes of a stream, up to its first event that carries output or an error (b"" if it
    ends at once). Read before the response starts, so that a decode instance failing that early can
    still be replaced by another; a chat stream's opening event (the role alone) is read past."""
    buffered = b""
    async for chunk in resp.content.iter_any():
        buffered += chunk
        if resp.content_type != "text/event-stream" or not _only_openings(buffered):
            return buffered
    return buffered


def _events(data: bytes) -> list[dict | None]:
    """The complete server-sent events of `data`, as JSON (None: [DONE] or not JSON)."""
    events = []
    for raw in data.split(b"\n\n")[:-1]:
        payload = raw.strip().removeprefix(b"data:").strip()
        try:
            event = json.loads(payload)
        except ValueError:
            event = None
        events.append(event if isinstance(event, dict) else None)
    return events


def _only_openings(data: bytes) -> bool:
    """True while `data` holds nothing but chat openings (choices whose delta has the role and no
    content yet) and perhaps the start of the next event: read on."""
    for event in _events(data):
        if event is None or "error" in event or not event.get("choices"):
            return False
        for choice in event["choices"]:
            delta = choice.get("delta")
            if not isinstance(delta, dict) or choice.get("finish_reason"):
                return False  # a completion's text, or a finished choice
            if {k for k, v in delta.items() if v not in (None, "", [])} - {"role"}:
                return False
    return True


def unavailable_before_output(data: bytes) -> str | None:
    """The message of a 503 error event that a stream opened with, before any output (the instance's
    engine died or is restarting); None otherwise."""
    for event in _events(data):
        error = (event or {}).get("error")
        if isinstance(error, dict) and error.get("code") == 503:
            return str(error.get("message"))
    return None


def decode_refused(data: bytes, decode_url: str, trace) -> bytes:
    """A 404 from the decode instance after the prefill instance served the request: the two serve
    different models or LoRA adapters. The error says so, and how to fix it."""
    note = (
        f"the decode instance {decode_url} does not serve what the prefill instance {trace.prefill} served; "
        "prefill and decode instances must serve the same model and LoRA adapters (load adapters through "
        "the router's /v1/load_lora_adapter, which loads them on every instance)"
    )
    trace.notes.append(note)
    try:
        body = json.loads(data)
        body["error"]["message"] = f"{body['error']['message']} ({note})"
    except (ValueError, KeyError, TypeError):
        return data
    return json.dumps(body).encode()


_DONE_EVENT = b"data: [DONE]\n\n"


async def relay_stream(pool, open_request: OpenRequest, first: bytes, trace) -> AsyncIterator[bytes]:
    """The decode instance's SSE bytes as they arrive (`pool`: the Router, `trace`: its RoutedRequest).
    If the stream breaks, the client gets an error event and [DONE] (its own SDK then raises instead
    of waiting). If the client leaves, Starlette cancels this generator and `finally` closes the
    upstream connection."""
    ended = False
    try:
        if first:
            yield first
        async for chunk in open_request.resp.content.iter_any():
            yield chunk
        ended = True
    except UPSTREAM_ERRORS as exc:
        ended = True
        reason = f"the stream broke off ({describe_error(exc, pool.config.request_timeout)})"
        pool._failed(open_request.instance, reason)
        trace.notes.append(f"decode {reason}")
        message = f"The decode instance failed mid-stream: {reason}."
        if open_request.resp.content_type == "text/event-stream":
            yield sse_error_event(message)
            yield _DONE_EVENT
        else:  # /generate's newline-delimited JSON
            yield json.dumps(error_body(message, "service_unavailable", None, 503)).encode() + b"\n"
    finally:
        if not ended:
            trace.notes.append("the client disconnected mid-stream (upstream request closed)")
        open_request.release()
