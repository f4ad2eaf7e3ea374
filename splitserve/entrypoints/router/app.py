"""The PD router's FastAPI application and its uvicorn runner (`splitserve router`)."""

from __future__ import annotations

import argparse
import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from splitserve.entrypoints.http import APIError, ApiKeyMiddleware, install_error_handlers, read_json_body
from splitserve.entrypoints.openai.anthropic_protocol import (
    AnthropicMessagesRequest,
    anthropic_error,
    parse_request,
    to_chat_body,
)
from splitserve.entrypoints.openai.api_docs import document_routes
from splitserve.entrypoints.openai.serving_anthropic import (
    anthropic_answer,
)
from splitserve.entrypoints.router.adapters import add_adapter_routes
from splitserve.entrypoints.router.config import RouterConfig, config_from_args
from splitserve.entrypoints.router.control import add_control_routes
from splitserve.entrypoints.router.loads import add_load_signals
from splitserve.entrypoints.router.relay import RelayResponse
from splitserve.entrypoints.router.roles import add_role_routes, auto_roles_loop
from splitserve.entrypoints.router.router import Router
from splitserve.entrypoints.ui import add_ui_routes
from splitserve.version import __version__


def build_router_app(config: RouterConfig) -> FastAPI:
    """The router's FastAPI app; its lifespan opens the shared HTTP session and runs the health
    checks. `app.state.router` is the Router (instances, metrics), for tests and embedding."""
    router = Router(config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await router.start()
        rebalancing = None
        if config.auto_roles:
            rebalancing = asyncio.create_task(auto_roles_loop(router, config.auto_roles_interval))
        try:
            yield
        finally:
            if rebalancing is not None:
                rebalancing.cancel()
            await router.stop()

    app = FastAPI(title="splitserve router", version=__version__, lifespan=lifespan)
    app.state.router = router

    install_error_handlers(app, "router")

    @app.post("/generate")
    async def generate(request: Request):
        return await router.handle_generation(request, "/generate")

    if config.openai_api:
        _add_openai_routes(app, router)
        add_adapter_routes(app, router)  # /v1/responses, /v1/files, /v1/batches
    else:
        _refuse_openai_routes(app)
    add_control_routes(app, router)  # sleep mode and weight updates, on every instance
    add_load_signals(app, router)  # /v1/loads per instance, the ORCA header of the pool
    add_role_routes(app, router)  # POST /router/pd_role: an instance's PD role switched live

    @app.get("/version")
    async def version(request: Request):
        return await router.forward(request, "GET", "/version")

    @app.get("/health")
    async def health():
        return router.health()

    @app.get("/metrics")
    async def metrics():
        return Response(router.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/instances", include_in_schema=False)
    async def instances():
        """Every instance with its role, health and load (the dashboard's table; docs/ui.md)."""
        return router.describe_instances()

    document_routes(app)
    ui_paths = add_ui_routes(app, dashboard_kind="router", enabled=not config.disable_ui)  # /, /dashboard
    if config.api_key or config.metrics_api_key:  # load balancers and Prometheus need no key, unless given one
        app.add_middleware(
            ApiKeyMiddleware,
            api_key=config.api_key,
            open_paths=("/health", "/metrics", "/openapi.json", "/docs", "/redoc", *ui_paths),
            path_keys={"/metrics": config.metrics_api_key},
        )
    return app


def _add_openai_routes(app: FastAPI, router: Router) -> None:
    @app.post("/v1/completions")
    async def completions(request: Request):
        return await router.handle_generation(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await router.handle_generation(request, "/v1/chat/completions")

    @app.post("/v1/messages")
    async def messages(request: Request):
        """Anthropic's Messages API: translated into a chat completion, which goes through prefill
        and decode as any other, and its answer back."""
        try:
            req = parse_request(AnthropicMessagesRequest, await read_json_body(request))
            chat_body = to_chat_body(req)
        except APIError as exc:
            return anthropic_error(exc.message, exc.status)
        answer = await router.handle_generation(request, "/v1/chat/completions", chat_body)
        if isinstance(answer, RelayResponse):
            return anthropic_answer(
                req, answer, lambda events: RelayResponse(events, answer.open_request, media_type="text/event-stream")
            )
        return anthropic_answer(req, answer)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await router.forward(request, "POST", "/v1/messages/count_tokens")

    @app.get("/v1/models")
    async def models(request: Request):
        return await router.forward(request, "GET", "/v1/models")

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await router.forward(request, "POST", "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await router.forward(request, "POST", "/detokenize")

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return await router.broadcast(request, "/v1/load_lora_adapter")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return await router.broadcast(request, "/v1/unload_lora_adapter")

    @app.post("/abort_requests")
    async def abort_requests(request: Request):
        """Every instance, prefill and decode: a request's decode runs on one, its leased KV waits on another."""
        return await router.broadcast(request, "/abort_requests")


def _refuse_openai_routes(app: FastAPI) -> None:
    """USE_OPENAI=0: the OpenAI routes answer a 404 that says why, not a bare "not found"."""

    async def openai_off():
        raise APIError(
            "This router serves vLLM's native API (USE_OPENAI=0): POST /generate. "
            "Start it with USE_OPENAI=1 for the OpenAI routes.",
            status=404,
            err_type="not_found_error",
        )

    for path in ("/v1/{rest:path}", "/tokenize", "/detokenize"):
        app.add_api_route(path, openai_off, methods=["GET", "POST"], include_in_schema=False)


def run_router(config: RouterConfig, host: str = "0.0.0.0", port: int = 9000) -> None:
    """Serve the router with uvicorn until interrupted (no access log: the router logs one line per
    completion request itself)."""
    import uvicorn

    uvicorn.run(build_router_app(config), host=host, port=port, access_log=False, log_level="info")


def main(ns: argparse.Namespace) -> None:
    run_router(config_from_args(ns), ns.host, ns.port)
