"""What the OpenAI-compatible endpoints share: the checks only the server can make, running
requests, collecting or merging their streams, client disconnects, and the JSON and server-sent
event answers.

Everything a client can get wrong is checked here, in the API process, before it reaches the
engine: the body's fields (protocol.py); the model name, the queue limit, a running engine and the
PD kv_transfer_params (this module); then the prompt and params, once, by the engine's Processor,
whose InvalidRequestError is answered with a 400 naming its param (entrypoints/http.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from pydantic import BaseModel

from splitserve.engine.async_llm import AsyncLLM, EngineDeadError
from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.messages import KVTransferParams
from splitserve.engine.output_processor import RequestOutputKind
from splitserve.engine.pd_role import role_state
from splitserve.engine.processor import ProcessedRequest, PromptType
from splitserve.entrypoints.http import CLIENT_REQUEST_ID, APIError
from splitserve.entrypoints.openai import chat_images
from splitserve.entrypoints.openai.chat_messages import template_kwargs
from splitserve.entrypoints.openai.encoding import merge_streams
from splitserve.entrypoints.openai.request_model import parse_request
from splitserve.entrypoints.openai.response_models import CompletionTokenUsageInfo, PromptTokenUsageInfo, UsageInfo
from splitserve.entrypoints.openai.serving_beam import beam_search_output
from splitserve.entrypoints.openai.serving_models import OpenAIServingModels
from splitserve.entrypoints.openai.serving_pd import PDServingMixin
from splitserve.lora.request import LoRARequest
from splitserve.outputs import RequestOutput
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import apply_chat_template
from splitserve.tracing import REQUEST_TRACE, tracing_for
from splitserve.version import __version__

logger = logging.getLogger("splitserve.api_server")

_DISCONNECT_POLL_S = 0.5


@dataclass
class ChoiceState:
    """What a streamed choice has sent so far."""

    text: str = ""
    num_tokens: int = 0
    token_ids: list = field(default_factory=list)  # chat: every token id streamed so far
    finished: bool = False
    started: bool = False
    content: str = ""  # chat: the answer's text so far (the text less its reasoning)
    tool_parser: Any = None  # chat with tools: this choice's ToolParser
    held_token_ids: list = field(default_factory=list)  # of chunks held back, sent with the next one
    held_logprobs: list = field(default_factory=list)


class OpenAIServing(PDServingMixin):
    """The base of the endpoints' handlers (OpenAIServingCompletion, OpenAIServingChat,
    OpenAIServingTokenization), as vLLM names them."""

    def __init__(self, engine: AsyncLLM, config, server_args, metrics):
        self.engine = engine
        self.processor = engine.processor
        self.model_config = config.model_config
        self.served_name = config.model_config.served_model_name
        self.max_model_len = config.model_config.max_model_len
        self.server_args = server_args
        self.metrics = metrics
        self.tokenizer = engine.get_tokenizer()
        self.fingerprint = f"splitserve-{__version__}"
        self.roles = role_state(engine, config)  # the PD role, changed live by POST /pd_role
        service = "splitserve" if self.pd_role == "mixed" else f"splitserve-{self.pd_role}"
        self.tracing = tracing_for(server_args.otlp_traces_endpoint, service)
        self.models = OpenAIServingModels(engine, config)
        # What a request's unset fields become: the model's sampling defaults (--generation-config),
        # and max_tokens from --default-max-tokens, else the model's max_new_tokens, else the context.
        self.sampling_defaults = config.model_config.sampling_defaults
        self.default_max_tokens = server_args.default_max_tokens or self.sampling_defaults.get("max_tokens")

    # --- shared checks ------------------------------------------------------------------------
    def _parse(self, parse: Callable[..., Any], body: dict):
        """Validate a body. Unknown fields are ignored with one warning line (vLLM's behaviour) or,
        with --strict-request-fields, refused with a 400."""
        return parse_request(parse, body, self.server_args.strict_request_fields)

    async def _check_model(self, name: str | None) -> LoRARequest | None:
        """The LoRA adapter the model name asks for (None: the base model); a 404 for an unknown name."""
        return await self.models.resolve(name)

    def _response_model(self, req) -> str:
        """The `model` of a response: the adapter's name when the request named one, else the served name."""
        return self.served_name if self.models.is_base_model(req.model) else req.model

    def _check_capacity(self) -> None:
        if self.engine.dead_reason is not None:
            raise APIError(f"The engine is not running: {self.engine.dead_reason}", 503, "service_unavailable")
        limit = self.server_args.max_queued_requests
        if limit is not None and not self.engine.try_reserve_queue_slot(limit):
            raise APIError(
                f"Too many requests are waiting (the limit is {limit}); retry later.", 429, "rate_limit_exceeded"
            )

    async def _accept(self, model: type[BaseModel], body: dict):
        """Parse a generation request, check its model and the queue, make its SamplingParams.
        Returns (request, params, the LoRA adapter its model names or None)."""
        req = self._parse(model.model_validate, body)
        lora = await self._check_model(req.model)
        if getattr(req, "priority", 0) and self.engine.scheduling_policy != "priority":
            raise APIError(
                f"priority {req.priority} needs the priority scheduling policy (start the server with "
                "--scheduling-policy priority); this one schedules first come, first served.",
                param="priority",
            )
        self._check_capacity()
        try:
            return req, req.to_sampling_params(self.default_max_tokens, self.sampling_defaults), lora
        except ValueError as exc:
            raise APIError(str(exc), param=getattr(req, "guide_param", None)) from None

    async def _process_params(self, req, params: SamplingParams) -> SamplingParams:
        """The Processor's check of the params, once per request. A guide is compiled there (in a
        worker thread: a large schema takes a while); its errors name the request field that held it."""
        try:
            if params.guided_decoding is None:
                return self.processor.process_params(params)
            return await asyncio.to_thread(self.processor.process_params, params)
        except InvalidRequestError as exc:
            if exc.param == "guided_decoding":
                exc.param = req.guide_param or "tools"
            raise

    # --- prompts ------------------------------------------------------------------------------
    async def _process(
        self, prompts: list[PromptType], params: SamplingParams, param: str, add_special_tokens: bool = True
    ) -> list[ProcessedRequest]:
        """Each prompt tokenized and validated by the engine's Processor under the server's rule
        (prompt + max_tokens must fit the context), in a worker thread so that a long prompt does
        not stall the event loop. `params` come from Processor.process_params, once for them all."""

        def process() -> list[ProcessedRequest]:
            return [
                self.processor.process_prompt(
                    prompt, params, add_special_tokens=add_special_tokens, param=param, max_tokens_must_fit=True
                )
                for prompt in prompts
            ]

        return await asyncio.to_thread(process)

    async def _render_chat(self, req) -> PromptType:
        """The messages of a chat request as its template renders them: the text, or with image parts a
        prompt carrying the images (entrypoints/openai/chat_images.py)."""
        template = req.chat_template or self.server_args.chat_template
        media = chat_images.media_config(self.server_args)
        messages, images = await chat_images.split_images(
            req.template_messages(), self.processor, template or self.tokenizer.chat_template, media
        )
        try:
            text = await asyncio.to_thread(
                apply_chat_template,
                self.tokenizer,
                messages,
                template,
                req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                **template_kwargs(req),
            )
        except Exception as exc:  # jinja raises many kinds of errors for a template the messages break
            raise APIError(f"The chat template could not render these messages: {exc}", param="messages") from None
        return chat_images.chat_prompt(text, images)

    def _prompt_text(self, request: ProcessedRequest) -> str:
        return request.prompt if request.prompt is not None else self.tokenizer.decode(request.prompt_token_ids)

    # --- running requests ---------------------------------------------------------------------
    def _log(
        self, request_id: str, requests: list[ProcessedRequest], params: SamplingParams, user: str | None = None
    ) -> None:
        if not self.server_args.disable_log_requests:
            logger.info(
                "Request %s%s: %d prompt(s) of %s tokens, max_tokens=%s, n=%d, temperature=%s",
                request_id,
                f" from user {user!r}" if user else "",
                len(requests),
                [len(r.prompt_token_ids) for r in requests],
                params.max_tokens,
                params.n,
                params.temperature,
            )

    def _streams(
        self,
        request_id: str,
        requests: list[ProcessedRequest],
        arrival: float,
        kind: RequestOutputKind,
        kv: KVTransferParams | None = None,
        lora: LoRARequest | None = None,
        priority: int = 0,
        client_request_id: str | None = None,
    ) -> list[AsyncIterator[RequestOutput]]:
        """Each processed prompt's outputs. client_request_id (the body's request_id, else the
        X-Request-Id header) names them for /abort_requests."""
        client_request_id = client_request_id or CLIENT_REQUEST_ID.get()
        for request in requests:
            request.client_request_id = client_request_id
        return [
            self.engine.generate(f"{request_id}-{i}", request, arrival, kind, kv, lora, priority)
            for i, request in enumerate(requests)
        ]

    def _generation_streams(self, req, request_id: str, requests, arrival: float, kind, kv=None, lora=None) -> list:
        """Each prompt's outputs: sampled, or (use_beam_search) a beam search's one output."""
        if not req.use_beam_search:
            return self._streams(
                request_id, requests, arrival, kind, kv, lora, req.priority, getattr(req, "request_id", None)
            )
        if kv is not None:
            raise APIError("Beam search does not run on prefill/decode instances.", param="use_beam_search")
        streams = []
        for i, request in enumerate(requests):
            room = self.max_model_len - len(request.prompt_token_ids)
            params = req.beam_search_params(min(request.params.max_tokens or room, room))
            stop_ids = ({self.processor.eos_token_id} | set(request.params.stop_token_ids)) - {None}
            streams.append(beam_search_output(self.engine, f"{request_id}-{i}", request, params, req.n, stop_ids, lora))
        return streams

    async def _collect(self, streams: list[AsyncIterator[RequestOutput]], raw: Request) -> list[RequestOutput]:
        """The final output of each stream; if the client goes away first, abort them all."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def consume() -> None:
            async for i, output in merge_streams(streams):
                finals[i] = output

        task = asyncio.ensure_future(consume())
        try:
            while not task.done():
                await asyncio.wait({task}, timeout=_DISCONNECT_POLL_S)
                if not task.done() and await raw.is_disconnected():
                    task.cancel()
                    logger.info("Client disconnected: request aborted")
                    raise APIError("The client disconnected.", 499, "client_closed_request")
            task.result()
        except EngineDeadError as exc:
            raise APIError(str(exc), 503, "service_unavailable") from None
        except InvalidRequestError as exc:
            raise APIError(str(exc), exc.status, exc.err_type, exc.param) from None
        except ValueError as exc:
            raise APIError(str(exc)) from None
        finally:
            if not task.done():
                task.cancel()
        return finals

    def _record_finished(self, output: RequestOutput) -> None:
        self.metrics.record_finished(
            output,
            output.num_generated_tokens,  # whole answers: a streamed final output holds only its last delta
            [c.finish_reason for c in output.outputs if c.finish_reason],
        )
        if self.tracing is not None:
            self.tracing.record_request(output, REQUEST_TRACE.get(), self.pd_role)

    @staticmethod
    def _usage(
        requests: list[ProcessedRequest], completion_tokens: int, cached: int, reasoning_tokens: int = 0
    ) -> UsageInfo:
        prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
        return UsageInfo(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokenUsageInfo(cached_tokens=cached),
            completion_tokens_details=CompletionTokenUsageInfo(reasoning_tokens=reasoning_tokens),
        )

    async def warmup(self) -> None:
        """One short request through the whole path, so the first user does not pay for cold caches."""
        start = time.monotonic()
        if self.model_config.runner_type == "pooling":
            request = self.processor.process_pooling("Hello", None)
        else:
            request = self.processor.process("Hello", SamplingParams(max_tokens=4))
        async for _ in self.engine.generate("warmup", request):
            pass
        logger.info("Warm-up request done in %.2f s", time.monotonic() - start)
