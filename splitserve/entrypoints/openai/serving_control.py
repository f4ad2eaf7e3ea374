"""Admin routes that act on the engine and the requests in it: /abort_requests, which aborts
requests by the ids their clients gave them (the `X-Request-Id` header or the body's `request_id`),
whichever API worker runs them; sleep mode (/sleep, /wake_up, /is_sleeping, /reset_prefix_cache);
/update_weights. Behind the API key when one is set, like every route but /health."""

from __future__ import annotations

from pydantic import ValidationError

from splitserve.engine.async_llm import AsyncLLM, EngineDeadError
from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.control_protocol import (
    AbortRequestsBody,
    AbortRequestsResponse,
    SleepStatus,
    UpdateWeightsBody,
    UpdateWeightsResponse,
)


async def abort_by_client_ids(engine: AsyncLLM, body: dict) -> AbortRequestsResponse:
    """Every request (each of its prompts and samples) whose client id is listed ends now with
    finish_reason "abort", its KV freed; on a PD prefill instance a finished request's KV lease
    ends too. The call does not wait for them."""
    try:
        req = AbortRequestsBody.model_validate(body)
    except ValidationError:
        raise APIError(
            'The body must be {"request_ids": ["..."]}: 1 to 4096 ids that clients gave as X-Request-Id or request_id.',
            param="request_ids",
        ) from None
    try:
        await engine.abort_client_requests(req.request_ids)
    except EngineDeadError as exc:
        raise APIError(str(exc), 503, "service_unavailable") from None
    return AbortRequestsResponse(request_ids=req.request_ids)


async def sleep_call(engine: AsyncLLM, op: str, level: int | str = 1) -> SleepStatus:
    """POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping, POST /reset_prefix_cache (vLLM's
    routes; engine/core/sleep_mode.py): a refusal (requests still running, a level other than 1 or 2)
    is a 400 that says why."""
    try:
        level = int(level)
    except ValueError:
        raise APIError(f"level must be 1 or 2, got {level!r}.", param="level") from None
    try:
        reply = await engine.sleep_call(op, level)
    except EngineDeadError as exc:
        raise APIError(str(exc), 503, "service_unavailable") from None
    if reply.error is not None:
        raise APIError(reply.error, param="level" if op == "sleep" else None)
    return SleepStatus(is_sleeping=reply.sleep_level > 0, level=reply.sleep_level)


async def update_weights(engine: AsyncLLM, body: dict) -> UpdateWeightsResponse:
    """Load a new checkpoint of the served model (engine/core/weight_update.py): a 400 that says why when
    it is refused (another architecture or shape, requests running, asleep, no such path) or when
    loading failed (the previous weights are then loaded again)."""
    try:
        req = UpdateWeightsBody.model_validate(body)
    except ValidationError:
        raise APIError(
            'The body must be {"model_path": "/path/to/checkpoint"} (and optionally "load_format": '
            '"auto", "safetensors", "pt" or "gguf").',
            param="model_path",
        ) from None
    if req.load_format not in ("auto", "safetensors", "pt", "gguf"):
        raise APIError(
            f"load_format must be auto, safetensors, pt or gguf, got {req.load_format!r}.", param="load_format"
        )
    try:
        reply = await engine.sleep_call("update_weights", model_path=req.model_path, load_format=req.load_format)
    except EngineDeadError as exc:
        raise APIError(str(exc), 503, "service_unavailable") from None
    if reply.error is not None:
        raise APIError(reply.error, param="model_path")
    return UpdateWeightsResponse(message=f"Weights loaded from {req.model_path}.", model_path=req.model_path)
