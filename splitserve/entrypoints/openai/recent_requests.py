"""GET /recent_requests: the last requests this API process finished, with their timings (the
dashboard's table): how long each waited, took to its first token and in all, and its tokens.

Kept in memory, per API process (with --workers N each worker answers for the requests it served);
request ids and counts only, never a prompt or an answer."""

from __future__ import annotations

import time
from collections import deque

from pydantic import BaseModel

MAX_RECENT = 50


class RecentRequest(BaseModel):
    request_id: str
    finished_at: float  # Unix time
    finish_reason: str | None
    prompt_tokens: int
    generated_tokens: int
    cached_tokens: int
    queue_s: float | None = None  # arrival to first scheduled
    ttft_s: float | None = None  # arrival to first token
    e2e_s: float | None = None  # arrival to finish
    tokens_per_s: float | None = None  # generated tokens over the time after the first one


class RecentRequestsResponse(BaseModel):
    object: str = "list"
    data: list[RecentRequest]  # the most recent first


class RecentRequests:
    def __init__(self, size: int = MAX_RECENT):
        self.entries: deque[RecentRequest] = deque(maxlen=size)

    def add(self, output, num_generated: int, reasons: list[str]) -> None:
        m = output.metrics
        entry = RecentRequest(
            request_id=output.request_id,
            finished_at=time.time(),
            finish_reason=reasons[0] if reasons else None,
            prompt_tokens=len(output.prompt_token_ids or ()),
            generated_tokens=num_generated,
            cached_tokens=max(output.num_cached_tokens or 0, 0),
        )
        if m is not None and m.finished_time is not None:
            entry.e2e_s = m.finished_time - m.arrival_time
            if m.first_scheduled_time is not None:
                entry.queue_s = max(m.first_scheduled_time - m.arrival_time, 0.0)
            if m.first_token_time is not None:
                entry.ttft_s = m.first_token_time - m.arrival_time
                decoding = m.finished_time - m.first_token_time
                entry.tokens_per_s = (num_generated - 1) / decoding if num_generated > 1 and decoding > 0 else None
        self.entries.append(entry)

    def answer(self) -> RecentRequestsResponse:
        return RecentRequestsResponse(data=list(reversed(self.entries)))
