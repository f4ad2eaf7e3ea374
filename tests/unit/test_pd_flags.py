"""`serve --pd XpYd` honours every server and engine flag or refuses it (entrypoints/pd_flags.py):
each field of ServerArgs and EngineArgs, set in turn, reaches the instances (their command line read
back by the server's own parser), the router's config, or is refused at start-up naming the flag.
No process is started."""

from __future__ import annotations

import dataclasses
import json

import pytest

from splitserve.engine.arg_utils import EngineArgs
from splitserve.engine.compatibility import CombinationRefused
from splitserve.engine.core.kv_events import KVEventsConfig, offset_endpoint
from splitserve.entrypoints import serve as serve_module
from splitserve.entrypoints.openai.args import ServerArgs, make_arg_parser, split_args
from splitserve.entrypoints.pd_flags import REFUSED, ROUTER, SERVER_PLACES, check_pd_flags, instance_env, instance_flags

# Values the generic rule cannot make up (a choice, a JSON config with its own keys).
SPECIAL = {
    "policy": "cache_aware",
    "kv_events_config": {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:6000"},
    "speculative_config": {"method": "ngram", "num_speculative_tokens": 2},
}


def _other_value(field: dataclasses.Field):
    """A value of the field's type that is not its default."""
    if field.name in SPECIAL:
        return SPECIAL[field.name]
    default = field.default
    if field.type.startswith("bool"):
        return not default
    if field.type.startswith("int"):
        return (default or 0) + 3
    if field.type.startswith("float"):
        return (default or 0.0) + 1.5
    if field.type.startswith("list[int]"):
        return [1, 2]
    if field.type.startswith("list[str]"):
        return ["a.example", "b.example"]
    if field.type.startswith("dict"):
        return {"k": 1}
    return "x-value"


def _router_config(server_args: ServerArgs):
    return serve_module._router_config(server_args, ["http://127.0.0.1:1"], ["http://127.0.0.1:2"])


def _reaches(engine_args: EngineArgs, server_args: ServerArgs, name: str, value) -> bool:
    """Whether field `name` (set to `value`) arrives: in every instance's parsed flags (or
    environment), or in the router's config."""
    for index, role in enumerate(("prefill", "decode")):
        flags = instance_flags(engine_args, server_args, role, index)
        ns = make_arg_parser().parse_args(flags)
        got = getattr(ns, name, None)
        env = instance_env(server_args)
        if name == "kv_events_config":
            assert got == {**value, "endpoint": f"tcp://*:{6000 + index}"}
        elif name == "kv_port":
            assert got == value + index
        elif name == "engine_worker_queue_port":
            assert got == value + index
        elif name == "api_key":
            assert env == {"SPLITSERVE_API_KEY": value}
        elif SERVER_PLACES.get(name) == ROUTER:
            assert got == getattr(ServerArgs(), name, got), f"--{name} reached an instance"
        else:
            assert got == value, (name, flags)
    if SERVER_PLACES.get(name) is None:
        return True
    config = _router_config(server_args)
    router_value = {
        "api_key": (config.api_key, config.instance_api_key),
        "metrics_api_key": config.metrics_api_key,
        "otlp_traces_endpoint": config.otlp_traces_endpoint,
        "policy": config.policy,
        "disable_ui": config.disable_ui,
    }.get(name)
    if name == "api_key":
        return router_value == (value, value)
    if name in ("host", "port", "pd"):  # the launcher's own: run_router(config, host, port), parse_pd_spec
        return True
    return router_value == value


@pytest.mark.parametrize("kind", [EngineArgs, ServerArgs])
def test_every_flag_reaches_the_instances_or_the_router_or_is_refused(kind, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    for field in dataclasses.fields(kind):
        engine_args, server_args = EngineArgs(), ServerArgs(pd="1p1d")
        value = _other_value(field)
        setattr(engine_args if kind is EngineArgs else server_args, field.name, value)
        if field.name in REFUSED:  # with the table's sentence (docs/compatibility.md)
            with pytest.raises(CombinationRefused) as info:
                check_pd_flags(engine_args, server_args, 2)
            assert info.value.rule.name == REFUSED[field.name]
            continue
        check_pd_flags(engine_args, server_args, 2)
        assert _reaches(engine_args, server_args, field.name, value), field.name


def test_the_tables_name_real_fields():
    names = {f.name for k in (EngineArgs, ServerArgs) for f in dataclasses.fields(k)}
    assert set(SERVER_PLACES) <= names and set(REFUSED) <= names


def test_the_launchers_own_parse_gives_what_the_instances_parse(monkeypatch):
    """Through the command line as a user types it: the flags the issue found dropped arrive."""
    monkeypatch.delenv("SPLITSERVE_API_KEY", raising=False)
    argv = [
        "--pd",
        "1p1d",
        "--allowed-media-domains",
        "img.example",
        "--allowed-local-media-path",
        "/srv/images",
        "--workers",
        "2",
        "--metrics-api-key",
        "mk",
        "--api-key",
        "k",
        "--use-warmup",
    ]
    engine_args, server_args = split_args(make_arg_parser().parse_args(argv))
    ns = make_arg_parser().parse_args(instance_flags(engine_args, server_args, "decode", 1))
    assert ns.allowed_media_domains == ["img.example"] and ns.allowed_local_media_path == "/srv/images"
    assert ns.workers == 2 and ns.use_warmup and ns.metrics_api_key is None and ns.pd is None
    assert "k" not in instance_flags(engine_args, server_args, "decode", 1)  # the key travels in the environment
    config = _router_config(server_args)
    assert (config.metrics_api_key, config.api_key, config.instance_api_key) == ("mk", "k", "k")
    with pytest.raises(ValueError, match="serve --pd with --metrics-port: the router serves /metrics on --port"):
        check_pd_flags(*split_args(make_arg_parser().parse_args(["--pd", "1p1d", "--metrics-port", "9100"])), 2)


def test_kv_events_under_pd_one_endpoint_per_instance():
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://*:5557"}
    events["replay_endpoint"] = "tcp://*:5600"
    engine_args, server_args = EngineArgs(kv_events_config=events), ServerArgs(pd="2p1d")
    check_pd_flags(engine_args, server_args, 3)
    configs = []
    for index in range(3):
        flags = instance_flags(engine_args, server_args, "prefill", index)
        configs.append(json.loads(flags[flags.index("--kv-events-config") + 1]))
    assert [c["endpoint"] for c in configs] == ["tcp://*:5557", "tcp://*:5558", "tcp://*:5559"]
    assert [c["replay_endpoint"] for c in configs] == ["tcp://*:5600", "tcp://*:5601", "tcp://*:5602"]
    # Endpoint and replay one port apart: the second instance's endpoint would be the first's replay socket.
    events["replay_endpoint"] = "tcp://*:5558"
    with pytest.raises(ValueError, match="need at least 3 ports between them"):
        check_pd_flags(EngineArgs(kv_events_config=events), server_args, 3)


def test_the_endpoint_offset_is_vllms():
    assert offset_endpoint("tcp://*:5557", 0) == "tcp://*:5557"
    assert offset_endpoint("tcp://*:5557", 1) == "tcp://*:5558"
    assert offset_endpoint("tcp://[::1]:7000", 3) == "tcp://[::1]:7003"
    assert offset_endpoint("ipc:///tmp/kv", 1) == "ipc:///tmp/kv_dp1"
    assert offset_endpoint("inproc://kv", 0) == "inproc://kv_dp0"
    with pytest.raises(ValueError, match="tcp://HOST:PORT"):
        offset_endpoint("tcp://*:*", 1)
    config = KVEventsConfig.from_value(
        {"enable_kv_cache_events": True, "publisher": "zmq", "replay_endpoint": "tcp://127.0.0.1:5600"}
    )
    assert (config.for_rank(2).endpoint, config.for_rank(2).replay_endpoint) == ("tcp://*:5559", "tcp://127.0.0.1:5602")
    with pytest.raises(ValueError, match="data-parallel ranks"):
        EngineArgs(
            kv_events_config={"enable_kv_cache_events": True, "publisher": "zmq", "replay_endpoint": "tcp://*:5558"},
            data_parallel_size=2,
        )._kv_events_config()


def test_replicas_get_their_rank():
    from types import SimpleNamespace

    from splitserve.engine.dp_client import replica_environments

    config = SimpleNamespace(parallel_config=SimpleNamespace(distributed_executor_backend="ray"))
    assert replica_environments(config, 2) == [{"SPLITSERVE_DATA_PARALLEL_RANK": r} for r in ("0", "1")]
