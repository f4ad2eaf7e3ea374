"""Tool-call parsers (hermes, llama3_json, mistral, pythonic): whole outputs read into OpenAI tool
calls, and streamed deltas that, however the output is cut, add up to the whole-output result:
the same content, the same names and the very same arguments strings."""

from __future__ import annotations

import json
import random
import re

import pytest

from splitserve.entrypoints.openai.tool_parsers import (
    TOOL_PARSERS,
    DeltaFunctionCall,
    DeltaToolCall,
    FunctionCall,
    ToolCall,
    get_tool_parser,
)


def args(**values) -> str:
    return json.dumps(values, ensure_ascii=False)


WEATHER = ("get_weather", args(city="Paris", unit="c"))
TIME = ("get_time", "{}")
UNICODE = ("lookup", args(city="Zürich", emoji="😀", cjk="東京", escaped="é😀"))

# (parser, text, content, [(name, arguments)]): outputs that are tool calls, or plain text.
CASES = [
    ("hermes", "The weather is nice today.", "The weather is nice today.", []),
    ("hermes", "a < b, <tool> and <tool_c", "a < b, <tool> and <tool_c", []),
    (
        "hermes",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>',
        None,
        [WEATHER],
    ),
    (
        "hermes",
        'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n'
        '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>',
        "Let me check.\n",
        [WEATHER, TIME],
    ),
    ("hermes", '<tool_call>\n{"name": "get_time"}', None, [TIME]),
    (
        "hermes",
        '<tool_call>{"name":"f","arguments":{"a" :1.50,"b":[ true,null ],"c":"x\\ny \\"q\\"","d":{"e":-2e3}}}',
        None,
        [("f", args(a=1.5, b=[True, None], c='x\ny "q"', d={"e": -2000.0}))],
    ),
    (
        "hermes",
        '<tool_call>\n{"name": "lookup", "arguments": {"city": "Zürich", "emoji": "😀", "cjk": "東京", '
        '"escaped": "\\u00e9\\ud83d\\ude00"}}\n</tool_call>',
        None,
        [UNICODE],
    ),
    (
        "hermes",
        '<tool_call>\n{"arguments": {"text": "</tool_call> <tool_call> {}"}, "name": "echo"}\n</tool_call>',
        None,
        [("echo", args(text="</tool_call> <tool_call> {}"))],
    ),
    ("llama3_json", "Hello! How can I help?", "Hello! How can I help?", []),
    ("llama3_json", "<b>bold</b> text", "<b>bold</b> text", []),
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}',
        None,
        [WEATHER],
    ),
    (
        "llama3_json",
        '\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}};'
        ' {"name": "get_time", "parameters": {}}',
        None,
        [WEATHER, TIME],
    ),
    (
        "llama3_json",
        '{"type": "function", "name": "lookup", "parameters": {"city": "Zürich", "emoji": "😀", "cjk": "東京", '
        '"escaped": "\\u00e9\\ud83d\\ude00"}};',
        None,
        [UNICODE],
    ),
    ("mistral", "No tools needed: see [1] and [TOOL] docs.", "No tools needed: see [1] and [TOOL] docs.", []),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}]',
        None,
        [WEATHER],
    ),
    (
        "mistral",
        'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}},\n'
        '{"name": "get_time", "arguments": {}}]',
        "Sure.",
        [WEATHER, TIME],
    ),
    (
        "mistral",
        '[TOOL_CALLS][{"name": "lookup", "arguments": {"city": "Zürich", "emoji": "😀", "cjk": "東京", '
        '"escaped": "\\u00e9\\ud83d\\ude00"}}]',
        None,
        [UNICODE],
    ),
    ("pythonic", "The answer is 42.", "The answer is 42.", []),
    ("pythonic", "[get_weather(city='Paris', unit=\"c\")]", None, [WEATHER]),
    (
        "pythonic",
        "[get_weather(city='Paris', unit='c'),\n get_time(),"
        " f(a=-1, b=2.5, c=True, d=None, e=[1, 'x'], g={'k': [False]})]",
        None,
        [WEATHER, TIME, ("f", args(a=-1, b=2.5, c=True, d=None, e=[1, "x"], g={"k": [False]}))],
    ),
    (
        "pythonic",
        "  [lookup(city='Zürich', emoji='😀', cjk='東京', escaped='\\u00e9\\U0001F600')]\n",
        None,
        [UNICODE],
    ),
    ("pythonic", "[f(s='a)b]c', t=\"it's\", u='''x\ny''')]", None, [("f", args(s="a)b]c", t="it's", u="x\ny"))]),
]

# Outputs that start like tool calls but are not: all of the text is content.
MALFORMED = [
    ("hermes", "<tool_call>\nnot json\n</tool_call>"),
    ("hermes", 'Check: <tool_call>\n{"name": "f", "arguments": {"a": 1}'),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'),
    ("hermes", '<tool_call>\n{"name": "f", "arguments": {"a": tru}}\n</tool_call>'),
    ("hermes", "<tool_call>"),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}'),
    ("llama3_json", "{not json}"),
    ("llama3_json", '<|python_tag|>brave_search.call(query="x")'),
    ("llama3_json", '{"name": "f", "parameters": {}} and then some text'),
    ("llama3_json", 'Sure: {"name": "f", "parameters": {}}'),
    ("mistral", "[TOOL_CALLS]not json"),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {}}'),
    ("mistral", "[TOOL_CALLS][]"),
    ("mistral", '[TOOL_CALLS]{"name": "f", "arguments": {}}'),
    ("mistral", "[TOOL_CALLS][1, 2]"),
    ("pythonic", "[get_weather(city=paris)]"),
    ("pythonic", "[f(1)]"),
    ("pythonic", "[f(**kw)]"),
    ("pythonic", "Sure: [f()]"),
    ("pythonic", "[f()] done"),
    ("pythonic", "[1, 2, 3]"),
    ("pythonic", "[f(a=1)"),
    ("pythonic", "[f(a=1+2)]"),
    ("pythonic", "[f(a={1: 2})]"),
    ("pythonic", "[f(a=(1, 2))]"),
    ("pythonic", "[os.system(cmd='x')]"),
    ("pythonic", "[f(a=1),]"),
]


@pytest.mark.parametrize("parser, text, content, calls", CASES)
def test_whole_output(parser, text, content, calls):
    result = get_tool_parser(parser).extract_tool_calls(text)
    assert result.tools_called == bool(calls)
    assert result.content == content
    assert [(call.function.name, call.function.arguments) for call in result.tool_calls] == calls


@pytest.mark.parametrize("parser, text", MALFORMED)
def test_malformed_output_is_content(parser, text):
    result = get_tool_parser(parser).extract_tool_calls(text)
    assert (result.tools_called, result.tool_calls, result.content) == (False, [], text)


@pytest.mark.parametrize("parser, text", [(parser, text) for parser, text, _, calls in CASES if len(calls) > 1])
def test_ids(parser, text):
    """vLLM's "chatcmpl-tool-<hex>", except Mistral's 9 letters and digits; distinct in a response."""
    ids = [call.id for call in get_tool_parser(parser).extract_tool_calls(text).tool_calls]
    id_form = r"[A-Za-z0-9]{9}" if parser == "mistral" else r"chatcmpl-tool-[0-9a-f]{32}"
    assert all(re.fullmatch(id_form, id_) for id_ in ids) and len(set(ids)) == len(ids)


def test_models_dump_as_openai():
    call = ToolCall(function=FunctionCall(name="f", arguments="{}"))
    assert call.model_dump(exclude={"id"}) == {"type": "function", "function": {"name": "f", "arguments": "{}"}}
    piece = DeltaToolCall(index=1, function=DeltaFunctionCall(arguments='{"a'))
    assert piece.model_dump() == {"index": 1, "function": {"arguments": '{"a'}}
    assert json.loads(DeltaToolCall(index=0).model_dump_json()) == {"index": 0}


def test_registry():
    assert set(TOOL_PARSERS) == {"hermes", "llama3_json", "mistral", "pythonic"}
    tokenizer = object()
    parser = get_tool_parser("hermes", tokenizer)
    assert parser.tokenizer is tokenizer and parser is not get_tool_parser("hermes")
    assert get_tool_parser("mistral").needs_special_tokens and not get_tool_parser("pythonic").needs_special_tokens
    with pytest.raises(ValueError, match="hermes, llama3_json, mistral, pythonic"):
        get_tool_parser("granite")


# --- streaming -------------------------------------------------------------------------------
TOKEN_LIKE = re.compile(r"<\|\w+\|>|</?\w+>|\[TOOL_CALLS\]| ?\w+| ?[^\w\s]+|\s+")


def random_split(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def chunkings(text: str) -> dict[str, list[str]]:
    tokens = TOKEN_LIKE.findall(text)
    assert "".join(tokens) == text
    return {
        "whole": [text],
        "chars": list(text),
        "threes": [text[i : i + 3] for i in range(0, len(text), 3)],
        "tokens": tokens,
        "tokens+empty final": [*tokens, ""],
        **{f"random{seed}": random_split(text, seed) for seed in range(6)},
    }


def stream(parser_name: str, chunks: list[str]):
    """Feeds the chunks as a server would; returns the content, the calls reassembled by index, the
    number of argument pieces per call and whether content came after a call started."""
    parser = get_tool_parser(parser_name)
    previous, content, calls, pieces, content_after_calls = "", "", {}, {}, False
    for i, chunk in enumerate(chunks):
        current = previous + chunk
        result = parser.extract_streaming(previous, current, chunk, final=i == len(chunks) - 1)
        previous = current
        if result is None:
            continue
        assert result.content or result.tool_calls
        content += result.content or ""
        content_after_calls |= bool(calls and result.content)
        for delta in result.tool_calls:
            merge(calls, delta)
            pieces[delta.index] = pieces.get(delta.index, 0) + bool(delta.function.arguments)
    assert parser.tools_streamed == bool(calls)
    return content, calls, pieces, content_after_calls


def merge(calls: dict[int, dict], delta: DeltaToolCall) -> None:
    """A call's first delta carries its id, type and whole name; later ones arguments only."""
    if delta.index not in calls:
        assert delta.index == len(calls)
        assert delta.id and delta.type == "function" and delta.function.name
        calls[delta.index] = {"id": delta.id, "name": delta.function.name, "arguments": delta.function.arguments}
    else:
        assert (delta.id, delta.type, delta.function.name) == (None, None, None)
        calls[delta.index]["arguments"] += delta.function.arguments


def stream_cases():
    for number, (parser, text, _, _) in enumerate(CASES):
        for name, chunks in chunkings(text).items():
            yield pytest.param(parser, text, chunks, id=f"{parser}-{number}-{name}")


@pytest.mark.parametrize("parser, text, chunks", stream_cases())
def test_stream_adds_up_to_the_whole_output(parser, text, chunks):
    expected = get_tool_parser(parser).extract_tool_calls(text)
    content, calls, _, content_after_calls = stream(parser, chunks)
    assert content == (expected.content or "")
    assert [(c["name"], c["arguments"]) for c in calls.values()] == [
        (call.function.name, call.function.arguments) for call in expected.tool_calls
    ]
    assert len({c["id"] for c in calls.values()}) == len(calls)
    id_form = r"[A-Za-z0-9]{9}" if parser == "mistral" else r"chatcmpl-tool-[0-9a-f]{32}"
    assert all(re.fullmatch(id_form, c["id"]) for c in calls.values())
    assert not content_after_calls


@pytest.mark.parametrize("parser, text", MALFORMED)
@pytest.mark.parametrize("split", ["chars", "tokens", "random3"])
def test_stream_of_malformed_output_sends_it_all_as_content(parser, text, split):
    content, _, _, _ = stream(parser, chunkings(text)[split])
    assert content == text


@pytest.mark.parametrize("parser", ["hermes", "llama3_json", "mistral"])
def test_json_arguments_stream_as_they_are_written(parser):
    text = next(text for name, text, _, calls in CASES if name == parser and calls == [UNICODE])
    _, calls, pieces, _ = stream(parser, list(text))
    assert calls[0]["arguments"] == UNICODE[1]
    assert pieces[0] > 20


def test_content_streams_before_the_calls():
    parser = get_tool_parser("hermes")
    assert parser.extract_streaming("", "Let me", "Let me").content == "Let me"
    assert parser.extract_streaming("Let me", "Let me <tool", " <tool").content == " "
    assert parser.extract_streaming("Let me <tool", "Let me <tool_call>", "_call>") is None
    result = parser.extract_streaming("Let me <tool_call>", 'Let me <tool_call>{"name": "f"', '{"name": "f"')
    assert result.content is None and result.tool_calls[0].function.name == "f"


def test_a_held_back_tag_start_is_released_at_the_end():
    parser = get_tool_parser("mistral")
    assert parser.extract_streaming("", "see [TOOL", "see [TOOL").content == "see "
    assert parser.extract_streaming("see [TOOL", "see [TOOL", "", final=True).content == "[TOOL"


def test_whole_extraction_leaves_a_stream_alone():
    text = CASES[3][1]
    parser = get_tool_parser("hermes")
    half = len(text) // 2
    first = parser.extract_streaming("", text[:half], text[:half])
    assert parser.extract_tool_calls(text).tools_called
    second = parser.extract_streaming(text[:half], text, text[half:], final=True)
    names = [d.function.name for r in (first, second) for d in r.tool_calls if d.function.name]
    assert names == ["get_weather", "get_time"]


# --- random outputs: any formatting the model may choose streams to the whole-output result ---
PIECES = [
    "a",
    "Z",
    " ",
    '"',
    "'",
    "\\",
    "\n",
    "\t",
    "\x01",
    "é",
    "😀",
    "東",
    "{",
    "}",
    "[",
    "]",
    ",",
    ":",
    "(",
    ")",
    "'''",
]


def random_string(rng: random.Random) -> str:
    return "".join(rng.choice(PIECES) for _ in range(rng.randint(0, 6)))


def random_value(rng: random.Random, depth: int = 0):
    kinds = ["str", "int", "float", "const", "list", "dict"][: 6 if depth < 2 else 4]
    kind = rng.choice(kinds)
    if kind == "list":
        return [random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))]
    if kind == "dict":
        return {random_string(rng): random_value(rng, depth + 1) for _ in range(rng.randint(0, 3))}
    return {
        "str": lambda: random_string(rng),
        "int": lambda: rng.randint(-(10**6), 10**6),
        "float": lambda: rng.choice([0.1, -2.5e-7, 1e22, 123456.789]),
        "const": lambda: rng.choice([True, False, None]),
    }[kind]()


def json_output(parser: str, calls: list[tuple[str, dict]], rng: random.Random) -> str:
    """The calls written as `parser`'s format expects, in a random JSON style."""
    style = {
        "ensure_ascii": rng.random() < 0.5,
        "indent": rng.choice([None, 2]),
        "separators": rng.choice([None, (",", ":")]),
    }
    key = rng.choice(["parameters", "arguments"]) if parser == "llama3_json" else "arguments"
    objects = [f'{{"name": {json.dumps(name)}, "{key}": {json.dumps(values, **style)}}}' for name, values in calls]
    if parser == "hermes":
        return rng.choice(["", "Sure! "]) + "\n".join(f"<tool_call>\n{o}\n</tool_call>" for o in objects)
    if parser == "llama3_json":
        return rng.choice(["", "<|python_tag|>"]) + "; ".join(objects)
    return rng.choice(["", "ok "]) + "[TOOL_CALLS][" + ", ".join(objects) + "]"


def python_literal(value, rng: random.Random) -> str:
    if isinstance(value, str) and rng.random() < 0.5:
        quote = rng.choice(['"', "'''", '"""'])
        body = value.encode("unicode_escape").decode("ascii")
        return quote + body.replace(quote[0], "\\" + quote[0]) + quote
    if isinstance(value, list):
        return "[" + ", ".join(python_literal(v, rng) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{python_literal(k, rng)}: {python_literal(v, rng)}" for k, v in value.items()) + "}"
    return repr(value)


def pythonic_output(calls: list[tuple[str, dict]], rng: random.Random) -> str:
    written = [
        f"{name}(" + ", ".join(f"{k}={python_literal(v, rng)}" for k, v in values.items()) + ")"
        for name, values in calls
    ]
    return "[" + rng.choice([", ", ",\n  "]).join(written) + "]"


@pytest.mark.parametrize("parser", sorted(TOOL_PARSERS))
@pytest.mark.parametrize("seed", range(40))
def test_random_outputs(parser, seed):
    rng = random.Random(seed)
    calls = [
        (f"fn_{i}", {f"k{j}": random_value(rng) for j in range(rng.randint(0, 3))}) for i in range(rng.randint(1, 3))
    ]
    text = pythonic_output(calls, rng) if parser == "pythonic" else json_output(parser, calls, rng)
    expected = [(name, json.dumps(values, ensure_ascii=False)) for name, values in calls]
    whole = get_tool_parser(parser).extract_tool_calls(text)
    assert [(call.function.name, call.function.arguments) for call in whole.tool_calls] == expected
    for chunks in (list(text), random_split(text, seed)):
        content, streamed, _, _ = stream(parser, chunks)
        assert content == (whole.content or "")
        assert [(c["name"], c["arguments"]) for c in streamed.values()] == expected
