"""What every request body of the OpenAI-compatible server shares: the base model's rules, the
error that names a parameter, and turning pydantic's validation errors into a 400's message."""

from __future__ import annotations

import logging
from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, WithJsonSchema, model_validator
from pydantic.fields import FieldInfo

from splitserve.entrypoints.http import APIError

logger = logging.getLogger("splitserve.api_server")
_HINT = " (--strict-request-fields refuses them)"


class ParameterError(ValueError):
    """A request error that names its parameter: pydantic gives a check that spans several fields
    no location, so the 400 body could not otherwise say which parameter was wrong."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param


def _accepts_none(field: FieldInfo) -> bool:
    annotation = field.annotation
    return annotation is Any or type(None) in getattr(annotation, "__args__", ())


def is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# JSON schemas the OpenAPI document shows for fields whose checks are written by hand (so that a bad
# value gets one clear message): what a valid value looks like, for clients and fuzzers.
TOKEN_ID_SCHEMA = {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}
TOKEN_IDS_SCHEMA = WithJsonSchema({"type": "array", "items": TOKEN_ID_SCHEMA})
SOME_TOKEN_IDS_SCHEMA = WithJsonSchema({"type": "array", "minItems": 1, "items": TOKEN_ID_SCHEMA})
TEXT_OR_TOKEN_IDS_SCHEMA = WithJsonSchema(
    {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "items": TOKEN_ID_SCHEMA}]}
)
PROMPT_SCHEMA = WithJsonSchema(
    {
        "anyOf": [
            {"type": "string", "minLength": 1},
            {"type": "array", "minItems": 1, "items": {"type": "string", "minLength": 1}},
            {"type": "array", "minItems": 1, "items": TOKEN_ID_SCHEMA},
            {"type": "array", "minItems": 1, "items": {"type": "array", "minItems": 1, "items": TOKEN_ID_SCHEMA}},
        ]
    }
)

STRICT_FIELDS = "strict_fields"  # validation context: refuse unknown fields instead of ignoring them
IGNORED_FIELDS = "ignored_fields"  # validation context: a list that collects the unknown fields ignored


class RequestModel(BaseModel):
    """Base of every request body. Unknown fields are ignored, as vLLM and FastDeploy do (the
    caller logs them), or refused when the validation context asks for strict fields (the
    server's --strict-request-fields); NaN and infinities are refused; a null for a field that has
    a non-null default is dropped so that the default applies (OpenAI reads null as "not given";
    clients other than OpenAI's SDK send such nulls)."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any, info: ValidationInfo) -> Any:
        if not isinstance(data, dict):
            return data
        fields = {field.alias or name: field for name, field in cls.model_fields.items()}
        fields.update(cls.model_fields)
        unknown = [k for k in data if k not in fields]
        if unknown:
            _unknown_fields(unknown, info.context or {})
        for key, value in data.items():
            if key in fields and _has_huge_int(value):
                raise ParameterError(key, f"{key}: an integer outside the 64-bit range.")
        return {k: v for k, v in data.items() if k in fields and (v is not None or _accepts_none(fields[k]))}


_INT64 = 1 << 63


def _has_huge_int(value: Any, depth: int = 0) -> bool:
    """An integer, or a list (of lists) of integers, that no engine field holds (JSON allows any
    size; the engine's messages do not). Nested objects are checked by their own models."""
    if isinstance(value, int) and not isinstance(value, bool):
        return not -_INT64 <= value < _INT64
    if isinstance(value, list) and depth < 2:
        return any(_has_huge_int(item, depth + 1) for item in value)
    return False


def _unknown_fields(names: list[str], context: dict) -> None:
    if context.get(STRICT_FIELDS):
        raise ParameterError(names[0], f"Unrecognized request argument supplied: {names[0]}")
    if IGNORED_FIELDS in context:
        context[IGNORED_FIELDS].extend(names)


def validation_error_message(exc: ValidationError) -> tuple[str, str | None]:
    """A readable message for a 400 and the offending parameter (the first error's location joined
    by '.', e.g. "messages.0.content"; a ParameterError's own parameter for a cross-field check)."""
    error = exc.errors()[0]
    param = ".".join(str(part) for part in error["loc"]) or None
    cause = error.get("ctx", {}).get("error")
    if isinstance(cause, ParameterError):
        return str(cause), cause.param
    if error["type"] == "extra_forbidden":
        return f"Unrecognized request argument supplied: {param}", param
    if error["type"] == "value_error":  # our own checks: the message already names its subject
        return str(cause) if cause is not None else error["msg"], param
    return (f"{param}: {error['msg']}" if param else error["msg"]), param


def parse_request(parse, body: dict, strict: bool = False, log: logging.Logger | None = None, hint: str = _HINT):
    """A request body validated by `parse` (a model's model_validate): a 400 APIError naming the
    parameter when it is wrong; unknown fields refused (`strict`, --strict-request-fields) or
    ignored with one warning line (vLLM's behaviour) on `log`."""
    context = {STRICT_FIELDS: strict, IGNORED_FIELDS: []}
    try:
        req = parse(body, context=context)
    except ValidationError as exc:
        message, param = validation_error_message(exc)
        raise APIError(message, param=param) from None
    if context[IGNORED_FIELDS]:
        names = ", ".join(sorted(set(context[IGNORED_FIELDS])))
        (log or logger).warning("Ignored request fields splitserve does not know: %s%s", names, hint)
    return req
