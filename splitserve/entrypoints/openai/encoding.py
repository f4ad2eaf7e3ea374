"""How the OpenAI server's answers go out: a response model as JSON, as server-sent events (with the
closing [DONE], and an error event where the engine died or refused the request midway), several
generation streams merged as their items come, and a logprobs entry's top tokens by rank."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel

from splitserve.engine.errors import EngineDeadError, InvalidRequestError
from splitserve.entrypoints.http import ErrorResponse, error_body
from splitserve.outputs import Logprob, RequestOutput


def ranked_logprobs(entry: dict[int, Logprob], n: int) -> list[Logprob]:
    """The n most likely tokens of a logprobs entry (it holds the top n plus the chosen token)."""
    return sorted((lp for lp in entry.values() if lp.rank is not None and lp.rank <= n), key=lambda lp: lp.rank)


async def merge_streams(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


def sse_event(model: BaseModel) -> str:
    return f"data: {model.model_dump_json()}\n\n"


def json_response(model: BaseModel) -> Response:
    """The model as JSON; a NaN or infinity left anywhere becomes null rather than a 500."""
    return Response(model.model_dump_json(), media_type="application/json")


def sse_response(events: AsyncIterator[str]) -> StreamingResponse:
    async def with_done() -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        except EngineDeadError as exc:
            yield f"data: {_error_json(str(exc), 503, 'service_unavailable')}\n\n"
        except InvalidRequestError as exc:
            yield f"data: {_error_json(str(exc), exc.status, exc.err_type)}\n\n"
        except ValueError as exc:
            yield f"data: {_error_json(str(exc), 400, 'invalid_request_error')}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(with_done(), media_type="text/event-stream")


def _error_json(message: str, code: int, err_type: str) -> str:
    return ErrorResponse.model_validate(error_body(message, err_type, None, code)).model_dump_json()
