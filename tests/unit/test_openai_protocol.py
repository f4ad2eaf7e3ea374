"""The OpenAI-compatible request/response models: every validation rule gives an error naming the
parameter at fault, accepted requests map onto the right SamplingParams, and responses serialize
in OpenAI's shapes."""

from __future__ import annotations

import json

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import ValidationError

from splitserve.engine.errors import InvalidRequestError
from splitserve.entrypoints.http import error_body, install_error_handlers
from splitserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.entrypoints.openai.request_model import validation_error_message
from splitserve.entrypoints.openai.response_models import (
    ChatCompletionResponse,
    ChatCompletionResponseChoice,
    ChatCompletionStreamChoice,
    ChatCompletionStreamResponse,
    ChatMessage,
    CompletionResponse,
    CompletionResponseChoice,
    DeltaMessage,
    ModelCard,
    ModelList,
    UsageInfo,
)
from splitserve.entrypoints.openai.tokenize_protocol import (
    DetokenizeRequest,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    parse_tokenize_request,
)
from splitserve.outputs import Logprob

USER = [{"role": "user", "content": "Hi"}]


def completion(**fields) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "Hello", **fields})


def chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, **fields})


def validate(model):
    """A maker that validates exactly the given fields, without the defaults above."""
    return lambda **fields: model.model_validate(fields)


def rejected(make, **fields) -> tuple[str, str | None]:
    """The (message, param) a 400 would carry for a request that must fail validation."""
    with pytest.raises(ValidationError) as info:
        make(**fields)
    return validation_error_message(info.value)


# --- unknown and unsupported parameters ------------------------------------------------------
STRICT = {"strict_fields": True}


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_unknown_fields_are_ignored_and_collected(model):
    """vLLM's and FastDeploy's behaviour: an unknown field is dropped; the server logs the names."""
    context = {"ignored_fields": []}
    body = {"prompt": "Hello", "messages": USER, "temprature": 0.5, "frobnicate": 1.0}
    body.pop("messages" if model is CompletionRequest else "prompt")
    request = model.model_validate(body, context=context)
    assert sorted(context["ignored_fields"]) == ["frobnicate", "temprature"]
    assert request.temperature is None


@pytest.mark.parametrize("model", [CompletionRequest, ChatCompletionRequest])
def test_unknown_field_is_refused_by_name_when_strict(model):
    body = {"prompt": "Hello"} if model is CompletionRequest else {"messages": USER}
    with pytest.raises(ValidationError) as info:
        model.model_validate({**body, "temprature": 0.5}, context=STRICT)
    message, param = validation_error_message(info.value)
    assert param == "temprature" and "temprature" in message


COMMON_UNSUPPORTED = {
    "suffix": "!",
    "service_tier": "flex",
    "store": True,
}
CHAT_UNSUPPORTED = {
    "functions": [{"name": "f"}],
    "reasoning_effort": "low",
    "audio": {"voice": "alloy"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
}


@pytest.mark.parametrize(
    "make, name, value",
    [(completion, k, v) for k, v in COMMON_UNSUPPORTED.items()]
    + [(chat, k, v) for k, v in {**COMMON_UNSUPPORTED, **CHAT_UNSUPPORTED}.items()],
)
def test_unsupported_parameter_with_a_value_is_refused(make, name, value):
    message, param = rejected(make, **{name: value})
    assert param == name
    assert name in message and "not supported" in message


@pytest.mark.parametrize(
    "make, name",
    [(completion, k) for k in COMMON_UNSUPPORTED] + [(chat, k) for k in {**COMMON_UNSUPPORTED, **CHAT_UNSUPPORTED}],
)
def test_unsupported_parameter_as_null_is_accepted(make, name):
    assert getattr(make(**{name: None}), name) is None


@pytest.mark.parametrize(
    "make, fields",
    [
        (
            completion,
            {
                "use_beam_search": False,
                "store": False,
                "service_tier": "auto",
                "user": "u1",
            },
        ),
        (
            chat,
            {
                "tool_choice": "none",
                "modalities": ["text"],
                "parallel_tool_calls": True,
                "service_tier": "default",
                "store": False,
                "user": "u1",
            },
        ),
    ],
)
def test_parameters_meaning_off_are_accepted(make, fields):
    request = make(**fields)
    assert {k: getattr(request, k) for k in fields} == fields


def test_false_flag_must_be_a_real_false():
    """0 == False in Python: a 0 must not pass as store=false."""
    assert rejected(completion, store=0)[1] == "store"


@pytest.mark.parametrize("field", ["n", "stream", "echo", "top_p", "skip_special_tokens", "min_tokens"])
def test_null_means_default(field):
    request = completion(**{field: None})
    assert getattr(request, field) == CompletionRequest.model_fields[field].default


# --- numeric bounds --------------------------------------------------------------------------
@pytest.mark.parametrize("make", [completion, chat])
@pytest.mark.parametrize("n, ok", [(0, False), (1, True), (128, True), (129, False)])
def test_n_bounds(make, n, ok):
    if ok:
        assert make(n=n).to_sampling_params(16).n == n
    else:
        assert rejected(make, n=n)[1] == "n"


@pytest.mark.parametrize(
    "field, bad",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.1),
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.5),
        ("repetition_penalty", 0.0),
        ("logprobs", 21),
        ("logprobs", -1),
        ("prompt_logprobs", 21),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("seed", 2**64),
    ],
)
def test_out_of_range_values_are_refused_by_name(field, bad):
    message, param = rejected(completion, **{field: bad})
    assert param == field and message.startswith(field)


def test_chat_top_logprobs_bound():
    assert rejected(chat, logprobs=True, top_logprobs=21)[1] == "top_logprobs"


# --- stop strings, logit_bias ----------------------------------------------------------------
@pytest.mark.parametrize(
    "stop, ok",
    [
        ("\n", True),
        (["a"] * 16, True),
        (["a"] * 17, False),
        ([""], False),
        ("", False),
        (["x" * 1024], True),
        (["x" * 1025], False),
        ([1], False),
    ],
)
def test_stop_limits(stop, ok):
    if ok:
        assert completion(stop=stop).to_sampling_params(16).stop == ([stop] if isinstance(stop, str) else stop)
    else:
        assert rejected(completion, stop=stop)[1] == "stop"


def test_logit_bias_is_mapped_to_int_token_ids():
    params = completion(logit_bias={"5": -100, "7": 2.5}).to_sampling_params(16)
    assert params.logit_bias == {5: -100.0, 7: 2.5}


@pytest.mark.parametrize(
    "bias", [{"a": 1}, {"-3": 1}, {"1.5": 1}, {"5": 100.5}, {"5": -101}, {str(i): 0 for i in range(1025)}]
)
def test_logit_bias_bad_key_value_or_size(bias):
    assert rejected(completion, logit_bias=bias)[1] == "logit_bias"


def test_logit_bias_limits_are_inclusive():
    assert completion(logit_bias={str(i): 100 for i in range(1024)}).logit_bias["0"] == 100


# --- cross-field checks ----------------------------------------------------------------------
@pytest.mark.parametrize("make", [completion, chat])
def test_stream_options_need_stream(make):
    message, param = rejected(make, stream_options={"include_usage": True})
    assert param == "stream_options" and "stream" in message
    request = make(stream=True, stream_options={"continuous_usage_stats": True})
    assert request.stream_options.include_usage and request.stream_options.continuous_usage_stats


def test_stream_options_refuse_unknown_fields_when_strict():
    body = {"prompt": "Hello", "stream": True, "stream_options": {"usage": True}}
    with pytest.raises(ValidationError) as info:
        CompletionRequest.model_validate(body, context=STRICT)
    assert validation_error_message(info.value)[1] == "usage"


def test_top_logprobs_needs_logprobs():
    assert rejected(chat, top_logprobs=3)[1] == "top_logprobs"
    assert rejected(chat, logprobs=False, top_logprobs=0)[1] == "top_logprobs"


@pytest.mark.parametrize("make", [completion, chat])
def test_metadata_min_tokens(make):
    assert make(metadata={"min_tokens": 4}).to_sampling_params(16).min_tokens == 4
    assert make(metadata={"min_tokens": 4}, min_tokens=4).to_sampling_params(16).min_tokens == 4
    assert make(metadata={"trace": "x"}, min_tokens=2).to_sampling_params(16).min_tokens == 2
    # The OpenAI client sends metadata values as strings: a numeric string is a number.
    assert make(metadata={"min_tokens": "4"}).to_sampling_params(16).min_tokens == 4
    for bad in (-1, "-4", "four", "", 2.5, True):
        assert rejected(make, metadata={"min_tokens": bad})[1] == "metadata.min_tokens"
    assert rejected(make, metadata={"min_tokens": 4}, min_tokens=3)[1] == "min_tokens"


@pytest.mark.parametrize("make", [completion, chat])
def test_max_completion_tokens_is_an_alias_of_max_tokens(make):
    assert make(max_completion_tokens=7).to_sampling_params(100).max_tokens == 7
    assert make(max_completion_tokens=7, max_tokens=7).to_sampling_params(100).max_tokens == 7
    message, param = rejected(make, max_completion_tokens=7, max_tokens=8)
    assert param == "max_completion_tokens" and "max_tokens" in message


def test_best_of():
    assert completion(n=3, best_of=3).to_sampling_params(16).best_of == 3
    assert completion(n=2, best_of=5, temperature=0.8).to_sampling_params(16).best_of == 5
    assert rejected(completion, n=3, best_of=2)[1] == "best_of"
    assert "greedy" in rejected(completion, n=1, best_of=3, temperature=0)[0]
    # Found by schemathesis: best_of=123897109 hung the server while it made the samples.
    assert "less than or equal to 128" in rejected(completion, n=1, best_of=123897109, temperature=0.8)[0]
    assert rejected(chat, n=1, best_of=3, temperature=1.0, stream=True)[1] == "best_of"


@pytest.mark.parametrize("make", [completion, chat])
def test_beam_search_fields(make):
    request = make(use_beam_search=True, n=2, best_of=4, temperature=0, length_penalty=0.5, early_stopping="never")
    params = request.beam_search_params(max_tokens=20)
    assert (params.beam_width, params.length_penalty, params.early_stopping) == (4, 0.5, "never")
    assert request.to_sampling_params(20).best_of is None  # the search, not the sampler, uses the width
    assert make(use_beam_search=True, n=3).beam_width == 3


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"use_beam_search": True}, "best_of"),
        ({"use_beam_search": True, "n": 2, "top_p": 0.9}, "top_p"),
        ({"use_beam_search": True, "n": 2, "top_k": 5}, "top_k"),
        ({"use_beam_search": True, "n": 2, "temperature": 0.7}, "temperature"),
        ({"length_penalty": 1.5}, "length_penalty"),
        ({"early_stopping": True}, "early_stopping"),
    ],
)
def test_beam_search_rules(fields, param):
    """The Ascend guide's constraints, each refused by name; the defaults pass anywhere."""
    assert rejected(completion, **fields)[1] == param
    assert completion(length_penalty=1.0, early_stopping=False, use_beam_search=False).length_penalty == 1.0


def test_min_tokens_above_max_tokens_raises_value_error():
    with pytest.raises(ValueError, match="min_tokens"):
        completion(min_tokens=10, max_tokens=5).to_sampling_params(16)


# --- chat messages ---------------------------------------------------------------------------
def test_image_url_parts_are_read_and_other_kinds_refused_naming_their_type():
    image = {"type": "image_url", "image_url": {"url": "http://x/y.png", "detail": "low"}}
    req = validate(ChatCompletionRequest)(
        messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, image]}]
    )
    assert req.template_messages()[0]["content"] == [{"type": "text", "text": "hi"}, image]
    assert req.messages[0].text() == "hi"
    audio = [{"role": "user", "content": [{"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}]}]
    message, param = rejected(validate(ChatCompletionRequest), messages=audio)
    assert param == "messages.0.content" and "input_audio" in message
    bad = [{"role": "user", "content": [{"type": "image_url", "image_url": "http://x/y.png"}]}]
    message, param = rejected(validate(ChatCompletionRequest), messages=bad)
    assert param == "messages.0.content" and "{'url': ...}" in message


@pytest.mark.parametrize(
    "messages, param",
    [
        ([], "messages"),
        ([{"role": "robot", "content": "x"}], "messages.0.role"),
        ([{"role": "user"}], "messages.0.content"),
        ([{"role": "user", "content": [{"type": "text"}]}], "messages.0.content"),
        ([{"role": "user", "content": "x", "tool_calls": []}], "messages.0.tool_calls"),
    ],
)
def test_bad_messages(messages, param):
    assert rejected(validate(ChatCompletionRequest), messages=messages)[1] == param


def test_template_messages_are_plain_string_dicts():
    request = chat(
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "user", "name": "ann", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "assistant", "content": "ok"},
            {"role": "tool", "content": "42", "tool_call_id": "call_1"},
        ]
    )
    assert request.template_messages() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb", "name": "ann"},
        {"role": "assistant", "content": "ok"},
        {"role": "tool", "content": "42", "tool_call_id": "call_1"},
    ]


def test_continue_final_message_excludes_generation_prompt():
    assert rejected(chat, continue_final_message=True)[1] == "continue_final_message"
    request = chat(continue_final_message=True, add_generation_prompt=False, echo=True)
    assert request.continue_final_message and not request.add_generation_prompt and request.echo


# --- to_sampling_params ----------------------------------------------------------------------
def test_completion_to_sampling_params_maps_every_field():
    params = completion(
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=3,
        stop=["END"],
        stop_token_ids=[9],
        include_stop_str_in_output=True,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.2,
        ignore_eos=True,
        min_tokens=2,
        max_tokens=30,
        logprobs=3,
        prompt_logprobs=1,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        bad_words=["bad"],
        allowed_token_ids=[1, 2, 3],
    ).to_sampling_params(1000)
    expected = dict(
        n=2,
        temperature=0.7,
        top_p=0.9,
        top_k=5,
        min_p=0.1,
        seed=3,
        stop=["END"],
        stop_token_ids=[9],
        include_stop_str_in_output=True,
        frequency_penalty=0.5,
        presence_penalty=-0.5,
        repetition_penalty=1.2,
        ignore_eos=True,
        min_tokens=2,
        max_tokens=30,
        logprobs=3,
        prompt_logprobs=1,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
        bad_words=["bad"],
        allowed_token_ids=[1, 2, 3],
    )
    assert {k: getattr(params, k) for k in expected} == expected


def test_defaults_map_to_engine_defaults():
    params = completion(top_k=-1).to_sampling_params(1000)
    assert (params.top_k, params.temperature, params.max_tokens, params.logprobs) == (0, 1.0, 16, None)
    assert completion(temperature=None).to_sampling_params(1000).temperature == 1.0
    assert completion(temperature=0).to_sampling_params(1000).temperature == 0.0


def test_null_max_tokens_takes_the_default():
    assert completion(max_tokens=None).to_sampling_params(123).max_tokens == 123
    assert completion(max_tokens=None).to_sampling_params(None).max_tokens is None
    assert chat().to_sampling_params(321).max_tokens == 321
    assert chat(max_tokens=5).to_sampling_params(321).max_tokens == 5


@pytest.mark.parametrize(
    "fields, logprobs",
    [
        ({}, None),
        ({"logprobs": False}, None),
        ({"logprobs": True}, 0),
        ({"logprobs": True, "top_logprobs": 0}, 0),
        ({"logprobs": True, "top_logprobs": 5}, 5),
    ],
)
def test_chat_logprobs_mapping(fields, logprobs):
    assert chat(**fields).to_sampling_params(16).logprobs == logprobs


def test_chat_prompt_logprobs_and_penalties():
    params = chat(prompt_logprobs=2, presence_penalty=1.0, logit_bias={"3": 1}).to_sampling_params(16)
    assert (params.prompt_logprobs, params.presence_penalty, params.logit_bias) == (2, 1.0, {3: 1.0})


# --- prompts ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "prompt, prompts",
    [
        ("Hello", ["Hello"]),
        (["a", "b"], ["a", "b"]),
        ([1, 2, 3], [[1, 2, 3]]),
        ([[1, 2], [3]], [[1, 2], [3]]),
    ],
)
def test_prompt_normalisation(prompt, prompts):
    assert completion(prompt=prompt).prompts() == prompts


@pytest.mark.parametrize("prompt", [[], [[]], [1, "a"], [-1], [True], [[1], "a"], {"text": "a"}, 5, None])
def test_bad_prompt_shapes(prompt):
    message, param = rejected(completion, prompt=prompt)
    assert param == "prompt" and "prompt" in message


def test_prompt_is_required():
    assert rejected(validate(CompletionRequest), model="m")[1] == "prompt"


# --- tokenize / detokenize -------------------------------------------------------------------
def test_tokenize_request_forms():
    plain = parse_tokenize_request({"prompt": "hi"})
    assert isinstance(plain, TokenizeCompletionRequest) and plain.add_special_tokens
    chat_form = parse_tokenize_request({"messages": USER})
    assert isinstance(chat_form, TokenizeChatRequest) and not chat_form.add_special_tokens
    assert chat_form.add_generation_prompt and chat_form.template_messages() == USER
    with pytest.raises(ValidationError):
        parse_tokenize_request({"prompt": "hi", "messages": USER}, context=STRICT)
    with pytest.raises(ValidationError):
        DetokenizeRequest.model_validate({"tokens": [1], "prompt": "x"}, context=STRICT)
    assert DetokenizeRequest.model_validate({"tokens": [1], "prompt": "x"}).tokens == [1]


# --- responses and errors --------------------------------------------------------------------
def test_error_body_shape():
    assert error_body("bad n", param="n") == {
        "error": {"message": "bad n", "type": "invalid_request_error", "param": "n", "code": 400}
    }
    assert error_body("boom", type="internal_server_error", code=500)["error"]["code"] == 500


def test_engine_refusals_answer_400_naming_their_parameter():
    app = FastAPI()
    install_error_handlers(app, "server")

    @app.post("/refuse")
    async def refuse():
        raise InvalidRequestError("too long", "max_tokens")

    r = TestClient(app).post("/refuse")
    assert r.status_code == 400 and r.json() == error_body("too long", param="max_tokens")


def test_validation_error_message_picks_the_first_parameter():
    message, param = rejected(completion, n=0)
    assert param == "n" and message.startswith("n:")


def test_response_ids_objects_and_extensions():
    response = CompletionResponse(
        model="m",
        usage=UsageInfo(prompt_tokens=2, completion_tokens=1, total_tokens=3),
        choices=[CompletionResponseChoice(index=0, text="x", finish_reason="stop")],
    )
    body = json.loads(response.model_dump_json())
    assert body["id"].startswith("cmpl-") and len(body["id"]) > 10 and body["object"] == "text_completion"
    assert isinstance(body["created"], int)
    choice = body["choices"][0]
    assert choice["logprobs"] is None and choice["stop_reason"] is None  # OpenAI's own fields stay
    assert "token_ids" not in choice and "prompt_logprobs" not in choice  # unfilled extensions go
    assert "prompt_tokens_details" not in body["usage"]
    assert CompletionResponse(model="m", usage=UsageInfo(), choices=[]).id != response.id


def test_prompt_logprobs_serialize():
    choice = CompletionResponseChoice(
        index=0, text="", token_ids=[5], prompt_logprobs=[None, {7: Logprob(-0.5, 1, "a")}]
    )
    body = json.loads(choice.model_dump_json())
    assert body["prompt_logprobs"] == [None, {"7": {"logprob": -0.5, "rank": 1, "decoded_token": "a"}}]
    assert body["token_ids"] == [5]


def test_chat_response_shapes():
    response = ChatCompletionResponse(
        model="m",
        usage=UsageInfo(),
        choices=[ChatCompletionResponseChoice(index=0, message=ChatMessage(content="hi", reasoning_content="think"))],
    )
    body = json.loads(response.model_dump_json())
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert body["choices"][0]["message"] == {"role": "assistant", "content": "hi", "reasoning_content": "think"}
    chunk = ChatCompletionStreamResponse(
        model="m",
        choices=[ChatCompletionStreamChoice(index=0, delta=DeltaMessage(), finish_reason="length", arrival_time=0.5)],
    )
    body = json.loads(chunk.model_dump_json())
    assert body["object"] == "chat.completion.chunk" and "usage" not in body
    assert body["choices"][0]["delta"] == {} and body["choices"][0]["arrival_time"] == 0.5
    assert json.loads(DeltaMessage(role="assistant", content="").model_dump_json()) == {
        "role": "assistant",
        "content": "",
    }


def test_model_list():
    body = ModelList(data=[ModelCard(id="m", root="/models/m", max_model_len=2048)]).model_dump()
    assert body["object"] == "list"
    assert {k: body["data"][0][k] for k in ("id", "object", "owned_by", "max_model_len")} == {
        "id": "m",
        "object": "model",
        "owned_by": "splitserve",
        "max_model_len": 2048,
    }


@pytest.mark.parametrize(
    "field, bad", [("stop_token_ids", [1, 2**70]), ("prompt", [[1, 2**70]]), ("top_k", -(2**63) - 1)]
)
def test_integers_past_64_bits_are_refused_by_name(field, bad):
    """Found by schemathesis: such integers could not be sent to the engine (a 500)."""
    message, param = rejected(completion, **{field: bad})
    assert param == field and "64-bit" in message


def test_integral_numbers_are_token_ids():
    """A JSON number such as 5.0 is the token id 5 (pydantic's ints take it too); 5.5 is not."""
    assert completion(prompt=[5.0, 6]).prompt == [5, 6]
    assert completion(prompt=[[5.0], [7]]).prompt == [[5], [7]]
    assert rejected(completion, prompt=[5.5])[1] == "prompt"
