"""The embedded default model (SmolLM2-135M-Instruct, Q4_1 GGUF): it loads with no arguments and
its greedy output equals transformers' on the same GGUF file, dequantized the same way."""

from __future__ import annotations

import os

import pytest

from splitserve import LLM, SamplingParams
from splitserve.loader.hf_model import load_hf_model
from tests.helpers.hf_reference import assert_greedy_match, hf_greedy

pytestmark = pytest.mark.slow  # loads the default model

PROMPTS = ["Hello, my name is", "The capital of France is", "def fibonacci(n):", "Water boils at"]
MAX_TOKENS = 32


@pytest.fixture(scope="module")
def llm() -> LLM:
    # Dequantized, as transformers runs the file (test_gguf_quantized.py compares the quantized run).
    return LLM(dtype="float32", max_model_len=512, use_tqdm_on_load=False, quantization="none")


def test_default_model_matches_transformers(llm, default_gguf):
    outputs = llm.generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0), use_tqdm=False
    )
    import torch

    from splitserve.loader.resolve import load_hf_config

    # with splitserve's config: transformers does not read the file's metadata again (4-5 s)
    directory, name = os.path.split(default_gguf)
    hf = load_hf_model(directory, name, torch.float32, config=load_hf_config(default_gguf))
    for out in outputs:
        completion = out.outputs[0]
        logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        assert_greedy_match(
            completion.token_ids, logprobs, hf_greedy(hf, out.prompt_token_ids, MAX_TOKENS), logprob_atol=2e-3
        )
    assert "Paris" in outputs[1].outputs[0].text


def test_chat_and_tokenizer(llm):
    tokenizer = llm.get_tokenizer()
    assert tokenizer.decode(tokenizer("Hello").input_ids, skip_special_tokens=True) == "Hello"
    out = llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}],
        SamplingParams(temperature=0, max_tokens=24),
        use_tqdm=False,
    )[0]
    assert out.prompt.startswith("<|im_start|>system") and out.prompt.endswith("<|im_start|>assistant\n")
    assert "Paris" in out.outputs[0].text
    assert out.outputs[0].finish_reason in ("stop", "length")


def test_json_answers_fit_a_small_token_budget(llm):
    """Structured output's default is one-line JSON: with free whitespace the default model spent a
    32-token budget on newlines inside the object (LangChain's with_structured_output failed so);
    a guide that asks for free whitespace still gets it."""
    import json

    from splitserve import GuidedDecodingParams

    schema = {
        "type": "object",
        "properties": {"country": {"type": "string"}, "capital": {"type": "string"}},
        "required": ["country", "capital"],
    }
    messages = [{"role": "user", "content": "Tell me about France."}]
    params = SamplingParams(temperature=0, max_tokens=32, guided_decoding=GuidedDecodingParams(json=schema))
    out = llm.chat(messages, params, use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "stop", out.text
    assert list(json.loads(out.text)) == ["country", "capital"] and "\n" not in out.text  # the schema's order
    free = GuidedDecodingParams(json=schema, disable_any_whitespace=False)
    loose = llm.chat(messages, SamplingParams(temperature=0, max_tokens=32, guided_decoding=free), use_tqdm=False)
    assert "\n" in loose[0].outputs[0].text  # the model's own whitespace, not the compact form
