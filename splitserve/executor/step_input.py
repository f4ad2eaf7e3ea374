"""What the engine and the model runners tell each other each step: data only (ids, token ids, block ids, sampling
parameters), so that one message can be sent as it is to every rank of a multi-process executor.

The engine's scheduler plans with live `Request` objects (engine/core/scheduler.py); `StepInput` is that
plan as the runners need it. A runner keeps its own state per request (executor/input_batch.py):
it is told about a request once (`NewRequestData`), then only what changes each step.
"""

from __future__ import annotations

import msgspec

from splitserve.kv_tier.ops import KVOffloadOps
from splitserve.lora.request import LoRARequest
from splitserve.multimodal.inputs import MultiModalFeature
from splitserve.pooling_params import PoolingParams
from splitserve.sampling_params import SamplingParams

# (token ids, logprobs, rank of the first id); the first id is the chosen token, then the top-k.
TokenLogprobs = tuple[list[int], list[float], int]


class NewRequestData(msgspec.Struct, array_like=True, omit_defaults=True):
    """A request the runners have not seen: what stays fixed for its whole life."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    stop_token_ids: list[int]  # eos and stop ids: what min_tokens holds back
    lora_request: LoRARequest | None = None  # its LoRA adapter (None: the base model)
    pooling: PoolingParams | None = None  # a pooling request: pool its prompt's hidden states
    mm_features: list[MultiModalFeature] = []  # its images: encoder inputs and the prompt tokens they replace


class ScheduledRequest(msgspec.Struct, array_like=True, omit_defaults=True):
    """One request's share of a step."""

    request_id: str
    num_computed_tokens: int  # tokens already in the KV cache: the position of the first input
    num_tokens: int  # tokens this step computes
    token_ids: list[int]  # their ids; one fewer when the last is still being sampled
    new_block_ids: list[int]  # blocks added since the last step (all of them when `resumed`)
    samples: bool  # the step reaches its last token: sample the next one
    resumed: bool = False  # back after a preemption: its block list starts over
    # Speculative decoding: the last this-many of token_ids are drafts to verify. The step samples
    # after every one of its last num_draft_tokens + 1 tokens (input_batch.py).
    num_draft_tokens: int = 0

    @property
    def last_token_pending(self) -> bool:
        """Its last input is the token the step in flight is sampling (overlap scheduling): the runner
        takes it from that step's output on the device."""
        return len(self.token_ids) < self.num_tokens


class StepInput(msgspec.Struct, array_like=True, omit_defaults=True):
    new_requests: list[NewRequestData] = []
    scheduled: list[ScheduledRequest] = []
    finished_request_ids: list[str] = []  # forget these (finished, aborted) before this step
    # Structured output: each guided request's next-token bitmask (int32 words, bit set = allowed).
    grammar_bitmasks: dict[str, bytes] = {}
    # Preemption by swapping, done before this step's forward: copies out first, then in.
    swap_out: list[tuple[int, int]] = []  # (device block, host block)
    swap_in: list[tuple[int, int]] = []  # (host block, device block)
    kv_offload: KVOffloadOps | None = None  # to and from the KV offloading tier, before the forward too

    @property
    def total_num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.scheduled)


class ModelRunnerOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What a step produced, by request id."""

    sampled: dict[str, int] = {}
    sampled_logprobs: dict[str, float] = {}  # each sampled token's logprob (cumulative_logprob's terms)
    logprobs: dict[str, TokenLogprobs] = {}
    # Per request: logprobs of the prompt tokens this step scored (position p scores token p + 1).
    prompt_logprobs: dict[str, list[TokenLogprobs]] = {}
    # Speculative decoding: how many of a request's drafts were accepted (its `sampled` token comes
    # after them), their logprobs in order, and a draft model's drafts for its next step.
    num_accepted: dict[str, int] = {}
    accepted_token_logprobs: dict[str, list[float]] = {}
    accepted_logprobs: dict[str, list[TokenLogprobs]] = {}
    draft_token_ids: dict[str, list[int]] = {}
    pooled: dict[str, list[float]] = {}  # pooling requests whose prompt this step finished: the embedding
