"""Pulls between in-process KV connectors: the transfer parameters to pass, and waiting for the result."""

from __future__ import annotations

import time

from splitserve.distributed.kv_transfer import transport as C
from splitserve.engine.messages import KVTransferParams


def pull_params(prefill: C.KVConnector, request_id: str = "p1") -> KVTransferParams:
    return KVTransferParams(remote_host="127.0.0.1", remote_port=prefill.port, remote_request_id=request_id)


def pull_result(connector: C.KVConnector, timeout: float = 10.0) -> C.PullResult:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        results = connector.poll_pulled()
        if results:
            return results[0]
        time.sleep(0.01)
    raise AssertionError("no pull result")
