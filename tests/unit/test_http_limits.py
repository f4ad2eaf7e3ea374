"""The JSON body limits the server and the PD router share (entrypoints/http.py): hostile bodies get
a 400 or 413 with OpenAI's error body, never a 500, and quickly."""

from __future__ import annotations

import time

import pytest

from splitserve.entrypoints import http
from splitserve.entrypoints.http import APIError, parse_json_object


def _refused(data: bytes) -> APIError:
    with pytest.raises(APIError) as info:
        parse_json_object(data)
    return info.value


@pytest.mark.parametrize(
    "data, status, words",
    [
        (b"[" * 10_000 + b"]" * 10_000, 400, "deeper than 64"),  # the parser's own limit
        (b'{"a": ' + b"[" * 100 + b"]" * 100 + b"}", 400, "deeper than 64"),  # past ours
        (b'{"prompt": "\xff\xfe"}', 400, "not valid UTF-8"),
        (b'{"prompt": ', 400, "not valid JSON"),
        (b"[1, 2]", 400, "must be a JSON object"),
        (b'{"p": [' + b"0," * (1 << 20) + b"0]}", 413, "more than 1048576 items"),
        (b'{"p": "' + b"x" * ((4 << 20) + 1) + b'"}', 413, "longer than 4194304 characters"),
        (b'{"' + b"x" * ((4 << 20) + 1) + b'": 1}', 413, "longer than"),  # a key is a string too
    ],
)
def test_hostile_bodies_are_refused(data, status, words):
    start = time.monotonic()
    error = _refused(data)
    assert error.status == status and words in error.message
    assert time.monotonic() - start < 5


def test_bodies_at_the_limits_are_accepted(monkeypatch):
    deep = b'{"a": ' + b"[" * 62 + b"]" * 62 + b"}"  # the object is level 1, the arrays 2..63
    assert parse_json_object(deep)["a"]
    monkeypatch.setattr(http, "MAX_JSON_OBJECT_KEYS", 3)
    assert len(parse_json_object(b'{"a": 1, "b": 2, "c": 3}')) == 3
    assert _refused(b'{"a": 1, "b": 2, "c": 3, "d": 4}').status == 413
