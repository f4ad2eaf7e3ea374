"""The FastAPI application of one API server worker: routes, API-key check, body limit, errors."""
from __future__ import annotations

import hmac
import json
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from splitserve import __version__
from splitserve.config import EngineConfig
from splitserve.engine.async_llm import AsyncLLM
from splitserve.entrypoints.openai import protocol as P
from splitserve.entrypoints.openai.metrics import Metrics, render_metrics
from splitserve.entrypoints.openai.serving import OpenAIServing, ServingError

logger = logging.getLogger("splitserve.api_server")

MAX_BODY_BYTES = 8 * 1024 * 1024
_OPEN_PATHS = {"/health", "/ping"}


def error_response(message: str, status: int, err_type: str = "invalid_request_error",
                   param: str | None = None) -> JSONResponse:
    return JSONResponse(P.error_body(message, err_type, param, status), status_code=status)


class BodyLimitMiddleware:
    """Refuse request bodies over the limit while they stream in, before anything parses them."""

    def __init__(self, app, limit: int = MAX_BODY_BYTES):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            return await self._too_large(scope, receive, send)
        seen = 0

        async def limited_receive():
            nonlocal seen
            message = await receive()
            seen += len(message.get("body", b""))
            if seen > self.limit:
                raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, limited_receive, send)
        except _BodyTooLarge:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope, receive, send):
        response = error_response(f"The request body is larger than {self.limit} bytes.", 413)
        await response(scope, receive, send)


class _BodyTooLarge(Exception):
    pass


def _authorized(request: Request, key: str) -> bool:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.encode(), key.encode())


def build_app(engine: AsyncLLM, config: EngineConfig, server_args, index: int = 0) -> FastAPI:
    metrics = Metrics(config.model_config.served_model_name, index)
    engine.on_stats = metrics.record_engine_stats
    serving = OpenAIServing(engine, config, server_args, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if server_args.use_warmup and index == 0:
            await serving.warmup()
        yield
        engine.shutdown()

    app = FastAPI(title="splitserve", version=__version__, lifespan=lifespan)

    @app.middleware("http")
    async def check_api_key(request: Request, call_next):
        path = request.url.path
        if server_args.api_key and path not in _OPEN_PATHS and not _is_open_metrics(path, server_args):
            if not _authorized(request, server_args.api_key):
                return error_response("Missing or invalid API key.", 401, "authentication_error")
        if path == "/metrics" and server_args.metrics_api_key and not _authorized(request, server_args.metrics_api_key):
            return error_response("Missing or invalid metrics API key.", 401, "authentication_error")
        return await call_next(request)

    @app.exception_handler(ServingError)
    async def serving_error(_: Request, exc: ServingError):
        return error_response(exc.message, exc.status, exc.err_type, exc.param)

    @app.exception_handler(404)
    async def not_found(request: Request, _exc):
        return error_response(f"{request.method} {request.url.path} is not a route of this server.", 404,
                              "not_found_error")

    @app.exception_handler(405)
    async def bad_method(request: Request, _exc):
        return error_response(f"{request.method} is not allowed on {request.url.path}.", 405)

    async def body_of(request: Request) -> dict:
        try:
            body = json.loads(await request.body())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ServingError(f"The request body is not valid JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise ServingError("The request body must be a JSON object.")
        return body

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await serving.create_completion(await body_of(request), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await serving.create_chat_completion(await body_of(request), request)

    @app.get("/v1/models")
    async def models():
        return serving.models()

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await serving.tokenize(await body_of(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await serving.detokenize(await body_of(request))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/health")
    async def health():
        if await engine.check_health(server_args.health_timeout):
            return Response(status_code=200)
        return error_response("The engine is not responding.", 503, "service_unavailable")

    @app.get("/metrics")
    async def metrics_route():
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    app.add_middleware(BodyLimitMiddleware)
    return app


def _is_open_metrics(path: str, server_args) -> bool:
    return path == "/metrics" and not server_args.metrics_api_key


def build_metrics_app(server_args) -> FastAPI:
    """The app of a separate --metrics-port."""
    app = FastAPI(title="splitserve metrics")

    @app.get("/metrics")
    async def metrics_route(request: Request):
        if server_args.metrics_api_key and not _authorized(request, server_args.metrics_api_key):
            return error_response("Missing or invalid metrics API key.", 401, "authentication_error")
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    return app
