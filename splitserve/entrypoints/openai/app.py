"""The FastAPI application of one API server worker: routes, API-key check, body limit, errors."""

from __future__ import annotations

import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse, Response

from splitserve.config import EngineConfig
from splitserve.engine.async_llm import AsyncLLM
from splitserve.entrypoints.http import (
    ApiKeyMiddleware,
    RequestIdMiddleware,
    error_response,
    install_error_handlers,
    read_json_body,
)
from splitserve.entrypoints.openai.api_docs import document_routes
from splitserve.entrypoints.openai.encoding import json_response
from splitserve.entrypoints.openai.load_signals import add_load_signals
from splitserve.entrypoints.openai.metrics import Metrics, render_metrics
from splitserve.entrypoints.openai.serving_anthropic import AnthropicServing
from splitserve.entrypoints.openai.serving_batches import add_batch_routes, batch_serving
from splitserve.entrypoints.openai.serving_chat import OpenAIServingChat
from splitserve.entrypoints.openai.serving_completion import OpenAIServingCompletion
from splitserve.entrypoints.openai.serving_control import abort_by_client_ids, sleep_call, update_weights
from splitserve.entrypoints.openai.serving_generate import NativeServing
from splitserve.entrypoints.openai.serving_pooling import OpenAIServingPooling
from splitserve.entrypoints.openai.serving_responses import ResponsesServing, add_responses_routes
from splitserve.entrypoints.openai.serving_tokenize import OpenAIServingTokenization
from splitserve.entrypoints.ui import add_ui_routes
from splitserve.tracing import TraceContextMiddleware
from splitserve.version import __version__

logger = logging.getLogger("splitserve.api_server")

_OPEN_PATHS = ("/health", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc")  # no key needed


def build_app(engine: AsyncLLM, config: EngineConfig, server_args, index: int = 0) -> FastAPI:
    metrics = Metrics(config.model_config.served_model_name, index, server_args.metrics_prefix)
    engine.on_stats = metrics.record_engine_stats
    global_scheduler = getattr(engine, "global_scheduler", None)  # GlobalSchedulerAsyncLLM's
    if global_scheduler is not None:
        global_scheduler.on_stolen = metrics.global_scheduler_stolen.inc
        global_scheduler.on_remote = metrics.global_scheduler_remote.inc
    engine.set_inter_token_hook(metrics.record_inter_token)
    completion = OpenAIServingCompletion(engine, config, server_args, metrics)
    chat = OpenAIServingChat(engine, config, server_args, metrics)
    tokenization = OpenAIServingTokenization(engine, config, server_args, metrics)
    native = NativeServing(engine, config, server_args, metrics)
    anthropic = AnthropicServing(chat)
    pooling = OpenAIServingPooling(engine, config, server_args, metrics)
    responses = ResponsesServing(chat)
    batches = batch_serving(completion, chat, pooling, config, server_args)
    tracing = completion.tracing

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if server_args.use_warmup and index == 0:
            await completion.warmup()
        yield
        engine.shutdown()
        if tracing is not None:
            tracing.flush()

    app = FastAPI(title="splitserve", version=__version__, lifespan=lifespan)

    install_error_handlers(app, "server")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion.create_completion(await read_json_body(request), request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat.create_chat_completion(await read_json_body(request), request)

    @app.post("/v1/messages")
    async def messages(request: Request):
        return await anthropic.create_message(await read_json_body(request), request)

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(request: Request):
        return await anthropic.count_tokens(await read_json_body(request))

    add_responses_routes(app, responses)

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        return await pooling.create_embedding(await read_json_body(request), request)

    for path in ("/score", "/v1/score"):
        app.add_api_route(path, _score_route(pooling), methods=["POST"], name=f"score {path}")
    for path in ("/classify", "/v1/classify"):
        app.add_api_route(path, _classify_route(pooling), methods=["POST"], name=f"classify {path}")
    for path in ("/rerank", "/v1/rerank", "/v2/rerank"):
        app.add_api_route(path, _rerank_route(pooling), methods=["POST"], name=f"rerank {path}")

    @app.post("/generate")
    async def generate(request: Request):
        return await native.generate(await read_json_body(request), request)

    @app.get("/v1/models")
    async def models():
        return await tokenization.models.show_available_models()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request):
        return PlainTextResponse(await tokenization.models.load_lora_adapter(await read_json_body(request)))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request):
        return PlainTextResponse(await tokenization.models.unload_lora_adapter(await read_json_body(request)))

    @app.post("/tokenize")
    async def tokenize(request: Request):
        return await tokenization.tokenize(await read_json_body(request))

    @app.post("/detokenize")
    async def detokenize(request: Request):
        return await tokenization.detokenize(await read_json_body(request))

    @app.post("/abort_requests")
    async def abort_requests(request: Request):
        """Abort requests by the ids their clients gave (X-Request-Id or the body's request_id), on
        whichever API worker they run; unknown ids are ignored."""
        return json_response(await abort_by_client_ids(engine, await read_json_body(request)))

    @app.post("/sleep")
    async def sleep(request: Request):
        """Release the KV cache and the weights (level 2) or move them to host memory (level 1)."""
        return json_response(await sleep_call(engine, "sleep", request.query_params.get("level", "1")))

    @app.post("/wake_up")
    async def wake_up():
        return json_response(await sleep_call(engine, "wake_up"))

    @app.get("/is_sleeping")
    async def is_sleeping():
        return json_response(await sleep_call(engine, "is_sleeping"))

    for path in ("/update_weights", "/update_weights_from_disk"):  # the second is SGLang's name
        app.add_api_route(path, _update_weights_route(engine), methods=["POST"], name=f"update weights {path}")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache():
        return json_response(await sleep_call(engine, "reset_prefix_cache"))

    @app.get("/version")
    async def version():
        return {"version": __version__}

    @app.get("/pd_role")
    async def pd_role():
        """Which PD role this instance has (the router checks that it lists it under that role), and
        where it publishes its KV cache events, if it does (the router's cache_aware policy reads them):
        one endpoint, or a list of each data-parallel replica's."""
        roles = completion.roles
        answer = {"pd_role": roles.role, "epoch": roles.epoch, "block_size": config.cache_config.block_size}
        events = config.kv_events_config
        if events is not None and events.publisher == "zmq":
            replicas = config.parallel_config.data_parallel_size
            endpoints = [events.for_rank(r).endpoint for r in range(replicas)] if replicas > 1 else events.endpoint
            answer["kv_events_endpoint"], answer["kv_events_topic"] = endpoints, events.topic
        return answer

    @app.post("/pd_role")
    async def switch_pd_role(request: Request):
        """Take another PD role while serving (a prefill or decode instance: prefill, decode or mixed)."""
        return completion.switch_pd_role(await read_json_body(request))

    @app.post("/kv_transfer/release")
    async def release_kv(request: Request):
        """PD prefill instances: free a lease no decode instance will pull (the router calls it)."""
        return await completion.release_kv_lease(await read_json_body(request))

    @app.get("/health")
    async def health():
        if await engine.check_health(server_args.health_timeout):
            return Response(status_code=200)
        return error_response("The engine is not responding.", 503, "service_unavailable")

    @app.get("/recent_requests")
    async def recent_requests():
        """The last requests this API process finished, with their timings (the dashboard's table)."""
        return metrics.recent.answer()

    @app.get("/metrics")
    async def metrics_route():
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    add_batch_routes(app, batches)  # /v1/files, /v1/batches
    add_load_signals(app, engine, config, server_args)  # the ORCA header, /v1/loads, gateway metrics
    document_routes(app, config.model_config.vocab_size)
    ui_paths = add_ui_routes(app, dashboard_kind="server", enabled=not server_args.disable_ui)  # /, /dashboard
    app.add_middleware(RequestIdMiddleware)
    if tracing is not None:
        app.add_middleware(TraceContextMiddleware, tracing=tracing)
    # /metrics is open to Prometheus unless it has a key of its own; the pages hold no secret.
    app.add_middleware(
        ApiKeyMiddleware,
        api_key=server_args.api_key,
        open_paths=(*_OPEN_PATHS, "/metrics", *ui_paths),
        path_keys={"/metrics": server_args.metrics_api_key},
    )
    return app


def build_metrics_app(server_args) -> FastAPI:
    """The app of a separate --metrics-port."""
    app = FastAPI(title="splitserve metrics")

    @app.get("/metrics")
    async def metrics_route():
        body, content_type = render_metrics()
        return Response(body, media_type=content_type)

    app.add_middleware(ApiKeyMiddleware, api_key=None, path_keys={"/metrics": server_args.metrics_api_key})
    return app


def _score_route(pooling: OpenAIServingPooling):
    async def score(request: Request):
        return await pooling.create_score(await read_json_body(request), request)

    return score


def _rerank_route(pooling: OpenAIServingPooling):
    async def rerank(request: Request):
        return await pooling.create_rerank(await read_json_body(request), request)

    return rerank


def _update_weights_route(engine: AsyncLLM):
    async def update(request: Request):
        return json_response(await update_weights(engine, await read_json_body(request)))

    return update


def _classify_route(pooling: OpenAIServingPooling):
    async def classify(request: Request):
        return await pooling.create_classify(await read_json_body(request), request)

    return classify
