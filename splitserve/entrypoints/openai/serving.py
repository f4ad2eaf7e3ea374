"""Request handling of the OpenAI-compatible API: validate, tokenize, run, and shape responses.

Everything a client can get wrong is checked here, in the API process, before it reaches the
engine: the body's fields (protocol.py), the model name, the queue limit, prompt and output
lengths against the context, token ids against the vocabulary.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, ValidationError

from splitserve import __version__
from splitserve.engine.async_llm import AsyncLLM, EngineDeadError
from splitserve.engine.output_processor import RequestOutputKind
from splitserve.engine.messages import KVTransferParams
from splitserve.entrypoints.openai import protocol as P
from splitserve.entrypoints.http import APIError, ErrorResponse, error_body
from splitserve.entrypoints.openai.reasoning import get_reasoning_parser
from splitserve.outputs import Logprob, RequestOutput
from splitserve.sampling_params import SamplingParams
from splitserve.tokenizer import apply_chat_template

logger = logging.getLogger("splitserve.api_server")

_DISCONNECT_POLL_S = 0.5
_DEFAULT_MODEL_ALIASES = (None, "default")


@dataclass
class _Prompt:
    text: str | None
    token_ids: list[int]


@dataclass
class _ChoiceState:
    """What a streamed choice has sent so far."""

    text: str = ""
    num_tokens: int = 0
    finished: bool = False
    started: bool = False


class OpenAIServing:
    def __init__(self, engine: AsyncLLM, config, server_args, metrics):
        self.engine = engine
        self.model_config = config.model_config
        self.served_name = config.model_config.served_model_name
        self.max_model_len = config.model_config.max_model_len
        self.vocab_size = config.model_config.vocab_size
        self.server_args = server_args
        self.metrics = metrics
        self.tokenizer = engine.get_tokenizer()
        self.reasoning = get_reasoning_parser(server_args.reasoning_parser) if server_args.reasoning_parser else None
        self.fingerprint = f"splitserve-{__version__}"
        self.pd_role = config.kv_transfer_config.pd_role
        engine.output_processor.on_inter_token = metrics.record_inter_token

    # --- shared checks ------------------------------------------------------------------------
    @staticmethod
    def _parse(model: type[BaseModel], body: dict):
        try:
            return model.model_validate(body)
        except ValidationError as exc:
            message, param = P.validation_error_message(exc)
            raise APIError(message, param=param) from None

    def _check_model(self, name: str | None) -> None:
        if name not in _DEFAULT_MODEL_ALIASES and name != self.served_name:
            raise APIError(f"The model {name!r} does not exist; this server serves {self.served_name!r}.",
                               404, "not_found_error", "model")

    def _check_capacity(self) -> None:
        if self.engine.dead_reason is not None:
            raise APIError(f"The engine is not running: {self.engine.dead_reason}", 503, "service_unavailable")
        limit = self.server_args.max_queued_requests
        if limit is not None and not self.engine.try_reserve_queue_slot(limit):
            raise APIError(f"Too many requests are waiting (the limit is {limit}); retry later.", 429,
                               "rate_limit_exceeded")

    async def _tokenize(self, prompt: str | list[int], add_special_tokens: bool = True) -> _Prompt:
        if isinstance(prompt, list):
            bad = [t for t in prompt if t >= self.vocab_size]
            if bad:
                raise APIError(f"Prompt token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1}).",
                                   param="prompt")
            return _Prompt(None, prompt)
        ids = await asyncio.to_thread(lambda: self.tokenizer(prompt, add_special_tokens=add_special_tokens).input_ids)
        return _Prompt(prompt, ids)

    def _check_lengths(self, prompt: _Prompt, params: SamplingParams, param: str) -> None:
        n = len(prompt.token_ids)
        if n == 0:
            raise APIError("The prompt is empty: it must have at least one token.", param=param)
        if n >= self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens, but the prompt "
                               f"has {n} tokens, leaving no room for output.", param=param)
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise APIError(f"This model's maximum context length is {self.max_model_len} tokens. However, you "
                               f"requested {n + params.max_tokens} tokens ({n} in the prompt, {params.max_tokens} "
                               "in the completion). Reduce the prompt or max_tokens.", param="max_tokens")

    def _prepare_params(self, params: SamplingParams) -> None:
        """Checks that need the tokenizer (token ids in logit_bias and allowed_token_ids)."""
        try:
            self.engine.processor.prepare_params(params)
        except ValueError as exc:
            raise APIError(str(exc)) from None

    def _log(self, request_id: str, prompts: list[_Prompt], params: SamplingParams) -> None:
        if not self.server_args.disable_log_requests:
            logger.info("Request %s: %d prompt(s) of %s tokens, max_tokens=%s, n=%d, temperature=%s, stream",
                        request_id, len(prompts), [len(p.token_ids) for p in prompts], params.max_tokens, params.n,
                        params.temperature)

    def _streams(self, request_id: str, prompts: list[_Prompt], params: SamplingParams, arrival: float,
                 kind: RequestOutputKind, kv: KVTransferParams | None = None) -> list[AsyncIterator[RequestOutput]]:
        return [self.engine.generate(f"{request_id}-{i}", {"prompt": p.text, "prompt_token_ids": p.token_ids},
                                     params, arrival, kind, kv) for i, p in enumerate(prompts)]

    # --- prefill/decode disaggregation ----------------------------------------------------------
    def _kv_transfer(self, req, params: SamplingParams, num_prompts: int) -> KVTransferParams | None:
        """The router's kv_transfer_params. A prefill answer must be one whole JSON with where its KV
        waits, so it cannot stream; its n samples become one prefill whose KV is pulled n times."""
        raw = req.kv_transfer_params
        if raw is None:
            return None
        if self.pd_role == "mixed":
            raise APIError("kv_transfer_params need a prefill or decode instance; this one runs with "
                               "--pd-role mixed.", param="kv_transfer_params")
        if num_prompts != 1:
            raise APIError("With kv_transfer_params a request must hold exactly one prompt.", param="prompt")
        try:
            kv = msgspec.convert(raw, KVTransferParams)
        except msgspec.ValidationError as exc:
            raise APIError(f"Invalid kv_transfer_params: {exc}", param="kv_transfer_params") from None
        if kv.do_remote_decode:
            if req.stream:
                raise APIError("A prefill request (do_remote_decode) cannot stream.", param="stream")
            kv.remote_num_pulls, params.n = params.n, 1
        if kv.do_remote_prefill and None in (kv.remote_host, kv.remote_port, kv.remote_request_id):
            raise APIError("do_remote_prefill needs remote_host, remote_port and remote_request_id.",
                               param="kv_transfer_params")
        return kv

    async def _remote_prompt(self, req, kv: KVTransferParams | None) -> _Prompt | None:
        """A decode request carries the token ids the prefill instance computed: using them (rather
        than tokenizing again) guarantees the pulled KV belongs to exactly this prompt."""
        ids = (req.kv_transfer_params or {}).get("prompt_token_ids") if kv and kv.do_remote_prefill else None
        if ids is None:
            return None
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise APIError("kv_transfer_params.prompt_token_ids must be a list of token ids.",
                               param="kv_transfer_params")
        return await self._tokenize(ids)

    @staticmethod
    def _kv_answer(kv: KVTransferParams | None, prompt: _Prompt, output: RequestOutput) -> dict | None:
        if kv is None or not kv.do_remote_decode or output.kv_transfer_params is None:
            return None
        return {**output.kv_transfer_params, "prompt_token_ids": prompt.token_ids}

    def _record_finished(self, output: RequestOutput) -> None:
        self.metrics.record_finished(output, sum(len(c.token_ids) for c in output.outputs),
                                     [c.finish_reason for c in output.outputs if c.finish_reason])

    # --- /v1/completions ----------------------------------------------------------------------
    def _accept(self, model: type[BaseModel], body: dict):
        """Parse a generation request, check its model and the queue, make its SamplingParams."""
        req = self._parse(model, body)
        self._check_model(req.model)
        self._check_capacity()
        try:
            return req, req.to_sampling_params(default_max_tokens=None)
        except ValueError as exc:
            raise APIError(str(exc)) from None

    async def create_completion(self, body: dict, raw: Request):
        arrival = time.monotonic()
        req, params = self._accept(P.CompletionRequest, body)
        if req.echo and params.logprobs is not None:
            params.prompt_logprobs = max(params.prompt_logprobs or 0, params.logprobs)
        self._prepare_params(params)
        kv = self._kv_transfer(req, params, len(req.prompts()))
        remote = await self._remote_prompt(req, kv)
        prompts = [remote] if remote else [await self._tokenize(p) for p in req.prompts()]
        for p in prompts:
            self._check_lengths(p, params, "prompt")
        request_id = P.random_id("cmpl")
        self._log(request_id, prompts, params)
        if req.stream:
            streams = self._streams(request_id, prompts, params, arrival, RequestOutputKind.DELTA, kv)
            return _sse(self._completion_stream(req, request_id, prompts, params, streams, arrival))
        streams = self._streams(request_id, prompts, params, arrival, RequestOutputKind.FINAL_ONLY, kv)
        finals = await self._collect(streams, raw)
        response = self._completion_response(req, request_id, prompts, params, finals)
        response.kv_transfer_params = self._kv_answer(kv, prompts[0], finals[0])
        return _json(response)

    def _completion_response(self, req, request_id, prompts, params, finals) -> P.CompletionResponse:
        choices, completion_tokens, cached = [], 0, 0
        for i, (prompt, output) in enumerate(zip(prompts, finals)):
            self._record_finished(output)
            cached += output.num_cached_tokens
            for c in output.outputs:
                completion_tokens += len(c.token_ids)
                text, logprobs = c.text, None
                if req.echo:
                    text = self._prompt_text(prompt) + text
                if params.logprobs is not None:
                    logprobs = self._completion_logprobs(c.token_ids, c.logprobs, params.logprobs, 0,
                                                         self._echo_logprobs(req, prompt, output))
                choices.append(P.CompletionResponseChoice(
                    index=i * params.n + c.index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, prompt_logprobs=output.prompt_logprobs if req.prompt_logprobs
                    is not None else None, token_ids=c.token_ids if req.return_token_ids else None,
                    prompt_token_ids=prompt.token_ids if req.return_token_ids else None,
                    cum_log_probs=c.cumulative_logprob, sentence_length=len(c.token_ids)))
        return P.CompletionResponse(id=request_id, model=self.served_name, choices=choices,
                                    usage=self._usage(prompts, completion_tokens, cached),
                                    system_fingerprint=self.fingerprint)

    def _usage(self, prompts: list[_Prompt], completion_tokens: int, cached: int) -> P.UsageInfo:
        prompt_tokens = sum(len(p.token_ids) for p in prompts)
        return P.UsageInfo(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                           total_tokens=prompt_tokens + completion_tokens,
                           prompt_tokens_details=P.PromptTokenUsageInfo(cached_tokens=cached))

    def _prompt_text(self, prompt: _Prompt) -> str:
        return prompt.text if prompt.text is not None else self.tokenizer.decode(prompt.token_ids)

    def _echo_logprobs(self, req, prompt: _Prompt, output: RequestOutput):
        """With echo, the legacy logprobs start with the prompt's tokens (the first has none)."""
        if not req.echo or output.prompt_logprobs is None:
            return None
        return list(zip(prompt.token_ids, output.prompt_logprobs))

    def _completion_logprobs(self, token_ids: list[int], logprobs, top_n: int, offset: int,
                             prefix=None) -> P.CompletionLogProbs:
        result = P.CompletionLogProbs()
        entries = list(prefix or []) + list(zip(token_ids, logprobs or []))
        for token_id, entry in entries:
            text = self.tokenizer.decode([token_id]) if entry is None else entry[token_id].decoded_token or ""
            result.text_offset.append(offset)
            offset += len(text)
            result.tokens.append(text)
            result.token_logprobs.append(None if entry is None else entry[token_id].logprob)
            result.top_logprobs.append(None if entry is None else _top(entry, top_n))
        return result

    async def _completion_stream(self, req, request_id, prompts, params, streams, arrival) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        states: dict[int, _ChoiceState] = {}
        completion_tokens, cached = 0, 0
        async for i, output in _merge(streams):
            cached = max(cached, output.num_cached_tokens)
            chunk_choices = []
            for c in output.outputs:
                index = i * params.n + c.index
                state = states.setdefault(index, _ChoiceState())
                if state.finished or not (c.text or c.token_ids or c.finish_reason):
                    continue
                completion_tokens += len(c.token_ids)
                text = c.text
                if req.echo and not state.started:
                    text = self._prompt_text(prompts[i]) + text
                state.started = True
                logprobs = None
                if params.logprobs is not None:
                    logprobs = self._completion_logprobs(c.token_ids, c.logprobs, params.logprobs, len(state.text))
                state.text += text
                state.num_tokens += len(c.token_ids)
                state.finished = c.finish_reason is not None
                chunk_choices.append(P.CompletionStreamChoice(
                    index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, token_ids=c.token_ids if req.return_token_ids else None,
                    prompt_token_ids=prompts[i].token_ids if req.return_token_ids and state.num_tokens == len(
                        c.token_ids) else None,
                    cum_log_probs=c.cumulative_logprob if state.finished else None,
                    sentence_length=state.num_tokens if state.finished else None,
                    arrival_time=time.monotonic() - arrival))
            if output.finished:
                self._record_finished(output)
            if chunk_choices:
                usage = self._usage(prompts, completion_tokens, cached) if continuous else None
                yield _event(P.CompletionStreamResponse(id=request_id, model=self.served_name, choices=chunk_choices,
                                                        usage=usage, system_fingerprint=self.fingerprint))
        if include_usage:
            yield _event(P.CompletionStreamResponse(id=request_id, model=self.served_name, choices=[],
                                                    usage=self._usage(prompts, completion_tokens, cached),
                                                    system_fingerprint=self.fingerprint))

    # --- /v1/chat/completions -----------------------------------------------------------------
    async def create_chat_completion(self, body: dict, raw: Request):
        arrival = time.monotonic()
        req, params = self._accept(P.ChatCompletionRequest, body)
        self._prepare_params(params)
        kv = self._kv_transfer(req, params, 1)
        prompt = await self._remote_prompt(req, kv) or await self._render_chat(
            req, req.add_generation_prompt, add_special_tokens=False)
        self._check_lengths(prompt, params, "messages")
        request_id = P.random_id("chatcmpl")
        self._log(request_id, [prompt], params)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        stream = self._streams(request_id, [prompt], params, arrival, kind, kv)
        echo = self._chat_echo(req)
        if req.stream:
            return _sse(self._chat_stream(req, request_id, prompt, params, stream, arrival, echo))
        (final,) = await self._collect(stream, raw)
        response = self._chat_response(req, request_id, prompt, params, final, echo)
        response.kv_transfer_params = self._kv_answer(kv, prompt, final)
        return _json(response)

    async def _render_chat(self, req, add_generation_prompt: bool, add_special_tokens: bool) -> _Prompt:
        template = req.chat_template or self.server_args.chat_template
        try:
            text = await asyncio.to_thread(
                apply_chat_template, self.tokenizer, req.template_messages(), template, add_generation_prompt,
                continue_final_message=req.continue_final_message, **(req.chat_template_kwargs or {}))
        except Exception as exc:  # jinja raises many kinds of errors for a template the messages break
            raise APIError(f"The chat template could not render these messages: {exc}", param="messages") from None
        return await self._tokenize(text, add_special_tokens=add_special_tokens)

    @staticmethod
    def _chat_echo(req) -> str:
        last = req.messages[-1]
        return last.text() if req.echo and last.role == "assistant" else ""

    def _split_reasoning(self, text: str) -> tuple[str | None, str | None]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.extract(text)

    def _chat_response(self, req, request_id, prompt, params, final: RequestOutput, echo: str):
        self._record_finished(final)
        choices, completion_tokens = [], 0
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            reasoning, content = self._split_reasoning(c.text)
            message = P.ChatMessage(content=echo + (content or ""), reasoning_content=reasoning)
            logprobs = self._chat_logprobs(c.token_ids, c.logprobs, params.logprobs) if req.logprobs else None
            choices.append(P.ChatCompletionResponseChoice(
                index=c.index, message=message, logprobs=logprobs, finish_reason=c.finish_reason,
                stop_reason=c.stop_reason, token_ids=c.token_ids if req.return_token_ids else None,
                cum_log_probs=c.cumulative_logprob, sentence_length=len(c.token_ids)))
        return P.ChatCompletionResponse(
            id=request_id, model=self.served_name, choices=choices,
            usage=self._usage([prompt], completion_tokens, final.num_cached_tokens),
            system_fingerprint=self.fingerprint,
            prompt_logprobs=final.prompt_logprobs if req.prompt_logprobs is not None else None,
            prompt_token_ids=prompt.token_ids if req.return_token_ids else None)

    def _chat_logprobs(self, token_ids: list[int], logprobs, top_n: int | None) -> P.ChatCompletionLogProbs:
        content = []
        for token_id, entry in zip(token_ids, logprobs or []):
            top = [_chat_logprob(lp) for lp in _ranked(entry, top_n or 0)]
            content.append(P.ChatCompletionLogProbsContent(**_chat_logprob(entry[token_id]).model_dump(),
                                                           top_logprobs=top))
        return P.ChatCompletionLogProbs(content=content)

    async def _chat_stream(self, req, request_id, prompt, params, streams, arrival, echo) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        states = {i: _ChoiceState() for i in range(params.n)}
        completion_tokens, cached = 0, 0

        def chunk(choices, usage=None) -> str:
            return _event(P.ChatCompletionStreamResponse(id=request_id, model=self.served_name, choices=choices,
                                                         usage=usage, system_fingerprint=self.fingerprint))

        def usage_now():
            return self._usage([prompt], completion_tokens, cached)

        yield chunk([P.ChatCompletionStreamChoice(index=i, delta=P.DeltaMessage(role="assistant", content=echo),
                                                  arrival_time=time.monotonic() - arrival) for i in states],
                    usage_now() if continuous else None)
        async for _, output in _merge(streams):
            cached = max(cached, output.num_cached_tokens)
            choices = []
            for c in output.outputs:
                state = states[c.index]
                if state.finished or not (c.text or c.token_ids or c.finish_reason):
                    continue
                completion_tokens += len(c.token_ids)
                state.finished = c.finish_reason is not None
                delta = self._chat_delta(state, c.text)
                logprobs = self._chat_logprobs(c.token_ids, c.logprobs, params.logprobs) if req.logprobs else None
                choices.append(P.ChatCompletionStreamChoice(
                    index=c.index, delta=delta, logprobs=logprobs, finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason, token_ids=c.token_ids if req.return_token_ids else None,
                    arrival_time=time.monotonic() - arrival))
            if output.finished:
                self._record_finished(output)
            if choices:
                yield chunk(choices, usage_now() if continuous else None)
        if include_usage:
            yield chunk([], usage_now())

    def _chat_delta(self, state: _ChoiceState, new_text: str) -> P.DeltaMessage:
        previous = state.text
        state.text += new_text
        if self.reasoning is None:
            return P.DeltaMessage(content=new_text)
        reasoning, content = self.reasoning.extract_delta(previous, new_text, final=state.finished)
        return P.DeltaMessage(reasoning_content=reasoning, content=content)

    # --- other routes -------------------------------------------------------------------------
    def models(self) -> dict:
        card = P.ModelCard(id=self.served_name, root=self.model_config.model, max_model_len=self.max_model_len)
        return P.ModelList(data=[card]).model_dump()

    async def tokenize(self, body: dict) -> JSONResponse:
        try:
            req = P.parse_tokenize_request(body)
        except ValidationError as exc:
            message, param = P.validation_error_message(exc)
            raise APIError(message, param=param) from None
        self._check_model(req.model)
        if isinstance(req, P.TokenizeChatRequest):
            prompt = await self._render_chat(req, req.add_generation_prompt, req.add_special_tokens)
        else:
            prompt = await self._tokenize(req.prompt, req.add_special_tokens)
        strs = self.tokenizer.convert_ids_to_tokens(prompt.token_ids) if req.return_token_strs else None
        return _json(P.TokenizeResponse(count=len(prompt.token_ids), max_model_len=self.max_model_len,
                                        tokens=prompt.token_ids, token_strs=strs))

    async def detokenize(self, body: dict) -> JSONResponse:
        req: P.DetokenizeRequest = self._parse(P.DetokenizeRequest, body)
        self._check_model(req.model)
        bad = [t for t in req.tokens if not 0 <= t < self.vocab_size]
        if bad:
            raise APIError(f"Token ids {bad[:5]} are outside the vocabulary (0..{self.vocab_size - 1}).",
                               param="tokens")
        text = await asyncio.to_thread(self.tokenizer.decode, req.tokens)
        return _json(P.DetokenizeResponse(prompt=text))

    async def warmup(self) -> None:
        """One short request through the whole path, so the first user does not pay for cold caches."""
        start = time.monotonic()
        async for _ in self.engine.generate("warmup", "Hello", SamplingParams(max_tokens=4)):
            pass
        logger.info("Warm-up request done in %.2f s", time.monotonic() - start)

    # --- running requests ---------------------------------------------------------------------
    async def _collect(self, streams: list[AsyncIterator[RequestOutput]], raw: Request) -> list[RequestOutput]:
        """The final output of each stream; if the client goes away first, abort them all."""
        finals: list[RequestOutput | None] = [None] * len(streams)

        async def consume() -> None:
            async for i, output in _merge(streams):
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
        except ValueError as exc:
            raise APIError(str(exc)) from None
        finally:
            if not task.done():
                task.cancel()
        return finals


def _ranked(entry: dict[int, Logprob], n: int) -> list[Logprob]:
    """The n most likely tokens of a logprobs entry (it holds the top n plus the chosen token)."""
    return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= n), key=lambda lp: lp.rank)


def _top(entry: dict[int, Logprob], n: int) -> dict[str, float]:
    return {lp.decoded_token or "": lp.logprob for lp in _ranked(entry, n)}


def _chat_logprob(lp: Logprob) -> P.ChatCompletionLogProb:
    token = lp.decoded_token or ""
    return P.ChatCompletionLogProb(token=token, logprob=lp.logprob, bytes=list(token.encode()))


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Items of several async iterators as they come, tagged with the iterator's index. Closing this
    closes them all (which aborts their requests)."""
    if len(streams) == 1:
        try:
            async for item in streams[0]:
                yield 0, item
        finally:
            await streams[0].aclose()
        return
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i: int, stream) -> None:
        try:
            async for item in stream:
                await queue.put((i, item))
            await queue.put((i, done))
        except BaseException as exc:  # hand errors (and cancellation) to the consumer
            await queue.put((i, exc))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    remaining = len(tasks)
    try:
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for stream in streams:
            await stream.aclose()


def _event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def _json(model: BaseModel) -> JSONResponse:
    return JSONResponse(model.model_dump(mode="json"))


def _sse(events: AsyncIterator[str]) -> StreamingResponse:
    async def with_done() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except EngineDeadError as exc:
            yield f"data: {_error_json(str(exc), 503, 'service_unavailable')}\n\n"
        except ValueError as exc:
            yield f"data: {_error_json(str(exc), 400, 'invalid_request_error')}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(with_done(), media_type="text/event-stream")


def _error_json(message: str, code: int, err_type: str) -> str:
    return ErrorResponse.model_validate(error_body(message, err_type, None, code)).model_dump_json()
