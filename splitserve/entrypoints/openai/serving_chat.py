"""/v1/chat/completions: messages rendered by the chat template, reasoning split from the answer."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from fastapi import Request

from splitserve.engine.output_processor import RequestOutputKind
from splitserve.entrypoints.openai.protocol import ChatCompletionRequest
from splitserve.entrypoints.openai.reasoning import get_reasoning_parser
from splitserve.entrypoints.openai.response_models import (
    ChatCompletionLogProb,
    ChatCompletionLogProbs,
    ChatCompletionLogProbsContent,
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    DeltaMessage,
    random_id,
)
from splitserve.entrypoints.openai.serving_base import (
    ChoiceState,
    OpenAIServing,
    json_response,
    merge_streams,
    ranked_logprobs,
    sse_event,
    sse_response,
)
from splitserve.outputs import Logprob, RequestOutput


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine, config, server_args, metrics):
        super().__init__(engine, config, server_args, metrics)
        self.reasoning = get_reasoning_parser(server_args.reasoning_parser) if server_args.reasoning_parser else None

    async def create_chat_completion(self, body: dict, raw: Request):
        arrival = time.monotonic()
        req, params = self._accept(ChatCompletionRequest, body)
        params = self.processor.process_params(params)
        kv = self._kv_transfer(req, params, 1)
        prompt = self._remote_prompt(req, kv) or await self._render_chat(req)
        # The template has placed the special tokens.
        (request,) = await self._process([prompt], params, "messages", add_special_tokens=False)
        request_id = random_id("chatcmpl")
        self._log(request_id, [request], params)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        stream = self._streams(request_id, [request], arrival, kind, kv)
        echo = self._chat_echo(req)
        if req.stream:
            return sse_response(self._chat_stream(req, request_id, request, params, stream, arrival, echo))
        (final,) = await self._collect(stream, raw)
        response = self._chat_response(req, request_id, request, params, final, echo)
        response.kv_transfer_params = self._kv_answer(kv, request, final)
        return json_response(response)

    @staticmethod
    def _chat_echo(req) -> str:
        last = req.messages[-1]
        return last.text() if req.echo and last.role == "assistant" else ""

    def _split_reasoning(self, text: str) -> tuple[str | None, str | None]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.extract(text)

    def _chat_response(self, req, request_id, request, params, final: RequestOutput, echo: str):
        self._record_finished(final)
        choices, completion_tokens = [], 0
        for c in final.outputs:
            completion_tokens += len(c.token_ids)
            reasoning, content = self._split_reasoning(c.text)
            message = ChatMessage(content=echo + (content or ""), reasoning_content=reasoning)
            logprobs = self._chat_logprobs(c.token_ids, c.logprobs, params.logprobs) if req.logprobs else None
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if req.return_token_ids else None,
                    cum_log_probs=c.cumulative_logprob,
                    sentence_length=len(c.token_ids),
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self.served_name,
            choices=choices,
            usage=self._usage([request], completion_tokens, final.num_cached_tokens),
            system_fingerprint=self.fingerprint,
            prompt_logprobs=final.prompt_logprobs if req.prompt_logprobs is not None else None,
            prompt_token_ids=request.prompt_token_ids if req.return_token_ids else None,
        )

    @staticmethod
    def _chat_logprobs(token_ids: list[int], logprobs, top_n: int | None) -> ChatCompletionLogProbs:
        content = []
        for token_id, entry in zip(token_ids, logprobs or []):
            top = [_chat_logprob(lp) for lp in ranked_logprobs(entry, top_n or 0)]
            content.append(
                ChatCompletionLogProbsContent(**_chat_logprob(entry[token_id]).model_dump(), top_logprobs=top)
            )
        return ChatCompletionLogProbs(content=content)

    async def _chat_stream(self, req, request_id, request, params, streams, arrival, echo) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        states = {i: ChoiceState() for i in range(params.n)}
        completion_tokens, cached = 0, 0

        def chunk(choices, usage=None) -> str:
            return sse_event(
                ChatCompletionStreamResponse(
                    id=request_id,
                    model=self.served_name,
                    choices=choices,
                    usage=usage,
                    system_fingerprint=self.fingerprint,
                )
            )

        def usage_now():
            return self._usage([request], completion_tokens, cached)

        yield chunk(
            [
                ChatCompletionStreamChoice(
                    index=i, delta=DeltaMessage(role="assistant", content=echo), arrival_time=time.monotonic() - arrival
                )
                for i in states
            ],
            usage_now() if continuous else None,
        )
        async for _, output in merge_streams(streams):
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
                choices.append(
                    ChatCompletionStreamChoice(
                        index=c.index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=c.finish_reason,
                        stop_reason=c.stop_reason,
                        token_ids=c.token_ids if req.return_token_ids else None,
                        arrival_time=time.monotonic() - arrival,
                    )
                )
            if output.finished:
                self._record_finished(output)
            if choices:
                yield chunk(choices, usage_now() if continuous else None)
        if include_usage:
            yield chunk([], usage_now())

    def _chat_delta(self, state: ChoiceState, new_text: str) -> DeltaMessage:
        previous = state.text
        state.text += new_text
        if self.reasoning is None:
            return DeltaMessage(content=new_text)
        reasoning, content = self.reasoning.extract_delta(previous, new_text, final=state.finished)
        return DeltaMessage(reasoning_content=reasoning, content=content)


def _chat_logprob(lp: Logprob) -> ChatCompletionLogProb:
    token = lp.decoded_token or ""
    return ChatCompletionLogProb(token=token, logprob=lp.logprob, bytes=list(token.encode()))
