"""The KV connector of one rank: moves a request's KV-cache blocks from a prefill instance to a
decode instance (with several ranks per instance, each rank moves its own share, see
distributed/kv_transfer/connector.py for the instance-wide view the engine sees).

Transport: ZMQ over TCP (works across hosts). It runs in the process that holds the rank's KV
cache, beside its work, in one thread per side, so that serving or pulling blocks never stalls a
model step:

- prefill side (KV server): a ROUTER socket answering pulls of leased blocks. A lease holds a
  finished prefill request's blocks until its `remote_num_pulls` pulls have been served or it
  expires; once it has expired a late pull is refused (the blocks may already hold other data).
- decode side (KV client, pull.py): pulls blocks into blocks the scheduler allocated, one job at a time,
  and reports each job's result to the engine loop, which then lets the request run (or, on any
  failure, computes the prompt itself). A pull fails at once when the prefill instance's KV
  server cannot be reached or drops the connection (it died), else after PULL_TIMEOUT_S without
  an answer.

Messages are typed msgspec structs (never pickle). A KV frame (frames.py) carries the request
id, the block ids, its shape and dtype and a CRC-32 of its bytes; a frame that does not match is
refused.
With a quantized KV cache (--kv-cache-dtype) the blocks' scales travel in a third frame, and both
instances must store the same kv_cache_dtype.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import msgspec
import torch
import zmq

from splitserve import envs
from splitserve.config import KVTransferConfig
from splitserve.distributed.kv_transfer.frames import (
    ConnectorMessage,
    KVFrameHeader,
    PullRequest,
    Release,
    crc32,
    dtype_name,
    gather,
)
from splitserve.distributed.kv_transfer.pull import POLL_MS, PullJob, PullSide, drain
from splitserve.distributed.kv_transfer.stats import KVTransferStats, PullResult

logger = logging.getLogger(__name__)


@dataclass
class Lease:
    block_ids: list[int]
    expires_at: float
    pulls_left: int


class KVConnector(PullSide):
    def __init__(
        self,
        config: KVTransferConfig,
        kv_caches: list[torch.Tensor],
        kv_scales: list[torch.Tensor] | None = None,
        kv_cache_dtype: str = "auto",
    ):
        self.config = config
        self.kv_caches = kv_caches  # per layer [2, num_kv_heads, num_blocks, block_size, head_dim (int4: / 2)]
        self.kv_scales = kv_scales  # per layer [2, num_kv_heads, num_blocks, block_size, fields], or None
        self.kv_cache_dtype = kv_cache_dtype  # the canonical name (KVCacheSpec.name): both sides must agree
        self.stats = KVTransferStats()
        self._running = True
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._released: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._jobs: queue.SimpleQueue[PullJob] = queue.SimpleQueue()
        self._results: queue.SimpleQueue[PullResult] = queue.SimpleQueue()
        self.port = config.kv_port
        self._threads = []
        # Both sides run on every PD instance, whatever its role, so that the role can change while it
        # serves (POST /pd_role): a former prefill instance serves its leases until they are pulled.
        if config.is_disaggregated:
            server = zmq.Context.instance().socket(zmq.ROUTER)
            server.setsockopt(zmq.LINGER, 0)
            if config.kv_port:
                server.bind(f"tcp://{config.kv_host}:{config.kv_port}")
            else:
                self.port = server.bind_to_random_port(f"tcp://{config.kv_host}")
            self._block_delay_s = envs.SPLITSERVE_FAULT_KV_BLOCK_DELAY_S or 0.0
            self._start(self._serve, server)
            logger.info(
                "KV server listening on %s:%d (leases expire after %.0f s)",
                config.kv_host,
                self.port,
                config.lease_seconds,
            )
            self._start(self._pull_loop)

    def _start(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, name=f"kv-{target.__name__.strip('_')}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def shutdown(self) -> None:
        self._running = False

    def snapshot_stats(self) -> KVTransferStats:
        with self._lock:
            self.stats.leases_active = len(self._leases)
        return msgspec.structs.replace(self.stats)

    # --- prefill side -----------------------------------------------------------------------
    def add_lease(self, request_id: str, block_ids: list[int], num_pulls: int) -> None:
        with self._lock:
            self._leases[request_id] = Lease(
                list(block_ids), time.monotonic() + self.config.lease_seconds, max(num_pulls, 1)
            )

    def poll_released(self) -> list[str]:
        """Leases that were fully pulled, released or expired: their blocks can be freed now."""
        return drain(self._released)

    def _serve(self, sock: zmq.Socket) -> None:
        decoder, encoder = msgspec.msgpack.Decoder(ConnectorMessage), msgspec.msgpack.Encoder()
        while self._running:
            if sock.poll(POLL_MS):
                identity, payload = sock.recv_multipart()
                try:
                    msg = decoder.decode(payload)
                except msgspec.DecodeError as exc:
                    logger.warning("Refused a malformed KV connector message: %s", exc)
                    continue
                if isinstance(msg, Release):
                    self.end_lease(msg.request_id)
                else:
                    header, payloads = self._read_blocks(msg)
                    self._inject_delay(header)
                    sock.send_multipart([identity, encoder.encode(header), *payloads], copy=False)
            self._expire()
        sock.close()

    def _inject_delay(self, header: KVFrameHeader) -> None:
        """Fault injection (SPLITSERVE_FAULT_KV_BLOCK_DELAY_S): hold a pull's blocks back, as a slow link would."""
        if self._block_delay_s > 0 and header.block_ids:
            delay = self._block_delay_s * len(header.block_ids)
            logger.warning(
                "Fault injection (%s): sending %d KV blocks of request %s in %.1f s",
                "SPLITSERVE_FAULT_KV_BLOCK_DELAY_S",
                len(header.block_ids),
                header.request_id,
                delay,
            )
            time.sleep(delay)

    def _read_blocks(self, msg: PullRequest) -> tuple[KVFrameHeader, list[memoryview | bytes]]:
        """The header and the payload frames: the blocks' data, then their scales if the cache has any."""
        with self._lock:
            lease = self._leases.get(msg.request_id)
            if lease is None or lease.expires_at < time.monotonic():
                self.stats.pulls_refused += 1
                return KVFrameHeader(msg.request_id, error="unknown or expired lease"), [b""]
            ids = lease.block_ids[msg.first_block : msg.first_block + msg.num_blocks]
            if msg.first_block < 0 or len(ids) != msg.num_blocks:
                self.stats.pulls_refused += 1
                return KVFrameHeader(
                    msg.request_id,
                    error=f"the lease holds {len(lease.block_ids)} blocks, "
                    f"blocks {msg.first_block}..{msg.first_block + msg.num_blocks - 1} asked",
                ), [b""]
            index = torch.tensor(ids, device=self.kv_caches[0].device)
            data = gather(self.kv_caches, index)
            scales = None if self.kv_scales is None else gather(self.kv_scales, index)
            lease.pulls_left -= 1
            if lease.pulls_left == 0:
                self._end_lease_locked(msg.request_id)
        raws = [t.view(torch.uint8).numpy().data for t in (data, scales) if t is not None]
        self.stats.blocks_sent += len(ids)
        self.stats.bytes_sent += sum(raw.nbytes for raw in raws)
        header = KVFrameHeader(
            msg.request_id,
            msg.first_block,
            ids,
            list(data.shape),
            dtype_name(data.dtype),
            crc32(raws),
            kv_cache_dtype=self.kv_cache_dtype,
            scale_shape=[] if scales is None else list(scales.shape),
        )
        return header, raws

    def end_lease(self, request_id: str) -> None:
        """The lease is over (released, or its pulls done): its blocks can be freed."""
        with self._lock:
            self._end_lease_locked(request_id)

    def _end_lease_locked(self, request_id: str) -> None:
        if self._leases.pop(request_id, None) is not None:
            self._released.put(request_id)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [rid for rid, lease in self._leases.items() if lease.expires_at < now]
            for rid in expired:
                self._end_lease_locked(rid)
        for rid in expired:
            self.stats.lease_expiries += 1
            logger.warning("KV lease of request %s expired before decode pulled it; its blocks are freed", rid)
