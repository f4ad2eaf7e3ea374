"""OpenAI's Files and Batch APIs: /v1/files (upload, list, retrieve, content, delete) and
/v1/batches (create, retrieve, list, cancel).

A batch runs in the background of the API worker that created it (batch_runner.py), each line
through the same handler as the online route it names, a few at a time (`--batch-max-concurrency`)
and, under `--scheduling-policy priority`, at BATCH_PRIORITY, after the online requests (lower
runs first). Files and batch objects live in `--batch-files-dir` (batch_store.py), so that every
API worker answers for every file and batch; a batch whose worker is gone is shown failed.
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
import time
from collections.abc import Callable
from functools import partial

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, Response
from pydantic import ValidationError
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException

from splitserve.entrypoints.http import CLIENT_REQUEST_ID, APIError, read_json_body
from splitserve.entrypoints.openai.batch_protocol import (
    ACTIVE_STATUSES,
    COMPLETION_WINDOW_S,
    UPLOAD_BODY,
    BatchError,
    BatchErrors,
    BatchList,
    BatchObject,
    CreateBatchRequest,
    FileList,
    FileObject,
    list_parameters,
    new_id,
)
from splitserve.entrypoints.openai.batch_runner import BatchJob, run_line
from splitserve.entrypoints.openai.batch_store import BatchStore, is_running, process_identity
from splitserve.entrypoints.openai.request_model import STRICT_FIELDS, validation_error_message

logger = logging.getLogger("splitserve.batches")

# The priority of a batch's requests under --scheduling-policy priority (vLLM's: lower runs first;
# online requests default to 0). A line that sets its own priority keeps it.
BATCH_PRIORITY = 100
_PRIORITY_ENDPOINTS = ("/v1/chat/completions", "/v1/completions")
_FORM_OVERHEAD_BYTES = 1 << 20  # the multipart framing and the other fields around the file


class BatchServing:
    """The routes' handlers. `handlers`: the online handler of each endpoint a batch may name,
    `handler(body, raw_request) -> Response`."""

    def __init__(
        self,
        handlers: dict[str, Callable],
        directory: str | None,
        max_file_bytes: int,
        concurrency: int,
        priority_scheduling: bool = False,
        strict_fields: bool = False,
        model: str | None = None,
    ):
        self.store = BatchStore(directory or tempfile.mkdtemp(prefix="splitserve-batches-"))
        self.handlers = handlers
        self.max_file_bytes = max_file_bytes
        self.concurrency = concurrency
        self.priority_scheduling = priority_scheduling
        self.strict_fields = strict_fields
        self.model = model
        self.jobs: dict[str, BatchJob] = {}  # the batches this worker runs, by id
        self._tasks: set[asyncio.Task] = set()

    # --- files --------------------------------------------------------------------------------
    async def upload(self, request: Request) -> FileObject:
        """POST /v1/files: a multipart body of `file` and `purpose` ("batch"). The file goes to disk
        as it arrives (beyond 1 MiB, starlette spools it to a temporary file), then into the store."""
        limit = self.max_file_bytes + _FORM_OVERHEAD_BYTES
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit:
            raise self._too_large()
        if not request.headers.get("content-type", "").lower().startswith("multipart/form-data"):
            raise APIError("POST /v1/files takes a multipart/form-data body: file, purpose.", param="file")
        limited = Request(request.scope, _limited_receive(request.receive, limit, self._too_large))
        try:
            form = await limited.form(max_files=1, max_fields=16)
        except (MultiPartException, HTTPException) as exc:
            message = getattr(exc, "detail", None) or exc
            raise APIError(f"The multipart body is invalid: {message}", param="file") from None
        try:
            upload, purpose = form.get("file"), form.get("purpose")
            if not isinstance(upload, UploadFile):
                raise APIError("The body has no file part named 'file'.", param="file")
            if purpose != "batch":
                raise APIError(f"purpose must be 'batch', got {purpose!r}.", param="purpose")
            info = await asyncio.to_thread(self.store.save, upload.file, upload.filename or "upload.jsonl", "batch")
        finally:
            await form.close()
        if info.bytes > self.max_file_bytes:
            self.store.delete_file(info.id)
            raise self._too_large()
        return info

    def _too_large(self) -> APIError:
        return APIError(f"The file is larger than {self.max_file_bytes} bytes (--batch-max-file-mb).", 413)

    def list_files(self, query) -> FileList:
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise APIError(f"order must be 'asc' or 'desc', got {order!r}.", param="order")
        limit = _limit(query, 10000, 10000)
        return self.store.files(query.get("purpose"), query.get("after"), limit, order)

    def file_content(self, file_id: str) -> FileResponse:
        info = self.store.file(file_id)
        path = self.store.data_path(file_id)
        if not os.path.exists(path):
            raise APIError(f"No such file: {file_id!r}.", 404, "not_found_error", param="file_id")
        return FileResponse(path, media_type="application/octet-stream", filename=info.filename)

    # --- batches ------------------------------------------------------------------------------
    async def create_batch(self, body: dict) -> BatchObject:
        try:
            req = CreateBatchRequest.model_validate(body, context={STRICT_FIELDS: self.strict_fields})
        except ValidationError as exc:
            message, param = validation_error_message(exc)
            raise APIError(message, param=param) from None
        if req.endpoint not in self.handlers:
            raise APIError(
                f"This server runs batches of {' and '.join(self.handlers)}, not {req.endpoint}.", param="endpoint"
            )
        try:
            info = self.store.file(req.input_file_id)
        except APIError as exc:
            exc.param = "input_file_id"
            raise
        if info.purpose != "batch":
            raise APIError(f"File {info.id} has purpose {info.purpose!r}, not 'batch'.", param="input_file_id")
        now = int(time.time())
        batch = BatchObject(
            id=new_id("batch_"),
            endpoint=req.endpoint,
            input_file_id=req.input_file_id,
            created_at=now,
            expires_at=now + COMPLETION_WINDOW_S,
            metadata=req.metadata,
            model=self.model,
        )
        self.store.put_batch(batch, process_identity())
        job = BatchJob(batch, self.store, partial(self._line, req.endpoint), self.concurrency)
        self.jobs[batch.id] = job
        task = asyncio.ensure_future(self._run(job))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        logger.info("batch %s: created, over %s (%d bytes) to %s", batch.id, info.id, info.bytes, req.endpoint)
        return batch

    async def _run(self, job: BatchJob) -> None:
        CLIENT_REQUEST_ID.set(None)  # the lines are not the create request's: /abort_requests can't name them
        try:
            await job.run()
        finally:
            self.jobs.pop(job.batch.id, None)

    async def _line(self, endpoint: str, number: int, line: str) -> dict:
        handler = self.handlers[endpoint]
        if self.priority_scheduling and endpoint in _PRIORITY_ENDPOINTS:
            handler = partial(_at_priority, handler)
        return await run_line(number, line, {endpoint: handler})

    def batch(self, batch_id: str) -> BatchObject:
        if batch_id in self.jobs:
            return self.jobs[batch_id].batch
        return self._present(*self.store.batch(batch_id))

    def list_batches(self, query) -> BatchList:
        def present(record: dict) -> BatchObject:
            job = self.jobs.get(record["batch"]["id"])
            return job.batch if job else self._present(BatchObject.model_validate(record["batch"]), record["owner"])

        return self.store.batches(query.get("after"), _limit(query, 20, 100), present)

    def cancel(self, batch_id: str) -> BatchObject:
        """Stop sending the batch's lines; those in flight finish (cancelling -> cancelled)."""
        batch = self.batch(batch_id)
        if batch.status in ("cancelling", "cancelled"):
            return batch
        if batch.status not in ("validating", "in_progress"):
            raise APIError(f"Batch {batch_id} is {batch.status}: it cannot be cancelled.", param="batch_id")
        if batch_id in self.jobs:
            self.jobs[batch_id].cancel()
            return batch
        self.store.request_cancel(batch_id)  # the worker that runs it stops at its next line
        return batch.model_copy(update={"status": "cancelling", "cancelling_at": int(time.time())})

    def _present(self, batch: BatchObject, owner: str) -> BatchObject:
        """A stored batch as it is: one still active whose API worker is gone never finishes (this
        worker's own running batches are answered from self.jobs before the store)."""
        if batch.status in ACTIVE_STATUSES and (owner == process_identity() or not is_running(owner)):
            message = "The API worker that ran this batch stopped before it finished."
            batch.errors = BatchErrors(data=[BatchError(code="interrupted", message=message)])
            batch.status, batch.failed_at = "failed", int(time.time())
            self.store.put_batch(batch, owner)
        return batch


async def _at_priority(handler: Callable, body: dict, raw):
    body.setdefault("priority", BATCH_PRIORITY)
    return await handler(body, raw)


def _limit(query, default: int, most: int) -> int:
    text = query.get("limit")
    if text is None:
        return default
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= most:
        raise APIError(f"limit must be an integer from 1 to {most}, got {text!r}.", param="limit")
    return int(text)


def _limited_receive(receive, limit: int, too_large: Callable[[], APIError]):
    """An ASGI receive that refuses a body past `limit` bytes as soon as it gets there."""
    size = 0

    async def limited():
        nonlocal size
        message = await receive()
        if message["type"] == "http.request":
            size += len(message.get("body", b""))
            if size > limit:
                raise too_large()
        return message

    return limited


def batch_serving(completion, chat, pooling, config, server_args) -> BatchServing:
    """The batch routes of a server: over /v1/embeddings on a pooling model, else over completions and chat."""
    if config.model_config.runner_type == "pooling":
        handlers = {"/v1/embeddings": pooling.create_embedding}
    else:
        handlers = {
            "/v1/chat/completions": chat.create_chat_completion,
            "/v1/completions": completion.create_completion,
        }
    return BatchServing(
        handlers,
        server_args.batch_files_dir,
        server_args.batch_max_file_mb * (1 << 20),
        server_args.batch_max_concurrency,
        priority_scheduling=config.scheduler_config.policy == "priority",
        strict_fields=server_args.strict_request_fields,
        model=config.model_config.served_model_name,
    )


def json_response(model) -> Response:
    """The model as JSON (serving_base.py's, which this module does not import: the PD router
    serves these routes without the engine)."""
    return Response(model.model_dump_json(), media_type="application/json")


def add_batch_routes(app: FastAPI, serving: BatchServing) -> None:
    @app.post("/v1/files", openapi_extra={"requestBody": UPLOAD_BODY})
    async def create_file(request: Request):
        return json_response(await serving.upload(request))

    @app.get("/v1/files", openapi_extra={"parameters": list_parameters(10000, 10000, purpose=True)})
    async def list_files(request: Request):
        return json_response(serving.list_files(request.query_params))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str):
        return json_response(serving.store.file(file_id))

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str):
        return json_response(serving.store.delete_file(file_id))

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str):
        return serving.file_content(file_id)

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        return json_response(await serving.create_batch(await read_json_body(request)))

    @app.get("/v1/batches", openapi_extra={"parameters": list_parameters(20, 100)})
    async def list_batches(request: Request):
        return json_response(serving.list_batches(request.query_params))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str):
        return json_response(serving.batch(batch_id))

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str):
        return json_response(serving.cancel(batch_id))
