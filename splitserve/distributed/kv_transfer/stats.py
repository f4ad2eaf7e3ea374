"""What the KV connectors report to the engine: a pull's result and an instance's counters."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


class KVTransferStats(msgspec.Struct, array_like=True):
    """A PD instance's KV connector counters, cumulative since start."""

    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    transfer_seconds: float = 0.0  # time spent pulling (decode side)
    pull_failures: int = 0  # pulls that failed or were refused (decode side)
    pulls_refused: int = 0  # pulls this prefill instance refused (unknown or expired lease)
    lease_expiries: int = 0
    leases_active: int = 0


@dataclass
class PullResult:
    request_id: str
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None
