"""OpenAI's Files and Batch APIs as the server reads and answers them: the file and batch objects,
their lists, the body of POST /v1/batches, and the ids (serving_batches.py serves the routes,
batch_store.py keeps the objects on disk, batch_runner.py runs a batch)."""

from __future__ import annotations

import re
import secrets
import time
from typing import Annotated, Literal

from pydantic import BaseModel, Field, StringConstraints

from splitserve.entrypoints.openai.request_model import RequestModel

BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
COMPLETION_WINDOW_S = 24 * 3600
_ID = re.compile(r"(file-|batch_)[0-9a-f]{24}")


def new_id(prefix: str) -> str:
    """`file-...` or `batch_...`: the creation time (ns, hex) then random digits, so that ids sort
    in the order they were made (the lists' order and their `after` cursor)."""
    return f"{prefix}{time.time_ns():016x}{secrets.token_hex(4)}"


def is_id(value: str, prefix: str) -> bool:
    """Whether `value` is an id this server could have made (anything else is never a file name)."""
    return value.startswith(prefix) and _ID.fullmatch(value) is not None


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Literal["batch", "batch_output"]
    status: Literal["uploaded", "processed", "error"] = "processed"  # deprecated by OpenAI, still sent
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0  # answered 200 (lines of the output file)
    failed: int = 0  # any other answer (lines of the error file)


class BatchError(BaseModel):
    code: str | None = None
    message: str | None = None
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str = "24h"
    status: BatchStatus = "validating"
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts = Field(default_factory=BatchRequestCounts)
    metadata: dict[str, str] | None = None
    model: str | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class CreateBatchRequest(RequestModel):
    """POST /v1/batches."""

    input_file_id: str
    endpoint: Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings"]
    completion_window: Literal["24h"]
    # OpenAI's limits: 16 pairs, keys of at most 64 characters, values of at most 512.
    metadata: (
        dict[Annotated[str, StringConstraints(max_length=64)], Annotated[str, StringConstraints(max_length=512)]] | None
    ) = Field(None, max_length=16)


# The OpenAPI document of the routes whose body or query FastAPI does not see (the handlers read them).
UPLOAD_BODY = {
    "required": True,
    "content": {
        "multipart/form-data": {
            "schema": {
                "type": "object",
                "properties": {
                    "file": {"type": "string", "format": "binary"},
                    "purpose": {"type": "string", "enum": ["batch"]},
                },
                "required": ["file", "purpose"],
            }
        }
    },
}


def list_parameters(default_limit: int, max_limit: int, purpose: bool = False) -> list[dict]:
    """The query parameters of GET /v1/files (with `purpose`) and GET /v1/batches."""
    params = [
        {"name": "after", "in": "query", "required": False, "schema": {"type": "string"}},
        {
            "name": "limit",
            "in": "query",
            "required": False,
            "schema": {"type": "integer", "minimum": 1, "maximum": max_limit, "default": default_limit},
        },
    ]
    if purpose:
        params.append({"name": "purpose", "in": "query", "required": False, "schema": {"type": "string"}})
        params.append(
            {"name": "order", "in": "query", "required": False, "schema": {"type": "string", "enum": ["asc", "desc"]}}
        )
    return params
