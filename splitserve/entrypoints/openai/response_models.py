"""Response bodies of the OpenAI-compatible server: OpenAI's shapes plus vLLM's extensions, as
pydantic v2 models (the request bodies are in protocol.py).

Responses are plain models whose optional fields default to None. OpenAI's own nullable fields
(`finish_reason`, `logprobs`, `stop_reason`, ...) are always serialized, null included, while
vLLM-style extensions the server did not fill (`token_ids`, `prompt_logprobs`, `reasoning_content`,
...) are left out of the JSON when None (`Field(exclude_if=...)`, pydantic >= 2.11), so a plain
`model_dump_json()` gives OpenAI's shapes.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, Field

from splitserve.entrypoints.openai.timings import Timings
from splitserve.entrypoints.openai.tool_parsers import DeltaToolCall, ToolCall
from splitserve.outputs import Logprob

MIN_LOGPROB = -9999.0  # what a token the sampler could not pick (-inf) reports, as vLLM does: JSON has no -inf


def finite_logprob(value: float | None) -> float | None:
    return None if value is None else max(value, MIN_LOGPROB)


def random_id(prefix: str) -> str:
    """A fresh response id such as "cmpl-<32 hex digits>"; stream chunks of one request share one."""
    return f"{prefix}-{uuid.uuid4().hex}"


def _now() -> int:
    return int(time.time())


def _is_none(value: Any) -> bool:
    return value is None


def _extension(default: Any = None) -> Any:
    """A vLLM-style field beyond OpenAI's schema: left out of the JSON while None."""
    return Field(default, exclude_if=_is_none)


class PromptTokenUsageInfo(BaseModel):
    cached_tokens: int = 0


class CompletionTokenUsageInfo(BaseModel):
    reasoning_tokens: int = 0  # of completion_tokens, those inside the reasoning (--reasoning-parser)


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokenUsageInfo | None = _extension()
    completion_tokens_details: CompletionTokenUsageInfo | None = _extension()


class CompletionLogProbs(BaseModel):
    """OpenAI's legacy logprobs: per token its text offset, logprob, text and top alternatives."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionResponseChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = _extension()
    token_ids: list[int] | None = _extension()
    prompt_token_ids: list[int] | None = _extension()
    cum_log_probs: float | None = _extension()
    sentence_length: int | None = _extension()


class CompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    kv_transfer_params: dict[str, Any] | None = _extension()
    timings: Timings | None = _extension()  # llama.cpp's, when asked (timings.py)


class CompletionStreamChoice(CompletionResponseChoice):
    """A streamed piece of one choice; `arrival_time` is the seconds since the request arrived."""

    arrival_time: float


class CompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("cmpl"))
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = _extension()
    system_fingerprint: str | None = None
    timings: Timings | None = _extension()  # in the last chunk, when asked


class ChatMessage(BaseModel):
    role: str = "assistant"
    content: str | None = None
    reasoning_content: str | None = _extension()
    tool_calls: list[ToolCall] | None = _extension()


class ChatCompletionLogProb(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatCompletionLogProbsContent(ChatCompletionLogProb):
    top_logprobs: list[ChatCompletionLogProb] = Field(default_factory=list)


class ChatCompletionLogProbs(BaseModel):
    content: list[ChatCompletionLogProbsContent] | None = None


class ChatCompletionResponseChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _extension()
    cum_log_probs: float | None = _extension()
    sentence_length: int | None = _extension()


class ChatCompletionResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionResponseChoice]
    usage: UsageInfo
    system_fingerprint: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = _extension()
    prompt_token_ids: list[int] | None = _extension()
    kv_transfer_params: dict[str, Any] | None = _extension()
    timings: Timings | None = _extension()  # llama.cpp's, when asked (timings.py)


class DeltaMessage(BaseModel):
    """The change a stream chunk brings; absent parts are left out (the last chunk's delta is {})."""

    role: str | None = _extension()
    content: str | None = _extension()
    reasoning_content: str | None = _extension()
    tool_calls: list[DeltaToolCall] | None = _extension()
    token_ids: list[int] | None = _extension()  # FastDeploy's: the ids of the tokens this chunk brings


class ChatCompletionStreamChoice(BaseModel):
    """A streamed piece of one choice; `arrival_time` is the seconds since the request arrived."""

    index: int
    delta: DeltaMessage
    logprobs: ChatCompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = _extension()
    arrival_time: float


class ChatCompletionStreamResponse(BaseModel):
    id: str = Field(default_factory=lambda: random_id("chatcmpl"))
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatCompletionStreamChoice]
    usage: UsageInfo | None = _extension()
    system_fingerprint: str | None = None
    timings: Timings | None = _extension()  # in the last chunk, when asked


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "splitserve"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = _extension()


class DetokenizeResponse(BaseModel):
    prompt: str
