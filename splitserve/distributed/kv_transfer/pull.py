"""The decode side of a rank's KV connector (transport.py's KVConnector, which also serves the prefill
side): pulls of a remote request's blocks into blocks the scheduler allocated, one job at a time on
a thread of their own, each over a watched connection, so that a prefill instance that dies fails the
pull at once; the results go back to the engine loop through poll_pulled()."""

from __future__ import annotations

import logging
import queue
import time
from dataclasses import dataclass

import msgspec
import torch
import zmq
from zmq.utils.monitor import recv_monitor_message

from splitserve.distributed.kv_transfer.frames import (
    KVFrameHeader,
    PullRequest,
    crc32,
    dtype_name,
    frame_shape,
    scatter,
)
from splitserve.distributed.kv_transfer.stats import PullResult

logger = logging.getLogger("splitserve.distributed.kv_transfer.transport")

POLL_MS = 100
PULL_TIMEOUT_S = 30.0  # a KV server that neither answers nor drops the connection (a lost host)
# The events of a pull's connection that mean the KV server is gone: it dropped the connection,
# or it refused one (ZMQ then retries, which would last until the timeout).
_PEER_GONE = {zmq.EVENT_DISCONNECTED: "closed the connection", zmq.EVENT_CONNECT_RETRIED: "refused the connection"}


@dataclass
class PullJob:
    request_id: str  # the local (decode) request
    host: str
    port: int
    remote_request_id: str
    first_block: int  # index into the remote request's blocks
    dest_block_ids: list[int]


class PullSide:
    """KVConnector's decode side; KVConnector.__init__ makes the state it uses (`_jobs`, `_results`,
    `stats`, `kv_caches`, `kv_scales`, `kv_cache_dtype`, `_running`) and starts `_pull_loop`."""

    def submit_pull(self, request_id: str, params, first_block: int, dest_block_ids: list[int]) -> None:
        """Pull blocks first_block.. of the remote request named in `params` (KVTransferParams)
        into our blocks `dest_block_ids`; the result comes back through poll_pulled()."""
        self._jobs.put(
            PullJob(
                request_id,
                params.remote_host,
                params.remote_port,
                params.remote_request_id,
                first_block,
                list(dest_block_ids),
            )
        )

    def poll_pulled(self) -> list[PullResult]:
        return drain(self._results)

    def _pull_loop(self) -> None:
        while self._running:
            try:
                job = self._jobs.get(timeout=POLL_MS / 1000)
            except queue.Empty:
                continue
            start = time.perf_counter()
            error = self._pull(job)
            if error is None:
                self.stats.transfer_seconds += time.perf_counter() - start
            else:
                self.stats.pull_failures += 1
                logger.warning(
                    "KV pull for request %s from %s:%d failed (%s); it will compute its prompt itself",
                    job.request_id,
                    job.host,
                    job.port,
                    error,
                )
            self._results.put(PullResult(job.request_id, error))

    def _pull(self, job: PullJob) -> str | None:
        """One pull over a connection of its own, watched: a KV server that dies mid-pull (or was
        gone before) fails the pull as soon as the connection drops, not after PULL_TIMEOUT_S."""
        sock = zmq.Context.instance().socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        monitor = sock.get_monitor_socket(sum(_PEER_GONE))  # the events are bit flags
        try:
            sock.connect(f"tcp://{job.host}:{job.port}")
            sock.send(
                msgspec.msgpack.encode(PullRequest(job.remote_request_id, job.first_block, len(job.dest_block_ids)))
            )
            error = await_answer(sock, monitor)
            return error if error is not None else self._receive(job, sock)
        finally:
            sock.disable_monitor()
            monitor.close()
            sock.close()

    def _receive(self, job: PullJob, sock: zmq.Socket) -> str | None:
        frames = sock.recv_multipart(copy=False)
        if len(frames) < 2:
            return f"expected a header and payload frames, got {len(frames)} frames"
        try:
            header = msgspec.msgpack.decode(frames[0].buffer, type=KVFrameHeader)
        except msgspec.DecodeError as exc:
            return f"malformed frame header: {exc}"
        return self._write(job, header, [frame.buffer for frame in frames[1:]])

    def _write(self, job: PullJob, header: KVFrameHeader, payloads: list[memoryview]) -> str | None:
        if header.error is not None:
            return f"the prefill instance refused: {header.error}"
        if header.kv_cache_dtype != self.kv_cache_dtype:
            return (
                f"refused a KV frame: the prefill instance's KV cache is {header.kv_cache_dtype}, this "
                f"instance's is {self.kv_cache_dtype}: start both with the same --kv-cache-dtype"
            )
        targets = [self.kv_caches] if self.kv_scales is None else [self.kv_caches, self.kv_scales]
        if len(payloads) != len(targets):
            return f"refused a KV frame: {len(payloads)} payload frames, expected {len(targets)}"
        shapes = [frame_shape(tensors, len(job.dest_block_ids)) for tensors in targets]
        scale_shape = shapes[1] if self.kv_scales is not None else []
        cache = self.kv_caches[0]
        problems = [
            (header.request_id != job.remote_request_id, f"frame for {header.request_id}"),
            (header.first_block != job.first_block, f"frame starts at block {header.first_block}"),
            (len(header.block_ids) != len(job.dest_block_ids), f"{len(header.block_ids)} blocks"),
            (header.shape != shapes[0], f"shape {header.shape}, expected {shapes[0]}"),
            (header.scale_shape != scale_shape, f"scale shape {header.scale_shape}, expected {scale_shape}"),
            (header.dtype != dtype_name(cache.dtype), f"dtype {header.dtype}, expected {dtype_name(cache.dtype)}"),
            (crc32(payloads) != header.checksum, "checksum mismatch"),
        ]
        for bad, what in problems:
            if bad:
                return f"refused a KV frame: {what}"
        index = torch.tensor(job.dest_block_ids, device=cache.device)
        for tensors, shape, payload in zip(targets, shapes, payloads):
            dtype = tensors[0].dtype
            scatter(tensors, index, torch.frombuffer(payload, dtype=torch.uint8).view(dtype).view(shape))
        self.stats.blocks_received += len(job.dest_block_ids)
        self.stats.bytes_received += sum(payload.nbytes for payload in payloads)
        return None


def await_answer(sock: zmq.Socket, monitor: zmq.Socket) -> str | None:
    """None once the answer is there; else why it will not come."""
    poller = zmq.Poller()
    poller.register(sock, zmq.POLLIN)
    poller.register(monitor, zmq.POLLIN)
    ready = dict(poller.poll(int(PULL_TIMEOUT_S * 1000)))
    if sock in ready:
        return None
    if monitor in ready:
        event = recv_monitor_message(monitor)["event"]
        return f"the prefill instance's KV server {_PEER_GONE[event]} (is it down?)"
    return f"no answer within {PULL_TIMEOUT_S:.0f} s"


def drain(items: queue.Queue) -> list:
    """Everything in the queue now, without waiting."""
    out = []
    while True:
        try:
            out.append(items.get_nowait())
        except queue.Empty:
            return out
