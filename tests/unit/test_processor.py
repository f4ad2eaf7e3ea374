"""The Processor, the one place a request is tokenized and validated: every refusal is an
InvalidRequestError (a ValueError) naming its parameter, the server's length rule is an option
that the offline API leaves off, and params are completed once on a copy."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from splitserve.engine.errors import InvalidRequestError
from splitserve.engine.processor import Processor
from splitserve.sampling_params import SamplingParams

VOCAB = 100
MAX_LEN = 16
BOS = 1


class CharTokenizer:
    """One token per character (its code modulo the vocabulary), BOS first with special tokens."""

    eos_token_id = 2

    def __call__(self, text: str, add_special_tokens: bool = True):
        ids = ([BOS] if add_special_tokens else []) + [3 + ord(c) % (VOCAB - 3) for c in text]
        return SimpleNamespace(input_ids=ids)


@pytest.fixture
def processor() -> Processor:
    # A stand-in tokenizer takes its end-of-sequence ids from the model's config: no files are read.
    config = SimpleNamespace(
        vocab_size=VOCAB,
        max_model_len=MAX_LEN,
        substitute_tokenizer=True,
        hf_config=SimpleNamespace(eos_token_id=[2, 7]),
        runner_type="generate",
        pooler_config=None,
        is_multimodal=False,
        architecture="TestForCausalLM",
    )
    return Processor(config, CharTokenizer())


def refused(call, *args, **kwargs) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as info:
        call(*args, **kwargs)
    assert isinstance(info.value, ValueError)
    return info.value


def test_text_and_token_id_prompts(processor):
    request = processor.process("abc", SamplingParams())
    assert request.prompt == "abc" and request.prompt_token_ids[0] == BOS and len(request.prompt_token_ids) == 4
    request = processor.process({"prompt": "x", "prompt_token_ids": [5, 6]}, SamplingParams())
    assert (request.prompt, request.prompt_token_ids) == ("x", [5, 6])
    request = processor.process_prompt("abc", SamplingParams(), add_special_tokens=False)
    assert len(request.prompt_token_ids) == 3
    with pytest.raises(TypeError):
        processor.process(3, SamplingParams())


def test_prompt_errors_name_the_prompt(processor):
    error = refused(processor.process, {"prompt_token_ids": []}, SamplingParams())
    assert "empty" in str(error) and error.param == "prompt"
    error = refused(processor.process_prompt, {"prompt_token_ids": [5, VOCAB]}, SamplingParams(), param="messages")
    assert "outside the vocabulary" in str(error) and error.param == "messages"


def test_offline_rule_clamps_max_tokens_and_needs_room_for_one_token(processor):
    request = processor.process({"prompt_token_ids": [5] * (MAX_LEN - 1)}, SamplingParams(max_tokens=100))
    assert processor.make_request("r", request.prompt_token_ids, request.params, 0.0).max_tokens == 1
    error = refused(processor.process, {"prompt_token_ids": [5] * MAX_LEN}, SamplingParams())
    assert "maximum model length" in str(error) and error.param == "prompt"


def test_server_rule_needs_room_for_max_tokens(processor):
    params = SamplingParams(max_tokens=10)
    fits = processor.process_prompt({"prompt_token_ids": [5] * 6}, params, max_tokens_must_fit=True)
    assert fits.params is params
    error = refused(processor.process_prompt, {"prompt_token_ids": [5] * 7}, params, max_tokens_must_fit=True)
    assert "maximum context length is 16 tokens" in str(error) and error.param == "max_tokens"
    error = refused(
        processor.process_prompt,
        {"prompt_token_ids": [5] * MAX_LEN},
        params,
        param="messages",
        max_tokens_must_fit=True,
    )
    assert "leaving no room for output" in str(error) and error.param == "messages"


def test_params_are_completed_on_a_copy(processor):
    params = SamplingParams(bad_words=["ab"], stop_token_ids=[9])
    done = processor.process_params(params)
    assert done is not params and params.bad_words_token_ids == []
    assert done.stop_token_ids == [7, 9]  # the config's second end-of-sequence id
    assert done.bad_words_token_ids == [processor.tokenize("ab", False), processor.tokenize(" ab", False)]
    assert processor.process_params(SamplingParams(ignore_eos=True)).stop_token_ids == []


@pytest.mark.parametrize("bad", [-292336, VOCAB])
def test_stop_token_ids_must_be_in_the_vocabulary(processor, bad):
    """Found by schemathesis: a negative stop token id reached a guided request's grammar matcher and
    killed the engine."""
    with pytest.raises(InvalidRequestError) as info:
        processor.process_params(SamplingParams(stop_token_ids=[3, bad]))
    assert info.value.param == "stop_token_ids" and str(bad) in str(info.value)


@pytest.mark.parametrize("params", [SamplingParams(logit_bias={VOCAB: 1.0}), SamplingParams(allowed_token_ids=[VOCAB])])
def test_token_ids_in_params_must_be_in_the_vocabulary(processor, params):
    error = refused(processor.process_params, params)
    assert "logit_bias/allowed_token_ids" in str(error) and error.param is None
