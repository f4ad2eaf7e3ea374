"""/v1/completions: one or more prompts (texts or token ids), echo, OpenAI's legacy logprobs."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from splitserve.engine.output_processor import RequestOutputKind
from splitserve.engine.processor import ProcessedRequest, PromptType
from splitserve.entrypoints.openai.encoding import (
    json_response,
    merge_streams,
    ranked_logprobs,
    sse_event,
    sse_response,
)
from splitserve.entrypoints.openai.protocol import CompletionRequest
from splitserve.entrypoints.openai.response_models import (
    CompletionLogProbs,
    CompletionResponse,
    CompletionResponseChoice,
    CompletionStreamChoice,
    CompletionStreamResponse,
    finite_logprob,
    random_id,
)
from splitserve.entrypoints.openai.serving_base import ChoiceState, OpenAIServing
from splitserve.entrypoints.openai.timings import StreamTimings, request_timings
from splitserve.outputs import Logprob, RequestOutput


class OpenAIServingCompletion(OpenAIServing):
    async def create_completion(self, body: dict, raw: Request):
        arrival = time.monotonic()
        req, params, lora = await self._accept(CompletionRequest, body)
        if req.echo and params.logprobs is not None:
            params.prompt_logprobs = max(params.prompt_logprobs or 0, params.logprobs)
        params = await self._process_params(req, params)
        kv = self._kv_transfer(req, params, len(req.prompts()))
        remote = self._remote_prompt(req, kv)
        prompts = [remote] if remote else [_engine_prompt(p) for p in req.prompts()]
        requests = await self._process(prompts, params, "prompt")
        request_id = random_id("cmpl")
        self._log(request_id, requests, params, req.user)
        if req.stream:
            streams = self._generation_streams(req, request_id, requests, arrival, RequestOutputKind.DELTA, kv, lora)
            return sse_response(self._completion_stream(req, request_id, requests, params, streams, arrival))
        streams = self._generation_streams(req, request_id, requests, arrival, RequestOutputKind.FINAL_ONLY, kv, lora)
        finals = await self._collect(streams, raw)
        response = self._completion_response(req, request_id, requests, params, finals)
        response.kv_transfer_params = self._kv_answer(kv, requests[0], finals[0])
        response.timings = request_timings(finals) if req.wants_timings(self.server_args.return_timings) else None
        return json_response(response)

    def _completion_response(self, req, request_id, requests, params, finals) -> CompletionResponse:
        choices, completion_tokens, cached = [], 0, 0
        for i, (request, output) in enumerate(zip(requests, finals)):
            self._record_finished(output)
            cached += output.num_cached_tokens
            completion_tokens += output.num_generated_tokens  # best_of's unreturned samples count too
            for c in output.outputs:
                text, logprobs = c.text, None
                if req.echo:
                    text = self._prompt_text(request) + text
                if params.logprobs is not None:
                    logprobs = self._completion_logprobs(
                        c.token_ids, c.logprobs, params.logprobs, 0, self._echo_logprobs(req, request, output)
                    )
                choices.append(
                    CompletionResponseChoice(
                        index=i * params.n + c.index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        prompt_logprobs=output.prompt_logprobs if req.prompt_logprobs is not None else None,
                        token_ids=c.token_ids if req.return_token_ids else None,
                        prompt_token_ids=request.prompt_token_ids if req.return_token_ids else None,
                        cum_log_probs=finite_logprob(c.cumulative_logprob),
                        sentence_length=len(text),  # characters, as AIAK counts them
                    )
                )
        return CompletionResponse(
            id=request_id,
            model=self._response_model(req),
            choices=choices,
            usage=self._usage(requests, completion_tokens, cached),
            system_fingerprint=self.fingerprint,
        )

    @staticmethod
    def _echo_logprobs(req, request: ProcessedRequest, output: RequestOutput):
        """With echo, the legacy logprobs start with the prompt's tokens (the first has none)."""
        if not req.echo or output.prompt_logprobs is None:
            return None
        return list(zip(request.prompt_token_ids, output.prompt_logprobs))

    def _completion_logprobs(
        self, token_ids: list[int], logprobs, top_n: int, offset: int, prefix=None
    ) -> CompletionLogProbs:
        result = CompletionLogProbs()
        entries = list(prefix or []) + list(zip(token_ids, logprobs or []))
        for token_id, entry in entries:
            text = self.tokenizer.decode([token_id]) if entry is None else entry[token_id].decoded_token or ""
            result.text_offset.append(offset)
            offset += len(text)
            result.tokens.append(text)
            result.token_logprobs.append(None if entry is None else finite_logprob(entry[token_id].logprob))
            result.top_logprobs.append(None if entry is None else _top(entry, top_n))
        return result

    async def _completion_stream(self, req, request_id, requests, params, streams, arrival) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        states: dict[int, ChoiceState] = {}
        completion_tokens, cached = 0, 0
        timed = StreamTimings(req.wants_timings(self.server_args.return_timings), len(streams))
        async for i, output in merge_streams(streams):
            cached = max(cached, output.num_cached_tokens)
            chunk_choices = []
            for c in output.outputs:
                index = i * params.n + c.index
                state = states.setdefault(index, ChoiceState())
                if state.finished or not (c.text or c.token_ids or c.finish_reason):
                    continue
                completion_tokens += len(c.token_ids)
                text = c.text
                if req.echo and not state.started:
                    text = self._prompt_text(requests[i]) + text
                state.started = True
                logprobs = None
                if params.logprobs is not None:
                    logprobs = self._completion_logprobs(c.token_ids, c.logprobs, params.logprobs, len(state.text))
                state.text += text
                state.num_tokens += len(c.token_ids)
                state.finished = c.finish_reason is not None
                first = state.num_tokens == len(c.token_ids)  # the prompt's ids go with the first tokens
                chunk_choices.append(
                    CompletionStreamChoice(
                        index=index,
                        text=text,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=c.token_ids if req.return_token_ids else None,
                        prompt_token_ids=requests[i].prompt_token_ids if req.return_token_ids and first else None,
                        cum_log_probs=finite_logprob(c.cumulative_logprob) if state.finished else None,
                        sentence_length=len(state.text) if state.finished else None,
                        arrival_time=time.monotonic() - arrival,
                    )
                )
            if output.finished:
                self._record_finished(output)
            last = timed.add(i, output) and not include_usage  # the timings go in the stream's last chunk
            if chunk_choices or last:
                usage = self._usage(requests, completion_tokens, cached) if continuous else None
                yield sse_event(
                    CompletionStreamResponse(
                        id=request_id,
                        model=self._response_model(req),
                        choices=chunk_choices,
                        usage=usage,
                        system_fingerprint=self.fingerprint,
                        timings=timed.timings() if last else None,
                    )
                )
        if include_usage:
            yield sse_event(
                CompletionStreamResponse(
                    id=request_id,
                    model=self._response_model(req),
                    choices=[],
                    usage=self._usage(requests, completion_tokens, cached),
                    system_fingerprint=self.fingerprint,
                    timings=timed.timings(),
                )
            )


def _engine_prompt(prompt: str | list[int]) -> PromptType:
    return {"prompt_token_ids": prompt} if isinstance(prompt, list) else prompt


def _top(entry: dict[int, Logprob], n: int) -> dict[str, float]:
    return {lp.decoded_token or "": finite_logprob(lp.logprob) for lp in ranked_logprobs(entry, n)}
