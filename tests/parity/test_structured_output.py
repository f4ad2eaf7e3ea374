"""Structured output through the engine: with a random-weight model (whose free outputs are noise)
every guided output still parses and validates, for every kind of guide, batched with unguided
requests (whose tokens the guided ones must not change), with n > 1, and with overlap scheduling."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from splitserve import LLM, GuidedDecodingParams, SamplingParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "armor": {"enum": ["leather", "chainmail", "plate"]},
        "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3},
    },
    "required": ["name", "age", "armor", "tags"],
}
REGEX = r"[A-Z][a-z]{2,5}-\d{3}"
CHOICES = ["red", "green", "blue"]
GRAMMAR = 'root ::= "(" item ("," item)? ")"\nitem ::= [a-c] | [0-9]'
PROMPTS = ["Describe a knight:", "Pick a colour", "Write something", "Hello"]


@pytest.fixture(scope="module")
def llm(tiny_chat_model) -> LLM:
    return LLM(tiny_chat_model, dtype="float32", max_model_len=256, use_tqdm_on_load=False)


def _generate(llm: LLM, guide: GuidedDecodingParams | None, n: int = 1, seed: int = 0) -> list[str]:
    params = SamplingParams(temperature=1.0, seed=seed, n=n, max_tokens=120, guided_decoding=guide)
    outputs = [c for o in llm.generate(PROMPTS, params, use_tqdm=False) for c in o.outputs]
    assert all(c.finish_reason == "stop" for c in outputs)  # ended by the grammar, not cut by max_tokens
    return [c.text for c in outputs]


def test_json_schema_outputs_validate(llm):
    # Compact JSON: a random model would otherwise fill the free whitespace until max_tokens.
    outputs = _generate(llm, GuidedDecodingParams(json=SCHEMA, whitespace_pattern=""), n=2)
    assert len(outputs) == 8
    for text in outputs:
        jsonschema.validate(json.loads(text), SCHEMA)


def test_regex_choice_and_grammar_outputs_match(llm):
    assert all(re.fullmatch(REGEX, t) for t in _generate(llm, GuidedDecodingParams(regex=REGEX)))
    assert all(t in CHOICES for t in _generate(llm, GuidedDecodingParams(choice=CHOICES), n=3))
    assert all(
        re.fullmatch(r"\([a-c0-9](,[a-c0-9])?\)", t) for t in _generate(llm, GuidedDecodingParams(grammar=GRAMMAR))
    )


def test_guided_requests_leave_the_others_alone(llm):
    """A batch mixing guided and free requests: the free ones get the tokens they get alone."""
    free = SamplingParams(temperature=0, max_tokens=20)
    alone = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, free, use_tqdm=False)]
    guided = SamplingParams(temperature=0, max_tokens=20, guided_decoding=GuidedDecodingParams(choice=CHOICES))
    mixed = llm.generate(PROMPTS * 2, [free] * 4 + [guided] * 4, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in mixed[:4]] == alone
    assert all(o.outputs[0].text in CHOICES for o in mixed[4:])


def test_overlap_scheduling_gives_the_same_guided_outputs(tiny_chat_model, llm):
    overlap = LLM(tiny_chat_model, dtype="float32", max_model_len=256, use_tqdm_on_load=False, async_scheduling=True)
    guide = GuidedDecodingParams(json=SCHEMA, whitespace_pattern="")
    assert _generate(overlap, guide, seed=3) == _generate(llm, guide, seed=3)


@pytest.mark.slow  # loads the default model
def test_the_default_model_fills_the_knight_schema(default_gguf):
    """The Ascend guide's guided_json example, offline, on the embedded model at temperature 0."""
    schema = {
        "title": "Character",
        "type": "object",
        "properties": {
            "name": {"title": "Name", "maxLength": 10, "type": "string"},
            "age": {"title": "Age", "type": "integer"},
            "armor": {"$ref": "#/definitions/Armor"},
            "weapon": {"$ref": "#/definitions/Weapon"},
            "strength": {"title": "Strength", "type": "integer"},
        },
        "required": ["name", "age", "armor", "weapon", "strength"],
        "definitions": {
            "Armor": {"enum": ["leather", "chainmail", "plate"], "type": "string"},
            "Weapon": {"enum": ["sword", "axe", "mace", "spear", "bow", "crossbow"], "type": "string"},
        },
    }
    prompt = (
        "Meet our valorous character, named Knight, who has reached the age of 32. Clad in impenetrable plate "
        "armor, Knight is well-prepared for any battle. Armed with a trusty sword and boasting a strength score "
        "of 90, this character stands as a formidable warrior on the field.Please provide details for this "
        "character, including their Name, Age, preferred Armor, Weapon, and Strength"
    )
    llm = LLM(default_gguf, max_model_len=512, use_tqdm_on_load=False)
    params = SamplingParams(temperature=0, max_tokens=200, guided_decoding=GuidedDecodingParams(json=schema))
    answer = json.loads(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].text)
    jsonschema.validate(answer, schema)
    assert answer["name"] == "Knight" and answer["age"] == 32
