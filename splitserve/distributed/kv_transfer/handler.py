"""A rank's side of prefill/decode disaggregation: the KV connector over this rank's KV cache
(distributed/kv_transfer/transport.py), driven by the engine through the executor (`call_kv_connector`), so
that every rank serves and pulls its own share of the blocks."""

from __future__ import annotations

from dataclasses import dataclass, replace

from splitserve.config import KVTransferConfig
from splitserve.distributed import ParallelRank
from splitserve.distributed.kv_transfer.transport import KVConnector


@dataclass
class RemoteBlocks:
    """Where a request's blocks wait: the prefill rank this rank pulls from."""

    remote_host: str
    remote_port: int
    remote_request_id: str


class KVTransferHandler:
    def __init__(self, config: KVTransferConfig, rank: ParallelRank, host: str | None = None):
        self.config, self.rank, self.host = config, rank, host
        self.connector: KVConnector | None = None

    def handle(self, runner, method: str, args: list):
        if method == "start":
            return self.start(runner)
        if self.connector is None:
            raise RuntimeError("the KV connector has not been started")
        if method == "add_lease":
            return self.connector.add_lease(*args)
        if method == "release_lease":
            return self.connector.end_lease(*args)
        if method == "submit_pull":
            return self.submit_pull(*args)
        if method == "apply_offload":  # the tier's copies that must land before a pull (connector.submit_pulls)
            return runner.offload.apply(args[0])
        if method == "poll":
            released = self.connector.poll_released()
            pulled = [(r.request_id, r.error) for r in self.connector.poll_pulled()]
            return released, pulled, self.connector.snapshot_stats()
        if method == "rebind":  # sleep released the KV cache, or waking allocated a new one (engine/core/sleep_mode.py)
            self.connector.kv_caches = runner.kv_caches if runner is not None else []
            self.connector.kv_scales = runner.kv_scales if runner is not None else None
            return None
        if method == "shutdown":
            return self.connector.shutdown()
        raise ValueError(f"unknown KV connector call {method!r}")

    def start(self, runner) -> tuple[str, int]:
        """Serve (prefill) or pull (decode) this rank's KV cache; returns where it listens. A fixed
        --kv-port is rank 0's; rank r listens on it + r."""
        config = self.config
        if config.kv_port:
            config = replace(config, kv_port=config.kv_port + self.rank.rank)
        if self.host is not None:
            config = replace(config, kv_host=self.host)
        self.connector = KVConnector(config, runner.kv_caches, runner.kv_scales, runner.kv_spec.name)
        return config.kv_host, self.connector.port

    def submit_pull(
        self, request_id: str, endpoints: list, remote_request_id: str, first_block: int, dest_block_ids: list[int]
    ) -> None:
        host, port = endpoints[self.rank.rank]
        self.connector.submit_pull(request_id, RemoteBlocks(host, port, remote_request_id), first_block, dest_block_ids)
