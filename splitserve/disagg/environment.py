"""The start-up environment of a process of a prefill/decode (PD) deployment run from rank tables:
GLOBAL_RANK_TABLE_FILE_PATH, RANK_TABLE_FILE_PATH and NODE_PORTS say whether this process is a prefill
instance, a decode instance or the router, on which devices, and (for the router) at which URLs the
instances listen. The tables themselves, and their rules, are disagg/ranktable.py's."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from splitserve.disagg.ranktable import (
    DECODE_GROUP,
    GLOBAL_ENV,
    LOCAL_ENV,
    PORTS_ENV,
    PREFILL_GROUP,
    ROLE_OF_GROUP,
    SCHEDULER_GROUP,
    RankTable,
    RankTableError,
    load_ranktable,
    validate_local_ranktable,
)


@dataclass(frozen=True)
class PDLaunch:
    """What a process of a PD deployment is: an engine ("prefill"/"decode") on device_ids, instance_index
    counting in global order; or the "router" (instance_index None), with the URLs of every instance."""

    role: str
    server_ip: str
    device_ids: list[int]
    instance_index: int | None
    global_ranktable: RankTable
    prefill_urls: list[str] = field(default_factory=list)
    decode_urls: list[str] = field(default_factory=list)
    use_openai: bool = True  # USE_OPENAI (router only): 0 serves vLLM's native API instead of OpenAI's


USE_OPENAI_ENV = "USE_OPENAI"


def parse_use_openai(env: Mapping[str, str]) -> bool:
    """USE_OPENAI, the Ascend guide's switch of the entry's API: 1 (default) OpenAI's, 0 vLLM's native."""
    value = env.get(USE_OPENAI_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{USE_OPENAI_ENV} must be 1 (the OpenAI API) or 0 (vLLM's native /generate), got {value!r}")
    return value == "1"


def parse_node_ports(value: str, global_table: RankTable) -> list[int]:
    """NODE_PORTS as one port per instance of the global table, in global order (prefill, then decode)."""
    try:
        ports = [int(p) for p in value.split(",")]
    except ValueError as exc:
        raise RankTableError("node-ports-integers", f"{PORTS_ENV}={value!r}", PORTS_ENV) from exc
    count = len(global_table.instances())
    if len(ports) != count:
        raise RankTableError("node-ports-count", f"{len(ports)} ports for {count} instances", PORTS_ENV)
    if len(set(ports)) != len(ports):
        raise RankTableError("node-ports-distinct", f"{PORTS_ENV}={value!r}", PORTS_ENV)
    if not all(1 <= p <= 65535 for p in ports):
        raise RankTableError("node-ports-range", f"{PORTS_ENV}={value!r}", PORTS_ENV)
    return ports


def _url(server_ip: str, port: int) -> str:
    host = f"[{server_ip}]" if ":" in server_ip else server_ip  # an IPv6 address needs brackets in a URL
    return f"http://{host}:{port}"


def resolve_pd_environment(env: Mapping[str, str] = os.environ) -> PDLaunch | None:
    """The PD role of this process from GLOBAL_RANK_TABLE_FILE_PATH (None when unset: no disaggregation),
    RANK_TABLE_FILE_PATH (the local table, whose content decides the role), NODE_PORTS (required by the
    router; checked for engines too when set, so that a wrong deployment fails at every start) and, for
    the router, USE_OPENAI."""
    global_path = env.get(GLOBAL_ENV)
    if not global_path:
        return None
    local_path = env.get(LOCAL_ENV)
    if not local_path:
        raise ValueError(f"{LOCAL_ENV} (the local rank table) must be set when {GLOBAL_ENV} is")
    global_table = load_ranktable(global_path, complete=True)
    gid, entry = validate_local_ranktable(load_ranktable(local_path), global_table, source=local_path)
    ports_text = env.get(PORTS_ENV)
    if gid == SCHEDULER_GROUP and not ports_text:
        raise ValueError(f"{PORTS_ENV} (one port per instance, prefill then decode) must be set for the router")
    ports = parse_node_ports(ports_text, global_table) if ports_text else []
    instances = global_table.instances()
    if gid != SCHEDULER_GROUP:
        index = [inst.key for _, inst in instances].index(entry.key)
        return PDLaunch(ROLE_OF_GROUP[gid], entry.server_ip, entry.device_ids, index, global_table)
    urls = {
        g: [_url(inst.server_ip, port) for (ig, inst), port in zip(instances, ports) if ig == g]
        for g in (PREFILL_GROUP, DECODE_GROUP)
    }
    return PDLaunch(
        "router",
        entry.server_ip,
        [],
        None,
        global_table,
        urls[PREFILL_GROUP],
        urls[DECODE_GROUP],
        use_openai=parse_use_openai(env),
    )
