"""The KV connector between two in-process connectors over loopback TCP: blocks arrive intact, and
frames that do not match (wrong request, shape, dtype, checksum) or leases that ended are refused;
a KV server that is gone or dies mid-pull fails the pull at once, one that stays silent after the
pull timeout."""

from __future__ import annotations

import threading
import time

import msgspec
import pytest
import torch
import zmq

from splitserve.config import KVTransferConfig
from splitserve.distributed.kv_transfer import pull
from splitserve.distributed.kv_transfer import transport as C
from splitserve.engine.messages import KVTransferParams
from splitserve.process_utils import free_port
from tests.helpers.kv_transfer import pull_params, pull_result

LAYERS, HEADS, BLOCKS, BS, DIM = 2, 2, 8, 4, 8


def _caches(fill: bool) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    make = (
        (lambda: torch.randn(2, HEADS, BLOCKS, BS, DIM, generator=gen))
        if fill
        else (lambda: torch.zeros(2, HEADS, BLOCKS, BS, DIM))
    )
    return [make() for _ in range(LAYERS)]


@pytest.fixture
def pair():
    prefill = C.KVConnector(KVTransferConfig("prefill", "127.0.0.1", 0, lease_seconds=30), _caches(True))
    decode = C.KVConnector(KVTransferConfig("decode"), _caches(False))
    yield prefill, decode
    prefill.shutdown()
    decode.shutdown()


def _released(connector: C.KVConnector, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        released = connector.poll_released()
        if released:
            return released
        time.sleep(0.01)
    return []


def test_blocks_arrive_intact_and_the_lease_ends(pair):
    prefill, decode = pair
    prefill.add_lease("p1", [5, 2, 7], num_pulls=1)
    decode.submit_pull("d1", pull_params(prefill), first_block=1, dest_block_ids=[0, 3])
    assert pull_result(decode).ok
    for src, dst in zip(prefill.kv_caches, decode.kv_caches):
        assert torch.equal(dst[:, :, 0], src[:, :, 2]) and torch.equal(dst[:, :, 3], src[:, :, 7])
        assert torch.count_nonzero(dst[:, :, 1]) == 0  # nothing else was written
    assert _released(prefill) == ["p1"]  # its one pull was served: the blocks can be freed
    stats = decode.snapshot_stats()
    assert stats.blocks_received == 2 and stats.bytes_received == LAYERS * 2 * HEADS * 2 * BS * DIM * 4
    assert prefill.snapshot_stats().blocks_sent == 2


def test_a_lease_serves_n_pulls(pair):
    prefill, decode = pair
    prefill.add_lease("p1", [1, 2], num_pulls=2)
    for _ in range(2):
        decode.submit_pull("d", pull_params(prefill), 0, [4, 5])
        assert pull_result(decode).ok
    decode.submit_pull("d", pull_params(prefill), 0, [4, 5])
    assert "unknown or expired lease" in pull_result(decode).error


def test_expired_lease_is_refused_and_freed(pair):
    prefill, decode = pair
    prefill.config.lease_seconds = 0.2
    prefill.add_lease("p1", [1], num_pulls=1)
    assert _released(prefill) == ["p1"]
    decode.submit_pull("d1", pull_params(prefill), 0, [0])
    result = pull_result(decode)
    assert not result.ok and "expired" in result.error
    assert prefill.snapshot_stats().lease_expiries == 1 and prefill.snapshot_stats().pulls_refused == 1
    assert decode.snapshot_stats().pull_failures == 1


def test_asking_past_the_lease_is_refused(pair):
    prefill, decode = pair
    prefill.add_lease("p1", [1, 2], num_pulls=1)
    decode.submit_pull("d1", pull_params(prefill), 1, [0, 1])
    assert "blocks 1..2 asked" in pull_result(decode).error


@pytest.mark.parametrize(
    "field, value, message",
    [
        ("request_id", "other", "frame for other"),
        ("shape", [1, 2, 3], "shape"),
        ("dtype", "bfloat16", "dtype"),
        ("checksum", 12345, "checksum mismatch"),
    ],
)
def test_frames_that_do_not_match_are_refused(pair, monkeypatch, field, value, message):
    prefill, decode = pair
    real = C.KVConnector._read_blocks

    def tampered(self, msg):
        header, data = real(self, msg)
        return msgspec.structs.replace(header, **{field: value}), data

    monkeypatch.setattr(C.KVConnector, "_read_blocks", tampered)
    prefill.add_lease("p1", [3], num_pulls=1)
    decode.submit_pull("d1", pull_params(prefill), 0, [6])
    result = pull_result(decode)
    assert not result.ok and message in result.error
    assert torch.count_nonzero(decode.kv_caches[0]) == 0  # nothing was written


def test_a_kv_server_that_is_gone_fails_the_pull_at_once(pair, monkeypatch):
    _, decode = pair
    monkeypatch.setattr(pull, "PULL_TIMEOUT_S", 20.0)
    dead = KVTransferParams(remote_host="127.0.0.1", remote_port=free_port(), remote_request_id="x")
    start = time.monotonic()
    decode.submit_pull("d1", dead, 0, [0])
    result = pull_result(decode)
    assert not result.ok and "refused the connection" in result.error
    assert time.monotonic() - start < 5


def _silent_kv_server(close_after_request: bool) -> tuple[int, threading.Thread]:
    """A KV server that takes one pull and never answers it, then (if asked) drops the connection, as
    a prefill instance killed mid-pull does."""
    sock = zmq.Context.instance().socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    port = sock.bind_to_random_port("tcp://127.0.0.1")

    def serve() -> None:
        sock.recv_multipart()
        if not close_after_request:
            time.sleep(1.0)
        sock.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return port, thread


def test_a_kv_server_that_dies_mid_pull_fails_the_pull_at_once(pair, monkeypatch):
    _, decode = pair
    monkeypatch.setattr(pull, "PULL_TIMEOUT_S", 20.0)
    port, _ = _silent_kv_server(close_after_request=True)
    start = time.monotonic()
    decode.submit_pull("d1", KVTransferParams(remote_host="127.0.0.1", remote_port=port, remote_request_id="x"), 0, [0])
    result = pull_result(decode)
    assert not result.ok and "closed the connection" in result.error
    assert time.monotonic() - start < 5


def test_no_answer_is_a_clean_failure(pair, monkeypatch):
    _, decode = pair
    monkeypatch.setattr(pull, "PULL_TIMEOUT_S", 0.3)
    port, thread = _silent_kv_server(close_after_request=False)
    decode.submit_pull("d1", KVTransferParams(remote_host="127.0.0.1", remote_port=port, remote_request_id="x"), 0, [0])
    result = pull_result(decode)
    assert not result.ok and "no answer within" in result.error
    thread.join()


def test_fault_injection_delays_each_block(monkeypatch, caplog):
    """SPLITSERVE_FAULT_KV_BLOCK_DELAY_S holds a pull's blocks back (per block), and says so in the log."""
    monkeypatch.setenv("SPLITSERVE_FAULT_KV_BLOCK_DELAY_S", "0.2")
    prefill = C.KVConnector(KVTransferConfig("prefill", "127.0.0.1", 0, lease_seconds=30), _caches(True))
    decode = C.KVConnector(KVTransferConfig("decode"), _caches(False))
    prefill.add_lease("p1", [1, 2, 3], num_pulls=1)
    start = time.monotonic()
    decode.submit_pull("d1", pull_params(prefill), 0, [4, 5, 6])
    assert pull_result(decode).ok
    assert time.monotonic() - start >= 0.6
    assert "Fault injection (SPLITSERVE_FAULT_KV_BLOCK_DELAY_S): sending 3 KV blocks of request p1" in caplog.text
    prefill.shutdown()
    decode.shutdown()


def test_a_decode_instances_offload_copies_reach_the_ranks_before_its_pulls():
    """With KV offloading on a decode instance, a pull's destination blocks may hold prefix blocks
    the tier must save first: the group sends the step's copies before any pull, then each pull."""
    from types import SimpleNamespace

    from splitserve.distributed.kv_transfer.connector import KVConnectorGroup
    from splitserve.kv_tier.ops import OFFLOAD_STORE, KVOffloadOps

    calls = []

    def call(method, *args):
        calls.append((method, *args))
        return [("127.0.0.1", 1)] if method == "start" else [None]

    group = KVConnectorGroup(call)
    ops = KVOffloadOps([(OFFLOAD_STORE, 3, 0, "")])
    params = KVTransferParams(remote_host="127.0.0.1", remote_port=1, remote_request_id="p1")
    pulls = [(SimpleNamespace(request_id=r, kv_transfer=params), 0, [3, 4]) for r in ("a", "b")]
    group.submit_pulls(pulls, ops)
    assert [c[0] for c in calls] == ["start", "apply_offload", "submit_pull", "submit_pull"]
    assert calls[1][1] is ops and calls[2][1] == "a"
    calls.clear()
    group.submit_pulls(pulls[:1], None)
    assert [c[0] for c in calls] == ["submit_pull"]
