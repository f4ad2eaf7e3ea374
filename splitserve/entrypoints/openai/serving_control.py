"""Admin routes that act on requests already running: /abort_requests, which aborts requests by
the ids their clients gave them (the `X-Request-Id` header or the body's `request_id`), whichever
API worker runs them. Behind the API key when one is set, like every route but /health."""

from __future__ import annotations

from pydantic import BaseModel, Field, ValidationError

from splitserve.engine.async_llm import AsyncLLM, EngineDeadError
from splitserve.entrypoints.http import APIError


class AbortRequestsBody(BaseModel):
    """POST /abort_requests."""

    request_ids: list[str] = Field(min_length=1, max_length=4096)


class AbortRequestsResponse(BaseModel):
    object: str = "abort"
    request_ids: list[str]  # what was asked for: ids that match no running request are ignored


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
