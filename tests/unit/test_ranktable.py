"""Rank tables: `splitserve ranktable gen/merge` through the CLI entry point, every validation rule broken
once (the message must name the rule), and resolve_pd_environment for a prefill instance, a decode instance
and the router. Pure file and JSON work: no model, no network."""

from __future__ import annotations

import copy
import json

import pytest

from splitserve.disagg.environment import PDLaunch, parse_node_ports, resolve_pd_environment
from splitserve.disagg.ranktable import (
    RankTableError,
    load_ranktable,
    ranktable_from_json,
    validate_local_ranktable,
)
from splitserve.disagg.ranktable_tools import generate_ranktables, parse_server_list
from splitserve.entrypoints.cli import main

IP = "10.0.0.1"
SCHEDULER = {"server_id": IP, "server_ip": IP}
PREFILL_45 = {
    "server_id": IP,
    "server_ip": IP,
    "device": [
        {"device_id": "4", "device_ip": IP, "rank_id": "0"},
        {"device_id": "5", "device_ip": IP, "rank_id": "1"},
    ],
}
DECODE_67 = {
    "server_id": IP,
    "server_ip": IP,
    "device": [
        {"device_id": "6", "device_ip": IP, "rank_id": "0"},
        {"device_id": "7", "device_ip": IP, "rank_id": "1"},
    ],
}


def table(scheduler=(), prefill=(), decode=()) -> dict:
    """A rank table dict in the specification's layout, with counts matching the lists."""
    groups = [("0", list(scheduler)), ("1", list(prefill)), ("2", list(decode))]
    return {
        "version": "1.0",
        "status": "completed",
        "server_group_list": [
            {"group_id": gid, "server_count": str(len(servers)), "server_list": servers} for gid, servers in groups
        ],
    }


SPEC_GLOBAL = table([SCHEDULER], [PREFILL_45], [DECODE_67])


def write(path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


def local(server: dict) -> dict:
    """A local rank table in the deployment guide's shape: the one server at the top level."""
    return {"version": "1.0", "status": "completed", "group_id": "0", "server_count": "1", "server_list": [server]}


def read(path) -> dict:
    return json.loads(path.read_text())


def cli_error(args, caplog) -> str:
    """Run the CLI expecting the one-line refusal (exit code 2); return what it logged."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    return caplog.text


# ---------------------------------------------------------------- gen and merge
def test_gen_specification_example(tmp_path, capsys):
    main(
        [
            "ranktable",
            "gen",
            "--prefill-server-list",
            "4,5",
            "--decode-server-list",
            "6,7",
            "--api-server",
            "--server-ip",
            IP,
            "--save-dir",
            str(tmp_path / "save_dir"),
        ]
    )
    out = tmp_path / "save_dir"
    expected = {
        f"global_ranktable_{IP}.json": SPEC_GLOBAL,
        f"local_ranktable_{IP}_host.json": local(SCHEDULER),
        f"local_ranktable_{IP}_45.json": local(PREFILL_45),
        f"local_ranktable_{IP}_67.json": local(DECODE_67),
    }
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)
    for name, obj in expected.items():
        assert read(out / name) == obj, name
    assert sorted(capsys.readouterr().out.split()) == sorted(str(out / name) for name in expected)


def test_gen_several_instances_per_role_and_no_api_server(tmp_path):
    main(
        [
            "ranktable",
            "gen",
            "--prefill-server-list",
            "0;1",
            "--decode-server-list",
            "2,3",
            "--server-ip",
            IP,
            "--save-dir",
            str(tmp_path),
        ]
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [
            f"global_ranktable_{IP}.json",
            f"local_ranktable_{IP}_0.json",
            f"local_ranktable_{IP}_1.json",
            f"local_ranktable_{IP}_23.json",
        ]
    )
    part = read(tmp_path / f"global_ranktable_{IP}.json")
    assert [g["server_count"] for g in part["server_group_list"]] == ["0", "2", "1"]
    prefill = part["server_group_list"][1]["server_list"]
    assert [[d["device_id"] for d in s["device"]] for s in prefill] == [["0"], ["1"]]
    assert read(tmp_path / f"local_ranktable_{IP}_23.json")["server_list"][0]["device"] == [
        {"device_id": "2", "device_ip": IP, "rank_id": "0"},
        {"device_id": "3", "device_ip": IP, "rank_id": "1"},
    ]


def test_parse_server_list():
    assert parse_server_list("4,5") == [[4, 5]]
    assert parse_server_list("0;1") == [[0], [1]]
    # As the deployment guide writes them: instances separated by spaces, in one word or several.
    assert parse_server_list("4,5 6,7") == parse_server_list(["4,5", "6,7"]) == [[4, 5], [6, 7]]
    assert parse_server_list("") == [] and parse_server_list(None) == [] and parse_server_list([]) == []
    for bad in ("a", "4,,5", "4,", "-1", "4.5", "04"):
        with pytest.raises(ValueError, match="bad device list"):
            parse_server_list(bad)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--prefill-server-list", "4,4"], "rule: unique-devices"),
        (["--prefill-server-list", "4", "--decode-server-list", "4"], "rule: unique-devices"),
        (["--prefill-server-list", "4,x"], "bad device list"),
        ([], "nothing to generate"),
        (["--prefill-server-list", "1,23;12,3"], "would both write"),
    ],
)
def test_gen_refuses_bad_input(tmp_path, caplog, args, message):
    log = cli_error(["ranktable", "gen", "--server-ip", IP, "--save-dir", str(tmp_path), *args], caplog)
    assert message in log
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


def test_gen_refuses_a_server_ip_that_is_no_address():
    with pytest.raises(ValueError, match="not an IP address"):
        generate_ranktables("10.0.0", [[0]], [], False)


def gen_two_machines(tmp_path) -> dict:
    """Machine A (10.0.0.1) runs the router and two prefill instances; B (10.0.0.2) one prefill instance and
    one decode instance of two devices, reusing A's device numbers. Returns the paths of interest."""
    for ip, extra in (
        ("10.0.0.1", ["--prefill-server-list", "0;1", "--api-server"]),
        ("10.0.0.2", ["--prefill-server-list", "0", "--decode-server-list", "1,2"]),
    ):
        main(["ranktable", "gen", "--server-ip", ip, "--save-dir", str(tmp_path / ip), *extra])
    parts = [str(tmp_path / ip / f"global_ranktable_{ip}.json") for ip in ("10.0.0.1", "10.0.0.2")]
    main(["ranktable", "merge", "--global-ranktable-list", *parts, "--save-dir", str(tmp_path / "merged")])
    return {
        "global": tmp_path / "merged" / "global_ranktable_merge.json",
        "parts": parts,
        "host": tmp_path / "10.0.0.1" / "local_ranktable_10.0.0.1_host.json",
        "a1": tmp_path / "10.0.0.1" / "local_ranktable_10.0.0.1_1.json",
        "b0": tmp_path / "10.0.0.2" / "local_ranktable_10.0.0.2_0.json",
        "b12": tmp_path / "10.0.0.2" / "local_ranktable_10.0.0.2_12.json",
    }


def instance(ip, *device_ids) -> dict:
    return {
        "server_id": ip,
        "server_ip": ip,
        "device": [{"device_id": str(d), "device_ip": ip, "rank_id": str(r)} for r, d in enumerate(device_ids)],
    }


def test_merge_two_machines(tmp_path, capsys):
    paths = gen_two_machines(tmp_path)
    assert capsys.readouterr().out.split()[-1] == str(paths["global"])
    assert read(paths["global"]) == table(
        [{"server_id": "10.0.0.1", "server_ip": "10.0.0.1"}],
        [instance("10.0.0.1", 0), instance("10.0.0.1", 1), instance("10.0.0.2", 0)],
        [instance("10.0.0.2", 1, 2)],
    )
    merged = load_ranktable(paths["global"], complete=True)
    assert [(gid, inst.server_ip, inst.device_ids) for gid, inst in merged.instances()] == [
        ("1", "10.0.0.1", [0]),
        ("1", "10.0.0.1", [1]),
        ("1", "10.0.0.2", [0]),
        ("2", "10.0.0.2", [1, 2]),
    ]


def test_merge_keeps_file_order(tmp_path):
    paths = gen_two_machines(tmp_path)
    main(["ranktable", "merge", "--global-ranktable-list", *reversed(paths["parts"]), "--save-dir", str(tmp_path)])
    prefill = read(tmp_path / "global_ranktable_merge.json")["server_group_list"][1]["server_list"]
    assert [s["server_ip"] for s in prefill] == ["10.0.0.2", "10.0.0.1", "10.0.0.1"]


def test_merge_refuses_incomplete_or_doubled_tables(tmp_path, caplog):
    paths = gen_two_machines(tmp_path)
    a, b = paths["parts"]
    assert "rule: scheduler" in cli_error(
        ["ranktable", "merge", "--global-ranktable-list", b, "--save-dir", str(tmp_path / "x")], caplog
    )
    caplog.clear()
    assert "rule: complete" in cli_error(
        ["ranktable", "merge", "--global-ranktable-list", a, "--save-dir", str(tmp_path / "x")], caplog
    )
    caplog.clear()
    assert "rule: unique-devices" in cli_error(
        ["ranktable", "merge", "--global-ranktable-list", a, b, b, "--save-dir", str(tmp_path / "x")], caplog
    )
    assert not (tmp_path / "x").exists()


# ---------------------------------------------------------------- validation rules
def test_round_trip_keeps_the_json():
    assert ranktable_from_json(copy.deepcopy(SPEC_GLOBAL)).to_json() == SPEC_GLOBAL


def test_same_device_ids_on_two_machines_are_fine(tmp_path):
    obj = table([SCHEDULER], [PREFILL_45], [instance("10.0.0.2", 4, 5)])
    assert load_ranktable(write(tmp_path / "t.json", obj), complete=True).group("2").server_list[0].device_ids == [4, 5]


def _groups(t):
    return t["server_group_list"]


def _drop(d, key):
    del d[key]


BROKEN = {
    "missing version": ("version-status", lambda t: _drop(t, "version")),
    "empty status": ("version-status", lambda t: t.update(status="")),
    "missing group": ("groups", lambda t: _groups(t).pop(2)),
    "group twice": ("groups", lambda t: _groups(t).append(copy.deepcopy(_groups(t)[1]))),
    "unknown group": ("groups", lambda t: _groups(t)[2].update(group_id="3")),
    "two servers in group 0": (
        "scheduler",
        lambda t: _groups(t)[0].update(
            server_count="2", server_list=[SCHEDULER, {"server_id": "10.0.0.2", "server_ip": "10.0.0.2"}]
        ),
    ),
    "no server in group 0": ("scheduler", lambda t: _groups(t)[0].update(server_count="0", server_list=[])),
    "device in group 0": ("scheduler", lambda t: _groups(t)[0].update(server_list=[instance(IP, 0)])),
    "server_count mismatch": ("server-count", lambda t: _groups(t)[1].update(server_count="2")),
    "instance without devices": ("devices", lambda t: _groups(t)[1]["server_list"][0].update(device=[])),
    "instance without device key": ("devices", lambda t: _drop(_groups(t)[2]["server_list"][0], "device")),
    "rank ids out of order": ("rank-ids", lambda t: _groups(t)[1]["server_list"][0]["device"][0].update(rank_id="1")),
    "rank ids not from 0": (
        "rank-ids",
        lambda t: [d.update(rank_id=str(int(d["rank_id"]) + 1)) for d in _groups(t)[2]["server_list"][0]["device"]],
    ),
    "duplicate device across roles": (
        "unique-devices",
        lambda t: _groups(t)[2]["server_list"][0]["device"][0].update(device_id="5"),
    ),
    "no decode instance": ("complete", lambda t: _groups(t)[2].update(server_count="0", server_list=[])),
    "number not a string": ("format", lambda t: _groups(t)[1].update(server_count=1)),
    "device id not decimal": (
        "format",
        lambda t: _groups(t)[1]["server_list"][0]["device"][0].update(device_id="npu4"),
    ),
    "missing server_ip": ("format", lambda t: _drop(_groups(t)[0]["server_list"][0], "server_ip")),
}


@pytest.mark.parametrize("case", list(BROKEN))
def test_each_rule_is_named_when_broken(tmp_path, case):
    rule, breaker = BROKEN[case]
    obj = copy.deepcopy(SPEC_GLOBAL)
    breaker(obj)
    with pytest.raises(RankTableError, match=rf"\[rule: {rule}\]") as exc:
        load_ranktable(write(tmp_path / "t.json", obj), complete=True)
    assert exc.value.rule == rule and "t.json" in str(exc.value)


def test_not_json_is_a_format_error(tmp_path):
    (tmp_path / "t.json").write_text("{")
    with pytest.raises(RankTableError, match=r"\[rule: format\] .*not JSON"):
        load_ranktable(tmp_path / "t.json")


def test_a_machines_part_is_not_complete(tmp_path):
    obj = table(prefill=[PREFILL_45])
    assert load_ranktable(write(tmp_path / "t.json", obj)).group("1").server_count == 1
    with pytest.raises(RankTableError, match=r"\[rule: scheduler\]"):
        load_ranktable(write(tmp_path / "t.json", obj), complete=True)


@pytest.mark.parametrize(
    "local, rule",
    [
        (table(prefill=[instance(IP, 4, 6)]), "local-in-global"),
        (table(prefill=[instance(IP, 5, 4)]), "local-in-global"),  # same devices, other rank order
        (table(decode=[PREFILL_45]), "local-in-global"),  # the instance, but in the other group
        (table(prefill=[instance("10.0.0.9", 4, 5)]), "local-in-global"),
        (table(scheduler=[{"server_id": "10.0.0.9", "server_ip": "10.0.0.9"}]), "local-in-global"),
        (table(prefill=[PREFILL_45], decode=[DECODE_67]), "local-shape"),
        (table(scheduler=[SCHEDULER], prefill=[PREFILL_45]), "local-shape"),
        (table(), "local-shape"),
    ],
)
def test_local_table_must_match_the_global_one(local, rule):
    with pytest.raises(RankTableError, match=rf"\[rule: {rule}\]"):
        validate_local_ranktable(ranktable_from_json(local), ranktable_from_json(SPEC_GLOBAL))


def test_local_tables_found_in_the_global_one():
    global_table = ranktable_from_json(SPEC_GLOBAL)
    gid, inst = validate_local_ranktable(ranktable_from_json(table(decode=[DECODE_67])), global_table)
    assert (gid, inst.device_ids) == ("2", [6, 7])
    assert validate_local_ranktable(ranktable_from_json(table([SCHEDULER])), global_table)[0] == "0"


@pytest.mark.parametrize(
    "ports, rule",
    [
        ("8001", "node-ports-count"),
        ("8001,8002,8003", "node-ports-count"),
        ("8001,8001", "node-ports-distinct"),
        ("0,8002", "node-ports-range"),
        ("8001,65536", "node-ports-range"),
        ("8001,http", "node-ports-integers"),
        ("8001;8002", "node-ports-integers"),
        ("", "node-ports-integers"),
    ],
)
def test_node_ports_rules(ports, rule):
    with pytest.raises(RankTableError, match=rf"\[rule: {rule}\].*NODE_PORTS"):
        parse_node_ports(ports, ranktable_from_json(SPEC_GLOBAL))


def test_node_ports_in_global_order():
    assert parse_node_ports("8001, 8002", ranktable_from_json(SPEC_GLOBAL)) == [8001, 8002]


# ---------------------------------------------------------------- start-up environment
def env_for(paths, local_key, ports=None) -> dict:
    env = {"GLOBAL_RANK_TABLE_FILE_PATH": str(paths["global"]), "RANK_TABLE_FILE_PATH": str(paths[local_key])}
    if ports is not None:
        env["NODE_PORTS"] = ports
    return env


def test_resolve_without_the_global_table_is_no_disaggregation():
    assert resolve_pd_environment({}) is None
    assert resolve_pd_environment({"RANK_TABLE_FILE_PATH": "x.json", "NODE_PORTS": "1"}) is None


def test_resolve_prefill_and_decode_instances(tmp_path):
    paths = gen_two_machines(tmp_path)
    prefill = resolve_pd_environment(env_for(paths, "a1"))
    assert isinstance(prefill, PDLaunch)
    assert (prefill.role, prefill.server_ip, prefill.device_ids, prefill.instance_index) == (
        "prefill",
        "10.0.0.1",
        [1],
        1,
    )
    assert (prefill.prefill_urls, prefill.decode_urls) == ([], [])
    assert len(prefill.global_ranktable.instances()) == 4
    decode = resolve_pd_environment(env_for(paths, "b12", ports="8001,8002,8003,8004"))
    assert (decode.role, decode.server_ip, decode.device_ids, decode.instance_index) == (
        "decode",
        "10.0.0.2",
        [1, 2],
        3,
    )
    assert resolve_pd_environment(env_for(paths, "b0")).instance_index == 2


def test_resolve_router(tmp_path):
    paths = gen_two_machines(tmp_path)
    router = resolve_pd_environment(env_for(paths, "host", ports="8001,8002,8003,9000"))
    assert (router.role, router.server_ip, router.device_ids, router.instance_index) == ("router", "10.0.0.1", [], None)
    assert router.prefill_urls == ["http://10.0.0.1:8001", "http://10.0.0.1:8002", "http://10.0.0.2:8003"]
    assert router.decode_urls == ["http://10.0.0.2:9000"]
    assert router.use_openai
    native = resolve_pd_environment({**env_for(paths, "host", ports="8001,8002,8003,9000"), "USE_OPENAI": "0"})
    assert not native.use_openai
    with pytest.raises(ValueError, match="USE_OPENAI must be 1 .* or 0"):
        resolve_pd_environment({**env_for(paths, "host", ports="8001,8002,8003,9000"), "USE_OPENAI": "yes"})


def test_resolve_errors(tmp_path):
    paths = gen_two_machines(tmp_path)
    with pytest.raises(ValueError, match="RANK_TABLE_FILE_PATH"):
        resolve_pd_environment({"GLOBAL_RANK_TABLE_FILE_PATH": str(paths["global"])})
    with pytest.raises(ValueError, match="NODE_PORTS .*router"):
        resolve_pd_environment(env_for(paths, "host"))
    with pytest.raises(RankTableError, match=r"\[rule: node-ports-count\]"):
        resolve_pd_environment(env_for(paths, "host", ports="8001,8002,8003"))
    with pytest.raises(RankTableError, match=r"\[rule: node-ports-distinct\]"):
        resolve_pd_environment(env_for(paths, "a1", ports="8001,8002,8003,8001"))
    # A machine's part is not a global table a deployment can run from.
    with pytest.raises(RankTableError, match=r"\[rule: complete\]"):
        resolve_pd_environment(
            {"GLOBAL_RANK_TABLE_FILE_PATH": paths["parts"][0], "RANK_TABLE_FILE_PATH": str(paths["a1"])}
        )
    # A local table of another deployment.
    other = write(tmp_path / "other.json", table(prefill=[instance("10.0.0.3", 0)]))
    with pytest.raises(RankTableError, match=r"\[rule: local-in-global\]"):
        resolve_pd_environment({"GLOBAL_RANK_TABLE_FILE_PATH": str(paths["global"]), "RANK_TABLE_FILE_PATH": other})


def test_serve_starts_the_router_of_the_rank_table(tmp_path, monkeypatch):
    """`splitserve serve` with the router's tables runs the router on the table's instance URLs, with
    the OpenAI routes unless USE_OPENAI=0."""
    from splitserve.entrypoints import serve as serve_module

    paths = gen_two_machines(tmp_path)
    started = []
    monkeypatch.setattr(serve_module, "run_router", lambda config, host, port: started.append((config, port)))
    for value, openai_api in (("1", True), ("0", False)):
        env = {**env_for(paths, "host", ports="8001,8002,8003,9000"), "USE_OPENAI": value}
        for name, val in env.items():
            monkeypatch.setenv(name, val)
        serve_module.main(["--model", "unused", "--port", "9100"])
        config, port = started[-1]
        assert port == 9100 and config.openai_api is openai_api
        assert config.decode_urls == ["http://10.0.0.2:9000"]


# ---------------------------------------------------------------- the deployment guide's spellings
def test_mode_spelling_and_default_save_dir(tmp_path, monkeypatch):
    """`ranktable --mode gen|merge` as pd_ranktable_tools.py is called; instances separated by spaces;
    --save-dir defaults to the current directory; local tables in the guide's shape."""
    monkeypatch.chdir(tmp_path)
    main(["ranktable", "--mode", "gen", "--prefill-server-list", "4,5", "0,1", "--decode-server-list", "6,7"])
    main(["ranktable", "--server-ip", IP, "--mode=gen", "--api-server"])
    names = sorted(p.name for p in tmp_path.iterdir())
    assert f"local_ranktable_{IP}_host.json" in names and len([n for n in names if n.endswith("_01.json")]) == 1
    table_45 = next(tmp_path.glob("local_ranktable_*_45.json"))
    assert read(table_45)["group_id"] == "0" and len(read(table_45)["server_list"]) == 1
    glob = next(p for p in tmp_path.glob("global_ranktable_*.json") if IP not in p.name)
    assert len(read(glob)["server_group_list"][1]["server_list"]) == 2  # two prefill instances
    main(
        [
            "ranktable",
            "--mode",
            "merge",
            "--global-ranktable-list",
            str(tmp_path / f"global_ranktable_{IP}.json"),
            str(glob),
        ]
    )
    assert (tmp_path / "global_ranktable_merge.json").exists()


def test_local_tables_in_the_guides_shape_take_the_role_the_global_table_gives():
    global_table = ranktable_from_json(SPEC_GLOBAL)
    assert validate_local_ranktable(ranktable_from_json(local(DECODE_67)), global_table)[0] == "2"
    assert validate_local_ranktable(ranktable_from_json(local(PREFILL_45)), global_table)[0] == "1"
    assert validate_local_ranktable(ranktable_from_json(local(SCHEDULER)), global_table)[0] == "0"
    stranger = {**DECODE_67, "server_ip": "10.9.9.9", "server_id": "10.9.9.9"}
    with pytest.raises(RankTableError, match="local-in-global"):
        validate_local_ranktable(ranktable_from_json(local(stranger)), global_table)
    with pytest.raises(RankTableError, match="local-shape"):
        ranktable_from_json({**local(DECODE_67), "server_count": "2", "server_list": [DECODE_67, PREFILL_45]})


def test_cpu_device_ids_are_slots_on_the_cores_that_exist(monkeypatch, caplog):
    import torch

    from splitserve.disagg import launch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(launch.os, "sched_getaffinity", lambda pid: {0, 1})
    assert launch.device_env([1]) == {launch.CPU_CORES_ENV: "1"}  # a core of this machine: itself
    assert not caplog.records
    assert launch.device_env([4, 5]) == {launch.CPU_CORES_ENV: "0,1"}
    assert launch.device_env([6, 7]) == {launch.CPU_CORES_ENV: "0,1"}
    assert "as slots they run on cores [0, 1] (device id mod 2)" in caplog.text
