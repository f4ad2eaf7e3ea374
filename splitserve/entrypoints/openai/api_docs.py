"""The OpenAPI document of the server and of the PD router: each route's request body and answers,
from the pydantic models the server validates and answers with.

The handlers read their bodies themselves (bounded parsing, OpenAI-style errors: entrypoints/http.py),
so FastAPI cannot see the models in their signatures; `document_routes` puts them in the schema, so
that clients, code generators and fuzzers see the real contract.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi.routing import APIRoute
from pydantic import BaseModel

from splitserve.entrypoints.http import ErrorResponse
from splitserve.entrypoints.openai.anthropic_protocol import (
    AnthropicCountTokensRequest,
    AnthropicErrorResponse,
    AnthropicMessageResponse,
    AnthropicMessagesRequest,
    AnthropicTokenCount,
)
from splitserve.entrypoints.openai.batch_protocol import (
    BatchList,
    BatchObject,
    CreateBatchRequest,
    FileDeleted,
    FileList,
    FileObject,
)
from splitserve.entrypoints.openai.control_protocol import (
    AbortRequestsBody,
    AbortRequestsResponse,
    GenerateRequest,
    KVReleaseRequest,
    KVReleaseResponse,
    LoadLoRAAdapterRequest,
    PDRoleSwitch,
    PDRoleSwitched,
    SleepStatus,
    UnloadLoRAAdapterRequest,
    UpdateWeightsBody,
    UpdateWeightsResponse,
)
from splitserve.entrypoints.openai.pooling_protocol import (
    ClassificationRequest,
    ClassificationResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from splitserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.entrypoints.openai.recent_requests import RecentRequestsResponse
from splitserve.entrypoints.openai.request_model import TOKEN_ID_SCHEMA
from splitserve.entrypoints.openai.response_models import (
    ChatCompletionResponse,
    CompletionResponse,
    DetokenizeResponse,
    ModelList,
    TokenizeResponse,
)
from splitserve.entrypoints.openai.responses_protocol import ResponseObject, ResponsesRequest
from splitserve.entrypoints.openai.tokenize_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
)

_REF = "#/components/schemas/{model}"
_SLEEP_ROUTES = ("/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache")
_ERRORS = {
    400: "The request is invalid (the message and param say why).",
    401: "A missing or wrong API key.",
    404: "An unknown model, LoRA adapter, route, file or batch.",
    409: "A prefill or decode request (kv_transfer_params) reached an instance that has switched to another PD role.",
    413: "The body, or an array, object or string in it, is too large.",
    429: "Too many requests are waiting in the engine.",
    503: "The engine (or, at the router, every instance of a role) is not available.",
}


@dataclass(frozen=True)
class RouteDoc:
    requests: tuple[type[BaseModel], ...] = ()  # the body is one of these
    response: type[BaseModel] | None = None  # the JSON answer (200)
    streams: str | None = None  # the media type of a streamed answer ("stream": true)
    text: bool = False  # a plain-text answer
    empty: bool = False  # an answer without a body (/health)
    binary: bool = False  # a file's bytes (application/octet-stream)
    errors: tuple[int, ...] = field(default=(400, 401, 404, 413, 429, 503))
    # Anthropic's routes answer their own errors in Anthropic's shape (the API-key check and the
    # body limits, before them, in OpenAI's).
    anthropic_errors: bool = False


_GENERATION_ERRORS = (400, 401, 404, 409, 413, 429, 503)  # 409: PD instances only (engine/pd_role.py)
ROUTE_DOCS: dict[str, RouteDoc] = {
    "/v1/completions": RouteDoc(
        (CompletionRequest,), CompletionResponse, "text/event-stream", errors=_GENERATION_ERRORS
    ),
    "/v1/chat/completions": RouteDoc(
        (ChatCompletionRequest,), ChatCompletionResponse, "text/event-stream", errors=_GENERATION_ERRORS
    ),
    "/generate": RouteDoc((GenerateRequest,), None, "application/x-ndjson"),
    "/tokenize": RouteDoc((TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse),
    "/detokenize": RouteDoc((DetokenizeRequest,), DetokenizeResponse),
    "/v1/models": RouteDoc((), ModelList, errors=(401, 503)),
    "/version": RouteDoc((), None, errors=(401, 503)),
    "/health": RouteDoc((), None, empty=True, errors=(503,)),
    "GET /pd_role": RouteDoc((), None, errors=(401,)),
    "/recent_requests": RouteDoc((), RecentRequestsResponse, errors=(401,)),
    "POST /pd_role": RouteDoc((PDRoleSwitch,), PDRoleSwitched, errors=(400, 401, 413)),
    "/metrics": RouteDoc((), None, text=True, errors=(401,)),
    "/v1/load_lora_adapter": RouteDoc((LoadLoRAAdapterRequest,), None, text=True),
    "/v1/unload_lora_adapter": RouteDoc((UnloadLoRAAdapterRequest,), None, text=True),
    "/v1/messages": RouteDoc(
        (AnthropicMessagesRequest,), AnthropicMessageResponse, "text/event-stream", anthropic_errors=True
    ),
    "/v1/messages/count_tokens": RouteDoc((AnthropicCountTokensRequest,), AnthropicTokenCount, anthropic_errors=True),
    "/kv_transfer/release": RouteDoc((KVReleaseRequest,), KVReleaseResponse, errors=(400, 401, 413, 503)),
    "/v1/embeddings": RouteDoc((EmbeddingRequest,), EmbeddingResponse),
    "/v1/responses": RouteDoc((ResponsesRequest,), ResponseObject, "text/event-stream"),
    "/v1/responses/{response_id}": RouteDoc((), ResponseObject, errors=(401, 404, 503)),
    "/v1/responses/{response_id}/cancel": RouteDoc((), ResponseObject, errors=(400, 401, 404, 503)),
    **{path: RouteDoc((), SleepStatus, errors=(400, 401, 503)) for path in _SLEEP_ROUTES},
    "/abort_requests": RouteDoc((AbortRequestsBody,), AbortRequestsResponse, errors=(400, 401, 413, 503)),
    # "METHOD /path" where the methods of one path answer differently.
    "POST /v1/files": RouteDoc((), FileObject, errors=(400, 401, 413)),  # multipart: serving_batches.py
    "GET /v1/files": RouteDoc((), FileList, errors=(400, 401)),
    "GET /v1/files/{file_id}": RouteDoc((), FileObject, errors=(401, 404)),
    "DELETE /v1/files/{file_id}": RouteDoc((), FileDeleted, errors=(401, 404)),
    "/v1/files/{file_id}/content": RouteDoc((), None, binary=True, errors=(401, 404)),
    "POST /v1/batches": RouteDoc((CreateBatchRequest,), BatchObject, errors=(400, 401, 404, 413)),
    "GET /v1/batches": RouteDoc((), BatchList, errors=(400, 401)),
    "/v1/batches/{batch_id}": RouteDoc((), BatchObject, errors=(401, 404)),
    "/v1/batches/{batch_id}/cancel": RouteDoc((), BatchObject, errors=(400, 401, 404)),
    **{
        path: RouteDoc((UpdateWeightsBody,), UpdateWeightsResponse, errors=(400, 401, 413, 503))
        for path in ("/update_weights", "/update_weights_from_disk")
    },
    **{path: RouteDoc((ScoreRequest,), ScoreResponse) for path in ("/score", "/v1/score")},
    **{path: RouteDoc((ClassificationRequest,), ClassificationResponse) for path in ("/classify", "/v1/classify")},
    **{path: RouteDoc((RerankRequest,), RerankResponse) for path in ("/rerank", "/v1/rerank", "/v2/rerank")},
}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": _REF.format(model=model.__name__)}


def _responses(doc: RouteDoc) -> dict:
    content = {}
    if doc.response is not None:
        content["application/json"] = {"schema": _ref(doc.response)}
    elif not doc.text and not doc.empty and not doc.binary:
        content["application/json"] = {"schema": {"type": "object"}}
    if doc.binary:
        content["application/octet-stream"] = {"schema": {"type": "string", "format": "binary"}}
    if doc.streams:  # server-sent events (chunks of the JSON answer) or JSON lines
        content[doc.streams] = {}
    if doc.text:
        content["text/plain"] = {"schema": {"type": "string"}}
    answers = {"200": {"description": "The answer.", **({"content": content} if content else {})}}
    schema = (
        {"anyOf": [_ref(AnthropicErrorResponse), _ref(ErrorResponse)]} if doc.anthropic_errors else _ref(ErrorResponse)
    )
    for status in doc.errors:
        answers[str(status)] = {"description": _ERRORS[status], "content": {"application/json": {"schema": schema}}}
    return answers


def _bound_token_ids(node, vocab_size: int) -> None:
    """Token-id schemas (request_model.TOKEN_ID_SCHEMA) with this model's vocabulary as their maximum."""
    if isinstance(node, dict):
        if node.get("type") == "integer" and node.get("maximum") == TOKEN_ID_SCHEMA["maximum"]:
            node["maximum"] = vocab_size - 1
        for value in node.values():
            _bound_token_ids(value, vocab_size)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, vocab_size)


def _route_doc(route) -> RouteDoc | None:
    """A route's doc: by "METHOD /path" when there is one, else by "/path"."""
    path = getattr(route, "path", "")
    for method in sorted(getattr(route, "methods", None) or ()):
        if f"{method} {path}" in ROUTE_DOCS:
            return ROUTE_DOCS[f"{method} {path}"]
    return ROUTE_DOCS.get(path)


def document_routes(app: FastAPI, vocab_size: int | None = None) -> None:
    """Give every route of ROUTE_DOCS that `app` has its request body and answers in the OpenAPI
    document, and add the models' schemas to its components; token ids are bounded by `vocab_size`
    when the app serves one model."""
    models: set[type[BaseModel]] = {ErrorResponse, AnthropicErrorResponse}
    documented: dict[tuple[str, str], RouteDoc] = {}
    for route in app.routes:
        doc = _route_doc(route)
        if not isinstance(route, APIRoute) or doc is None:
            continue
        documented.update({(route.path, method.lower()): doc for method in route.methods})
        if doc.requests:
            refs = [_ref(m) for m in doc.requests]
            schema = refs[0] if len(refs) == 1 else {"anyOf": refs}
            body = {"required": True, "content": {"application/json": {"schema": schema}}}
            route.openapi_extra = {"requestBody": body}
        models.update(doc.requests)
        if doc.response is not None:
            models.add(doc.response)
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = build()
        for (path, method), doc in documented.items():  # replacing FastAPI's generic 200
            schema["paths"][path][method]["responses"] = _responses(doc)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for model in sorted(models, key=lambda m: m.__name__):
            definition = model.model_json_schema(ref_template=_REF)
            for name, sub in definition.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components[model.__name__] = definition
        if vocab_size:
            _bound_token_ids(components, vocab_size)
        return schema

    app.openapi = openapi
