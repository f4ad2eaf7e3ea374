"""The router's calls that act on every instance, prefill and decode alike, so that they stay alike:
LoRA adapters (/v1/load_lora_adapter, /v1/unload_lora_adapter), /abort_requests (a request's decode
runs on one instance, its leased KV waits on another), sleep mode (/sleep, /wake_up, /is_sleeping,
/reset_prefix_cache) and weight updates (/update_weights, SGLang's /update_weights_from_disk).

Each call goes to all instances at once and runs to its end even when the client leaves (half the
instances asleep or updated would be worse). The answer is the instances' own when all succeed
(/is_sleeping: asleep only when every instance is); otherwise an OpenAI-style error naming the
instance that failed, with its status, and the instances where the call did take effect."""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from splitserve.disagg.policies import Upstream
from splitserve.entrypoints.http import error_response, parse_json_object, read_body
from splitserve.entrypoints.router.pool import UpstreamPool
from splitserve.entrypoints.router.relay import UPSTREAM_ERRORS, describe_error

logger = logging.getLogger("splitserve.router")

Answer = tuple[int, bytes, str | None]  # status, body, content type


async def call_all(
    pool: UpstreamPool, method: str, path: str, data: bytes | None = None, content_type: str | None = None
) -> tuple[list[tuple[Upstream, Answer]], Response | None]:
    """`method path` on every instance at once: their answers, and the error to give the client
    when any failed (None when all succeeded)."""
    instances = pool.all_instances()
    calls = [pool._exchange(None, inst, method, path, data=data, content_type=content_type) for inst in instances]
    results = await asyncio.gather(*calls, return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException) and not isinstance(result, UPSTREAM_ERRORS):
            raise result
    succeeded = [
        inst.url
        for inst, result in zip(instances, results)
        if not isinstance(result, BaseException) and result[0] < 400
    ]
    for inst, result in zip(instances, results):
        if isinstance(result, BaseException):
            reason = describe_error(result, pool.config.request_timeout)
            status, err_type, param, message = 503, "service_unavailable", None, f"could not be reached ({reason})"
        elif result[0] >= 400:
            status = result[0]
            err_type, param, message = _instance_error(*result)
        else:
            continue
        text = f"The {inst.role} instance {inst.url} failed {method} {path}: {message}"
        if succeeded:
            text += f" (it took effect on {', '.join(succeeded)})"
        logger.warning("%s", text)
        return [], error_response(text, status, err_type, param)
    return list(zip(instances, results)), None


def _instance_error(status: int, body: bytes, _: str | None) -> tuple[str, str | None, str]:
    """An instance's error answer: its type, param and message (its body's first 200 characters
    when it is not OpenAI's error body, e.g. a 404 of a server without the route)."""
    try:
        error = json.loads(body)["error"]
        return str(error.get("type") or "invalid_request_error"), error.get("param"), str(error["message"])
    except (ValueError, KeyError, TypeError, AttributeError):
        text = body[:200].decode("utf-8", "replace").strip()
        kind = "service_unavailable" if status >= 500 else "invalid_request_error"
        return kind, None, f"HTTP {status}" + (f" ({text})" if text else "")


async def broadcast(
    pool: UpstreamPool, method: str, path: str, data: bytes | None = None, content_type: str | None = None
) -> Response:
    """The call on every instance; when all succeed, the first instance's answer."""
    answers, failure = await call_all(pool, method, path, data, content_type)
    if failure is not None:
        return failure
    status, body, ctype = answers[0][1]
    return Response(body, status_code=status, media_type=ctype)


async def broadcast_json(pool: UpstreamPool, request: Request, path: str) -> Response:
    """A POST with a JSON object body, checked here (the instances' limits) before any instance gets it."""
    data = await read_body(request)
    parse_json_object(data)
    return await broadcast(pool, "POST", path, data, request.headers.get("content-type") or "application/json")


async def is_sleeping(pool: UpstreamPool) -> Response:
    """GET /is_sleeping: asleep (at the lowest of their levels) only when every instance is; each
    instance's own answer under `instances`."""
    answers, failure = await call_all(pool, "GET", "/is_sleeping")
    if failure is not None:
        return failure
    states = []
    for inst, (_, body, _) in answers:
        state = json.loads(body)
        states.append({"url": inst.url, "role": inst.role, **state})
    asleep = all(s.get("is_sleeping") for s in states)
    level = min(int(s.get("level") or 0) for s in states) if asleep else 0
    return JSONResponse({"is_sleeping": asleep, "level": level, "instances": states})


def add_control_routes(app: FastAPI, pool: UpstreamPool) -> None:
    """Sleep mode and weight updates, on every instance (the plain server's routes, same answers)."""

    def with_query(request: Request, path: str) -> str:
        return f"{path}?{request.url.query}" if request.url.query else path

    @app.post("/sleep")
    async def sleep(request: Request):
        """Every instance releases its KV cache and weights (level 2) or moves them to host memory (level 1)."""
        return await broadcast(pool, "POST", with_query(request, "/sleep"))

    @app.post("/wake_up")
    async def wake_up(request: Request):
        return await broadcast(pool, "POST", with_query(request, "/wake_up"))

    @app.get("/is_sleeping")
    async def sleeping():
        return await is_sleeping(pool)

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return await broadcast(pool, "POST", "/reset_prefix_cache")

    for path in ("/update_weights", "/update_weights_from_disk"):  # the second is SGLang's name
        app.add_api_route(path, _update_weights_route(pool, path), methods=["POST"], name=f"update weights {path}")


def _update_weights_route(pool: UpstreamPool, path: str):
    async def update(request: Request):
        """Every instance loads the new checkpoint (prefill and decode must compute with the same weights)."""
        return await broadcast_json(pool, request, path)

    return update
