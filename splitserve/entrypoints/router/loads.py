"""The router's load signals, for a gateway in front of routers (docs/gateway.md):

- GET /v1/loads: every instance's own /v1/loads (SGLang's report, openai/loads.py), asked at once,
  per instance (`instances`: its url, role, health, and its `aggregate`, or the `error` that kept
  it from answering), every entry also in `loads` (tagged with its `instance` and `role`), and the
  `aggregate` of them all; the query (include, dp_rank) goes to each instance as it came;
- the ORCA `endpoint-load-metrics` header on completions and chat, computed by the router for the
  whole pool rather than passed through from the one decode instance that answered: a gateway
  that balances over routers needs each router's pool, and a request waiting for a prefill
  instance waits as much as one waiting for decode. num_requests_waiting sums the waiting requests
  of every up instance (prefill and decode, or the replicas) and kv_cache_usage_perc is the mean
  of the up instances that answer (decode, or the replicas), from the loads the instances reported
  at the last health check (--health-interval, 2 s by default).
"""

from __future__ import annotations

import asyncio
import json

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response

from splitserve.disagg.policies import Upstream
from splitserve.entrypoints.openai.loads import aggregate, loads_answer
from splitserve.entrypoints.orca import NamedMetrics, OrcaLoadMiddleware, named_load_metrics
from splitserve.entrypoints.router.pool import UpstreamPool
from splitserve.entrypoints.router.relay import UPSTREAM_ERRORS, describe_error, status_reason

ORCA_PATHS = ("/v1/completions", "/v1/chat/completions")


def pool_load(pool: UpstreamPool) -> NamedMetrics:
    """The ORCA named metrics of the router's pool (the module's docstring says how)."""
    up = [i for i in pool.all_instances() if i.healthy and i.load is not None]
    waiting = sum(i.load.waiting for i in up)
    usage = [i.load.kv_cache_usage for i in up if i.role == pool.answer_role]
    return named_load_metrics(waiting, sum(usage) / len(usage) if usage else 0.0)


async def instance_loads(pool: UpstreamPool, inst: Upstream, query: str) -> dict:
    """One instance's row of the router's /v1/loads: its entries, or why it gave none."""
    row: dict = {"url": inst.url, "role": inst.role, "healthy": inst.healthy}
    timeout = aiohttp.ClientTimeout(total=pool.config.health_timeout)
    url = inst.url + "/v1/loads" + (f"?{query}" if query else "")
    try:
        async with pool.session.get(url, headers=pool._headers(), timeout=timeout) as resp:
            status, data = resp.status, await resp.read()
            body = await resp.json(content_type=None) if status == 200 else None
    except UPSTREAM_ERRORS as exc:
        return {**row, "error": describe_error(exc, pool.config.health_timeout)}
    except ValueError:
        return {**row, "error": "its /v1/loads answer is not JSON"}
    if status != 200 or not isinstance(body, dict) or not isinstance(body.get("loads"), list):
        return {**row, "error": status_reason(status, data) if status != 200 else "no loads in its answer"}
    row["loads"] = [{**entry, "instance": inst.url, "role": inst.role} for entry in body["loads"]]
    row["aggregate"] = body.get("aggregate") or aggregate(body["loads"])
    return row


async def router_loads(pool: UpstreamPool, query: str) -> dict:
    """The body of the router's GET /v1/loads."""
    rows = await asyncio.gather(*(instance_loads(pool, inst, query) for inst in pool.all_instances()))
    loads = [entry for row in rows for entry in row.pop("loads", [])]
    return {**loads_answer(loads), "instances": list(rows)}


def add_load_signals(app: FastAPI, pool: UpstreamPool) -> None:
    """The router's /v1/loads and ORCA header on `app`."""
    app.add_middleware(OrcaLoadMiddleware, load=lambda: pool_load(pool), paths=ORCA_PATHS)

    @app.get("/v1/loads")
    async def loads(request: Request):
        """Every instance's SGLang load report, per instance and aggregated (docs/gateway.md)."""
        return Response(json.dumps(await router_loads(pool, request.url.query)), media_type="application/json")
