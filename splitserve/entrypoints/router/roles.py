"""Changing the instances' PD roles from the router, without a restart (engine/pd_role.py says what
an instance does with the work it holds):

- `POST /router/pd_role {"url": ..., "pd_role": "prefill" | "decode" | "mixed"}` switches one instance and
  follows it at once (the router also follows switches made at an instance itself, at its next
  health check or at the first 409 it answers);
- `--auto-roles` rebalances by itself: every `--auto-roles-interval` seconds it compares the requests
  waiting or running per prefill instance and per decode instance (their /metrics, read at each
  health check) and, when one role carries `AUTO_ROLES_RATIO` times the other's load and at least
  `AUTO_ROLES_MIN_GAP` requests more per instance, moves the least loaded instance of the lighter
  role over, never leaving a role with no instance.
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from splitserve.disagg.policies import Upstream
from splitserve.entrypoints.http import error_response, read_json_body
from splitserve.entrypoints.router.config import DECODE, PREFILL, ROLES
from splitserve.entrypoints.router.pool import UpstreamPool
from splitserve.entrypoints.router.relay import UPSTREAM_ERRORS, describe_error

logger = logging.getLogger("splitserve.router")

AUTO_ROLES_RATIO = 3.0
AUTO_ROLES_MIN_GAP = 2.0


async def switch_role(pool: UpstreamPool, inst: Upstream, role: str) -> tuple[int, bytes]:
    """POST /pd_role at the instance, then follow it: its answer (status, body)."""
    status, data, _ = await pool._exchange(
        None, inst, "POST", "/pd_role", data=json.dumps({"pd_role": role}).encode(), content_type="application/json"
    )
    if status == 200:
        await pool.check_instance(inst)
    return status, data


def add_role_routes(app: FastAPI, pool: UpstreamPool) -> None:
    @app.post("/router/pd_role")
    async def pd_role(request: Request):
        """Switch one instance's PD role: {"url": "http://host:port", "pd_role": "decode"}."""
        body = await read_json_body(request)
        url, role = body.get("url"), body.get("pd_role")
        inst = next((i for i in pool.all_instances() if i.url == str(url).rstrip("/")), None)
        if inst is None:
            known = ", ".join(i.url for i in pool.all_instances())
            return error_response(f"No instance of this router has the url {url!r} (it has {known}).", 404, param="url")
        if role not in ROLES:
            return error_response(f"pd_role must be one of {', '.join(ROLES)}; got {role!r}.", 400, param="pd_role")
        try:
            status, data = await switch_role(pool, inst, role)
        except UPSTREAM_ERRORS as exc:
            reason = describe_error(exc, pool.config.request_timeout)
            return error_response(f"{inst.url} could not be reached: {reason}", 503, "service_unavailable")
        return Response(data, status_code=status, media_type="application/json")


def per_instance_load(insts: list[Upstream]) -> float:
    """Requests waiting or running per instance, by their last reports (this router's own open
    requests where an instance's metrics could not be read)."""
    loads = [i.load.num_requests if i.load is not None else i.in_flight for i in insts]
    return sum(loads) / len(loads) if loads else 0.0


def rebalance_choice(pool: UpstreamPool) -> tuple[Upstream, str] | None:
    """The instance to move and its new role, or None when the roles' loads are close enough."""
    prefill, decode = pool.healthy(PREFILL), pool.healthy(DECODE)
    if not prefill or not decode:
        return None
    loads = {PREFILL: per_instance_load(prefill), DECODE: per_instance_load(decode)}
    heavy, light = (PREFILL, DECODE) if loads[PREFILL] > loads[DECODE] else (DECODE, PREFILL)
    lighter = prefill if light == PREFILL else decode
    if len(lighter) < 2 or loads[heavy] - loads[light] < AUTO_ROLES_MIN_GAP:
        return None
    if loads[heavy] < AUTO_ROLES_RATIO * loads[light]:
        return None
    load = lambda i: i.load.num_requests if i.load is not None else i.in_flight  # noqa: E731
    return min(lighter, key=load), heavy


async def auto_roles_loop(pool: UpstreamPool, interval: float) -> None:
    """--auto-roles: one switch at most per interval, from the loads of the last health checks."""
    while True:
        await asyncio.sleep(interval)
        choice = rebalance_choice(pool)
        if choice is None:
            continue
        inst, role = choice
        logger.info(
            "Auto roles: %s goes from %s to %s (requests per instance: prefill %.1f, decode %.1f)",
            inst.url,
            inst.role,
            role,
            per_instance_load(pool.healthy(PREFILL)),
            per_instance_load(pool.healthy(DECODE)),
        )
        try:
            status, data = await switch_role(pool, inst, role)
        except UPSTREAM_ERRORS as exc:
            logger.warning("Auto roles: %s could not be switched: %s", inst.url, exc)
            continue
        if status != 200:
            logger.warning("Auto roles: %s refused the switch: %s", inst.url, data[:300].decode(errors="replace"))
