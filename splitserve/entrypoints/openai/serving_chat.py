"""/v1/chat/completions: messages rendered by the chat template, reasoning split from the answer,
tool calls read from it (tool_calling.py)."""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

from fastapi import Request

from splitserve.engine.output_processor import RequestOutputKind
from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai import chat_images
from splitserve.entrypoints.openai.encoding import (
    json_response,
    merge_streams,
    ranked_logprobs,
    sse_event,
    sse_response,
)
from splitserve.entrypoints.openai.protocol import ChatCompletionRequest
from splitserve.entrypoints.openai.reasoning import get_reasoning_parser, parser_for_model
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
    finite_logprob,
    random_id,
)
from splitserve.entrypoints.openai.serving_base import ChoiceState, OpenAIServing
from splitserve.entrypoints.openai.timings import StreamTimings, request_timings
from splitserve.entrypoints.openai.tool_calling import ToolPlan, plan_tools, tool_guide
from splitserve.outputs import Logprob, RequestOutput

logger = logging.getLogger("splitserve.api_server")


class OpenAIServingChat(OpenAIServing):
    def __init__(self, engine, config, server_args, metrics):
        super().__init__(engine, config, server_args, metrics)
        name = server_args.reasoning_parser
        if name is None:  # a thinking model's family parser (reasoning.parser_for_model)
            template = server_args.chat_template or getattr(self.tokenizer, "chat_template", None)
            name = parser_for_model(getattr(config.model_config.hf_config, "model_type", ""), template)
            if name is not None:
                logger.info(
                    "Reasoning parser %s: the model's chat template thinks (--reasoning-parser none: off)", name
                )
        self.reasoning = get_reasoning_parser(name) if name not in (None, "none") else None
        self._think_end_id = self._single_token_id(self.reasoning.end_tag) if self.reasoning else None

    def _single_token_id(self, text: str) -> int | None:
        """The id of `text` when the tokenizer has it as one token (as thinking models have </think>)."""
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        return ids[0] if len(ids) == 1 else None

    def _reasoning_tokens(self, token_ids: list[int], text: str) -> int:
        """How many of a choice's tokens are reasoning: up to and including </think>, or all of them
        while it has not come. Where </think> is not one token, its text is tokenized to count."""
        if self.reasoning is None:
            return 0
        reasoning, content = self.reasoning.extract(text)
        if reasoning is None and not text.startswith(self.reasoning.start_tag):
            return 0
        end = text.find(self.reasoning.end_tag)
        if end < 0:
            return len(token_ids)
        if self._think_end_id is not None and self._think_end_id in token_ids:
            return token_ids.index(self._think_end_id) + 1
        upto = text[: end + len(self.reasoning.end_tag)]
        return min(len(token_ids), len(self.tokenizer.encode(upto, add_special_tokens=False)))

    async def create_chat_completion(self, body: dict, raw: Request):
        arrival = time.monotonic()
        req, params, lora = await self._accept(ChatCompletionRequest, body)
        plan = self._plan_tools(req, params)
        params = await self._process_params(req, params)
        kv = self._kv_transfer(req, params, 1)
        prompt = self._remote_prompt(req, kv) or await self._render_chat(req)
        # The template has placed the special tokens.
        (request,) = await self._process([prompt], params, "messages", add_special_tokens=False)
        request_id = random_id("chatcmpl")
        self._log(request_id, [request], params, req.user)
        kind = RequestOutputKind.DELTA if req.stream else RequestOutputKind.FINAL_ONLY
        stream = self._generation_streams(req, request_id, [request], arrival, kind, kv, lora)
        echo = self._chat_echo(req)
        if req.stream:
            return sse_response(self._chat_stream(req, plan, request_id, request, params, stream, arrival, echo))
        (final,) = await self._collect(stream, raw)
        response = self._chat_response(req, plan, request_id, request, params, final, echo)
        response.kv_transfer_params = self._kv_answer(kv, request, final)
        response.timings = request_timings([final]) if req.wants_timings(self.server_args.return_timings) else None
        return json_response(response)

    async def count_prompt_tokens(self, body: dict) -> int:
        """The prompt tokens a chat request's messages (and tools) render to, as generation would
        count them (Anthropic's /v1/messages/count_tokens)."""
        req = self._parse(ChatCompletionRequest.model_validate, body)
        await self._check_model(req.model)
        prompt = await self._render_chat(req)
        return len(await chat_images.prompt_token_ids(self.processor, prompt, False))

    def _plan_tools(self, req, params) -> ToolPlan:
        """The request's tool choice; a required or named one becomes the request's guide."""
        args = self.server_args
        plan = plan_tools(req, args.enable_auto_tool_choice, args.tool_call_parser)
        guide = tool_guide(req, plan)
        if guide is not None:
            if params.guided_decoding is not None:
                raise APIError(
                    f"tool_choice {plan.mode!r} forces the output's shape, so it cannot be combined with "
                    f"{req.guide_param}.",
                    param="tool_choice",
                )
            params.guided_decoding = guide
        if plan.needs_special_tokens:
            params.skip_special_tokens = False
        return plan

    @staticmethod
    def _chat_echo(req) -> str:
        last = req.messages[-1]
        return last.text() if req.echo and last.role == "assistant" else ""

    def _split_reasoning(self, text: str) -> tuple[str | None, str | None]:
        if self.reasoning is None:
            return None, text
        return self.reasoning.extract(text)

    def _message(self, plan: ToolPlan, text: str, echo: str) -> tuple[ChatMessage, bool]:
        """A choice's message: reasoning split off, then tool calls read from the answer (content
        null when the answer is only calls, as OpenAI sends it); and whether tools were called."""
        reasoning, content = self._split_reasoning(text)
        tool_calls = None
        if plan.calls_tools:
            extracted = plan.new_parser(self.tokenizer).extract_tool_calls(content or "")
            if extracted.tools_called:
                tool_calls, content = extracted.tool_calls, extracted.content
        if tool_calls and not content and not echo:
            return ChatMessage(content=None, reasoning_content=reasoning, tool_calls=tool_calls), True
        return ChatMessage(content=echo + (content or ""), reasoning_content=reasoning, tool_calls=tool_calls), bool(
            tool_calls
        )

    def _chat_response(self, req, plan, request_id, request, params, final: RequestOutput, echo: str):
        self._record_finished(final)
        choices, completion_tokens = [], final.num_generated_tokens  # best_of's unreturned samples count too
        reasoning_tokens = sum(self._reasoning_tokens(c.token_ids, c.text) for c in final.outputs)
        for c in final.outputs:
            message, called = self._message(plan, c.text, echo)
            logprobs = self._chat_logprobs(c.token_ids, c.logprobs, params.logprobs) if req.logprobs else None
            choices.append(
                ChatCompletionResponseChoice(
                    index=c.index,
                    message=message,
                    logprobs=logprobs,
                    finish_reason=plan.finish_reason(c.finish_reason, called),
                    stop_reason=c.stop_reason,
                    token_ids=c.token_ids if req.return_token_ids else None,
                    cum_log_probs=finite_logprob(c.cumulative_logprob),
                    sentence_length=len(echo + c.text),  # characters, as AIAK counts them
                )
            )
        return ChatCompletionResponse(
            id=request_id,
            model=self._response_model(req),
            choices=choices,
            usage=self._usage([request], completion_tokens, final.num_cached_tokens, reasoning_tokens),
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

    async def _chat_stream(self, req, plan, request_id, request, params, streams, arrival, echo) -> AsyncIterator[str]:
        include_usage = req.stream_options is not None and req.stream_options.include_usage
        continuous = req.stream_options is not None and req.stream_options.continuous_usage_stats
        states = {i: ChoiceState(tool_parser=plan.new_parser(self.tokenizer)) for i in range(params.n)}
        completion_tokens, cached = 0, 0
        timed = StreamTimings(req.wants_timings(self.server_args.return_timings), len(streams))

        def chunk(choices, usage=None, timings=None) -> str:
            return sse_event(
                ChatCompletionStreamResponse(
                    id=request_id,
                    model=self._response_model(req),
                    choices=choices,
                    usage=usage,
                    system_fingerprint=self.fingerprint,
                    timings=timings,
                )
            )

        def usage_now():
            reasoning = sum(self._reasoning_tokens(s.token_ids, s.text) for s in states.values())
            return self._usage([request], completion_tokens, cached, reasoning)

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
                state.token_ids += c.token_ids
                state.finished = c.finish_reason is not None
                delta = self._chat_delta(state, c.text)
                state.held_token_ids += c.token_ids
                state.held_logprobs += c.logprobs or []
                if delta is None and not state.finished:
                    continue  # held back (it may be the start of a tool call's marker): sent with the next chunk
                token_ids, entries = state.held_token_ids, state.held_logprobs
                state.held_token_ids, state.held_logprobs = [], []
                logprobs = self._chat_logprobs(token_ids, entries, params.logprobs) if req.logprobs else None
                called = state.tool_parser is not None and state.tool_parser.tools_streamed
                delta = delta or DeltaMessage()
                if token_ids:
                    delta.token_ids = token_ids
                choices.append(
                    ChatCompletionStreamChoice(
                        index=c.index,
                        delta=delta,
                        logprobs=logprobs,
                        finish_reason=plan.finish_reason(c.finish_reason, called),
                        stop_reason=c.stop_reason,
                        token_ids=token_ids if req.return_token_ids else None,
                        arrival_time=time.monotonic() - arrival,
                    )
                )
            if output.finished:
                self._record_finished(output)
            last = timed.add(0, output) and not include_usage  # the timings go in the stream's last chunk
            if choices or last:
                yield chunk(choices, usage_now() if continuous else None, timed.timings() if last else None)
        if include_usage:
            yield chunk([], usage_now(), timed.timings())

    def _chat_delta(self, state: ChoiceState, new_text: str) -> DeltaMessage | None:
        """What new text adds to a streamed choice: reasoning, then content or tool-call deltas;
        None when a tool parser holds it all back for now."""
        previous = state.text
        state.text += new_text
        reasoning, content = None, new_text
        if self.reasoning is not None:
            reasoning, content = self.reasoning.extract_delta(previous, new_text, final=state.finished)
        if state.tool_parser is None:
            return DeltaMessage(reasoning_content=reasoning, content=content)
        before = state.content
        state.content += content or ""
        result = state.tool_parser.extract_streaming(before, state.content, content or "", final=state.finished)
        if result is None and reasoning is None:
            return None
        return DeltaMessage(
            reasoning_content=reasoning,
            content=result.content if result else None,
            tool_calls=(result.tool_calls or None) if result else None,
        )


def _chat_logprob(lp: Logprob) -> ChatCompletionLogProb:
    token = lp.decoded_token or ""
    return ChatCompletionLogProb(token=token, logprob=finite_logprob(lp.logprob), bytes=list(token.encode()))
