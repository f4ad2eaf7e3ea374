"""A launched step (InFlightStep) and what collecting it gives: each request's sampled token, and
with speculative decoding the verification of its drafts against the target's own samples."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from splitserve.executor.host import StepReady
from splitserve.executor.sampler import SamplerOutput
from splitserve.executor.step_input import ModelRunnerOutput


@dataclass
class InFlightStep:
    """A launched step: its sampled tokens on the device (for the next step's inputs) and on their
    way to the host, and `ready`, reached when they have arrived. It holds what collect() needs of
    its requests, which may be forgotten by the time it is collected."""

    request_ids: list[str]  # the rows of `sampled`: the requests that sample (several rows each when verifying drafts)
    num_logprobs: list[int | None]  # per row: how many top logprobs it asked for
    drafts: dict[str, tuple[int, list[int]]] = field(default_factory=dict)  # InputBatch.drafts
    sampled: SamplerOutput | None = None
    host: list = field(default_factory=list)  # host copies of sampled.host_tensors()
    prompt_host: dict[str, list[torch.Tensor]] = field(default_factory=dict)  # host copies, per request
    pooled_host: dict[str, torch.Tensor] = field(default_factory=dict)  # finished embeddings, host copies
    ready: StepReady | None = None

    def __post_init__(self) -> None:
        self._rows = {rid: i for i, rid in enumerate(self.request_ids)}  # the last row of each request

    def row_of(self, request_id: str) -> int:
        return self._rows[request_id]


def collect_samples(step: InFlightStep, out: ModelRunnerOutput) -> None:
    """Each request's sampled token; a request verifying drafts keeps those that its own samples
    repeat, in order, and ends with the sample after the last of them (speculative sampling with
    drafts of one certain token: each kept token is exactly the target's sample)."""
    tokens, token_logprobs = step.host[0].tolist(), step.host[1].tolist()
    entries = None
    if len(step.host) > 2:
        ids, lps, ranks = (t.tolist() for t in step.host[2:])
        entries = [
            (ids[i][: k + 1], lps[i][: k + 1], ranks[i]) if k is not None else None
            for i, k in enumerate(step.num_logprobs)
        ]
    for request_id, last in step._rows.items():
        first, drafts = step.drafts.get(request_id, (last, []))
        accepted = 0
        while accepted < len(drafts) and tokens[first + accepted] == drafts[accepted]:
            accepted += 1
        final = first + accepted
        out.sampled[request_id] = tokens[final]
        out.sampled_logprobs[request_id] = token_logprobs[final]
        if entries is not None and entries[final] is not None:
            out.logprobs[request_id] = entries[final]
        if drafts:
            out.num_accepted[request_id] = accepted
            out.accepted_token_logprobs[request_id] = token_logprobs[first:final]
            if entries is not None and entries[final] is not None:
                out.accepted_logprobs[request_id] = entries[first:final]


def collect_pooled(step: InFlightStep, out: ModelRunnerOutput) -> None:
    """Each finished pooling request's embedding. Its one token (0, never shown) ends it by length,
    as max_tokens=1 asks, through the same bookkeeping as a sampled token."""
    for request_id, vector in step.pooled_host.items():
        out.pooled[request_id] = vector.tolist()
        out.sampled[request_id], out.sampled_logprobs[request_id] = 0, 0.0
