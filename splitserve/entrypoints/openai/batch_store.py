"""Files and batches on disk, in `--batch-files-dir`, so that every API worker of a server (and a
server started again on the same directory) sees the same ones:

    files/<file id>.data     a file's bytes (an uploaded batch input, a batch's output or errors)
    files/<file id>.json     its FileObject
    batches/<batch id>.json  a batch's BatchObject and the API worker that runs it ("pid@start time")
    batches/<batch id>.cancel  a cancel asked of a worker other than the one that runs it

JSON records are written whole to a temporary name and renamed, so a reader never sees half of one.
Ids are checked against the shape this server makes before they name a path.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from typing import BinaryIO

from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.batch_protocol import (
    BatchList,
    BatchObject,
    FileDeleted,
    FileList,
    FileObject,
    is_id,
    new_id,
)

_COPY_CHUNK = 1 << 20


class BatchStore:
    def __init__(self, directory: str):
        self.directory = directory
        self.files_dir = os.path.join(directory, "files")
        self.batches_dir = os.path.join(directory, "batches")
        os.makedirs(self.files_dir, exist_ok=True)
        os.makedirs(self.batches_dir, exist_ok=True)

    # --- files --------------------------------------------------------------------------------
    def data_path(self, file_id: str) -> str:
        return os.path.join(self.files_dir, f"{file_id}.data")

    def save(self, source: BinaryIO, filename: str, purpose: str) -> FileObject:
        """A new file with the bytes of `source` (read in chunks: never all in memory)."""
        file_id = new_id("file-")
        with open(self.data_path(file_id), "wb") as out:
            shutil.copyfileobj(source, out, _COPY_CHUNK)
        return self.register(file_id, filename, purpose)

    def new_file_id(self) -> str:
        """An id for a file that is written at data_path(id) first, then register()ed."""
        return new_id("file-")

    def register(self, file_id: str, filename: str, purpose: str) -> FileObject:
        """Make the bytes at data_path(file_id) a file that the routes list and serve."""
        info = FileObject(
            id=file_id,
            bytes=os.path.getsize(self.data_path(file_id)),
            created_at=int(time.time()),
            filename=filename,
            purpose=purpose,
        )
        _write_json(os.path.join(self.files_dir, f"{file_id}.json"), info.model_dump())
        return info

    def file(self, file_id: str) -> FileObject:
        record = _read_json(os.path.join(self.files_dir, f"{file_id}.json")) if is_id(file_id, "file-") else None
        if record is None:
            raise APIError(f"No such file: {file_id!r}.", 404, "not_found_error", param="file_id")
        return FileObject.model_validate(record)

    def delete_file(self, file_id: str) -> FileDeleted:
        self.file(file_id)
        _remove(os.path.join(self.files_dir, f"{file_id}.json"))
        _remove(self.data_path(file_id))  # a batch reading it keeps its open handle
        return FileDeleted(id=file_id)

    def files(self, purpose: str | None, after: str | None, limit: int, order: str = "desc") -> FileList:
        keep = None if purpose is None else (lambda record: record.get("purpose") == purpose)
        page, has_more = _page(self.files_dir, "file-", after, limit, order == "desc", keep)
        data = [FileObject.model_validate(record) for record in page]
        return FileList(data=data, first_id=_first(data), last_id=_last(data), has_more=has_more)

    # --- batches ------------------------------------------------------------------------------
    def _batch_path(self, batch_id: str, suffix: str = ".json") -> str:
        return os.path.join(self.batches_dir, f"{batch_id}{suffix}")

    def put_batch(self, batch: BatchObject, owner: str) -> None:
        """Store the batch, run by the process `owner` (process_identity())."""
        _write_json(self._batch_path(batch.id), {"batch": batch.model_dump(), "owner": owner})

    def batch(self, batch_id: str) -> tuple[BatchObject, str]:
        """The batch and the API worker that runs it; a 404 for an unknown id."""
        record = _read_json(self._batch_path(batch_id)) if is_id(batch_id, "batch_") else None
        if record is None:
            raise APIError(f"No such batch: {batch_id!r}.", 404, "not_found_error", param="batch_id")
        return BatchObject.model_validate(record["batch"]), record["owner"]

    def batches(self, after: str | None, limit: int, present: Callable[[dict], BatchObject]) -> BatchList:
        """The newest batches first; `present` turns a stored record into the batch to show."""
        page, has_more = _page(self.batches_dir, "batch_", after, limit, True, None)
        data = [present(record) for record in page]
        return BatchList(data=data, first_id=_first(data), last_id=_last(data), has_more=has_more)

    def request_cancel(self, batch_id: str) -> None:
        with open(self._batch_path(batch_id, ".cancel"), "w"):
            pass

    def cancel_requested(self, batch_id: str) -> bool:
        return os.path.exists(self._batch_path(batch_id, ".cancel"))

    def clear_cancel(self, batch_id: str) -> None:
        _remove(self._batch_path(batch_id, ".cancel"))


def process_identity(pid: int | None = None) -> str:
    """`pid@start time` (Linux: clock ticks after boot, from /proc), so that another process that
    got the pid later does not pass for this one; `pid@?` where /proc does not say."""
    pid = pid or os.getpid()
    try:
        with open(f"/proc/{pid}/stat") as f:
            start = f.read().rsplit(")", 1)[1].split()[19]  # field 22; the split starts at field 3
    except (OSError, IndexError):
        start = "?"
    return f"{pid}@{start}"


def is_running(owner: str) -> bool:
    """Whether the process `owner` (process_identity()) still runs."""
    pid = int(owner.split("@", 1)[0])
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    identity = process_identity(pid)
    return identity.endswith("@?") or identity == owner


def _page(
    directory: str, prefix: str, after: str | None, limit: int, newest_first: bool, keep: Callable[[dict], bool] | None
) -> tuple[list[dict], bool]:
    """Up to `limit` records of `directory` past the id `after`, in id (= creation) order, and
    whether more follow. Only the records on the page (and those `keep` skips) are read."""
    ids = sorted((n[:-5] for n in os.listdir(directory) if n.endswith(".json")), reverse=newest_first)
    ids = [i for i in ids if is_id(i, prefix)]
    if after is not None:
        ids = [i for i in ids if (i < after if newest_first else i > after)]
    page: list[dict] = []
    for position, record_id in enumerate(ids):
        record = _read_json(os.path.join(directory, f"{record_id}.json"))
        if record is None or (keep is not None and not keep(record)):
            continue
        if len(page) == limit:
            return page, True
        page.append(record)
        if len(page) == limit and keep is None:
            return page, position + 1 < len(ids)
    return page, False


def _first(data: list) -> str | None:
    return data[0].id if data else None


def _last(data: list) -> str | None:
    return data[-1].id if data else None


def _write_json(path: str, record: dict) -> None:
    temporary = f"{path}.{os.getpid()}.tmp"
    with open(temporary, "w") as f:
        json.dump(record, f)
    os.replace(temporary, path)


def _read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except FileNotFoundError:
        return None


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass
