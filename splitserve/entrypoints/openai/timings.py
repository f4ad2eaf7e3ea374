"""Per-request timings in completion and chat answers, when asked: llama.cpp's `timings` object
(what llama-server puts in its answers) plus the request's queue time, time to first token and
total time, from the times the engine already records for the request (RequestMetrics, the
figures of /metrics' latency histograms).

Asked per request with `"return_timings": true` (splitserve's field; `false` turns off the server's
default), or with llama.cpp's `"timings_per_token": true`; `--return-timings` makes it the default
of every request, as llama-server always sends them. The object comes in the non-streamed answer
and in the last chunk of a stream (the usage chunk when stream_options.include_usage asks for one;
splitserve does not send timings with every chunk as llama.cpp's timings_per_token does):

    cache_n                 prompt tokens found in the prefix cache
    prompt_n                prompt tokens computed (the prompt less cache_n)
    prompt_ms               first scheduled -> first token: the prompt's computation
    prompt_per_token_ms     prompt_ms / prompt_n;  prompt_per_second: prompt_n per second of it
    predicted_n             tokens generated
    predicted_ms            first token -> last token
    predicted_per_token_ms  predicted_ms / predicted_n;  predicted_per_second: predicted_n per second
    queue_ms                arrival -> first scheduled
    ttft_ms                 arrival -> first token (queue_ms + prompt_ms)
    total_ms                arrival -> last token (ttft_ms + predicted_ms)

The rates are llama.cpp's (n / ms, the first token counted with the generated ones; 0 when the time
is 0). With several prompts in one completion request, counts are summed and the times span them
all (the first arrival, the first token of any, the last token of all).
"""

from __future__ import annotations

from pydantic import BaseModel

from splitserve.entrypoints.openai.request_model import RequestModel
from splitserve.outputs import RequestOutput


class TimingsRequestFields(RequestModel):
    """The request fields that ask for the answer's `timings`."""

    return_timings: bool | None = None  # None: the server's --return-timings
    timings_per_token: bool = False  # llama.cpp's: asks for the timings too (splitserve sends them once)

    def wants_timings(self, server_default: bool) -> bool:
        if self.return_timings is not None:
            return self.return_timings
        return self.timings_per_token or server_default


class Timings(BaseModel):
    cache_n: int
    prompt_n: int
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float
    queue_ms: float
    ttft_ms: float
    total_ms: float


def _per(ms: float, n: int) -> tuple[float, float]:
    """(ms per token, tokens per second)."""
    return (ms / n if n else 0.0), (1e3 * n / ms if ms > 0 else 0.0)


def request_timings(outputs: list[RequestOutput]) -> Timings | None:
    """The timings of a request's finished outputs (one per prompt); None when the engine did not
    time them (an output without metrics)."""
    metrics = [o.metrics for o in outputs if o is not None and o.metrics is not None]
    if not metrics or len(metrics) < len(outputs) or any(m.finished_time is None for m in metrics):
        return None
    arrival = min(m.arrival_time for m in metrics)
    finished = max(m.finished_time for m in metrics)
    first_token = min((m.first_token_time for m in metrics if m.first_token_time is not None), default=finished)
    scheduled = min((m.first_scheduled_time for m in metrics if m.first_scheduled_time is not None), default=arrival)
    scheduled = min(max(scheduled, arrival), first_token)
    cached = sum(o.num_cached_tokens for o in outputs)
    prompt_n = sum(len(o.prompt_token_ids) for o in outputs) - cached
    predicted_n = sum(o.num_generated_tokens for o in outputs)
    prompt_ms = 1e3 * (first_token - scheduled)
    predicted_ms = 1e3 * (finished - first_token)
    prompt_per_token, prompt_per_second = _per(prompt_ms, prompt_n)
    predicted_per_token, predicted_per_second = _per(predicted_ms, predicted_n)
    return Timings(
        cache_n=cached,
        prompt_n=prompt_n,
        prompt_ms=prompt_ms,
        prompt_per_token_ms=prompt_per_token,
        prompt_per_second=prompt_per_second,
        predicted_n=predicted_n,
        predicted_ms=predicted_ms,
        predicted_per_token_ms=predicted_per_token,
        predicted_per_second=predicted_per_second,
        queue_ms=1e3 * (scheduled - arrival),
        ttft_ms=1e3 * (first_token - arrival),
        total_ms=1e3 * (finished - arrival),
    )


class StreamTimings:
    """The timings of a streamed answer, for its last chunk: each stream's final output is kept as
    it comes (`add`); `complete` once every stream has finished."""

    def __init__(self, wanted: bool, num_streams: int):
        self.wanted = wanted
        self.finals: list[RequestOutput | None] = [None] * num_streams

    def add(self, index: int, output: RequestOutput) -> bool:
        """Keep a stream's output; True when it finished the last unfinished stream (timings wanted)."""
        if not self.wanted or not output.finished or self.finals[index] is not None:
            return False
        self.finals[index] = output
        return self.complete

    @property
    def complete(self) -> bool:
        return all(f is not None for f in self.finals)

    def timings(self) -> Timings | None:
        return request_timings(self.finals) if self.wanted and self.complete else None
