"""Request bodies of the OpenAI-compatible server: OpenAI's field names plus vLLM's extensions, as
pydantic v2 models (the response bodies are in response_models.py).

An unknown field is ignored with a warning in the log, as vLLM and FastDeploy do, or refused with
--strict-request-fields (request_model.py); a known OpenAI/vLLM parameter that splitserve lacks
(unsupported_params.py) is refused unless it is null or its harmless default. An explicit null for
a parameter with a non-null default means "use the default", as in OpenAI's API.
Checks that span several fields raise `ParameterError`, which names the parameter at fault;
`validation_error_message()` turns any `pydantic.ValidationError` into the message and parameter
of a 400 body.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from splitserve.entrypoints.openai.beam_fields import BeamSearchRequestFields
from splitserve.entrypoints.openai.chat_messages import ChatCompletionTool, ChatMessageParam, NamedToolChoice
from splitserve.entrypoints.openai.guided import GuidedRequestFields
from splitserve.entrypoints.openai.request_model import (
    PROMPT_SCHEMA,
    SOME_TOKEN_IDS_SCHEMA,
    TOKEN_IDS_SCHEMA,
    ParameterError,
    RequestModel,
    is_token_id,
)
from splitserve.entrypoints.openai.timings import TimingsRequestFields
from splitserve.entrypoints.openai.unsupported_params import refuse_unsupported
from splitserve.sampling_params import MAX_N, SamplingParams

MAX_LOGPROBS = 20
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_LEN = 1024
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_LOGIT_BIAS = 100.0
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
# A parameter splitserve knows but lacks: accepted only as "off" (unsupported_params.py); the OpenAPI
# document says null, the one value that always works.
Unsupported = Annotated[Any, WithJsonSchema({"type": "null"})]


class StreamOptions(RequestModel):
    """`include_usage`: send a last chunk with the usage (vLLM's default when stream_options is
    given); `continuous_usage_stats`: put the usage so far in every chunk."""

    include_usage: bool = True
    continuous_usage_stats: bool = False


def _check_stop(value: Any) -> Any:
    """Stop strings: each one is matched against the text after every token, so their number and
    length are bounded; an empty one would stop generation at once."""
    if value is None:
        return value
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise ValueError("'stop' must be a string or a list of strings.")
    if len(stops) > MAX_STOP_STRINGS:
        raise ValueError(f"'stop' may hold at most {MAX_STOP_STRINGS} strings, got {len(stops)}.")
    if not all(stops):
        raise ValueError("'stop' strings must not be empty.")
    if any(len(s) > MAX_STOP_STRING_LEN for s in stops):
        raise ValueError(f"'stop' strings may be at most {MAX_STOP_STRING_LEN} characters long.")
    return value


class _GenerationRequest(GuidedRequestFields, BeamSearchRequestFields, TimingsRequestFields):
    """What /v1/completions and /v1/chat/completions share: sampling, stopping, streaming."""

    # In the OpenAPI document, rules checked by hand: stream_options needs stream; without
    # use_beam_search, length_penalty and early_stopping keep their defaults.
    model_config = ConfigDict(
        **RequestModel.model_config,
        json_schema_extra={
            "dependentSchemas": {
                "stream_options": {"required": ["stream"], "properties": {"stream": {"const": True}}},
            },
            "if": {"not": {"required": ["use_beam_search"], "properties": {"use_beam_search": {"const": True}}}},
            "then": {"properties": {"length_penalty": {"const": 1.0}, "early_stopping": {"const": False}}},
        },
    )

    model: str | None = None
    request_id: str | None = None  # the client's id for /abort_requests (vLLM's field; also X-Request-Id)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    stop: str | list[str] | None = None
    stop_token_ids: Annotated[list[int], TOKEN_IDS_SCHEMA] | None = None
    include_stop_str_in_output: bool = False
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=_INT64_MIN, le=_INT64_MAX)
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    metadata: dict[str, Any] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    bad_words: list[str] | None = None
    allowed_token_ids: Annotated[list[int], SOME_TOKEN_IDS_SCHEMA] | None = None
    return_token_ids: bool = False
    echo: bool = False
    user: str | None = None
    # vLLM's: with --scheduling-policy priority, lower runs first (and is preempted last).
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    kv_transfer_params: dict[str, Any] | None = None  # prefill/decode disaggregation (set by the router)
    # Known but unsupported: accepted only as "off" (see unsupported_params.py).
    suffix: Unsupported = None
    service_tier: Unsupported = None
    store: Unsupported = None

    _refuse = field_validator("suffix", "service_tier", "store")(refuse_unsupported)
    _stop = field_validator("stop", mode="before")(_check_stop)

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        """OpenAI's limits: keys are token ids, biases lie in [-100, 100] (-100 bans a token)."""
        if value is None:
            return value
        if len(value) > MAX_LOGIT_BIAS_ENTRIES:
            raise ValueError(f"'logit_bias' may hold at most {MAX_LOGIT_BIAS_ENTRIES} entries, got {len(value)}.")
        for key, bias in value.items():
            if not (key.isascii() and key.isdigit()):
                raise ValueError(f"'logit_bias' keys must be token ids (non-negative integers), got {key!r}.")
            if not -MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS:
                raise ValueError(f"'logit_bias' values must be in [-100, 100], got {bias} for token {key}.")
        return value

    @model_validator(mode="after")
    def _check_generation(self) -> _GenerationRequest:
        """Resolve the alternative spellings (max_completion_tokens, metadata.min_tokens) into
        max_tokens and min_tokens, refusing contradictions, and refuse stream_options without stream."""
        given = self.model_fields_set
        if self.max_completion_tokens is not None:
            if "max_tokens" in given and self.max_tokens not in (None, self.max_completion_tokens):
                raise ParameterError(
                    "max_completion_tokens",
                    f"'max_tokens' ({self.max_tokens}) and 'max_completion_tokens' "
                    f"({self.max_completion_tokens}) differ; give only one of them.",
                )
            self.max_tokens = self.max_completion_tokens
        meta_min_tokens = (self.metadata or {}).get("min_tokens")
        if isinstance(meta_min_tokens, str) and meta_min_tokens.strip().isdigit():
            meta_min_tokens = int(meta_min_tokens)  # the OpenAI client sends metadata values as strings
        if meta_min_tokens is not None:
            if not is_token_id(meta_min_tokens):
                raise ParameterError(
                    "metadata.min_tokens", f"'metadata.min_tokens' must be an integer >= 0, got {meta_min_tokens!r}."
                )
            if "min_tokens" in given and self.min_tokens != meta_min_tokens:
                raise ParameterError(
                    "min_tokens",
                    f"'min_tokens' ({self.min_tokens}) and 'metadata.min_tokens' "
                    f"({meta_min_tokens}) differ; give only one of them.",
                )
            self.min_tokens = meta_min_tokens
        if self.stream_options is not None and not self.stream:
            raise ParameterError("stream_options", "'stream_options' is only allowed when 'stream' is true.")
        return self

    def _sampling_kwargs(self, default_max_tokens: int | None, defaults: dict | None) -> dict[str, Any]:
        """The SamplingParams fields both endpoints fill the same way. `defaults` (the model's
        generation config, loader/generation_config.py) fill the sampling fields this request left
        unset; a beam search takes none of them (it does not sample)."""
        defaults = {} if self.use_beam_search else defaults or {}
        given = self.model_fields_set

        def pick(name: str):
            own = getattr(self, name)
            return own if name in given and own is not None else defaults.get(name, own)

        temperature = pick("temperature")
        return dict(
            n=self.n,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=pick("repetition_penalty"),
            temperature=1.0 if temperature is None else temperature,
            top_p=pick("top_p"),
            top_k=pick("top_k"),
            min_p=pick("min_p"),
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            bad_words=self.bad_words,
            ignore_eos=self.ignore_eos,
            max_tokens=default_max_tokens if self.max_tokens is None else self.max_tokens,
            min_tokens=self.min_tokens,
            prompt_logprobs=self.prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            allowed_token_ids=self.allowed_token_ids,
            guided_decoding=self.guided_decoding_params(),
            best_of=None if self.use_beam_search else self.best_of,
        )


def check_prompt_shapes(value: Any, name: str = "prompt") -> Any:
    """A prompt field (completions' `prompt`, embeddings' `input`): a string, a list of strings, a
    list of token ids or a list of lists of token ids, not empty; checked by hand so that a bad one
    gets one message listing the accepted shapes rather than one error per member of the union."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value:
        if all(isinstance(p, str) for p in value):
            return value
        ids = _token_ids(value)
        if ids is not None:
            return ids
        batch = [_token_ids(p) if isinstance(p, list) and p else None for p in value]
        if all(ids is not None for ids in batch):
            return batch
    raise ValueError(
        f"'{name}' must be a string, a list of strings, a list of token ids or a list of lists of token ids, "
        "and not empty."
    )


def prompt_list(prompt: str | list) -> list[str | list[int]]:
    """The batch of prompts of a checked prompt field, each a text or a list of token ids."""
    if isinstance(prompt, str) or is_token_id(prompt[0]):
        return [prompt]
    return list(prompt)


def _token_ids(values: list) -> list[int] | None:
    """Token ids as ints (a JSON number like 5.0 is the integer 5, as pydantic's ints take it); None
    when one is not a non-negative integer."""
    ids = []
    for value in values:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not is_token_id(value):
            return None
        ids.append(value)
    return ids


class CompletionRequest(_GenerationRequest):
    """POST /v1/completions. `max_tokens` defaults to 16 as in OpenAI; an explicit null means "up to
    the context length" (`to_sampling_params`'s `default_max_tokens`)."""

    prompt: Annotated[str | list[str] | list[int] | list[list[int]], PROMPT_SCHEMA]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt(cls, value: Any) -> Any:
        return check_prompt_shapes(value, "prompt")

    def prompts(self) -> list[str | list[int]]:
        """The batch of prompts, each a text or a list of token ids, whichever shape was sent."""
        return prompt_list(self.prompt)

    def to_sampling_params(self, default_max_tokens: int | None, defaults: dict | None = None) -> SamplingParams:
        """The engine's SamplingParams; `default_max_tokens` replaces a null max_tokens, `defaults`
        the sampling fields left unset. Raises ValueError for combinations SamplingParams refuses
        (e.g. min_tokens > max_tokens)."""
        return SamplingParams(**self._sampling_kwargs(default_max_tokens, defaults), logprobs=self.logprobs)


class ConversationRequest(RequestModel):
    """What /v1/chat/completions and /tokenize (chat form) share: the messages and the template."""

    messages: list[ChatMessageParam] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_template_flags(self) -> ConversationRequest:
        """Continuing the last message and opening a new assistant turn exclude each other."""
        if self.add_generation_prompt and self.continue_final_message:
            raise ParameterError(
                "continue_final_message",
                "'continue_final_message' and "
                "'add_generation_prompt' cannot both be true; set add_generation_prompt to false.",
            )
        return self

    def template_messages(self) -> list[dict[str, str]]:
        """The messages as plain dicts with string content, for the chat template."""
        return [message.template_dict() for message in self.messages]


class ChatCompletionRequest(_GenerationRequest, ConversationRequest):
    """POST /v1/chat/completions. `max_tokens` (or `max_completion_tokens`) defaults to the rest of
    the context (`to_sampling_params`'s `default_max_tokens`). `echo` is only carried: the server
    prepends the last message's content when that message is the assistant's."""

    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list[ChatCompletionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # Known but unsupported: accepted only as "off" (see unsupported_params.py).
    functions: Unsupported = None
    reasoning_effort: Unsupported = None
    audio: Unsupported = None
    modalities: Unsupported = None
    prediction: Unsupported = None
    web_search_options: Unsupported = None

    _refuse_chat = field_validator(
        "functions", "reasoning_effort", "audio", "modalities", "prediction", "web_search_options"
    )(refuse_unsupported)

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        """OpenAI's rules: a tool choice other than "none" needs tools, and a named one must be one of them."""
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ParameterError("tool_choice", "'tool_choice' needs 'tools' to choose from.")
        if isinstance(self.tool_choice, NamedToolChoice):
            name = self.tool_choice.function.name
            if name not in {tool.function.name for tool in self.tools}:
                raise ParameterError("tool_choice", f"The tool {name!r} named by 'tool_choice' is not in 'tools'.")
        return self

    @model_validator(mode="after")
    def _check_top_logprobs(self) -> ChatCompletionRequest:
        """As in OpenAI, top_logprobs only refines logprobs=true."""
        if self.top_logprobs is not None and not self.logprobs:
            raise ParameterError("top_logprobs", "'top_logprobs' requires 'logprobs' to be true.")
        return self

    def to_sampling_params(self, default_max_tokens: int | None, defaults: dict | None = None) -> SamplingParams:
        """The engine's SamplingParams; `default_max_tokens` replaces a null max_tokens (None: the
        context left after the prompt), `defaults` the sampling fields left unset. logprobs=true
        asks for top_logprobs alternatives (0: only the chosen token)."""
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**self._sampling_kwargs(default_max_tokens, defaults), logprobs=logprobs)
