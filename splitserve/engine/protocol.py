"""Messages between front-ends (the offline LLM, API server workers) and the EngineCore.

Typed msgspec structs, sent as msgpack over ZMQ between processes (never pickle), and passed as
they are when the core runs in-process.
"""
from __future__ import annotations

import msgspec

from splitserve.sampling_params import SamplingParams

# (token ids, logprobs, rank of the first id); the first id is the chosen token, then the top-k.
TokenLogprobs = tuple[list[int], list[float], int]


class EngineCoreRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int
    arrival_time: float


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Ping(msgspec.Struct, tag="ping", array_like=True):
    nonce: int


ClientMessage = EngineCoreRequest | AbortRequests | Ping


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: TokenLogprobs | None = None
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # sent with the finishing output, for queue-time metrics

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class SchedulerStats(msgspec.Struct, array_like=True):
    """The engine's state after a step; counters are cumulative since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    pong: int | None = None
    engine_dead: str | None = None  # the reason, when the engine core is going down
