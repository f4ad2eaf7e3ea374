"""The client side of `splitserve bench serve`: one streamed request, timed chunk by chunk."""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass, field

# Frequent English words: each is one token (with its leading space) in the usual BPE vocabularies, so
# that prompts made without a tokenizer still have roughly the requested length.
WORDS = (
    "the of and to in is was for that on as with by he at from his it an were are which this be or "
    "has had not first one their its new after but who they have her she two been other when there all "
    "during into school time may years more most only over city some world would where later up such "
    "used many can state about national out known university united then made team game people "
    "under year last work part series between season film album river house music since three "
    "while being both long well group name second home life family"
).split()


def parse_header(value: str) -> tuple[str, str]:
    """One --header KEY=VALUE (vLLM's `bench serve` flag): an HTTP header sent with every request."""
    key, sep, text = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, got {value!r}")
    return key.strip(), text.strip()


def request_headers(ns: argparse.Namespace) -> dict[str, str]:
    """The headers of every request: the API key (--api-key, else $OPENAI_API_KEY) and each --header."""
    api_key = ns.api_key or os.environ.get("OPENAI_API_KEY")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    return {**headers, **dict(getattr(ns, "header", None) or [])}


@dataclass
class Request:
    prompt: str | list[int]
    prompt_len: int  # exact for token ids, close for decoded text, a word count without a tokenizer
    output_len: int
    priority: int = 0  # sent as the request's `priority` when not 0 (--priority-fraction)


@dataclass
class Outcome:
    """What one streamed request measured; the token counts stay None until the server's usage (or, after
    the run, a local count) fills them."""

    success: bool = False
    error: str = ""
    ttft: float = 0.0
    itl: list[float] = field(default_factory=list)
    latency: float = 0.0
    text: str = ""
    chunks: int = 0
    prompt_tokens: int | None = None
    output_tokens: int | None = None
    cached_tokens: int | None = None  # prompt tokens the server found in its prefix cache (usage details)


class SSEBuffer:
    """Splits a response byte stream into the payloads of its `data:` lines. A network read can end
    anywhere in an event, so the unfinished last line waits for the next read."""

    def __init__(self) -> None:
        self._pending = b""

    def feed(self, chunk: bytes) -> list[str]:
        lines = (self._pending + chunk).split(b"\n")
        self._pending = lines.pop()
        payloads = []
        for raw in lines:
            line = raw.rstrip(b"\r").decode("utf-8")
            if line.startswith("data:"):
                payloads.append(line[5:].removeprefix(" "))
        return payloads


def _event_error(event: dict) -> str | None:
    """The message of an error event: OpenAI's {"error": {...}} or vLLM's {"object": "error", ...}."""
    if "error" in event:
        error = event["error"]
        return error.get("message", str(error)) if isinstance(error, dict) else str(error)
    if event.get("object") == "error":
        return event.get("message", "error event")
    return None


def _event_text(event: dict, chat: bool) -> str:
    """The generated text of one chunk (reasoning text counts, as it costs tokens like any other)."""
    choices = event.get("choices") or []
    if not choices:
        return ""
    if not chat:
        return choices[0].get("text") or ""
    delta = choices[0].get("delta") or {}
    return delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or ""


def _event_has_output(event: dict, chat: bool) -> bool:
    """Whether a chunk carries generated tokens, whatever their text: every chunk with a choice,
    except a chat stream's opening one (the assistant's role, sent before any token). Tokens that
    decode to no text still count (as vLLM counts them): a model whose ids run past its tokenizer's
    vocabulary (dummy weights with another model's tokenizer) generates such tokens."""
    choices = event.get("choices") or []
    if not choices:
        return False
    delta = choices[0].get("delta") or {}
    return not chat or "role" not in delta or bool(_event_text(event, chat))


class _Stream:
    """The timing state of one response while it streams, fed one SSE payload at a time."""

    def __init__(self, chat: bool) -> None:
        self.outcome, self.chat, self.pieces, self.done = Outcome(), chat, [], False
        self.start = self.last = time.perf_counter()

    def read(self, payload: str, now: float) -> None:
        """TTFT at the first chunk with generated tokens, one ITL gap per later such chunk (however many
        tokens it carries, as vLLM counts), the usage figures wherever they come, and nothing after [DONE]."""
        if self.done or payload == "[DONE]":
            self.done = True
            return
        event, outcome = json.loads(payload), self.outcome
        if (message := _event_error(event)) is not None:
            outcome.error, self.done = f"error event: {message}", True
            return
        if usage := event.get("usage"):
            outcome.prompt_tokens = usage.get("prompt_tokens")
            outcome.output_tokens = usage.get("completion_tokens")
            outcome.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        if _event_has_output(event, self.chat):
            if outcome.chunks == 0:
                outcome.ttft = now - self.start
            else:
                outcome.itl.append(now - self.last)
            self.last = now
            outcome.chunks += 1
            self.pieces.append(_event_text(event, self.chat))


async def send_request(session, url: str, body: dict, headers: dict, chat: bool) -> Outcome:
    """Stream one request and time it. Every failure (HTTP status, connection, timeout, error event, a
    stream without tokens) becomes an Outcome with its message: one bad request must not end the run. The
    body is read to its end, past [DONE], so that the connection goes back to the pool for reuse."""
    stream = _Stream(chat)
    outcome = stream.outcome
    try:
        async with session.post(url, json=body, headers=headers) as response:
            if response.status != 200:
                outcome.error = f"HTTP {response.status}: {(await response.text())[:300]}"
                return outcome
            buffer = SSEBuffer()
            async for chunk in response.content.iter_any():
                now = time.perf_counter()
                for payload in buffer.feed(chunk):
                    stream.read(payload, now)
                if outcome.error:
                    return outcome
        outcome.latency = time.perf_counter() - stream.start
    except Exception as exc:  # noqa: BLE001 - any failure of one request is recorded, never raised
        outcome.error = f"{type(exc).__name__}: {exc}".rstrip(": ")
        return outcome
    outcome.text = "".join(stream.pieces)
    outcome.success = outcome.chunks > 0
    if not outcome.success:
        outcome.error = "the stream carried no generated tokens"
    return outcome


async def fetch_model(session, base_url: str, headers: dict) -> str:
    """The first model the server lists, for runs without --model."""
    url = f"{base_url}/v1/models"
    try:
        async with session.get(url, headers=headers) as response:
            response.raise_for_status()
            return (await response.json())["data"][0]["id"]
    except Exception as exc:  # noqa: BLE001 - every cause gets the same advice
        raise ValueError(
            f"could not read the model name from {url} ({type(exc).__name__}: {exc}); pass --model"
        ) from None
