"""The load signals a gateway in front of the server picks an instance by (docs/gateway.md), wired
into one API worker's app: the ORCA `endpoint-load-metrics` header on completions and chat
(entrypoints/orca.py), GET /v1/loads (loads.py) and the Prometheus metrics endpoint pickers read
from vLLM (gateway_metrics.py). All of them read the engine's last stats, which every worker
already receives: nothing here asks the engine anything."""

from __future__ import annotations

import json

from fastapi import FastAPI, Request
from fastapi.responses import Response

from splitserve.config import EngineConfig
from splitserve.engine.pd_role import role_state
from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.gateway_metrics import GatewayMetrics
from splitserve.entrypoints.openai.loads import DecodeRates, check_dp_rank, loads_answer, parse_include, replica_load
from splitserve.entrypoints.orca import OrcaLoadMiddleware, named_load_metrics

ORCA_PATHS = ("/v1/completions", "/v1/chat/completions")


def replica_stats(engine) -> list:
    """The last stats of each data-parallel replica (one entry without data parallelism)."""
    replicas = getattr(engine, "replicas", None)
    return [r.stats for r in replicas] if replicas else [engine.stats]


def add_load_signals(app: FastAPI, engine, config: EngineConfig, server_args) -> None:
    """The ORCA header, /v1/loads and the gateway metrics, on `app` (call it after the metrics
    layer has set `engine.on_stats`: the gateway metrics and the decode rate hook in after it)."""
    gateway = GatewayMetrics(config, config.model_config.served_model_name, server_args.metrics_prefix)
    rates = DecodeRates()
    roles = role_state(engine, config)
    record = engine.on_stats

    def on_stats(stats) -> None:
        if record is not None:
            record(stats)
        gateway.record(stats)
        rates.observe(replica_stats(engine))

    engine.on_stats = on_stats

    def orca_load():
        stats = engine.stats
        return named_load_metrics(stats.num_waiting, stats.kv_cache_usage) if stats else named_load_metrics(0, 0)

    app.add_middleware(OrcaLoadMiddleware, load=orca_load, paths=ORCA_PATHS)

    @app.get("/v1/loads")
    async def loads(request: Request):
        """SGLang's load report: per data-parallel replica, and their aggregate (docs/gateway.md)."""
        query = request.query_params
        include = parse_include(query.get("include"))
        if query.get("format") not in (None, "json"):
            raise APIError("Only format=json is served; /metrics has the Prometheus form.", param="format")
        parts = replica_stats(engine)
        wanted = check_dp_rank(query.get("dp_rank"), len(parts))
        role = roles.role  # changed live by POST /pd_role
        entries = [
            replica_load(stats, i, config, role, rates.rate(i), include)
            for i, stats in enumerate(parts)
            if wanted is None or i == wanted
        ]
        return Response(json.dumps(loads_answer(entries)), media_type="application/json")  # no encoder pass
