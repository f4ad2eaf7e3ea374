"""`serve --pd XpYd`: where each of the launcher's flags goes (the router, every instance, or both),
or why it is refused; docs/serving.md promises that a flag is honoured or refused, never ignored.

The flags are derived from the parsed arguments, not listed: every engine flag and every server flag
that differs from its default is written out again for each instance (engine_flags, server_flags),
except those SERVER_PLACES gives to the router alone and those REFUSED names. Ports that instances
on one machine cannot share are offset by the instance's index (as data-parallel ranks offset theirs).
tests/unit/test_pd_flags.py sets every field of ServerArgs and EngineArgs in turn and checks that it
reaches an instance or the router, or is refused.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json

from splitserve.engine import compatibility
from splitserve.engine.arg_flags import engine_flags
from splitserve.engine.arg_utils import EngineArgs
from splitserve.engine.core.kv_events import KVEventsConfig
from splitserve.entrypoints.openai.args import ServerArgs, add_server_args

ROUTER, BOTH = "router", "both"  # every other server flag goes to the instances

# Server flags that are not the instances' alone.
SERVER_PLACES = {
    "host": ROUTER,  # the router listens there; the instances on 127.0.0.1
    "port": ROUTER,  # the instances on free ports the launcher picks
    "pd": ROUTER,  # the launcher's own
    "policy": ROUTER,
    "metrics_api_key": ROUTER,  # the router's /metrics; it reads the instances' (on loopback) for their load
    "api_key": BOTH,  # clients send it to the router, the router to the instances (in their environment)
    "otlp_traces_endpoint": BOTH,
    "disable_ui": BOTH,  # the router's pages, and the instances' (reachable on their own ports)
}

# Flags refused under --pd when they differ from their default: their rule in the table of refused
# combinations (engine/compatibility.py, docs/compatibility.md) says why.
REFUSED = {
    "metrics_port": "serve_pd+metrics_port",
    "pd_role": "serve_pd+pd_role",
    "data_parallel_size": "data_parallel+pd",
}

# Engine fields written per instance (offset by its index) rather than as they are.
_ENGINE_PER_INSTANCE = ("pd_role", "kv_port", "kv_events_config")
_SERVER_PER_INSTANCE = ("engine_worker_queue_port",)
_API_KEY_ENV = "SPLITSERVE_API_KEY"  # envs.py: the instances' --api-key, kept off their command lines


def check_pd_flags(engine_args: EngineArgs, server_args: ServerArgs, num_instances: int) -> None:
    """Refuse, in one line naming the flag, what `serve --pd` cannot honour."""
    for args in (engine_args, server_args):
        for field in dataclasses.fields(args):
            if field.name in REFUSED and getattr(args, field.name) != field.default:
                raise compatibility.refusal(REFUSED[field.name])
    events = KVEventsConfig.from_value(engine_args.kv_events_config)
    if events is not None:
        events.check_ranks(num_instances, "PD instances")


def instance_flags(engine_args: EngineArgs, server_args: ServerArgs, role: str, index: int = 0) -> list[str]:
    """The command-line flags of instance `index` of a local PD deployment (host and port aside)."""
    flags = [*engine_flags(engine_args, skip=_ENGINE_PER_INSTANCE), "--pd-role", role]
    world = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    if engine_args.kv_port:  # one port per rank from kv_port on
        flags += ["--kv-port", str(engine_args.kv_port + index * world)]
    if engine_args.kv_events_config is not None:
        flags += ["--kv-events-config", json.dumps(instance_kv_events(engine_args.kv_events_config, index))]
    if server_args.engine_worker_queue_port is not None:
        flags += ["--engine-worker-queue-port", str(server_args.engine_worker_queue_port + index)]
    names = [f.name for f in dataclasses.fields(ServerArgs)]
    return flags + server_flags(server_args, [n for n in names if SERVER_PLACES.get(n) != ROUTER])


def instance_env(server_args: ServerArgs) -> dict[str, str]:
    """The instances' environment beyond their devices: the API key the router sends them."""
    return {_API_KEY_ENV: server_args.api_key} if server_args.api_key else {}


def instance_kv_events(config: dict, index: int) -> dict:
    """Instance `index`'s --kv-events-config: its own sockets, offset by its index (vLLM's rule for
    data-parallel ranks, engine/core/kv_events.py)."""
    events = KVEventsConfig.from_value(config)
    if events is None:
        return config
    own = events.for_rank(index, tag="pd")
    config = {**config, "endpoint": own.endpoint}
    if own.replay_endpoint:
        config["replay_endpoint"] = own.replay_endpoint
    return config


def server_flags(args: ServerArgs, names: list[str]) -> list[str]:
    """The flags that recreate the `names` fields of `args` (those that differ from the defaults,
    and not those written per instance)."""
    actions = _server_actions()
    defaults = {f.name: f.default for f in dataclasses.fields(ServerArgs)}
    flags: list[str] = []
    for name in names:
        value = getattr(args, name)
        if value == defaults[name] or name in _SERVER_PER_INSTANCE or name == "api_key":
            continue
        action = actions[name]
        option = action.option_strings[0]
        if action.nargs == 0:  # a switch (store_true)
            flags += [option] if value else []
        elif isinstance(value, list):
            flags += [option, *map(str, value)]
        else:
            flags += [option, str(value)]
    return flags


@functools.cache
def _server_actions() -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser(add_help=False)
    add_server_args(parser)
    return {action.dest: action for action in parser._actions}
