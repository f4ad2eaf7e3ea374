"""/v1/responses: OpenAI's Responses API, served by the chat completions path (as /v1/messages is):
a request, after the conversation of its previous_response_id, becomes a chat completion request
(responses_protocol.py), and the answer, whole or streamed, becomes a response object or OpenAI's
event sequence (response.created ... response.completed). Stored responses can be read, deleted
and, when run in the background, cancelled."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.entrypoints.http import APIError, error_response, read_json_body
from splitserve.entrypoints.openai.responses_protocol import (
    ResponseObject,
    ResponsesRequest,
    ResponseStore,
    finish_status,
    function_call_item,
    message_item,
    new_id,
    output_items,
    reasoning_part,
    response_object,
    text_part,
    to_chat_body,
    usage_of,
)

logger = logging.getLogger("splitserve.api_server")


class ResponsesServing:
    """The routes, over the chat completions endpoint (`chat`: OpenAIServingChat)."""

    def __init__(self, chat, store: ResponseStore | None = None):
        self.chat = chat
        self.store = store or ResponseStore()
        self.background: dict[str, asyncio.Task] = {}

    async def create(self, body: dict, raw: Request) -> Response:
        req: ResponsesRequest = self.chat._parse(ResponsesRequest.model_validate, body)
        history: list[dict] = []
        if req.previous_response_id is not None:
            stored = self.store.get(req.previous_response_id)
            if stored is None:
                raise APIError(
                    f"Previous response with id {req.previous_response_id!r} not found (responses are kept "
                    f"{self.store.ttl:g} s, by the API worker that made them, when created with store=true).",
                    404,
                    param="previous_response_id",
                )
            history = stored[1]
        chat_body = to_chat_body(req, history)
        model = await self._model(req)
        response_id = new_id("resp")
        if req.background:
            if not req.store:
                raise APIError("background responses must be stored: set store to true.", param="background")
            pending = response_object(req, response_id, model, "in_progress")
            self.store.put(pending, [])
            self.background[response_id] = asyncio.ensure_future(self._run_background(req, chat_body, pending, raw))
            return JSONResponse(pending.model_dump())
        answer = await self.chat.create_chat_completion(chat_body, raw)
        if answer.status_code != 200:
            return answer
        if isinstance(answer, StreamingResponse):
            return self._streamed(answer, self._events(req, chat_body, response_id, model, answer.body_iterator))
        response = self._finished(req, chat_body, response_id, model, json.loads(answer.body))
        return JSONResponse(response.model_dump())

    async def _model(self, req: ResponsesRequest) -> str:
        """The response's `model` (the PD router asks an instance for the served name)."""
        return self.chat._response_model(req)

    def _streamed(self, answer: StreamingResponse, events: AsyncIterator[str]) -> Response:
        """The streamed response of `events`, made from the chat stream `answer` (the PD router's
        keeps the decode instance's connection until the client has it all)."""
        return StreamingResponse(events, media_type="text/event-stream")

    def _finished(self, req, chat_body: dict, response_id: str, model: str, chat: dict) -> ResponseObject:
        choice = chat["choices"][0]
        status, incomplete = finish_status(choice.get("finish_reason"))
        response = response_object(
            req,
            response_id,
            model,
            status,
            output=output_items(choice["message"]),
            usage=usage_of(chat.get("usage")),
            incomplete_details=incomplete,
        )
        self._store(req, chat_body, response, choice["message"])
        return response

    def _store(self, req, chat_body: dict, response: ResponseObject, message: dict) -> None:
        if req.store:
            reply = {k: message[k] for k in ("role", "content", "tool_calls") if message.get(k) is not None}
            turns = [m for m in chat_body["messages"] if not (req.instructions and m is chat_body["messages"][0])]
            self.store.put(response, [*turns, {"role": "assistant", **reply}])

    async def _run_background(self, req, chat_body: dict, pending: ResponseObject, raw: Request) -> None:
        try:
            answer = await self.chat.create_chat_completion(chat_body, _Detached(raw))
            if answer.status_code != 200:
                error = json.loads(answer.body).get("error", {})
                self._fail(pending, str(error.get("code")), error.get("message"))
            else:
                self._finished(req, chat_body, pending.id, pending.model, json.loads(answer.body))
        except asyncio.CancelledError:
            self.store.put(pending.model_copy(update={"status": "cancelled"}), [])
        except Exception as exc:  # noqa: BLE001 - a background failure is the response's status, not a crash
            logger.exception("Background response %s failed", pending.id)
            self._fail(pending, "server_error", str(exc))
        finally:
            self.background.pop(pending.id, None)

    def _fail(self, pending: ResponseObject, code: str, message: str | None) -> None:
        error = {"code": code, "message": message}
        self.store.put(pending.model_copy(update={"status": "failed", "error": error}), [])

    # --- stored responses ------------------------------------------------------------------------
    def _stored(self, response_id: str) -> ResponseObject:
        stored = self.store.get(response_id)
        if stored is None:
            raise APIError(f"Response with id {response_id!r} not found.", 404, param="response_id")
        return stored[0]

    async def retrieve(self, response_id: str) -> Response:
        return JSONResponse(self._stored(response_id).model_dump())

    async def delete(self, response_id: str) -> Response:
        self._stored(response_id)
        task = self.background.get(response_id)
        if task is not None:
            task.cancel()
        self.store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str) -> Response:
        response = self._stored(response_id)
        task = self.background.get(response_id)
        if not response.background:
            return error_response("Only responses created with background=true can be cancelled.", 400)
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        return JSONResponse(self._stored(response_id).model_dump())

    # --- streaming -------------------------------------------------------------------------------
    async def _events(self, req, chat_body, response_id: str, model: str, chat_events) -> AsyncIterator[str]:
        state = _StreamState(response_object(req, response_id, model, "in_progress"))
        yield state.event("response.created", response=state.response.model_dump())
        yield state.event("response.in_progress", response=state.response.model_dump())
        buffered = ""
        async for raw in chat_events:
            buffered += raw.decode() if isinstance(raw, bytes) else raw
            *complete, buffered = buffered.split("\n\n")
            for event in complete:
                payload = event.strip().removeprefix("data:").strip()
                if not payload or payload == "[DONE]":
                    continue
                chunk = json.loads(payload)
                if "error" in chunk:
                    error = chunk["error"]
                    yield state.event("error", code=str(error.get("code")), message=error.get("message"), param=None)
                    return
                for out in state.chunk(chunk):
                    yield out
        for out in state.close():
            yield out
        status, incomplete = finish_status(state.finish_reason)
        update = {"status": status, "incomplete_details": incomplete, "output": state.items}
        state.response = state.response.model_copy(update={**update, "usage": usage_of(state.usage)})
        message = {"role": "assistant", "content": state.text or None}
        if state.calls:
            message["tool_calls"] = [
                {"id": c["call_id"], "type": "function", "function": {"name": c["name"], "arguments": c["arguments"]}}
                for c in state.calls
            ]
        self._store(req, chat_body, state.response, message)
        name = "response.completed" if status == "completed" else f"response.{status}"
        yield state.event(name, response=state.response.model_dump())


def add_responses_routes(app: FastAPI, serving: ResponsesServing) -> None:
    """POST /v1/responses; GET and DELETE /v1/responses/{id}; POST /v1/responses/{id}/cancel."""

    @app.post("/v1/responses")
    async def create_response(request: Request):
        return await serving.create(await read_json_body(request), request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve_response(response_id: str):
        return await serving.retrieve(response_id)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        return await serving.delete(response_id)

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel_response(response_id: str):
        return await serving.cancel(response_id)


class _Detached:
    """A background response's stand-in for its HTTP request: its client may leave, it runs on."""

    def __init__(self, raw: Request):
        self.headers = raw.headers

    async def is_disconnected(self) -> bool:
        return False


class _StreamState:
    """Turns chat chunks into Responses events: one output item open at a time (reasoning, the
    message, or a function call), each closed with its done events when the next starts."""

    def __init__(self, response: ResponseObject):
        self.response = response
        self.sequence = 0
        self.items: list[dict] = []
        self.open: tuple[str, int | None] | None = None
        self.text = ""
        self.calls: list[dict] = []
        self.usage: dict | None = None
        self.finish_reason: str | None = None

    def event(self, name: str, **data) -> str:
        body = {"type": name, "sequence_number": self.sequence, **data}
        self.sequence += 1
        return f"event: {name}\ndata: {json.dumps(body)}\n\n"

    @property
    def index(self) -> int:
        return len(self.items) - 1

    def _start(self, kind: str, item: dict, call: int | None = None) -> list[str]:
        events = self.close()
        self.items.append(item)
        self.open = (kind, call)
        events.append(self.event("response.output_item.added", output_index=self.index, item={**item}))
        if kind == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item["id"],
                    output_index=self.index,
                    content_index=0,
                    part=text_part(""),
                )
            )
        return events

    def close(self) -> list[str]:
        if self.open is None:
            return []
        kind, _ = self.open
        item, events = self.items[-1], []
        self.open = None
        where = {"item_id": item["id"], "output_index": self.index}
        if kind == "message":
            text = item["content"][0]["text"]
            events.append(self.event("response.output_text.done", **where, content_index=0, text=text, logprobs=[]))
            events.append(self.event("response.content_part.done", **where, content_index=0, part=item["content"][0]))
        elif kind == "reasoning":
            text = item["content"][0]["text"]
            events.append(self.event("response.reasoning_text.done", **where, content_index=0, text=text))
        else:
            events.append(self.event("response.function_call_arguments.done", **where, arguments=item["arguments"]))
        item["status"] = "completed"
        events.append(self.event("response.output_item.done", output_index=self.index, item=item))
        return events

    def chunk(self, chunk: dict) -> list[str]:
        self.usage = chunk.get("usage") or self.usage
        events: list[str] = []
        for choice in chunk.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("reasoning_content"):
                if self.open != ("reasoning", None):
                    item = {"type": "reasoning", "id": new_id("rs"), "summary": [], "content": [reasoning_part("")]}
                    events += self._start("reasoning", item)
                self.items[-1]["content"][0]["text"] += delta["reasoning_content"]
                events.append(
                    self.event(
                        "response.reasoning_text.delta",
                        item_id=self.items[-1]["id"],
                        output_index=self.index,
                        content_index=0,
                        delta=delta["reasoning_content"],
                    )
                )
            if delta.get("content"):
                if self.open != ("message", None):
                    events += self._start("message", message_item(new_id("msg"), "", "in_progress"))
                self.items[-1]["content"][0]["text"] += delta["content"]
                self.text += delta["content"]
                events.append(
                    self.event(
                        "response.output_text.delta",
                        item_id=self.items[-1]["id"],
                        output_index=self.index,
                        content_index=0,
                        delta=delta["content"],
                        logprobs=[],
                    )
                )
            for call in delta.get("tool_calls") or []:
                function = call.get("function") or {}
                if self.open != ("function_call", call.get("index")):
                    item = function_call_item(
                        new_id("fc"), call.get("id") or new_id("call"), function.get("name") or "", "", "in_progress"
                    )
                    self.calls.append(item)
                    events += self._start("function_call", item, call.get("index"))
                if function.get("arguments"):
                    self.items[-1]["arguments"] += function["arguments"]
                    events.append(
                        self.event(
                            "response.function_call_arguments.delta",
                            item_id=self.items[-1]["id"],
                            output_index=self.index,
                            delta=function["arguments"],
                        )
                    )
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return events
