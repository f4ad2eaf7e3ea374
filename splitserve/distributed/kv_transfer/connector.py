"""The KV connector as the engine sees it: one object for all of an instance's ranks.

Each rank runs its own KV connector over its own KV cache (distributed/kv_transfer/transport.py: the
transport, leases and pulls), so that with tensor parallelism every rank moves its own KV heads
(and with pipeline parallelism its own layers). This group forwards the engine's calls to every
rank through the executor and joins their answers: a lease ends when every rank's has ended, and
a pull has arrived when every rank's has (and failed if any rank's failed). A decode instance
pulls only from a prefill instance with as many ranks as itself (rank r from rank r).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import msgspec

from splitserve import envs
from splitserve.distributed.kv_transfer.stats import KVTransferStats, PullResult

logger = logging.getLogger(__name__)

_IDLE_POLL_S = 1.0  # with nothing outstanding, the ranks' counters are still refreshed this often


class KVConnectorGroup:
    def __init__(self, call: Callable[..., list]):
        """`call(method, *args)` runs a KV connector method on every rank, answers in rank order."""
        self._call = call
        self.endpoints: list[tuple[str, int]] = [tuple(e) for e in call("start")]
        self._leases: dict[str, int] = {}  # lease -> ranks whose lease has not ended yet
        self._pulls: dict[str, list[str | None]] = {}  # pull -> the errors (or None) of the ranks that finished
        self._done: list[PullResult] = []  # pulls refused before they started
        self._stats = KVTransferStats()
        self._last_poll = 0.0
        self._lease_delay_s = envs.SPLITSERVE_FAULT_KV_LEASE_DELAY_S or 0.0

    @property
    def num_ranks(self) -> int:
        return len(self.endpoints)

    @property
    def port(self) -> int:
        return self.endpoints[0][1]

    # --- prefill side -----------------------------------------------------------------------
    def add_lease(self, request_id: str, block_ids: list[int], num_pulls: int) -> None:
        self._call("add_lease", request_id, list(block_ids), num_pulls)
        self._leases[request_id] = self.num_ranks
        if self._lease_delay_s > 0:
            logger.warning(
                "Fault injection (%s): request %s is leased; its answer waits %.1f s",
                "SPLITSERVE_FAULT_KV_LEASE_DELAY_S",
                request_id,
                self._lease_delay_s,
            )
            time.sleep(self._lease_delay_s)

    def release_lease(self, request_id: str) -> None:
        """End a lease before its pulls or its time are done (the decode side will not pull it)."""
        if request_id in self._leases:
            self._call("release_lease", request_id)

    # --- decode side ------------------------------------------------------------------------
    def submit_pulls(self, pulls: list, offload_ops=None) -> None:
        """A step's pulls, (request, first block, destination block ids) each. The offloading tier's
        copies decided with them (`offload_ops`, KVOffloadOps taken out of the step) are made first:
        a pull writes into its blocks as soon as it is submitted, and a block it was given may hold
        a prefix block that the tier must save before it is overwritten."""
        if offload_ops is not None:
            self._call("apply_offload", offload_ops)
        for request, first_block, dest in pulls:
            self.submit_pull(request.request_id, request.kv_transfer, first_block, dest)

    def submit_pull(self, request_id: str, params, first_block: int, dest_block_ids: list[int]) -> None:
        """Pull blocks first_block.. of the remote request named in `params` (KVTransferParams)."""
        endpoints = params.remote_endpoints or [(params.remote_host, params.remote_port)]
        if len(endpoints) != self.num_ranks:
            error = (
                f"the prefill instance has {len(endpoints)} ranks and this one {self.num_ranks}: prefill and "
                "decode instances must have the same tensor- and pipeline-parallel sizes"
            )
            logger.warning("KV pull for request %s refused: %s", request_id, error)
            self._done.append(PullResult(request_id, error))
            return
        self._call(
            "submit_pull",
            request_id,
            [list(e) for e in endpoints],
            params.remote_request_id,
            first_block,
            list(dest_block_ids),
        )
        self._pulls[request_id] = []

    # --- both -------------------------------------------------------------------------------
    def rebind(self) -> None:
        """Every rank's connector takes its runner's KV cache again: after sleep released it (so that
        its memory is freed) and after waking allocated a new one (so that pulls and leases use it)."""
        self._call("rebind")

    def poll(self) -> tuple[list[str], list[PullResult]]:
        """Leases that ended on every rank, and pulls that finished on every rank. Asks the ranks
        at every call while something is outstanding, else once a second (for their counters)."""
        done, self._done = self._done, []
        now = time.monotonic()
        if not self._leases and not self._pulls and now - self._last_poll < _IDLE_POLL_S:
            return [], done
        self._last_poll = now
        answers = self._call("poll")
        # Across processes the counters arrive as plain msgpack (a list): back to the struct.
        self._stats = _combine([msgspec.convert(stats, KVTransferStats) for _, _, stats in answers])
        return self._count_releases([rid for released, _, _ in answers for rid in released]), done + self._join_pulls(
            [p for _, pulled, _ in answers for p in pulled]
        )

    def _count_releases(self, released: list[str]) -> list[str]:
        ended = []
        for rid in released:
            if rid in self._leases:
                self._leases[rid] -= 1
                if self._leases[rid] == 0:
                    del self._leases[rid]
                    ended.append(rid)
        return ended

    def _join_pulls(self, pulled: list) -> list[PullResult]:
        finished = []
        for rid, error in pulled:
            errors = self._pulls.get(rid)
            if errors is None:
                continue
            errors.append(error)
            if len(errors) == self.num_ranks:
                del self._pulls[rid]
                failed = [e for e in errors if e is not None]
                finished.append(PullResult(rid, "; ".join(failed) if failed else None))
        return finished

    def snapshot_stats(self) -> KVTransferStats:
        return self._stats

    def shutdown(self) -> None:
        self._call("shutdown")


def _combine(per_rank: list[KVTransferStats]) -> KVTransferStats:
    """The instance's counters: bytes add up over the ranks; blocks, leases and failures are the
    same requests seen by every rank, so rank 0's (or the worst rank's) count."""
    first = per_rank[0]
    return KVTransferStats(
        blocks_sent=first.blocks_sent,
        bytes_sent=sum(s.bytes_sent for s in per_rank),
        blocks_received=first.blocks_received,
        bytes_received=sum(s.bytes_received for s in per_rank),
        transfer_seconds=max(s.transfer_seconds for s in per_rank),
        pull_failures=max(s.pull_failures for s in per_rank),
        pulls_refused=max(s.pulls_refused for s in per_rank),
        lease_expiries=max(s.lease_expiries for s in per_rank),
        leases_active=first.leases_active,
    )
