"""What every request body of the OpenAI-compatible server shares: the base model's rules, the
error that names a parameter, and turning pydantic's validation errors into a 400's message."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, model_validator
from pydantic.fields import FieldInfo


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
        return {k: v for k, v in data.items() if k in fields and (v is not None or _accepts_none(fields[k]))}


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
