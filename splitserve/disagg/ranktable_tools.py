"""Making rank tables: this machine's part of the global table and its local tables (`splitserve
ranktable gen`), and one global table from the machines' parts (`merge`). The format and its rules
are in ranktable.py."""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Sequence

from splitserve.disagg.ranktable import (
    _NUMBER,
    DECODE_GROUP,
    GROUP_IDS,
    PREFILL_GROUP,
    Device,
    LocalRankTable,
    RankTable,
    RankTableError,
    RankTableServer,
    local_ranktable,
    make_ranktable,
    validate_ranktable,
)

logger = logging.getLogger(__name__)


def parse_server_list(text: str | Sequence[str] | None) -> list[list[int]]:
    """The device ids of each instance: "4,5" is one instance of two devices; instances are separated by
    spaces, as the deployment guide writes them ("4,5 6,7", or several command-line words), or by ';'."""
    if text is None:
        return []
    words = [text] if isinstance(text, str) else list(text)
    parts = [p for w in words for p in w.replace(";", " ").split()]
    text = " ".join(words)
    instances = []
    for part in parts:
        ids = [s.strip() for s in part.split(",")]
        if not all(_NUMBER.fullmatch(s) for s in ids):
            raise ValueError(
                f"bad device list {part!r} in {text!r}: expected comma-separated device ids "
                f"(non-negative integers), instances separated by spaces"
            )
        instances.append([int(s) for s in ids])
    return instances


def default_server_ip() -> str:
    """This machine's address as its hostname resolves (what other machines would use), or 127.0.0.1 when the
    hostname does not resolve to an IPv4 address. A loopback result (Debian maps the hostname to 127.0.1.1)
    is kept but warned about: other machines cannot reach it, so pass --server-ip for a multi-machine table."""
    try:
        ip = socket.gethostbyname(socket.gethostname())
        if ipaddress.ip_address(ip).is_loopback:
            logger.warning(
                "this machine's hostname resolves to %s, a loopback address; "
                "pass --server-ip for a table that other machines use",
                ip,
            )
        return ip
    except (OSError, ValueError):
        return "127.0.0.1"


def _instance(server_ip: str, device_ids: Sequence[int]) -> RankTableServer:
    return RankTableServer(server_ip, server_ip, [Device(d, server_ip, rank) for rank, d in enumerate(device_ids)])


def generate_ranktables(
    server_ip: str, prefill: Sequence[Sequence[int]], decode: Sequence[Sequence[int]], api_server: bool
) -> dict[str, RankTable | LocalRankTable]:
    """File name -> table for one machine: its part of the global table, one local table per instance, and
    the host table with api_server. Refuses a bad IP, no instance and no api server, a device used twice and
    two instances whose file names would collide (device ids 1,23 and 12,3 both give "123")."""
    try:
        ipaddress.ip_address(server_ip)
    except ValueError as exc:
        raise ValueError(f"--server-ip {server_ip!r} is not an IP address") from exc
    if not (prefill or decode or api_server):
        raise ValueError("nothing to generate: give --prefill-server-list, --decode-server-list or --api-server")
    scheduler = [RankTableServer(server_ip, server_ip)] if api_server else []
    roles = {
        PREFILL_GROUP: [_instance(server_ip, ids) for ids in prefill],
        DECODE_GROUP: [_instance(server_ip, ids) for ids in decode],
    }
    part = make_ranktable(scheduler, roles[PREFILL_GROUP], roles[DECODE_GROUP])
    validate_ranktable(part, complete=False)
    tables = {f"global_ranktable_{server_ip}.json": part}
    if api_server:
        tables[f"local_ranktable_{server_ip}_host.json"] = local_ranktable(scheduler[0])
    for _, inst in part.instances():
        name = f"local_ranktable_{server_ip}_{''.join(map(str, inst.device_ids))}.json"
        if name in tables:
            raise ValueError(f"two instances on {server_ip} would both write {name}; renumber their devices")
        tables[name] = local_ranktable(inst)
    return tables


def merge_ranktables(tables: Sequence[RankTable], source: str = "") -> RankTable:
    """One global table from the machines' parts: each group's servers concatenated in the given order, counts
    recomputed, then validated as complete."""
    if not tables:
        raise ValueError("no rank table to merge")
    if not all(isinstance(t, RankTable) for t in tables):
        raise ValueError("merge takes the machines' global tables (global_ranktable_<ip>.json), not local ones")
    versions = {t.version for t in tables}
    if len(versions) > 1:
        raise RankTableError("version-status", f"the tables have different versions {sorted(versions)}", source)
    merged = make_ranktable(*([inst for t in tables for inst in t.group(gid).server_list] for gid in GROUP_IDS))
    merged.version = tables[0].version
    validate_ranktable(merged, complete=True, source=source)
    return merged
