"""Parity with transformers on tiny random-weight models: prompts, tolerances, builders and checks."""

from __future__ import annotations

import random

import torch

from splitserve import LLM, SamplingParams
from tests.helpers.hf_reference import assert_greedy_match, hf_greedy

# float32 on both sides. These models' logits reach tens (initializer_range 0.5) and different
# but equivalent summation orders (fused q/k/v, batched decode attention) differ by ~1e-6 of that:
# observed up to 1.1e-4 in logprob.
LOGPROB_ATOL = 5e-4


def _prompts() -> list[list[int]]:
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1024) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    shared = [rng.randrange(3, 1024) for _ in range(21)]
    prompts += [shared + [5, 6, 7], shared + [8, 9]]  # shared prefixes: prefix-cache hits
    return prompts


PROMPTS = _prompts()


# --- models built with transformers, checked one prompt at a time ------------------------------------
MAX_TOKENS = 24  # what references() and generate_and_check() generate unless told
SHAPE = dict(
    vocab_size=1024,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=3,
    num_attention_heads=4,
    initializer_range=0.5,
    bos_token_id=1,
    eos_token_id=2,
)


def build(config, seed: int):
    """transformers' model of `config`, float32, with random biases too (they start at zero)."""
    import transformers

    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".bias"):
                param.normal_(0.0, 0.5)
    return model


def references(model, prompts=PROMPTS, max_tokens: int = MAX_TOKENS):
    """One prompt at a time. A dynamic NTK rope keeps the longest length it has seen across calls,
    so it is put back to its initial frequencies before each prompt, as a fresh model would be."""
    refs = []
    for prompt in prompts:
        rotary = model.model.rotary_emb
        if rotary.rope_type == "dynamic":
            rotary.inv_freq = rotary.original_inv_freq.clone()
            rotary.max_seq_len_cached = rotary.original_max_seq_len
        refs.append(hf_greedy(model, prompt, max_tokens))
    return refs


def generate_and_check(llm: LLM, refs, prompts=PROMPTS, max_tokens: int = MAX_TOKENS) -> None:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for out, ref in zip(outputs, refs):
        completion = out.outputs[0]
        logprobs = [lp[tok].logprob for lp, tok in zip(completion.logprobs, completion.token_ids)]
        assert_greedy_match(completion.token_ids, logprobs, ref, LOGPROB_ATOL)


def llm(path: str, **kwargs) -> LLM:
    kwargs.setdefault("max_model_len", 128)
    return LLM(path, dtype="float32", use_tqdm_on_load=False, **kwargs)


# --- a Llama with a dynamic NTK rope, and prompts that go past its original length -------------------
ORIGINAL_LENGTH = 32  # max_position_embeddings of the dynamic model: prompts and outputs go past it


def _rope_prompts() -> list[list[int]]:
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 1024) for _ in range(n)] for n in (5, 20, 31, 32, 33, 40, 50)]
    shared = [rng.randrange(3, 1024) for _ in range(36)]
    # Past the original length with a common prefix: their prompt tokens rotate for different
    # lengths, so prefix caching must not hand one the other's blocks.
    return prompts + [shared + [5, 6, 7], shared + [8, 9, 10, 11, 12, 13]]


ROPE_PROMPTS = _rope_prompts()


def dynamic_llama(rope_type: str = "dynamic"):
    import transformers

    rope = {"rope_type": rope_type, "factor": 2.0, "rope_theta": 10000.0}
    if rope_type == "default":
        rope = {"rope_type": "default", "rope_theta": 10000.0}
    config = transformers.LlamaConfig(
        **SHAPE,
        num_key_value_heads=2,
        max_position_embeddings=ORIGINAL_LENGTH,
        rope_parameters=rope,
        tie_word_embeddings=False,
    )
    return build(config, seed=21)
