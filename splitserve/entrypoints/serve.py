"""`splitserve serve` (and `python -m splitserve.entrypoints.openai.api_server`): the one place that
decides what this process runs.

- no PD setting: one OpenAI-compatible server instance (entrypoints/openai/server.py);
- `--pd XpYd`: a whole PD deployment on this machine: X prefill and Y decode instances as child
  processes, then the router in this process;
- a rank-table environment (disagg/environment.py): the role it gives this process, a prefill or
  decode instance on its devices, or the router in front of the instances the table lists.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from splitserve import envs
from splitserve.disagg.environment import resolve_pd_environment
from splitserve.engine.arg_utils import EngineArgs
from splitserve.entrypoints.openai.args import ServerArgs, make_arg_parser, split_args
from splitserve.entrypoints.openai.server import run_server
from splitserve.entrypoints.pd_flags import check_pd_flags, instance_env, instance_flags
from splitserve.process_utils import leaving, main_and_exit, unwind_on_sigterm

if TYPE_CHECKING:
    from splitserve.entrypoints.router import RouterConfig

logger = logging.getLogger("splitserve.serve")


def serve(engine_args: EngineArgs, server_args: ServerArgs) -> None:
    if server_args.pd:
        return serve_local_pd(engine_args, server_args, server_args.pd)
    pd_env = resolve_pd_environment()
    if pd_env is None:
        return run_server(engine_args, server_args)
    if pd_env.role == "router":
        logger.info("Rank table: router for prefill %s and decode %s", pd_env.prefill_urls, pd_env.decode_urls)
        config = _router_config(server_args, pd_env.prefill_urls, pd_env.decode_urls)
        if not pd_env.use_openai:
            logger.info("USE_OPENAI=0: the router serves vLLM's native API (POST /generate), not the OpenAI routes")
            config.openai_api = False
        return run_router(config, server_args.host, server_args.port)
    logger.info(
        "Rank table: %s instance %d on %s, devices %s",
        pd_env.role,
        pd_env.instance_index,
        pd_env.server_ip,
        pd_env.device_ids,
    )
    from splitserve.disagg import launch

    _ranks_from_devices(engine_args, pd_env.device_ids)
    os.environ.update(launch.device_env(pd_env.device_ids))
    engine_args.pd_role, engine_args.kv_host = pd_env.role, pd_env.server_ip
    return run_server(engine_args, server_args)


def serve_local_pd(engine_args: EngineArgs, server_args: ServerArgs, spec: str) -> None:
    """`serve --pd XpYd`: start the instances, wait until they are healthy, then run the router;
    an instance whose process exits is started again (launch.InstanceKeeper); the instances are
    stopped however the router ends."""
    from splitserve.disagg import launch

    num_prefill, num_decode = launch.parse_pd_spec(spec)
    roles = ["prefill"] * num_prefill + ["decode"] * num_decode
    check_pd_flags(engine_args, server_args, len(roles))  # every flag reaches what it concerns, or is refused
    instances: list[launch.LocalInstance] = []
    keeper = None
    # SIGTERM and SIGHUP unwind through `finally`, so the instances are stopped; SIGINT unwinds as
    # KeyboardInterrupt; after SIGKILL the instances' parent-death signal stops them.
    unwind_on_sigterm()
    try:
        world = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
        for index, (role, env) in enumerate(zip(roles, launch.split_devices(len(roles), world))):
            flags = instance_flags(engine_args, server_args, role, index)
            instances.append(launch.start_instance(role, flags, {**env, **instance_env(server_args)}))
        launch.wait_healthy(instances)
        keeper = launch.InstanceKeeper(instances).start()
        config = _router_config(
            server_args,
            [i.url for i in instances if i.role == "prefill"],
            [i.url for i in instances if i.role == "decode"],
        )
        logger.info("PD deployment %s ready: router on port %d", spec, server_args.port)
        run_router(config, server_args.host, server_args.port)
    finally:
        leaving()
        if keeper is not None:
            keeper.stop()
        launch.stop_all(instances)


def _ranks_from_devices(engine_args: EngineArgs, device_ids: list[int]) -> None:
    """An instance's rank-table entry lists its devices, one per rank: without parallelism flags,
    as many tensor-parallel ranks as devices; with them, their product must be the device count."""
    world = engine_args.tensor_parallel_size * engine_args.pipeline_parallel_size
    if world == 1 and len(device_ids) > 1:
        logger.info(
            "Rank table: %d devices for this instance, so --tensor-parallel-size %d", len(device_ids), len(device_ids)
        )
        engine_args.tensor_parallel_size = len(device_ids)
    elif world != len(device_ids):
        raise ValueError(
            f"The rank table gives this instance {len(device_ids)} devices {device_ids}, but "
            f"--tensor-parallel-size x --pipeline-parallel-size is {world}: they must match."
        )


def run_router(config: RouterConfig, host: str, port: int) -> None:
    """The router; its web stack (aiohttp, the router's app) is imported only when it runs, so that
    a model server starts its engine process without waiting for it."""
    from splitserve.entrypoints.router import run_router as run

    run(config, host, port)


def _router_config(server_args: ServerArgs, prefill_urls: list[str], decode_urls: list[str]) -> RouterConfig:
    from splitserve.entrypoints.router import RouterConfig

    return RouterConfig(
        prefill_urls=prefill_urls,
        decode_urls=decode_urls,
        policy=server_args.policy,
        api_key=server_args.api_key,
        instance_api_key=server_args.api_key,
        metrics_api_key=server_args.metrics_api_key,
        otlp_traces_endpoint=server_args.otlp_traces_endpoint,
        disable_ui=server_args.disable_ui,
    )


def main(argv: list[str] | None = None, default_max_tokens: int | None = None) -> None:
    """`default_max_tokens`: the entry point's default of --default-max-tokens (16 for FastDeploy's)."""
    logging.basicConfig(
        level=envs.SPLITSERVE_LOGGING_LEVEL.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    ns = make_arg_parser(default_max_tokens=default_max_tokens).parse_args(argv)
    try:
        serve(*split_args(ns))
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        logger.error("%s", exc)
        sys.exit(2)


if __name__ == "__main__":  # what `serve --pd` starts its instances with (launch.INSTANCE_MODULE)
    main_and_exit(main)
