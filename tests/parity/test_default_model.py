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

    hf = load_hf_model(os.path.dirname(default_gguf), os.path.basename(default_gguf), torch.float32)
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
