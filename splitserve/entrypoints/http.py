"""HTTP pieces that the API server and the PD router share: OpenAI-style errors, the API-key
check, and reading a bounded JSON body."""

from __future__ import annotations

import hmac
import json
from contextvars import ContextVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel

from splitserve.engine.errors import InvalidRequestError

MAX_BODY_BYTES = 8 * 1024 * 1024


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int | str | None = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: int | str | None = 400
) -> dict:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return ErrorResponse(error=ErrorInfo(message=message, type=type, param=param, code=code)).model_dump()


class APIError(Exception):
    """An error answered with OpenAI's error body."""

    def __init__(
        self, message: str, status: int = 400, err_type: str = "invalid_request_error", param: str | None = None
    ):
        super().__init__(message)
        self.message, self.status, self.err_type, self.param = message, status, err_type, param


def error_response(
    message: str, status: int, err_type: str = "invalid_request_error", param: str | None = None
) -> JSONResponse:
    return JSONResponse(error_body(message, err_type, param, status), status_code=status)


def install_error_handlers(app: FastAPI, what: str) -> None:
    """APIError, a request the engine's Processor refuses (InvalidRequestError: 400 with its param),
    unknown routes and wrong methods all answer with OpenAI's error body."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError):
        return error_response(exc.message, exc.status, exc.err_type, exc.param)

    @app.exception_handler(InvalidRequestError)
    async def invalid_request(_: Request, exc: InvalidRequestError):
        return error_response(str(exc), exc.status, exc.err_type, exc.param)

    @app.exception_handler(404)
    async def not_found(request: Request, _exc):
        return error_response(
            f"{request.method} {request.url.path} is not a route of this {what}.", 404, "not_found_error"
        )

    @app.exception_handler(405)
    async def bad_method(request: Request, _exc):
        return error_response(f"{request.method} is not allowed on {request.url.path}.", 405)


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every route but `open_paths`; `path_keys` give some paths a
    key of their own (e.g. /metrics). Keys are compared in constant time. Pure ASGI, so streamed
    responses and their disconnects pass through untouched."""

    def __init__(self, app, api_key: str | None, open_paths=(), path_keys: dict[str, str] | None = None):
        self.app = app
        self.api_key = api_key.encode() if api_key else None
        self.open_paths = set(open_paths)
        self.path_keys = {path: key.encode() for path, key in (path_keys or {}).items() if key}

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            path = scope["path"]
            key = self.path_keys.get(path) or (None if path in self.open_paths else self.api_key)
            if key is not None and not _bearer_matches(scope, key):
                name = "metrics API key" if path in self.path_keys else "API key"
                return await error_response(f"Missing or invalid {name}.", 401, "authentication_error")(
                    scope, receive, send
                )
        await self.app(scope, receive, send)


# The X-Request-Id of the request being handled (None without one): the id its client chose.
CLIENT_REQUEST_ID: ContextVar[str | None] = ContextVar("client_request_id", default=None)


class RequestIdMiddleware:
    """A request's `X-Request-Id` header: kept in CLIENT_REQUEST_ID while it is handled (so that
    /abort_requests can name it) and echoed in the answer's headers. Pure ASGI, like ApiKeyMiddleware."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        value = dict(scope.get("headers") or []).get(b"x-request-id") if scope["type"] == "http" else None
        if not value:
            return await self.app(scope, receive, send)

        async def send_with_id(message) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", value)]
            await send(message)

        token = CLIENT_REQUEST_ID.set(value.decode("latin-1"))
        try:
            await self.app(scope, receive, send_with_id)
        finally:
            CLIENT_REQUEST_ID.reset(token)


def _bearer_matches(scope, key: bytes) -> bool:
    """`Authorization: Bearer KEY` (OpenAI's clients), or `x-api-key: KEY` (Anthropic's)."""
    headers = dict(scope.get("headers") or [])
    scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
    if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), key):
        return True
    return hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), key)


async def read_json_body(request: Request, limit: int = MAX_BODY_BYTES) -> dict:
    return parse_json_object(await read_body(request, limit))


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The request body; one over the limit is refused (413) as soon as that is known, from its
    declared length or the bytes so far, before it is all buffered."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(f"The request body is larger than {limit} bytes.", 413)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise APIError(f"The request body is larger than {limit} bytes.", 413)
        chunks.append(chunk)
    return b"".join(chunks)


# Limits of a JSON request body, besides its size (docs/serving.md, "Errors and limits").
MAX_JSON_DEPTH = 64  # nesting of arrays and objects
MAX_JSON_ARRAY_ITEMS = 1 << 20  # items of one array (a prompt of token ids is one)
MAX_JSON_OBJECT_KEYS = 1 << 16  # keys of one object
MAX_JSON_STRING_CHARS = 4 << 20  # characters of one string


def parse_json_object(data: bytes) -> dict:
    """The body as a JSON object, within the limits above: deeper nesting is a 400, a longer array,
    object or string a 413; invalid UTF-8 or JSON a 400."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise APIError(f"The request body is not valid UTF-8: {exc}") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise APIError(f"The request body is not valid JSON: {exc}") from None
    except RecursionError:  # deeper than the parser can go, far past MAX_JSON_DEPTH
        raise _too_deep() from None
    if not isinstance(body, dict):
        raise APIError("The request body must be a JSON object.")
    _check_json_limits(body)
    return body


def _too_deep() -> APIError:
    return APIError(f"The request body nests arrays and objects deeper than {MAX_JSON_DEPTH} levels.")


def _check_json_limits(body) -> None:
    """Walk the parsed body without recursion, checking each limit."""
    stack = [(body, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            if len(value) > MAX_JSON_STRING_CHARS:
                raise APIError(f"A string of the request body is longer than {MAX_JSON_STRING_CHARS} characters.", 413)
            continue
        if isinstance(value, dict):
            if len(value) > MAX_JSON_OBJECT_KEYS:
                raise APIError(f"An object of the request body has more than {MAX_JSON_OBJECT_KEYS} keys.", 413)
            children = [*value, *value.values()]  # the keys are strings too
        elif isinstance(value, list):
            if len(value) > MAX_JSON_ARRAY_ITEMS:
                raise APIError(f"An array of the request body has more than {MAX_JSON_ARRAY_ITEMS} items.", 413)
            children = value
        else:
            continue
        if depth > MAX_JSON_DEPTH:
            raise _too_deep()
        stack.extend((child, depth + 1) for child in children if isinstance(child, (dict, list, str)))
