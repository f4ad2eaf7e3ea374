"""Rank tables: the cluster topology of a prefill/decode (PD) disaggregated deployment, in the MindIE format:
the files, their rules, and how `splitserve ranktable gen|merge` makes them.

A rank table is JSON with three server groups: "0" the scheduler (the router, one server, no devices), "1" the
prefill instances and "2" the decode instances. Each entry of a group's server_list is one instance (one
engine), named by its server_ip and its device ids; several instances may share a server_ip with disjoint
devices. Every number is written as a string, as in the MindIE specification:

    {"version": "1.0", "status": "completed", "server_group_list": [
      {"group_id": "0", "server_count": "1", "server_list": [{"server_id": "10.0.0.1", "server_ip": "10.0.0.1"}]},
      {"group_id": "1", "server_count": "1", "server_list": [{"server_id": "10.0.0.1", "server_ip": "10.0.0.1",
        "device": [{"device_id": "4", "device_ip": "10.0.0.1", "rank_id": "0"}, ...]}]},
      {"group_id": "2", ...}]}

Each machine runs `splitserve ranktable gen` for its own instances, giving its part of the global table and one
local table per instance (plus a host table for the router). `splitserve ranktable merge` joins the machines'
parts into the global table. At start-up, GLOBAL_RANK_TABLE_FILE_PATH, RANK_TABLE_FILE_PATH and NODE_PORTS
(one port per instance, in global order: every prefill instance, then every decode instance) tell a process
which role it plays; see disagg/environment.py.

A table that breaks a rule is refused with a RankTableError (a ValueError) whose message starts with
"[rule: NAME]", NAME being one of RULES.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

logger = logging.getLogger(__name__)

SCHEDULER_GROUP, PREFILL_GROUP, DECODE_GROUP = "0", "1", "2"
GROUP_IDS = (SCHEDULER_GROUP, PREFILL_GROUP, DECODE_GROUP)
ROLE_OF_GROUP = {SCHEDULER_GROUP: "router", PREFILL_GROUP: "prefill", DECODE_GROUP: "decode"}
VERSION, STATUS = "1.0", "completed"
GLOBAL_ENV, LOCAL_ENV, PORTS_ENV = "GLOBAL_RANK_TABLE_FILE_PATH", "RANK_TABLE_FILE_PATH", "NODE_PORTS"
MERGED_FILE_NAME = "global_ranktable_merge.json"
RULES = {
    "format": "the JSON has the specification's keys and types; numbers are strings of decimal digits",
    "version-status": "version and status are present (and equal across merged tables)",
    "groups": 'exactly the three groups "0", "1" and "2"',
    "server-count": "server_count equals the length of server_list",
    "scheduler": "group 0 has exactly one server (at most one in a machine's part), without devices",
    "devices": "every prefill or decode instance has at least one device",
    "rank-ids": 'the rank_ids of an instance are "0" .. "n-1" in order',
    "unique-devices": "a device id is used once per server_ip, across all instances",
    "complete": "a global table has at least one prefill and one decode instance",
    "local-shape": "a local table holds exactly one instance, or only the scheduler",
    "local-in-global": "the local table's instance appears in the global table, in the same group",
    "node-ports-integers": "NODE_PORTS is a comma-separated list of integers",
    "node-ports-count": "NODE_PORTS lists one port per instance of the global table",
    "node-ports-distinct": "NODE_PORTS has no port twice",
    "node-ports-range": "every port of NODE_PORTS is in 1..65535",
}
_NUMBER = re.compile(r"0|[1-9][0-9]*")


class RankTableError(ValueError):
    """A rank table or NODE_PORTS broke `rule` (a key of RULES); a ValueError so that the CLI reports it."""

    def __init__(self, rule: str, message: str, source: str = "") -> None:
        self.rule = rule
        where = f"{source}: " if source else ""
        super().__init__(f"[rule: {rule}] {where}{message} (rule: {RULES[rule]})")


@dataclass
class Device:
    """One accelerator of an instance: the CUDA device on NVIDIA machines, a core on CPU."""

    device_id: int
    device_ip: str
    rank_id: int

    def to_json(self) -> dict:
        return {"device_id": str(self.device_id), "device_ip": self.device_ip, "rank_id": str(self.rank_id)}


@dataclass
class RankTableServer:
    """One server_list entry: one engine (or, in group 0, the router), on server_ip, using `devices`."""

    server_id: str
    server_ip: str
    devices: list[Device] = field(default_factory=list)

    @property
    def device_ids(self) -> list[int]:
        return [d.device_id for d in self.devices]

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """What names an instance across tables: its machine and its devices in rank order."""
        return self.server_ip, tuple(self.device_ids)

    def to_json(self) -> dict:
        """The scheduler has no "device" key at all, as in the specification's example."""
        out = {"server_id": self.server_id, "server_ip": self.server_ip}
        if self.devices:
            out["device"] = [d.to_json() for d in self.devices]
        return out


@dataclass
class ServerGroup:
    """A group as written: server_count is kept as read so that validation can compare it with the list."""

    group_id: str
    server_count: int
    server_list: list[RankTableServer] = field(default_factory=list)

    def to_json(self) -> dict:
        return {
            "group_id": self.group_id,
            "server_count": str(self.server_count),
            "server_list": [s.to_json() for s in self.server_list],
        }


@dataclass
class RankTable:
    """A whole table (global, a machine's part of it, or local), mirroring the JSON; see validate_ranktable."""

    version: str
    status: str
    server_group_list: list[ServerGroup]

    def group(self, group_id: str) -> ServerGroup:
        """The group with this id; a table without it breaks the "groups" rule."""
        for g in self.server_group_list:
            if g.group_id == group_id:
                return g
        raise RankTableError("groups", f"no group {group_id!r}")

    def instances(self) -> list[tuple[str, RankTableServer]]:
        """(group id, instance) of every engine in global order: all prefill instances, then all decode ones.
        NODE_PORTS and PDLaunch.instance_index count in this order."""
        return [(gid, inst) for gid in (PREFILL_GROUP, DECODE_GROUP) for inst in self.group(gid).server_list]

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "status": self.status,
            "server_group_list": [g.to_json() for g in self.server_group_list],
        }


def make_ranktable(
    scheduler: Sequence[RankTableServer] = (),
    prefill: Sequence[RankTableServer] = (),
    decode: Sequence[RankTableServer] = (),
) -> RankTable:
    """A table with the three groups in order and server_count computed, as gen and merge write them."""
    lists = {SCHEDULER_GROUP: list(scheduler), PREFILL_GROUP: list(prefill), DECODE_GROUP: list(decode)}
    return RankTable(VERSION, STATUS, [ServerGroup(gid, len(lists[gid]), lists[gid]) for gid in GROUP_IDS])


# ---------------------------------------------------------------- parsing
def _expect(obj: Mapping, key: str, kind: type, where: str, source: str):
    """obj[key], which must be a `kind`; a missing key or a wrong type breaks the "format" rule."""
    if not isinstance(obj, Mapping) or key not in obj:
        raise RankTableError("format", f"{where} has no {key!r}", source)
    value = obj[key]
    if not isinstance(value, kind):
        raise RankTableError("format", f"{where}.{key} must be a {kind.__name__}, not {value!r}", source)
    return value


def _number(obj: Mapping, key: str, where: str, source: str) -> int:
    """A specification number: a string of decimal digits without leading zeros, so it writes back unchanged."""
    text = _expect(obj, key, str, where, source)
    if not _NUMBER.fullmatch(text):
        raise RankTableError("format", f"{where}.{key} must be a string of decimal digits, not {text!r}", source)
    return int(text)


def _instance_from_json(obj: Mapping, where: str, source: str) -> RankTableServer:
    devices = _expect(obj, "device", list, where, source) if isinstance(obj, Mapping) and "device" in obj else []
    return RankTableServer(
        server_id=_expect(obj, "server_id", str, where, source),
        server_ip=_expect(obj, "server_ip", str, where, source),
        devices=[
            Device(
                _number(d, "device_id", f"{where}.device[{j}]", source),
                _expect(d, "device_ip", str, f"{where}.device[{j}]", source),
                _number(d, "rank_id", f"{where}.device[{j}]", source),
            )
            for j, d in enumerate(devices)
        ],
    )


@dataclass
class LocalRankTable:
    """A local table in the deployment guide's shape: one instance (or the scheduler) at the top level,
    {"version", "status", "group_id": "0", "server_count": "1", "server_list": [server]}; the global
    table says which role it has."""

    version: str
    status: str
    server: RankTableServer

    def to_json(self) -> dict:
        return {
            "version": self.version,
            "status": self.status,
            "group_id": "0",
            "server_count": "1",
            "server_list": [self.server.to_json()],
        }


def local_ranktable(server: RankTableServer) -> LocalRankTable:
    return LocalRankTable(VERSION, STATUS, server)


def ranktable_from_json(obj: object, source: str = "") -> RankTable | LocalRankTable:
    """The typed table of parsed JSON; only the shape is checked here, the rules by validate_ranktable.
    A table with a top-level server_list is a local table in the guide's shape (LocalRankTable)."""
    if not isinstance(obj, Mapping):
        raise RankTableError("format", "a rank table must be a JSON object", source)
    if "server_list" in obj and "server_group_list" not in obj:
        servers = _expect(obj, "server_list", list, "table", source)
        if _number(obj, "server_count", "table", source) != len(servers) or len(servers) != 1:
            raise RankTableError("local-shape", f"a local table holds one server, this one {len(servers)}", source)
        version, status = obj.get("version", ""), obj.get("status", "")
        if not (isinstance(version, str) and version and isinstance(status, str) and status):
            raise RankTableError("version-status", "version and status must both be present and non-empty", source)
        return LocalRankTable(version, status, _instance_from_json(servers[0], "server_list[0]", source))
    groups = []
    for i, g in enumerate(_expect(obj, "server_group_list", list, "table", source)):
        where = f"server_group_list[{i}]"
        servers = _expect(g, "server_list", list, where, source)
        groups.append(
            ServerGroup(
                _expect(g, "group_id", str, where, source),
                _number(g, "server_count", where, source),
                [_instance_from_json(s, f"{where}.server_list[{j}]", source) for j, s in enumerate(servers)],
            )
        )
    version, status = obj.get("version", ""), obj.get("status", "")  # when missing: the version-status rule
    if not isinstance(version, str) or not isinstance(status, str):
        raise RankTableError("format", f"version and status must be strings, not {version!r} and {status!r}", source)
    return RankTable(version, status, groups)


def load_ranktable(path: str | os.PathLike, *, complete: bool = False) -> RankTable | LocalRankTable:
    """Read and validate a table; complete=True for a global table that a deployment will run from."""
    source = str(path)
    try:
        obj = json.loads(Path(path).read_text())
    except json.JSONDecodeError as exc:
        raise RankTableError("format", f"not JSON: {exc}", source) from exc
    table = ranktable_from_json(obj, source)
    if isinstance(table, RankTable):
        validate_ranktable(table, complete=complete, source=source)
    elif complete:
        raise RankTableError("groups", "a local table where the global table was expected", source)
    return table


def write_ranktable(table: RankTable | LocalRankTable, path: str | os.PathLike) -> Path:
    """Write the table as indented JSON and return the path, creating its directory when missing."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(table.to_json(), indent=2) + "\n")
    return path


# ---------------------------------------------------------------- validation
def validate_ranktable(table: RankTable, *, complete: bool = True, source: str = "") -> None:
    """Check every rule of one table. complete=False is for a machine's part of the global table or a local
    table, which may lack the scheduler or a role; a merged table, or one a deployment runs from, is complete."""
    if not table.version or not table.status:
        raise RankTableError("version-status", "version and status must both be present and non-empty", source)
    ids = [g.group_id for g in table.server_group_list]
    if sorted(ids) != sorted(GROUP_IDS):
        raise RankTableError("groups", f"the group ids are {ids}", source)
    for g in table.server_group_list:
        if g.server_count != len(g.server_list):
            raise RankTableError(
                "server-count",
                f"group {g.group_id!r} says server_count {g.server_count} but lists {len(g.server_list)} servers",
                source,
            )
    scheduler = table.group(SCHEDULER_GROUP).server_list
    if len(scheduler) > 1 or (complete and not scheduler) or any(s.devices for s in scheduler):
        raise RankTableError(
            "scheduler",
            f"group 0 holds {len(scheduler)} servers, with {sum(len(s.devices) for s in scheduler)} devices",
            source,
        )
    used: set[tuple[str, int]] = set()
    for gid, inst in table.instances():
        _check_instance(gid, inst, used, source)
    if complete and not (table.group(PREFILL_GROUP).server_list and table.group(DECODE_GROUP).server_list):
        raise RankTableError("complete", "a prefill or a decode instance is missing", source)


def _check_instance(gid: str, inst: RankTableServer, used: set[tuple[str, int]], source: str) -> None:
    """The per-instance rules; `used` collects (server_ip, device_id) across the instances seen so far."""
    name = f"{ROLE_OF_GROUP[gid]} instance on {inst.server_ip}"
    if not inst.devices:
        raise RankTableError("devices", f"the {name} has no device", source)
    ranks = [d.rank_id for d in inst.devices]
    if ranks != list(range(len(ranks))):
        raise RankTableError("rank-ids", f"the {name} has rank_ids {ranks}", source)
    for d in inst.devices:
        if (inst.server_ip, d.device_id) in used:
            raise RankTableError("unique-devices", f"device {d.device_id} is used twice on {inst.server_ip}", source)
        used.add((inst.server_ip, d.device_id))


def validate_local_ranktable(
    local: RankTable, global_table: RankTable, source: str = ""
) -> tuple[str, RankTableServer]:
    """(group id, instance) that a local table describes, after checking that the global table has it in the
    same group; for the host table the group is "0" and the instance the scheduler. A local table in the
    guide's shape (LocalRankTable) takes the group of the global table that holds its server."""
    if isinstance(local, LocalRankTable):
        entry = local.server
        groups = [g.group_id for g in global_table.server_group_list if entry.key in {s.key for s in g.server_list}]
        if not groups:
            raise RankTableError(
                "local-in-global",
                f"the server {entry.server_ip} with devices {entry.device_ids} is in no group of the global table",
                source,
            )
        return groups[0], entry
    validate_ranktable(local, complete=False, source=source)
    scheduler = local.group(SCHEDULER_GROUP).server_list
    entries = scheduler + [inst for _, inst in local.instances()]
    if len(entries) != 1:
        raise RankTableError("local-shape", f"it holds {len(entries)} servers", source)
    gid = SCHEDULER_GROUP if scheduler else local.instances()[0][0]
    entry = entries[0]
    if entry.key not in {s.key for s in global_table.group(gid).server_list}:
        raise RankTableError(
            "local-in-global",
            f"the {ROLE_OF_GROUP[gid]} server {entry.server_ip} with devices "
            f"{entry.device_ids} is not in group {gid!r} of the global table",
            source,
        )
    return gid, entry
