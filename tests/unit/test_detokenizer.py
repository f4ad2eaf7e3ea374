"""Incremental detokenization against decoding everything at once, with multi-byte characters, through
the tokenizers backend's stream decoder and through the window of decode calls (other tokenizers)."""

from __future__ import annotations

import pytest

from splitserve.engine import detokenizer
from splitserve.engine.detokenizer import IncrementalDetokenizer, find_stop_string

TEXTS = [
    "Hello, world! How are you?",
    "héllo wörld — naïve café",
    "数学 and 日本語のテキスト",
    "emoji 🎉🚀 mixed 👩‍👩‍👧 text",
    "  leading spaces\n\nand\ttabs",
]


@pytest.fixture(params=["stream", "window"])
def path(request, monkeypatch):
    if request.param == "window":
        monkeypatch.setattr(detokenizer, "_stream_backend", lambda tokenizer: None)
    return request.param


def test_a_fast_tokenizer_streams(smollm_tokenizer):
    assert IncrementalDetokenizer(smollm_tokenizer, [1, 2])._stream is not None


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_equals_full_decode_and_never_splits_characters(smollm_tokenizer, text, path):
    prompt = smollm_tokenizer("Say:", add_special_tokens=False).input_ids
    ids = smollm_tokenizer(text, add_special_tokens=False).input_ids
    detok = IncrementalDetokenizer(smollm_tokenizer, prompt)
    deltas = [detok.add_token(t) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == smollm_tokenizer.decode(ids) == detok.output_text
    if any("\ufffd" in smollm_tokenizer.decode([t]) for t in ids):
        assert "" in deltas  # a token ended mid-character and its bytes were held back


def test_special_tokens_skipped_or_kept(smollm_tokenizer, path):
    ids = smollm_tokenizer("<|im_start|>hi<|im_end|>", add_special_tokens=False).input_ids
    skip = IncrementalDetokenizer(smollm_tokenizer, [], skip_special_tokens=True)
    keep = IncrementalDetokenizer(smollm_tokenizer, [], skip_special_tokens=False)
    for t in ids:
        skip.add_token(t)
        keep.add_token(t)
    assert skip.output_text == "hi"
    assert keep.output_text == "<|im_start|>hi<|im_end|>"


def test_stream_and_window_give_the_same_deltas(smollm_tokenizer):
    """Token by token, over prompts and outputs cut from real text (special tokens included) between
    characters. (Where a prompt ends inside a character, the stream gives that character with the
    output token that completes it, the window nothing.)"""
    import random

    rng, compared = random.Random(0), 0
    ids = smollm_tokenizer("<|im_start|>" + " ".join(TEXTS) + "<|im_end|>", add_special_tokens=False).input_ids
    for _ in range(200):
        start, cut, end = sorted(rng.sample(range(len(ids) + 1), 3))
        prompt, output = ids[start:cut], ids[cut:end]
        if smollm_tokenizer.decode(prompt).endswith("\ufffd") or smollm_tokenizer.decode(output).startswith("\ufffd"):
            continue
        skip = rng.random() < 0.5
        stream = IncrementalDetokenizer(smollm_tokenizer, prompt, skip_special_tokens=skip)
        window = IncrementalDetokenizer(smollm_tokenizer, prompt, skip_special_tokens=skip)
        window._stream = None
        assert [stream.add_token(t) for t in output] == [window.add_token(t) for t in output], (prompt, output)
        compared += 1
    assert compared > 100


def test_find_stop_string_only_looks_at_new_text():
    assert find_stop_string("abc STOP def", 4, ["STOP"], False) is None  # completed earlier
    assert find_stop_string("abc STO", 3, ["STOP"], False) is None
    assert find_stop_string("abc STOP", 1, ["STOP"], False) == ("STOP", 4)
    assert find_stop_string("abc STOP", 1, ["STOP"], True) == ("STOP", 8)
    assert find_stop_string("xx\nyy", 3, ["zz", "\n"], False) == ("\n", 2)


def test_outputs_without_tokens_end_the_request_and_carry_refusals():
    """An output that finishes a sample without a token (aborted before it ran, a grammar that did
    not compile in the engine, a refused request) must finish it, or its caller would wait forever;
    a refusal comes back as an InvalidRequestError naming the request."""
    from splitserve.engine.errors import InvalidRequestError
    from splitserve.engine.messages import EngineCoreOutput
    from splitserve.engine.output_processor import OutputProcessor, RequestOutputKind, RequestState, SampleState
    from splitserve.sampling_params import SamplingParams

    processor = OutputProcessor(tokenizer=None)
    for rid in ("aborted", "refused"):
        sample = SampleState(0, SamplingParams(detokenize=False), None)
        processor.add_request(RequestState(rid, None, [5, 6], RequestOutputKind.FINAL_ONLY, {rid: sample}))
    outputs, _ = processor.process_outputs(
        [
            EngineCoreOutput("aborted", [], finish_reason="abort"),
            EngineCoreOutput("refused", [], finish_reason="abort", error="adapter gone", error_not_found=True),
        ]
    )
    aborted, refused = outputs
    assert aborted.finished and aborted.outputs[0].finish_reason == "abort"
    assert isinstance(refused, InvalidRequestError) and refused.status == 404 and refused.request_id == "refused"
    assert not processor.requests


@pytest.mark.parametrize("include_stop", [False, True])
@pytest.mark.parametrize("stop_by", ["eos", "stop_token_ids"])
def test_a_speculative_run_that_ends_on_a_stop_token_keeps_the_text_before_it(smollm_tokenizer, stop_by, include_stop):
    """Speculative decoding hands several tokens in one output; when the core stopped the request on
    its last token (eos or stop_token_ids), the tokens accepted before it are text like any other:
    the answer equals the same tokens handed one by one, the stop token's own text left out unless
    include_stop_str_in_output."""
    from splitserve.engine.messages import EngineCoreOutput
    from splitserve.engine.output_processor import OutputProcessor, RequestOutputKind, RequestState, SampleState
    from splitserve.sampling_params import SamplingParams

    tokenizer = smollm_tokenizer
    body = tokenizer.encode(" The capital of France is Paris", add_special_tokens=False)
    stop_token = tokenizer.eos_token_id if stop_by == "eos" else tokenizer.encode(".", add_special_tokens=False)[0]
    extra = {"stop_token_ids": [stop_token]} if stop_by == "stop_token_ids" else {}
    prompt = tokenizer.encode("Question:", add_special_tokens=False)

    def answer(steps):
        processor = OutputProcessor(tokenizer)
        params = SamplingParams(include_stop_str_in_output=include_stop, **extra)
        sample = SampleState(0, params, processor.new_detokenizer(prompt, params))
        processor.add_request(RequestState("r", None, prompt, RequestOutputKind.FINAL_ONLY, {"r": sample}))
        outputs = []
        for j, step in enumerate(steps):
            last = j == len(steps) - 1
            core_out = EngineCoreOutput("r", step, finish_reason="stop" if last else None, stop_reason=None)
            outputs += processor.process_outputs([core_out])[0]
        return outputs[-1].outputs[0]

    tokens = body + [stop_token]
    one_by_one = answer([[t] for t in tokens])
    speculative = answer([tokens[:2], tokens[2:]])  # the stop token inside an accepted run of several
    expected = tokenizer.decode(tokens if include_stop else body, skip_special_tokens=True)
    assert one_by_one.text == speculative.text == expected
    assert "Paris" in speculative.text and speculative.token_ids == tokens


def test_tokens_that_come_after_a_stop_string_are_dropped(smollm_tokenizer):
    """A front-end that reads several of the core's messages at once (data parallelism, a busy
    server) may get a sample's next tokens in the same call as the one that completed its stop
    string (they were sampled before the abort arrived): the answer stays cut at the stop."""
    from splitserve.engine.messages import EngineCoreOutput
    from splitserve.engine.output_processor import OutputProcessor, RequestOutputKind, RequestState, SampleState
    from splitserve.sampling_params import SamplingParams

    tokens = smollm_tokenizer.encode(" one two three four five", add_special_tokens=False)
    processor = OutputProcessor(smollm_tokenizer)
    for rid, n in (("single", 1), ("pair", 2)):
        params = SamplingParams(stop=[" three"], n=n)
        samples = {f"{rid}-{i}": SampleState(i, params, processor.new_detokenizer([5], params)) for i in range(n)}
        processor.add_request(RequestState(rid, None, [5], RequestOutputKind.FINAL_ONLY, samples))
    steps = [EngineCoreOutput(core_id, [t]) for t in tokens for core_id in ("single-0", "pair-0")]
    steps.append(EngineCoreOutput("pair-1", tokens[:1], finish_reason="length"))
    outputs, to_abort = processor.process_outputs(steps)
    assert sorted(to_abort) == ["pair-0", "single-0"]
    by_id = {o.request_id: o for o in outputs}
    assert [(c.text, c.finish_reason) for c in by_id["single"].outputs] == [(" one two", "stop")]
    assert [(c.text, c.finish_reason) for c in by_id["pair"].outputs] == [(" one two", "stop"), (" one", "length")]


@pytest.mark.parametrize("interval", [1, 3, 4])
def test_stream_interval_coalesces_streamed_tokens_and_loses_none(smollm_tokenizer, interval):
    """--stream-interval N: the first token at once, then N tokens per output, the rest with the finish;
    the deltas add up to the text of every token, as with one output per token."""
    from splitserve.engine.messages import EngineCoreOutput
    from splitserve.engine.output_processor import OutputProcessor, RequestOutputKind, RequestState, SampleState
    from splitserve.sampling_params import SamplingParams

    tokens = smollm_tokenizer.encode(" one two three four five six seven eight nine ten")
    processor = OutputProcessor(smollm_tokenizer)
    processor.stream_interval = interval
    params = SamplingParams(max_tokens=len(tokens))
    sample = SampleState(0, params, processor.new_detokenizer([5], params))
    processor.add_request(RequestState("r", None, [5], RequestOutputKind.DELTA, {"r": sample}))
    deltas = []
    for i, token in enumerate(tokens):
        last = i == len(tokens) - 1
        outputs, _ = processor.process_outputs(
            [EngineCoreOutput("r", [token], finish_reason="length" if last else None)]
        )
        deltas += [o.outputs[0] for o in outputs]
    sizes = [len(d.token_ids) for d in deltas]
    rest = (len(tokens) - 1) % interval
    assert sizes == [1] + [interval] * ((len(tokens) - 1) // interval) + ([rest] if rest else [])
    assert "".join(d.text for d in deltas) == smollm_tokenizer.decode(tokens)
    assert deltas[-1].finish_reason == "length" and not processor.requests
