"""Structured output's pieces without a model: the guide parameters and their request fields, the
grammars xgrammar compiles (and the errors that name what is wrong), the token bitmask the model
runner applies, and tool calling's plan, forced-call guides and their readers."""

from __future__ import annotations

import json

import pytest
import torch
import xgrammar as xgr

from splitserve.engine.core.structured_output import GuideCompiler, choice_grammar
from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.entrypoints.openai.tool_calling import plan_tools, tool_guide
from splitserve.entrypoints.openai.tool_parsers.forced import NamedToolCallParser, RequiredToolCallsParser
from splitserve.executor.sampler import apply_token_bitmask
from splitserve.sampling_params import (
    GuidedDecodingParams,
    SamplingParams,
    StructuredOutputsConfig,
    StructuredOutputsParams,
)

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
USER = [{"role": "user", "content": "Hi"}]
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    },
    {"type": "function", "function": {"name": "get_time"}},
]


@pytest.fixture(scope="module")
def compiler(smollm_tokenizer) -> GuideCompiler:
    return GuideCompiler(smollm_tokenizer, 49152)


# --- parameters --------------------------------------------------------------------------------
def test_exactly_one_guide_and_a_known_backend():
    assert GuidedDecodingParams(json=SCHEMA).json == json.dumps(SCHEMA)  # in its order: xgrammar follows it
    assert GuidedDecodingParams(choice=["a", "b"]).kind == "choice"
    for bad in ({}, {"regex": "a", "choice": ["a"]}, {"choice": []}, {"json_object": True, "backend": "outlines"}):
        with pytest.raises(ValueError):
            GuidedDecodingParams(**bad)
    assert StructuredOutputsParams is GuidedDecodingParams


def test_structured_outputs_is_guided_decoding():
    params = SamplingParams(structured_outputs=GuidedDecodingParams(regex="a+"))
    assert params.guided_decoding.regex == "a+" and params.structured_outputs is None
    assert params.reads_output_history  # the engine must know each token before the next step's mask
    with pytest.raises(ValueError):
        SamplingParams(
            guided_decoding=GuidedDecodingParams(regex="a"), structured_outputs=GuidedDecodingParams(regex="b")
        )


@pytest.mark.parametrize(
    "fields, kind",
    [
        ({"guided_json": SCHEMA}, "json"),
        ({"guided_json": json.dumps(SCHEMA)}, "json"),
        ({"guided_regex": "[0-9]+"}, "regex"),
        ({"guided_choice": ["yes", "no"]}, "choice"),
        ({"guided_grammar": 'root ::= "a"'}, "grammar"),
        ({"structured_outputs": {"json_object": True}}, "json_object"),
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}}, "json"),
        ({"response_format": {"type": "text"}}, None),
    ],
)
def test_request_fields_become_the_guide(fields, kind):
    request = CompletionRequest.model_validate({"prompt": "x", **fields})
    guide = request.to_sampling_params(8).guided_decoding
    assert (guide.kind if guide else None) == kind


def test_two_guides_are_refused_naming_the_second():
    from pydantic import ValidationError

    from splitserve.entrypoints.openai.request_model import validation_error_message

    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate(
            {"messages": USER, "guided_regex": "a", "response_format": {"type": "json_object"}}
        )
    assert validation_error_message(info.value)[1] == "response_format"


# --- compiling ---------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "guide, message",
    [
        (GuidedDecodingParams(json="{not json"), "JSON schema"),
        (GuidedDecodingParams(regex="(unclosed"), "regular expression"),
        (GuidedDecodingParams(grammar="root ::= undefined_rule"), "grammar"),
    ],
)
def test_a_guide_that_does_not_compile_names_its_kind(compiler, guide, message):
    with pytest.raises(ValueError, match=message):
        compiler.compile(guide)


def test_choices_are_the_only_sentences(compiler, smollm_tokenizer):
    choices = ['say "hi"', "naïve", "back\\slash"]
    compiled = compiler.compile(GuidedDecodingParams(choice=choices))
    for choice in choices:
        matcher = xgr.GrammarMatcher(compiled)
        assert matcher.accept_string(choice) and matcher.is_completed()
    assert not xgr.GrammarMatcher(compiled).accept_string("other")
    assert choice_grammar(["a"]) == 'root ::= "a"'


def test_whitespace_pattern_without_whitespace_gives_compact_json(compiler):
    compact = xgr.GrammarMatcher(compiler.compile(GuidedDecodingParams(json=SCHEMA, whitespace_pattern="")))
    assert not compact.accept_string('{ "name"')
    loose = xgr.GrammarMatcher(compiler.compile(GuidedDecodingParams(json=SCHEMA)))
    assert loose.accept_string('{ "name"')


def test_disable_any_whitespace_gives_one_line_json(compiler):
    compact = xgr.GrammarMatcher(compiler.compile(GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=True)))
    assert compact.accept_string('{"name": "x"}') and compact.is_completed()
    compact = xgr.GrammarMatcher(compiler.compile(GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=True)))
    assert not compact.accept_string('{\n "name"')
    free = GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=False, whitespace_pattern="")  # the flag wins
    assert xgr.GrammarMatcher(compiler.compile(free)).accept_string('{\n "name"')


def test_the_servers_whitespace_default_fills_what_the_request_left_open():
    guide = GuidedDecodingParams(json=SCHEMA)
    completed = StructuredOutputsConfig().complete(guide)
    assert completed.disable_any_whitespace is True and guide.disable_any_whitespace is None  # a copy
    assert (
        StructuredOutputsConfig.from_value('{"disable_any_whitespace": false}').complete(guide).disable_any_whitespace
        is False
    )
    for given in (
        GuidedDecodingParams(json=SCHEMA, whitespace_pattern=" *"),
        GuidedDecodingParams(json=SCHEMA, disable_any_whitespace=False),
    ):
        assert StructuredOutputsConfig().complete(given) is given
    for bad, message in (
        ('{"disable_whitespace": true}', "unknown keys"),
        ({"backend": "outlines"}, "xgrammar"),
        ({"disable_any_whitespace": "no"}, "true or false"),
    ):
        with pytest.raises(ValueError, match=message):
            StructuredOutputsConfig.from_value(bad)
    request = ChatCompletionRequest.model_validate(
        {"messages": USER, "structured_outputs": {"json": SCHEMA, "disable_any_whitespace": False}}
    )
    assert request.guided_decoding_params().disable_any_whitespace is False


# --- the bitmask -------------------------------------------------------------------------------
def test_bitmask_matches_xgrammars_own(compiler):
    matcher = xgr.GrammarMatcher(compiler.compile(GuidedDecodingParams(json=SCHEMA)))
    matcher.accept_string('{"name": "Ab')
    bitmask = xgr.allocate_token_bitmask(1, 49152)
    matcher.fill_next_token_bitmask(bitmask, 0)
    logits = torch.randn(3, 49152, generator=torch.Generator().manual_seed(0))
    expected = logits.clone()
    xgr.apply_token_bitmask_inplace(expected[1:2], bitmask)
    apply_token_bitmask(logits, torch.tensor([1]), bitmask)
    assert torch.equal(logits, expected)
    assert torch.isfinite(logits[0]).all() and 0 < torch.isfinite(logits[1]).sum() < 49152


# --- tool calling ------------------------------------------------------------------------------
def _chat(**fields) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": USER, "tools": TOOLS, **fields})


def test_tool_plans():
    assert plan_tools(ChatCompletionRequest.model_validate({"messages": USER}), True, "hermes").mode == "none"
    assert plan_tools(_chat(tool_choice="none"), True, "hermes").mode == "none"
    assert plan_tools(_chat(), False, None).mode == "none"  # auto needs the server's flags
    assert plan_tools(_chat(), True, "hermes").mode == "auto"
    assert plan_tools(_chat(tool_choice="required"), False, None).mode == "required"
    named = plan_tools(_chat(tool_choice={"type": "function", "function": {"name": "get_time"}}), False, None)
    assert (named.mode, named.function) == ("named", "get_time")
    with pytest.raises(APIError, match="enable-auto-tool-choice"):
        plan_tools(_chat(tool_choice="auto"), False, None)


def test_required_tool_guide_schema():
    request = _chat(tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(tool_guide(request, plan_tools(request, False, None)).json)
    assert schema["minItems"] == 1 and schema["maxItems"] == 1
    names = [item["properties"]["name"]["enum"] for item in schema["items"]["anyOf"]]
    assert names == [["get_weather"], ["get_time"]]


@pytest.mark.parametrize("chunk", [1, 3, 1000])
def test_forced_call_readers_stream_what_they_extract(chunk):
    text = '[{"name": "get_weather", "parameters": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]'
    for parser_class, output in [(RequiredToolCallsParser, text), (NamedToolCallParser, '{"city": "Oslo"}')]:
        make = (
            (lambda c=parser_class: c())
            if parser_class is RequiredToolCallsParser
            else (lambda c=parser_class: c("get_weather"))
        )
        whole = make().extract_tool_calls(output)
        streamed, parser, sent = {}, make(), ""
        for start in range(0, len(output), chunk):
            delta = output[start : start + chunk]
            result = parser.extract_streaming(sent, sent + delta, delta, final=start + chunk >= len(output))
            sent += delta
            for call in result.tool_calls if result else []:
                entry = streamed.setdefault(call.index, {"name": None, "arguments": ""})
                entry["name"] = entry["name"] or (call.function.name if call.function else None)
                entry["arguments"] += (call.function.arguments or "") if call.function else ""
        assert whole.tools_called and whole.content is None
        assert [(c.function.name, c.function.arguments) for c in whole.tool_calls] == [
            (e["name"], e["arguments"]) for _, e in sorted(streamed.items())
        ]
