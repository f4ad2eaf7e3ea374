"""OpenAI's Responses API (/v1/responses) and Batch API (/v1/files, /v1/batches) at the router: the
plain server's own adapters (serving_responses.py, serving_batches.py) over the router's chat and
completion handling, so that each request they make goes through prefill and decode as any other.

Stored responses (previous_response_id, GET, DELETE, cancel of background ones) and batch files
live in the router's process, as they live in the API worker of a plain server; a batch's files go
to a temporary directory of the router's."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from splitserve.entrypoints.openai.request_model import parse_request
from splitserve.entrypoints.openai.responses_protocol import ResponsesRequest
from splitserve.entrypoints.openai.serving_batches import BatchServing, add_batch_routes
from splitserve.entrypoints.openai.serving_responses import ResponsesServing, add_responses_routes
from splitserve.entrypoints.router.relay import UPSTREAM_ERRORS, RelayResponse
from splitserve.entrypoints.router.router import Router

logger = logging.getLogger("splitserve.router")

BASE_MODEL_ALIASES = (None, "default")  # what a request may call the served model (serving_models.py's)
BATCH_MAX_FILE_BYTES = 200 << 20  # the plain server's defaults (--batch-max-file-mb, --batch-max-concurrency)
BATCH_CONCURRENCY = 8
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


class _ModelCard(BaseModel):
    id: str


class _ModelList(BaseModel):
    """/v1/models, as much of it as the router reads."""

    data: list[_ModelCard]


class RouterChat:
    """What the Responses adapter asks of a chat handler (OpenAIServingChat on a plain server),
    answered by the router: a chat request goes through prefill and decode."""

    def __init__(self, router: Router):
        self.router = router
        self.served_name: str | None = None  # the model's name, as the instances serve it

    def _parse(self, parse, body: dict):
        return parse_request(parse, body, log=logger, hint="")

    async def create_chat_completion(self, body: dict, raw: Request) -> Response:
        return await self.router.handle_generation(raw, CHAT, body)

    async def response_model(self, req: ResponsesRequest) -> str:
        """The request's adapter name, or the served model's name (an instance's /v1/models, asked
        once) when it names the base model."""
        if req.model not in BASE_MODEL_ALIASES and req.model != self.served_name:
            return req.model
        if self.served_name is None:
            self.served_name = await self._fetch_served_name()
        return self.served_name or req.model or "default"

    async def _fetch_served_name(self) -> str | None:
        router = self.router
        for inst in router.healthy(router.answer_role) or router.instances[router.answer_role]:
            try:
                status, data, _ = await router._exchange(None, inst, "GET", "/v1/models")
                if status == 200:
                    return _ModelList.model_validate_json(data).data[0].id
            except (*UPSTREAM_ERRORS, ValidationError, IndexError):
                continue
        return None


class RouterResponses(ResponsesServing):
    """The plain server's Responses adapter, over RouterChat; a stream keeps the decode instance's
    connection open until the client has it all (RelayResponse)."""

    chat: RouterChat

    async def _model(self, req: ResponsesRequest) -> str:
        return await self.chat.response_model(req)

    def _streamed(self, answer: StreamingResponse, events: AsyncIterator[str]) -> Response:
        if isinstance(answer, RelayResponse):
            return RelayResponse(events, answer.open_request, media_type="text/event-stream")
        return super()._streamed(answer, events)


def router_batches(router: Router) -> BatchServing:
    """The Batch API, each line sent through the router's completion or chat handling, a few at a time."""

    def handler(path: str):
        async def handle(body: dict, raw) -> Response:
            return await router.handle_generation(raw, path, body)

        return handle

    return BatchServing(
        {CHAT: handler(CHAT), COMPLETIONS: handler(COMPLETIONS)}, None, BATCH_MAX_FILE_BYTES, BATCH_CONCURRENCY
    )


def add_adapter_routes(app: FastAPI, router: Router) -> None:
    """/v1/responses and /v1/files, /v1/batches, as a plain server has them."""
    add_responses_routes(app, RouterResponses(RouterChat(router)))
    add_batch_routes(app, router_batches(router))
