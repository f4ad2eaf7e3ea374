"""The state of one sequence inside the engine core (one per sample when n > 1)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from splitserve.multimodal.inputs import block_extra_keys
from splitserve.sampling_params import SamplingParams


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    SWAPPED = enum.auto()  # preempted, its KV copied to host memory (preemption_mode="swap")
    WAITING_FOR_REMOTE_KV = enum.auto()  # blocks allocated, KV being pulled from a prefill instance
    # Everything after this point is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()

    @property
    def is_finished(self) -> bool:
        return self in _FINISHED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


# A set lookup: an IntEnum comparison costs ~0.2 us, and the engine asks several times per token.
_FINISHED = frozenset(status for status in RequestStatus if status > RequestStatus.WAITING_FOR_REMOTE_KV)
_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_id: int | None
    max_tokens: int  # resolved: never past max_model_len
    arrival_time: float = field(default_factory=time.monotonic)
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until then
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[bytes] = field(default_factory=list)
    first_scheduled_time: float | None = None
    stop_token_set: set[int] = field(default_factory=set)  # what min_tokens holds back: eos + stop ids
    kv_transfer: object = None  # KVTransferParams, for PD disaggregation
    lora_request: object = None  # LoRARequest: the adapter it runs with (None: the base model)
    priority: int = 0  # the priority scheduling policy's key (lower first), then arrival_time
    grammar: object = None  # structured output: the xgrammar GrammarMatcher of the tokens so far
    # Overlap scheduling: tokens sampled by launched steps whose values the host has not read yet
    # (at most 1 between engine steps, 2 while one is launched and the one before it is being
    # finished). The scheduler counts them as tokens; the model runner takes them from the device.
    num_pending_tokens: int = 0
    # Dynamic NTK rope, a prompt past the trained length: its keys are rotated for this length, so
    # prefix caching may share its blocks only with prompts of the same length (0: any).
    rope_scaling_len: int = 0
    # Speculative decoding: draft tokens proposed to follow the sequence, verified by its next step.
    spec_token_ids: list[int] = field(default_factory=list)
    new_token_ids: list[int] = field(default_factory=list)  # what the last step appended
    pooling_params: object = None  # PoolingParams: a pooling request (one step's token, ignored)
    client_request_id: str | None = None  # the id its client gave, for /abort_requests
    mm_features: list = field(default_factory=list)  # its images (multimodal/inputs.py MultiModalFeature)

    def __post_init__(self) -> None:
        # Whether sampling reads its outputs on the host (SamplingParams.reads_output_history), read
        # by every overlapped step: its parameters are final by now.
        self.reads_output_history = self.sampling_params.reads_output_history
        self.all_token_ids = list(self.prompt_token_ids) + list(self.output_token_ids)
        self.stop_token_set = set(self.sampling_params.stop_token_ids)
        if self.eos_token_id is not None and not self.sampling_params.ignore_eos:
            self.stop_token_set.add(self.eos_token_id)

    @classmethod
    def from_engine_core_request(cls, req) -> Request:
        return cls(
            req.request_id,
            req.prompt_token_ids,
            req.sampling_params,
            req.eos_token_id,
            req.max_tokens,
            arrival_time=req.arrival_time,
            kv_transfer=req.kv_transfer,
            lora_request=req.lora_request,
            priority=req.priority,
            pooling_params=req.pooling_params,
            client_request_id=req.client_request_id,
            mm_features=list(req.mm_features),
        )

    @property
    def lora_int_id(self) -> int:
        return self.lora_request.lora_int_id if self.lora_request is not None else 0

    @property
    def block_hash_salt(self) -> bytes:
        """What sets its KV apart from the same tokens' under another adapter, or under another
        dynamic NTK scaling length (prefix caching)."""
        lora = self.lora_request
        salt = b"" if lora is None else b"lora:%d:%s" % (lora.lora_int_id, lora.lora_path.encode())
        return salt + (b"ntk:%d" % self.rope_scaling_len if self.rope_scaling_len else b"")

    def block_extra_keys(self, start: int, block_size: int) -> bytes:
        """The extra keys of its block over tokens start .. start + block_size - 1: the salt, and the
        identifiers of the images whose placeholder tokens lie there."""
        if not self.mm_features:
            return self.block_hash_salt
        return self.block_hash_salt + block_extra_keys(self.mm_features, start, start + block_size)

    @property
    def wants_remote_prefill(self) -> bool:
        return self.kv_transfer is not None and self.kv_transfer.do_remote_prefill

    @property
    def remote_kv_target(self) -> int:
        """PD decode side: the prompt tokens whose KV is pulled. All of them when the prefill
        instance sent its first token; else all but the last, which is computed here for its logits."""
        return self.num_prompt_tokens - (self.kv_transfer.first_token_id is None)

    @property
    def keeps_kv_for_remote_decode(self) -> bool:
        return self.kv_transfer is not None and self.kv_transfer.do_remote_decode

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_tokens_with_pending(self) -> int:
        return len(self.all_token_ids) + self.num_pending_tokens

    @property
    def reaches_length_limit_with_pending(self) -> bool:
        """Its pending token is certain to end it by length: no further step is worth scheduling."""
        return self.num_pending_tokens > 0 and (self.num_output_tokens + self.num_pending_tokens >= self.max_tokens)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def uses_prefix_cache(self) -> bool:
        # Prompt logprobs need the logits of every prompt position, so cached positions won't do.
        return self.sampling_params.prompt_logprobs is None

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def is_finished(self) -> bool:
        return self.status in _FINISHED

    def check_stop(self, max_model_len: int) -> bool:
        """After a new token: set a finished status (and stop_reason) if the sequence must end.
        Length limits come first, as in vLLM: an eos that is also the last allowed token is "length"."""
        params, last = self.sampling_params, self.all_token_ids[-1]
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            self.status = RequestStatus.FINISHED_LENGTH_CAPPED
            return True
        if self.num_output_tokens < params.min_tokens:
            return False
        if last == self.eos_token_id and not params.ignore_eos:
            self.status = RequestStatus.FINISHED_STOPPED
            return True
        if last in params.stop_token_ids:
            self.status, self.stop_reason = RequestStatus.FINISHED_STOPPED, last
            return True
        return False
