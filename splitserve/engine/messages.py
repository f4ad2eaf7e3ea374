"""Messages between front-ends (the offline LLM, API server workers) and the EngineCore.

Typed msgspec structs, sent as msgpack over ZMQ between processes (never pickle), and passed as
they are when the core runs in-process.
"""

from __future__ import annotations

import msgspec

from splitserve.distributed.kv_transfer.stats import KVTransferStats
from splitserve.executor.step_input import TokenLogprobs
from splitserve.kv_tier.stats import KVOffloadStats
from splitserve.lora.request import LoRARequest
from splitserve.multimodal.inputs import MultiModalFeature
from splitserve.pooling_params import PoolingParams
from splitserve.sampling_params import SamplingParams


class KVTransferParams(msgspec.Struct, omit_defaults=True):
    """Prefill/decode disaggregation, per request. A prefill instance gets do_remote_decode: it
    computes the prompt, keeps its KV blocks under a lease for `remote_num_pulls` pulls, and
    answers with where to pull them from and the first token it sampled from the prompt's logits. A
    decode instance gets do_remote_prefill plus that answer: it pulls the KV of every prompt token
    and goes on from that first token, so that it computes exactly what a mixed instance computes
    after the prompt (the same rows through the same kernels). Without a first token (an answer of an
    older instance, or one sample of several) it pulls all prompt tokens but the last and computes
    the last one itself, giving the logits of its own first token."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_host: str | None = None
    remote_port: int | None = None
    remote_request_id: str | None = None
    remote_num_pulls: int = 1
    # With several ranks per instance, where each rank's blocks wait (host, port), in rank order:
    # decode rank r pulls its own KV heads (or layers) from prefill rank r.
    remote_endpoints: list[tuple[str, int]] | None = None
    # The prefill instance's first token, its logprob, and its top logprobs when they were asked for.
    first_token_id: int | None = None
    first_token_logprob: float | None = None
    first_logprobs: TokenLogprobs | None = None


class EngineCoreRequest(msgspec.Struct, tag="add", array_like=True, omit_defaults=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int
    arrival_time: float
    kv_transfer: KVTransferParams | None = None
    lora_request: LoRARequest | None = None
    priority: int = 0  # with the priority scheduling policy: lower runs first
    pooling_params: PoolingParams | None = None  # a pooling request: its prompt's embedding, no tokens
    client_request_id: str | None = None  # the id its client gave (X-Request-Id, request_id): /abort_requests
    mm_features: list[MultiModalFeature] = []  # its images (multimodal/inputs.py)


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class AbortClientRequests(msgspec.Struct, tag="abort_client", array_like=True):
    """Abort every request whose client gave one of these ids, whichever front-end sent it; their
    front-ends hear that they ended (finish_reason "abort")."""

    client_request_ids: list[str]


class SleepCall(msgspec.Struct, tag="sleep", array_like=True, omit_defaults=True):
    """sleep (level 1 or 2), wake_up, is_sleeping, reset_prefix_cache or update_weights (from
    model_path), answered with a SleepReply."""

    call_id: int
    op: str
    level: int = 1
    model_path: str = ""
    load_format: str = "auto"


class SleepReply(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    sleep_level: int = 0  # after the call: 0 awake, else the level it sleeps at
    error: str | None = None


class Ping(msgspec.Struct, tag="ping", array_like=True):
    nonce: int


class GrammarVocabulary(msgspec.Struct, tag="grammar_vocabulary", array_like=True):
    """Structured output's view of the vocabulary (xgrammar's TokenizerInfo, serialized), sent once by
    a front-end before its first guided request: the engine process then needs no tokenizer of its own
    (loading one can take seconds, which the first guided requests would wait for)."""

    tokenizer_info: str


class LoRACall(msgspec.Struct, tag="lora", array_like=True, omit_defaults=True):
    """A front-end's change to, or look at, the engine's LoRA adapters (engine/lora_registry.py):
    op "add" (name, path, base_model_name; lora_int_id: the id the caller chose, as the offline API
    lets it, 0 for the engine's next), "remove" (name) or "list". Answered by a LoRAReply."""

    call_id: int
    op: str
    name: str = ""
    path: str = ""
    base_model_name: str | None = None
    lora_int_id: int = 0


class LoRAReply(msgspec.Struct, array_like=True, omit_defaults=True):
    """The engine's adapters after the call, or what went wrong (not_found: no adapter of that name)."""

    call_id: int
    version: int  # the registry's version after the call
    loras: list[LoRARequest] = []
    error: str | None = None
    not_found: bool = False


ClientMessage = (
    EngineCoreRequest | AbortRequests | AbortClientRequests | Ping | GrammarVocabulary | LoRACall | SleepCall
)


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None  # one entry per new token, when logprobs were asked for
    new_token_logprobs: list[float] | None = None  # the new tokens' logprobs, also when none were asked for
    new_prompt_logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_cached_tokens: int = 0
    first_scheduled_time: float | None = None  # sent with the finishing output, for queue-time metrics
    kv_transfer: KVTransferParams | None = None  # prefill side: where the leased KV can be pulled from
    error: str | None = None  # the engine refused the request (finish_reason "abort"): why
    error_not_found: bool = False  # ... because what it names (a LoRA adapter) is not there
    pooled: list[float] | None = None  # a pooling request's embedding (it finishes with it)
    error_status: int = 0  # the HTTP status of `error` when not 400 / 404 (503: the engine sleeps)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def refused_output(request_id: str, why: str, status: int = 503) -> EngineCoreOutput:
    """A request's last output when it ends without running on: an error its front-end answers with
    `status` (finish_reason "abort")."""
    return EngineCoreOutput(request_id, [], finish_reason="abort", error=why, error_status=status)


def queue_ttl_expired(request_id: str, ttl: float) -> EngineCoreOutput:
    """A request that waited past --scheduler-ttl (in an engine's queue or the global scheduler's)."""
    return refused_output(
        request_id, f"The request waited in the queue more than {ttl:g} s (--scheduler-ttl) and was dropped."
    )


class SpecDecodingStats(msgspec.Struct, array_like=True):
    """Speculative decoding's counters, cumulative since start, as vLLM's spec_decode metrics."""

    num_drafts: int = 0  # request-steps that verified at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = []  # [i]: drafts accepted at position i

    def add(self, num_drafted: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafted
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_drafted:
            self.accepted_per_position += [0] * (num_drafted - len(self.accepted_per_position))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verifying step: the accepted drafts plus the token the target adds."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    def describe(self) -> str:
        return (
            f"acceptance rate {100 * self.acceptance_rate:.1f}% ({self.num_accepted_tokens} of "
            f"{self.num_draft_tokens} draft tokens), mean acceptance length {self.mean_acceptance_length:.2f} "
            f"over {self.num_drafts} drafts"
        )


class SchedulerStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """The engine's state after a step; counters are cumulative since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    kv_transfer: KVTransferStats | None = None
    lora_version: int = 0  # changes whenever an adapter is added or removed
    kv_cache_bytes: int = 0  # allocated for the KV cache, every rank
    kv_cache_resident_bytes: int = 0  # of those, backed by memory (Executor.kv_cache_memory)
    # KV blocks that requests hold, counted block by block by the invariant check the engine runs
    # while it is idle (None while requests run): 0 on an idle instance that holds no lease.
    kv_blocks_held: int | None = None
    taken_at: float = 0.0  # Unix time at which the engine process took these stats
    spec_decoding: SpecDecodingStats | None = None  # None: no speculative decoding
    kv_offload: KVOffloadStats | None = None  # None: no KV offloading tier
    generation_tokens: int = 0  # tokens sampled since start, every request's (the decode rate of /v1/loads)
    # LoRA adapter name -> requests running / waiting with it (vLLM's running_lora_adapters and
    # waiting_lora_adapters, for vllm:lora_requests_info); None with LoRA off
    running_loras: dict[str, int] | None = None
    waiting_loras: dict[str, int] | None = None
    expert_load: list[int] | None = None  # MoE: tokens routed to each expert since start, all layers summed


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    stats: SchedulerStats | None = None
    pong: int | None = None
    engine_dead: str | None = None  # the reason, when the engine core is going down
    lora_reply: LoRAReply | None = None
    sleep_reply: SleepReply | None = None
