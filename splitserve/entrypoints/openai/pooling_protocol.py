"""The bodies of the pooling routes (the pooling runner, docs/pooling.md): OpenAI's /v1/embeddings,
vLLM's /score and /classify, and the Jina / Cohere shaped /rerank, as pydantic v2 models (requests
and answers)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator

from splitserve.entrypoints.openai.protocol import check_prompt_shapes, prompt_list
from splitserve.entrypoints.openai.request_model import PROMPT_SCHEMA, TEXT_OR_TOKEN_IDS_SCHEMA, RequestModel

TextOrIds = Annotated[str | list[int], TEXT_OR_TOKEN_IDS_SCHEMA]


def _text_or_ids(value: Any, name: str) -> Any:
    checked = check_prompt_shapes(value, name)
    if isinstance(checked, list) and checked and not isinstance(checked[0], int):
        raise ValueError(f"'{name}' must be one text or one list of token ids.")
    return checked


def _texts(value: Any, name: str) -> list:
    """One text (or token ids) or a list of them, as a list."""
    return prompt_list(check_prompt_shapes(value, name))


class _InputsRequest(RequestModel):
    """A body whose `input` is one text, texts, token ids or lists of them, one pooling request each."""

    model: str | None = None
    input: Annotated[str | list[str] | list[int] | list[list[int]], PROMPT_SCHEMA]
    user: str | None = None
    add_special_tokens: bool = True

    @field_validator("input", mode="before")
    @classmethod
    def _check_input(cls, value: Any) -> Any:
        return check_prompt_shapes(value, "input")

    def inputs(self) -> list[str | list[int]]:
        return prompt_list(self.input)


class EmbeddingRequest(_InputsRequest):
    """POST /v1/embeddings: OpenAI's fields, plus vLLM's `normalize` and `add_special_tokens`."""

    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    normalize: bool | None = None


class ClassificationRequest(_InputsRequest):
    """POST /classify (and /v1/classify), vLLM's: each input's label probabilities."""


class ScoreRequest(RequestModel):
    """POST /score (and /v1/score), vLLM's: text_1 against text_2 (one against one, one against many,
    or many against as many, pairwise); `queries` / `documents` are accepted for them too."""

    model: str | None = None
    text_1: Annotated[str | list[str] | list[int] | list[list[int]], PROMPT_SCHEMA] | None = None
    text_2: Annotated[str | list[str] | list[int] | list[list[int]], PROMPT_SCHEMA] | None = None
    queries: Annotated[str | list[str] | list[int] | list[list[int]], PROMPT_SCHEMA] | None = None
    documents: Annotated[str | list[str] | list[int] | list[list[int]], PROMPT_SCHEMA] | None = None
    user: str | None = None

    @field_validator("text_1", "text_2", "queries", "documents", mode="before")
    @classmethod
    def _check_texts(cls, value: Any, info) -> Any:
        return None if value is None else check_prompt_shapes(value, info.field_name)

    def sides(self) -> tuple[list, list]:
        first = self.text_1 if self.text_1 is not None else self.queries
        second = self.text_2 if self.text_2 is not None else self.documents
        if first is None or second is None:
            raise ValueError("score takes text_1 and text_2 (or queries and documents).")
        return prompt_list(first), prompt_list(second)


class RerankRequest(RequestModel):
    """POST /rerank, /v1/rerank, /v2/rerank (Jina's and Cohere's shape): the documents ordered by
    relevance to the query, best first; top_n keeps the best n (0 or unset: all)."""

    model: str | None = None
    query: TextOrIds
    documents: Annotated[list[str] | list[list[int]], PROMPT_SCHEMA]
    top_n: int = Field(0, ge=0)
    return_documents: bool = True
    user: str | None = None

    @field_validator("query", mode="before")
    @classmethod
    def _check_query(cls, value: Any) -> Any:
        return _text_or_ids(value, "query")

    @field_validator("documents", mode="before")
    @classmethod
    def _check_documents(cls, value: Any) -> Any:
        if not isinstance(value, list):
            raise ValueError("'documents' must be a list of texts (or of lists of token ids).")
        checked = check_prompt_shapes(value, "documents")
        return [checked] if isinstance(checked[0], int) else checked  # one document's token ids


# --- answers ----------------------------------------------------------------------------------------
def _id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class PoolingUsage(BaseModel):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingData(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str  # a string with encoding_format base64 (little-endian float32)


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


class ClassificationData(BaseModel):
    index: int
    label: str  # the most probable label's name (config.json's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


class ScoreData(BaseModel):
    object: Literal["score"] = "score"
    index: int
    score: float


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankDocument(BaseModel):
    text: str


class RerankResult(BaseModel):
    index: int
    relevance_score: float
    document: RerankDocument | None = None


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: _id("rerank"))
    model: str
    usage: PoolingUsage
    results: list[RerankResult]
