"""Result objects returned to users, named and shaped as vLLM's."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Logprob:
    """The log-probability of one token, its rank in the vocabulary (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token is always present).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    kv_transfer_params: dict | None = None  # PD prefill side: where a decode instance pulls the KV from
    num_generated_tokens: int = 0  # every sampled token, the best_of samples not returned included
    pooled: list[float] | None = None  # a pooling request's embedding (PoolingRequestOutput has it for users)


@dataclass
class EmbeddingOutput:
    """A prompt's embedding (vLLM's EmbeddingOutput)."""

    embedding: list[float]

    @property
    def hidden_size(self) -> int:
        return len(self.embedding)


@dataclass
class EmbeddingRequestOutput:
    """What LLM.embed returns per prompt, as vLLM's: `output.outputs.embedding`."""

    request_id: str
    outputs: EmbeddingOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    """A classifier's probabilities, one per label (vLLM's ClassificationOutput)."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """What LLM.classify returns per prompt, as vLLM's: `output.outputs.probs`."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ScoringOutput:
    score: float


@dataclass
class ScoringRequestOutput:
    """What LLM.score returns per pair, as vLLM's: `output.outputs.score`."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class RequestMetrics:
    """Wall-clock times (time.monotonic) of one request's life, for latency statistics."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None


@dataclass
class BeamSearchSequence:
    """One hypothesis of a beam search, as vLLM's: the prompt's and the generated tokens."""

    tokens: list[int]
    logprobs: list[float]  # of the generated tokens
    cum_logprob: float
    text: str | None = None  # the generated text
    finish_reason: str | None = None  # "stop" (a stop token) or "length"


@dataclass
class BeamSearchOutput:
    """A prompt's hypotheses, best first."""

    sequences: list[BeamSearchSequence]
