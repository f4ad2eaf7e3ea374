"""One request through the PD router, as it is logged and traced: which instances served it, how
long the prefill took, retries and fallbacks (its one log line), and with tracing on its span with a
child span per call to an instance (splitserve/tracing.py)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from splitserve.tracing import Tracing


@dataclass
class RoutedRequest:
    """What happened to one request, for its one log line and its spans."""

    request_id: str
    path: str
    started: float = field(default_factory=time.monotonic)
    prefill: str | None = None
    prefill_s: float | None = None
    decode: str | None = None
    retries: int = 0
    fallback: str | None = None
    notes: list[str] = field(default_factory=list)
    hashes: list[bytes] | None = None  # the prompt's block hashes (the cache_aware policy)
    tracing: Tracing | None = None
    span: Any = None  # the router's span of this request, until it ends
    calls: list = field(default_factory=list)  # the spans of calls to instances still open

    def line(self, status: int) -> str:
        parts = [f"{self.path} {self.request_id}: HTTP {status} in {time.monotonic() - self.started:.3f} s"]
        if self.prefill:
            parts.append(
                f"prefill {self.prefill}" + (f" ({self.prefill_s:.3f} s)" if self.prefill_s is not None else "")
            )
        if self.fallback:
            parts.append(f"FALLBACK to decode-only ({self.fallback})")
        if self.decode:
            parts.append(f"decode {self.decode}")
        if self.retries:
            parts.append(f"{self.retries} retr{'y' if self.retries == 1 else 'ies'}")
        return ", ".join(parts + self.notes)

    # --- tracing (each a no-op when it is off) ------------------------------------------------
    def start_span(self, tracing: Tracing | None, headers: Mapping[str, str]) -> None:
        """The router's span of this request, a child of the client's trace context if it sent one."""
        if tracing is None:
            return
        self.tracing = tracing
        attributes = {"http.route": self.path, "splitserve.request_id": self.request_id}
        self.span = tracing.start_span(f"POST {self.path}", tracing.extract(headers), "server", **attributes)

    def open_call(self, role: str, url: str) -> tuple[Any, dict[str, str] | None]:
        """A client span for one call to an instance, and the headers that carry its trace context."""
        if self.span is None:
            return None, None
        span = self.tracing.start_span(role, self.span, "client", **{"splitserve.instance": url})
        self.calls.append(span)
        return span, self.tracing.headers_for(span)

    def end_call(self, span, error: str | None = None) -> None:
        if span is not None and span in self.calls:
            self.calls.remove(span)
            Tracing.end_span(span, error)

    def end(self, status: int) -> None:
        """The request is answered (a stream: relayed to its end): its spans end."""
        if self.span is None:
            return
        for call in self.calls:
            Tracing.end_span(call)
        self.calls.clear()
        self.span.set_attribute("http.response.status_code", status)
        if self.fallback:
            self.span.set_attribute("splitserve.fallback", self.fallback)
        Tracing.end_span(self.span, None if status < 400 else f"HTTP {status}")
        self.span = None
