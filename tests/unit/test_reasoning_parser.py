"""Reasoning parsers: whole-text splits for both parsers, and streaming over every way of cutting a
text into deltas gives the same split without ever emitting part of a tag."""

from __future__ import annotations

import pytest

from splitserve.entrypoints.openai.reasoning import REASONING_PARSERS, get_reasoning_parser, parser_for_model

DEEPSEEK = get_reasoning_parser("deepseek_r1")
QWEN3 = get_reasoning_parser("qwen3")
ERNIE = get_reasoning_parser("ernie45")


@pytest.mark.parametrize(
    "text, expected",
    [
        ("Let me think.</think>The answer is 4.", ("Let me think.", "The answer is 4.")),
        ("<think>Repeated tag.</think>Answer", ("Repeated tag.", "Answer")),
        ("still thinking, no end", ("still thinking, no end", None)),
        ("</think>Direct answer", (None, "Direct answer")),
        ("All reasoning</think>", ("All reasoning", None)),
        ("a < b and c </thing>", ("a < b and c </thing>", None)),
        ("r</think>x</think>y", ("r", "x</think>y")),
        ("", (None, None)),
    ],
)
def test_deepseek_r1_whole_text(text, expected):
    assert DEEPSEEK.extract(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<think>Hmm.</think>\n\nHello!", ("Hmm.", "\n\nHello!")),
        ("Hello, no thinking here.", (None, "Hello, no thinking here.")),
        ("<think></think>Answer", (None, "Answer")),
        ("<think>unterminated", ("unterminated", None)),
        ("Intro <think>x</think> y", (None, "Intro <think>x</think> y")),
        ("</think>stray end", (None, "</think>stray end")),
        ("<thi", (None, "<thi")),
    ],
)
def test_qwen3_whole_text(text, expected):
    assert QWEN3.extract(text) == expected


@pytest.mark.parametrize(
    "text, expected",
    [
        ("abc\n</think>\n\n<response>\ndef\n</response>\n", ("abc\n", "def")),
        ("abc</think>def", ("abc", "def")),
        ("abc\n</think>\ndef", ("abc\n", "def")),
        ("<think>abc</think>\n<response>\na\nb\n</response>", ("abc", "a\nb")),
        ("still thinking", ("still thinking", None)),
        ("r</think>\n\n<response>\nunfinished", ("r", "unfinished")),
        ("r</think><respons", ("r", "<respons")),
        ("r</think>x <response> y", ("r", "x <response> y")),
    ],
)
def test_ernie45_whole_text(text, expected):
    assert ERNIE.extract(text) == expected


@pytest.mark.parametrize(
    "model_type, template, expected",
    [
        ("ernie4_5_moe", "{{ x }}<think>\n{{ y }}</think>", "ernie45"),
        ("ernie4_5", "{{ x }}</think>", "ernie45"),
        ("qwen3", "{% if thinking %}<think>\n\n</think>{% endif %}", "qwen3"),
        ("qwen3", "{{ messages }}", None),  # the template does not think
        ("llama", "{{ x }}</think>", None),  # a family without a known parser
        ("qwen3", None, None),
    ],
)
def test_parser_for_model(model_type, template, expected):
    assert parser_for_model(model_type, template) == expected


def test_unknown_parser_lists_the_known_names():
    assert set(REASONING_PARSERS) == {"deepseek_r1", "qwen3", "ernie45"}
    with pytest.raises(ValueError, match="deepseek_r1.*qwen3"):
        get_reasoning_parser("granite")


# --- streaming -------------------------------------------------------------------------------
# Texts whose bodies hold no angle brackets, so any '<' or '>' in a delta would be a tag fragment.
CLEAN_TEXTS = {
    "deepseek_r1": [
        "Let me think.</think>The answer is 4.",
        "<think>ab</think>cd",
        "no end at all",
        "</think>x",
        "reason</think>",
        "r</think>\n\nc",
    ],
    "qwen3": ["<think>Hmm.</think>\n\nHello!", "<think></think>A", "plain content", "<think>open", "<think>r</think>"],
    "ernie45": [
        "abc\n</think>\n\n<response>\ndef\n</response>\n",
        "abc</think>def",
        "abc\n</think>\ndef",
        "r</think>\n\n<response>\nopen",
        "still thinking",
    ],
}
# Texts with '<' in the bodies or tags that never complete: streaming must still add up.
TRICKY_TEXTS = {
    "deepseek_r1": [
        "a < b </thinking> c </think> x < y",
        "ends with </thi",
        "<thi",
        "<",
        "</think></think>",
        "<think",
        "x</think>y<think>z",
    ],
    "qwen3": [
        "<think>a < b</think>c <think> d",
        "<thi",
        "<think>ends with </th",
        "<",
        "Intro <think>x</think>",
        "<think>x</think></think>",
    ],
    "ernie45": [
        "r</think><respons",
        "r</think>x <response> y",
        "r</think>\n<response>a\n</resp",
        "r</think><response>\n\n</response>tail",
        "r</think>\n\n",
        "a</think><response>",
    ],
}


def stream(parser, deltas: list[str]) -> tuple[list[str], list[str]]:
    """The reasoning and content deltas emitted for `deltas`, the last one sent with final=True."""
    reasoning, content, previous = [], [], ""
    for i, delta in enumerate(deltas):
        r, c = parser.extract_delta(previous, delta, final=i == len(deltas) - 1)
        reasoning += [r] if r is not None else []
        content += [c] if c is not None else []
        previous += delta
    return reasoning, content


def cuttings(text: str) -> list[list[str]]:
    """Every 2-way split (empty ends included), and char by char."""
    return [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text) or [""]]


def cases(texts: dict[str, list[str]]):
    return [(name, text) for name, group in texts.items() for text in group]


@pytest.mark.parametrize("name, text", cases(CLEAN_TEXTS) + cases(TRICKY_TEXTS))
def test_streamed_deltas_add_up_to_the_whole_text_split(name, text):
    parser = get_reasoning_parser(name)
    expected = tuple(part or "" for part in parser.extract(text))
    for deltas in cuttings(text):
        reasoning, content = stream(parser, deltas)
        assert ("".join(reasoning), "".join(content)) == expected, deltas
        assert "" not in reasoning + content  # empty deltas are reported as None


@pytest.mark.parametrize("name, text", cases(CLEAN_TEXTS))
def test_no_delta_carries_a_tag_fragment(name, text):
    parser = get_reasoning_parser(name)
    for deltas in cuttings(text):
        for piece in sum(stream(parser, deltas), []):
            assert "<" not in piece and ">" not in piece, (deltas, piece)


def test_partial_end_tag_is_held_until_resolved():
    assert DEEPSEEK.extract_delta("abc", "</thi") == (None, None)
    assert DEEPSEEK.extract_delta("abc</thi", "nk>The") == (None, "The")
    assert DEEPSEEK.extract_delta("abc</thi", "s is") == ("</this is", None)


def test_final_delta_releases_a_held_tag_start():
    assert QWEN3.extract_delta("", "<thi") == (None, None)
    assert QWEN3.extract_delta("<thi", "", final=True) == (None, "<thi")
    assert DEEPSEEK.extract_delta("x", "</th", final=True) == ("</th", None)


class _CharTokenizer:
    """One token per character, and </think> as one token (id 1000), as thinking models have it."""

    def encode(self, text, add_special_tokens=False):
        ids, i = [], 0
        while i < len(text):
            if text.startswith("</think>", i):
                ids.append(1000)
                i += len("</think>")
            else:
                ids.append(ord(text[i]))
                i += 1
        return ids


@pytest.mark.parametrize(
    "parser, text, expected",
    [
        ("deepseek_r1", "ab</think>cd", 3),  # a, b and </think>
        ("deepseek_r1", "abc", 3),  # no </think> yet: all reasoning
        ("qwen3", "<think>ab</think>cd", 10),  # <think> is 7 characters here, then a, b, </think>
        ("qwen3", "plain answer", 0),
    ],
)
def test_reasoning_tokens_are_counted_up_to_the_end_tag(parser, text, expected):
    from splitserve.entrypoints.openai.serving_chat import OpenAIServingChat

    serving = object.__new__(OpenAIServingChat)
    serving.tokenizer = _CharTokenizer()
    serving.reasoning = get_reasoning_parser(parser)
    serving._think_end_id = serving._single_token_id("</think>")
    assert serving._think_end_id == 1000
    assert serving._reasoning_tokens(serving.tokenizer.encode(text), text) == expected
