"""One batch, run in the background of the API worker that created it: the input file read line by
line, at most `concurrency` lines in flight, each result written as it finishes (answers of 200 to
the output file, the others to the error file), the counts kept in the batch object and logged,
and the batch's status moved validating -> in_progress -> finalizing -> completed (or cancelling
-> cancelled, or failed)."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from typing import TextIO

from starlette.datastructures import Headers

from splitserve.entrypoints.http import APIError, error_body
from splitserve.entrypoints.openai.batch_protocol import BatchError, BatchErrors, BatchObject
from splitserve.entrypoints.openai.batch_store import BatchStore, process_identity

logger = logging.getLogger("splitserve.batches")

PERSIST_EVERY_S = 1.0
LineHandler = Callable[[int, str], Awaitable[dict]]


class _NoClient:
    """Stands for the HTTP request the handlers watch for a client that left: here, none ever does;
    it sends no header (the PD router's handler reads them)."""

    headers = Headers()

    async def is_disconnected(self) -> bool:
        return False


async def run_line(number: int, line: str, handlers: dict) -> dict:
    """One line of OpenAI's batch input format (`{"custom_id", "method", "url", "body"}`) run by the
    handler of its url, as `splitserve run-batch` and POST /v1/batches run them: its result in
    OpenAI's batch output shape, `{"id", "custom_id", "response": {"status_code", "request_id",
    "body"}, "error"}`; a bad line gets an error result of its own."""
    custom_id = None
    request_id = f"splitserve-batch-{uuid.uuid4().hex}"
    try:
        try:
            item = json.loads(line)
        except ValueError as exc:
            raise APIError(f"Line {number} is not JSON: {exc}.") from None
        if not isinstance(item, dict):
            raise APIError(f"Line {number} is not a JSON object.")
        custom_id = item.get("custom_id")
        url, body = item.get("url"), item.get("body")
        if not isinstance(custom_id, str):
            raise APIError(f"Line {number}: custom_id must be a string.", param="custom_id")
        if item.get("method", "POST") != "POST":
            raise APIError(f"Line {number}: method must be POST, got {item.get('method')!r}.", param="method")
        if url not in handlers:
            raise APIError(f"Line {number}: url must be {' or '.join(handlers)}, got {url!r}.", 404, param="url")
        if not isinstance(body, dict):
            raise APIError(f"Line {number}: body must be a JSON object.", param="body")
        if body.get("stream"):
            raise APIError(f"Line {number}: a batch request cannot stream.", param="stream")
        response = await handlers[url](body, _NoClient())
        answer = {"status_code": response.status_code, "request_id": request_id, "body": json.loads(response.body)}
        error = None
    except APIError as exc:
        answer = {"status_code": exc.status, "request_id": request_id, "body": None}
        error = error_body(exc.message, exc.err_type, exc.param, exc.status)["error"]
    except Exception as exc:  # a bug must cost its line, not the batch
        logger.exception("Line %d failed", number)
        answer = {"status_code": 500, "request_id": request_id, "body": None}
        error = error_body(f"{type(exc).__name__}: {exc}", "internal_error", None, 500)["error"]
    return {"id": f"splitserve-{uuid.uuid4().hex}", "custom_id": custom_id, "response": answer, "error": error}


async def run_lines(
    lines: Iterator[tuple[int, str]],
    handle: LineHandler,
    done: Callable[[dict], None],
    concurrency: int,
    stopping: Callable[[], bool] = lambda: False,
) -> None:
    """Each line's result handed to `done` as it finishes. A line is read only once a slot is free,
    so at most `concurrency` lines are held at once however long the input is; once `stopping()`
    says so, no further line is read and the ones in flight finish."""
    assert concurrency >= 1
    slots = asyncio.Semaphore(concurrency)
    pending: set[asyncio.Task] = set()

    async def one(number: int, line: str) -> None:
        try:
            done(await handle(number, line))
        finally:
            slots.release()

    try:
        while True:
            await slots.acquire()
            item = None if stopping() else next(lines, None)
            if item is None:
                slots.release()
                break
            task = asyncio.ensure_future(one(*item))
            pending.add(task)
            task.add_done_callback(pending.discard)
        await asyncio.gather(*pending)
    finally:
        for task in pending:
            task.cancel()


def numbered_lines(f: TextIO) -> Iterator[tuple[int, str]]:
    """A file's non-blank lines with their numbers, read one at a time."""
    for number, line in enumerate(f, 1):
        if line.strip():
            yield number, line


def count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


class BatchJob:
    """The run of one batch; `batch` is its live object (the routes of this worker answer from it)."""

    def __init__(
        self,
        batch: BatchObject,
        store: BatchStore,
        handle: LineHandler,
        concurrency: int,
        log_every_s: float = 5.0,
    ):
        self.batch = batch
        self.store = store
        self.handle = handle
        self.concurrency = concurrency
        self.log_every_s = log_every_s
        self._outputs: dict[str, TextIO] = {}
        self._last_log = self._last_persist = time.monotonic()

    async def run(self) -> None:
        try:
            await self._run()
        except Exception as exc:  # the batch fails, the worker goes on
            logger.exception("batch %s failed", self.batch.id)
            self._fail("internal_error", f"{type(exc).__name__}: {exc}")

    async def _run(self) -> None:
        batch = self.batch
        try:
            total = await asyncio.to_thread(count_lines, self.store.data_path(batch.input_file_id))
        except FileNotFoundError:
            return self._fail("file_not_found", f"The input file {batch.input_file_id} was deleted.")
        if total == 0:
            return self._fail("empty_file", "The input file has no request.")
        batch.request_counts.total = total
        if batch.cancelling_at is None:  # else cancelled while validating: no line is sent
            self._set("in_progress", in_progress_at=_now())
            logger.info("batch %s: %d requests to %s", batch.id, total, batch.endpoint)
        ids = {"output": self.store.new_file_id(), "error": self.store.new_file_id()}
        with open(self.store.data_path(batch.input_file_id)) as source:
            try:
                self._outputs = {kind: open(self.store.data_path(i), "w") for kind, i in ids.items()}  # noqa: SIM115
                await run_lines(numbered_lines(source), self.handle, self._write, self.concurrency, self._stopping)
            finally:
                for f in self._outputs.values():
                    f.close()
        if batch.cancelling_at is None:
            self._set("finalizing", finalizing_at=_now())
        self._register(ids)
        self._log_progress()
        if batch.cancelling_at is None:
            self._set("completed", completed_at=_now())
        else:
            self._set("cancelled", cancelled_at=_now())
        self.store.clear_cancel(batch.id)

    def cancel(self) -> None:
        """Send no further line; the ones in flight finish, and what was done is written."""
        if self.batch.cancelling_at is None:
            self._set("cancelling", cancelling_at=_now())
            logger.info("batch %s: cancelling; the requests in flight finish", self.batch.id)

    def _stopping(self) -> bool:
        if self.batch.cancelling_at is None and self.store.cancel_requested(self.batch.id):
            self.cancel()  # asked of another API worker
        return self.batch.cancelling_at is not None

    def _write(self, result: dict) -> None:
        ok = result["response"]["status_code"] == 200
        self._outputs["output" if ok else "error"].write(json.dumps(result) + "\n")
        counts = self.batch.request_counts
        if ok:
            counts.completed += 1
        else:
            counts.failed += 1
        now = time.monotonic()
        if now - self._last_persist >= PERSIST_EVERY_S:  # for the routes of the other API workers
            for f in self._outputs.values():
                f.flush()
            self._persist()
        if now - self._last_log >= self.log_every_s:
            self._log_progress()

    def _log_progress(self) -> None:
        self._last_log = time.monotonic()
        counts = self.batch.request_counts
        logger.info(
            "batch %s: %d/%d requests done (%d failed)",
            self.batch.id,
            counts.completed + counts.failed,
            counts.total,
            counts.failed,
        )

    def _register(self, ids: dict[str, str]) -> None:
        """The output and error files as files of the store; an empty one is dropped."""
        for kind, file_id in ids.items():
            path = self.store.data_path(file_id)
            if os.path.getsize(path) == 0:
                os.remove(path)
                continue
            self.store.register(file_id, f"{self.batch.id}_{kind}.jsonl", "batch_output")
            setattr(self.batch, f"{kind}_file_id", file_id)

    def _fail(self, code: str, message: str) -> None:
        self.batch.errors = BatchErrors(data=[BatchError(code=code, message=message)])
        self._set("failed", failed_at=_now())

    def _set(self, status: str, **times: int) -> None:
        self.batch.status = status
        for name, value in times.items():
            setattr(self.batch, name, value)
        self._persist()

    def _persist(self) -> None:
        self._last_persist = time.monotonic()
        self.store.put_batch(self.batch, process_identity())


def _now() -> int:
    return int(time.time())
