"""llama.cpp's per-request `timings` (entrypoints/openai/timings.py) from a request's times, the
stream's last chunk waiting for every prompt's, and the request fields that ask for them
(tests/e2e/test_load_signals.py reads them from a server)."""

from __future__ import annotations

import pytest

from splitserve.entrypoints.http import APIError
from splitserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest
from splitserve.entrypoints.openai.request_model import parse_request
from splitserve.entrypoints.openai.timings import StreamTimings, request_timings
from splitserve.outputs import CompletionOutput, RequestMetrics, RequestOutput


def _output(prompt_len, cached, generated, arrival, scheduled, first, finished) -> RequestOutput:
    metrics = RequestMetrics(arrival, scheduled, first, finished, finished)
    done = CompletionOutput(0, "x", [1] * generated, None, None, "length")
    return RequestOutput("r", None, [0] * prompt_len, None, [done], True, cached, metrics, None, generated)


def test_request_timings_are_llama_cpps_plus_queue_and_ttft():
    timings = request_timings([_output(10, 4, 5, 1.0, 1.5, 1.6, 2.1)])
    assert timings.cache_n == 4 and timings.prompt_n == 6 and timings.predicted_n == 5
    assert timings.queue_ms == pytest.approx(500) and timings.prompt_ms == pytest.approx(100)
    assert timings.ttft_ms == pytest.approx(600) and timings.predicted_ms == pytest.approx(500)
    assert timings.total_ms == pytest.approx(1100)
    assert timings.prompt_per_token_ms == pytest.approx(100 / 6) and timings.prompt_per_second == pytest.approx(60)
    assert timings.predicted_per_token_ms == pytest.approx(100) and timings.predicted_per_second == pytest.approx(10)
    one = request_timings([_output(3, 0, 1, 1.0, 1.0, 1.2, 1.2)])  # one token: no decode time, no rate
    assert one.predicted_ms == 0 and one.predicted_per_second == 0.0 and one.predicted_per_token_ms == 0.0
    both = request_timings([_output(10, 4, 5, 1.0, 1.5, 1.6, 2.1), _output(8, 0, 5, 1.0, 1.1, 1.3, 2.5)])
    assert both.prompt_n == 14 and both.predicted_n == 10 and both.ttft_ms == pytest.approx(300)
    assert both.total_ms == pytest.approx(1500) and both.queue_ms == pytest.approx(100)
    assert request_timings([RequestOutput("r", None, [0], None, [], True)]) is None  # not timed


def test_stream_timings_wait_for_every_stream():
    timed = StreamTimings(True, 2)
    running = _output(3, 0, 1, 1.0, 1.1, 1.2, None)
    running.finished = False
    assert not timed.add(0, running) and timed.timings() is None
    assert not timed.add(0, _output(3, 0, 2, 1.0, 1.1, 1.2, 1.5))
    assert timed.add(1, _output(3, 0, 2, 1.0, 1.1, 1.2, 1.6)) and timed.timings().predicted_n == 4
    off = StreamTimings(False, 1)
    assert not off.add(0, _output(3, 0, 2, 1.0, 1.1, 1.2, 1.5)) and off.timings() is None


def test_timings_request_fields():
    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    for body, default, wanted in (
        ({}, False, False),
        ({}, True, True),
        ({"return_timings": True}, False, True),
        ({"return_timings": False}, True, False),
        ({"timings_per_token": True}, False, True),
        ({"return_timings": None}, True, True),
    ):
        for model, base in ((ChatCompletionRequest, chat), (CompletionRequest, {"prompt": "x"})):
            req = parse_request(model.model_validate, {**base, **body}, strict=True)  # known fields
            assert req.wants_timings(default) is wanted, (body, default)
    with pytest.raises(APIError):
        parse_request(CompletionRequest.model_validate, {"prompt": "x", "return_timings": "soon"})
