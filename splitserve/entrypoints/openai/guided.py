"""The structured-output fields of completion and chat requests, with vLLM's and OpenAI's names:
`guided_json`, `guided_regex`, `guided_choice`, `guided_grammar`, `guided_decoding_backend`,
`guided_whitespace_pattern`, vLLM's newer `structured_outputs` object, and OpenAI's
`response_format` (`text`, `json_object`, `json_schema`). At most one guide per request; it becomes
SamplingParams.guided_decoding (docs/structured_output.md)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from splitserve.entrypoints.openai.request_model import ParameterError, RequestModel
from splitserve.sampling_params import GuidedDecodingParams

_GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")


class JsonSchemaFormat(RequestModel):
    """OpenAI's `response_format.json_schema`: the schema under `schema` (`json_schema` is accepted
    too, as some clients send it)."""

    name: str = "response"
    description: str | None = None
    json_schema: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    model_config = {"populate_by_name": True}

    @model_validator(mode="before")
    @classmethod
    def _schema_spellings(cls, data: Any) -> Any:
        if isinstance(data, dict) and "schema" not in data and "json_schema" in data:
            data = {**data, "schema": data["json_schema"]}
            del data["json_schema"]
        return data


class ResponseFormat(RequestModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and (self.json_schema is None or self.json_schema.json_schema is None):
            raise ParameterError(
                "response_format.json_schema", "response_format of type json_schema needs json_schema.schema."
            )
        return self


class GuidedRequestFields(RequestModel):
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict[str, Any] | None = None
    response_format: ResponseFormat | None = None

    @field_validator("guided_choice")
    @classmethod
    def _choices(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and not value:
            raise ValueError("'guided_choice' must hold at least one string.")
        return value

    @model_validator(mode="after")
    def _one_guide(self) -> GuidedRequestFields:
        used = self._guides_used()
        if len(used) > 1:
            raise ParameterError(used[1], f"Give one structured-output guide per request, not {' and '.join(used)}.")
        return self

    def _guides_used(self) -> list[str]:
        used = [name for name in _GUIDED_FIELDS if getattr(self, name) is not None]
        if self.response_format is not None and self.response_format.type != "text":
            used.append("response_format")
        return used

    @property
    def guide_param(self) -> str | None:
        """The request field that holds the guide (for errors about it)."""
        used = self._guides_used()
        return used[0] if used else None

    def guided_decoding_params(self) -> GuidedDecodingParams | None:
        """The guide as SamplingParams.guided_decoding; ValueError for one that is not well formed."""
        param = self.guide_param
        if param is None:
            return None
        common = {"backend": self.guided_decoding_backend, "whitespace_pattern": self.guided_whitespace_pattern}
        if param == "structured_outputs":
            fields = {k: v for k, v in self.structured_outputs.items() if v is not None}
            unknown = sorted(set(fields) - set(GuidedDecodingParams.__dataclass_fields__))
            if unknown:
                raise ValueError(f"structured_outputs.{unknown[0]} is not supported by splitserve.")
            return GuidedDecodingParams(**{**common, **fields})
        if param == "response_format":
            if self.response_format.type == "json_object":
                return GuidedDecodingParams(json_object=True, **common)
            return GuidedDecodingParams(json=self.response_format.json_schema.json_schema, **common)
        kind = param.removeprefix("guided_")
        return GuidedDecodingParams(**{kind: getattr(self, param)}, **common)
