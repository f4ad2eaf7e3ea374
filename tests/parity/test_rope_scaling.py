"""Dynamic NTK rope scaling and log-n attention against transformers, on tiny random Llamas.

transformers rescales a dynamic rope each forward for the highest position + 1 and keeps cached
keys as they were rotated; the reference runs one sequence at a time. splitserve gives each token
max(prompt length, position + 1) and must produce the same tokens however it batches, chunks,
preempts or caches prefixes. Log-n attention has no transformers Llama counterpart, so the
reference is transformers' Llama with its queries scaled as Qwen-1 does it (patched in)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from splitserve import LLM, TurbomindEngineConfig
from tests.helpers.parity import ROPE_PROMPTS, SHAPE, build, dynamic_llama, generate_and_check, llm, references

MAX_TOKENS = 24


@pytest.fixture(scope="module")
def dynamic_model(tmp_path_factory, smollm_tokenizer):
    """(checkpoint directory, transformers' reference tokens for ROPE_PROMPTS)."""
    model = dynamic_llama()
    path = tmp_path_factory.mktemp("dynamic_llama")
    model.save_pretrained(path)
    smollm_tokenizer.save_pretrained(path)
    return str(path), references(model, ROPE_PROMPTS)


def test_dynamic_ntk_whole_batch_and_prefix_cache(dynamic_model):
    path, refs = dynamic_model
    engine = llm(path, max_model_len=96, block_size=8)
    generate_and_check(engine, refs, ROPE_PROMPTS)
    generate_and_check(engine, refs, ROPE_PROMPTS)  # again, from the prefix cache
    stats = engine.llm_engine.engine_core.scheduler.prefix_cache_stats
    assert stats.hits > 0


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(max_num_batched_tokens=7, enable_prefix_caching=False),  # every prompt in chunks, beside decodes
        dict(max_num_seqs=1, enable_prefix_caching=False),
        dict(block_size=4, num_gpu_blocks_override=40),  # preempted and recomputed
    ],
    ids=["chunked", "one_at_a_time", "preempted"],
)
def test_dynamic_ntk_however_batched(dynamic_model, kwargs):
    path, refs = dynamic_model
    engine = llm(path, max_model_len=96, **kwargs)
    generate_and_check(engine, refs, ROPE_PROMPTS)
    if "num_gpu_blocks_override" in kwargs:
        assert engine.llm_engine.engine_core.scheduler.num_preemptions > 0


def test_max_model_len_past_max_position_embeddings_needs_dynamic_rope(tmp_path, smollm_tokenizer):
    model = dynamic_llama("default")
    model.save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="max_model_len=96 is outside 1..32"):
        llm(str(tmp_path), max_model_len=96)


def test_lmdeploy_rope_scaling_factor_is_dynamic_ntk(tmp_path, smollm_tokenizer):
    """The engine TurbomindEngineConfig(rope_scaling_factor=2) asks for, on a model without rope
    scaling, gives the tokens of transformers' Llama with dynamic NTK factor 2; its session_len
    exceeds max_position_embeddings."""
    scaled = dynamic_llama()
    plain = dynamic_llama("default")
    plain.load_state_dict(scaled.state_dict())
    plain.save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    backend = TurbomindEngineConfig(
        dtype="float32", session_len=96, rope_scaling_factor=2.0, cache_max_entry_count=0.05
    )
    kwargs = dataclasses.asdict(backend.to_engine_args(str(tmp_path)))
    engine = LLM(kwargs.pop("model"), **{**kwargs, "use_tqdm_on_load": False})
    generate_and_check(engine, references(scaled, ROPE_PROMPTS), ROPE_PROMPTS)


def test_lmdeploy_fields_become_hf_overrides():
    assert TurbomindEngineConfig().to_engine_args("m").hf_overrides is None
    args = TurbomindEngineConfig(rope_scaling_factor=4.0, use_logn_attn=True).to_engine_args("m")
    assert args.hf_overrides == {"rope_scaling": {"rope_type": "dynamic", "factor": 4.0}, "use_logn_attn": True}


# --- log-n attention --------------------------------------------------------------------------------
TRAINING_LENGTH = 24  # Qwen-1's config key seq_length: queries past it are scaled


def _qwen_logn_table(length: int, size: int = 256) -> torch.Tensor:
    """Qwen-1's logn_list, indexed by 0-based position: log_L(i) for i = position + 1 > L, else 1."""
    return torch.tensor([math.log(i, length) if i > length else 1.0 for i in range(1, size)])


@pytest.fixture
def logn_reference(monkeypatch):
    """transformers' Llama with every query scaled by Qwen-1's log-n factor of its position."""
    from transformers.models.llama import modeling_llama

    table, seen = _qwen_logn_table(TRAINING_LENGTH), {}
    rope_forward, apply_rope = modeling_llama.LlamaRotaryEmbedding.forward, modeling_llama.apply_rotary_pos_emb

    def recording_forward(self, x, position_ids):
        seen["positions"] = position_ids
        return rope_forward(self, x, position_ids)

    def scaled(q, k, cos, sin, *args, **kwargs):
        q, k = apply_rope(q, k, cos, sin, *args, **kwargs)
        return q * table[seen["positions"]][:, None, :, None].to(q.dtype), k

    monkeypatch.setattr(modeling_llama.LlamaRotaryEmbedding, "forward", recording_forward)
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", scaled)


def test_logn_attention(tmp_path, smollm_tokenizer, logn_reference):
    import transformers

    config = transformers.LlamaConfig(**SHAPE, num_key_value_heads=2, max_position_embeddings=512)
    config.seq_length = TRAINING_LENGTH
    model = build(config, seed=22)
    model.save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    refs = references(model, ROPE_PROMPTS)
    engine = llm(str(tmp_path), hf_overrides={"use_logn_attn": True}, max_num_batched_tokens=16)
    generate_and_check(engine, refs, ROPE_PROMPTS)


def test_logn_scale_leaves_positions_within_the_training_length_alone():
    from splitserve.layers.rotary import logn_query_scale, logn_training_length

    scale = logn_query_scale(torch.arange(100), 32, torch.float32).flatten()
    assert torch.all(scale[:32] == 1.0)  # positions 0..31: 32 tokens, none past L
    assert torch.allclose(scale, _qwen_logn_table(32, 101))
    assert scale[32] > 1.0 and torch.all(scale[33:] > scale[32:-1])

    class Config:
        max_position_embeddings = 64

    assert logn_training_length(Config()) is None  # off unless asked
    Config.use_logn_attn = True
    assert logn_training_length(Config()) == 64
    Config.seq_length = 16
    assert logn_training_length(Config()) == 16


def test_default_rope_has_no_per_token_work(dynamic_model, tmp_path, smollm_tokenizer):
    """Only a dynamic rope makes the runner build per-token lengths; the others keep their table."""
    from splitserve.layers.rotary import DynamicNTKRotaryEmbedding, RotaryEmbedding

    path, _ = dynamic_model
    dynamic_runner = llm(path, max_model_len=64).llm_engine.engine_core.executor.runner
    assert dynamic_runner.uses_rope_lengths
    assert isinstance(dynamic_runner.model.model.rotary, DynamicNTKRotaryEmbedding)
    plain = dynamic_llama("default")
    plain.save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    runner = llm(str(tmp_path), max_model_len=32).llm_engine.engine_core.executor.runner
    assert not runner.uses_rope_lengths and isinstance(runner.model.model.rotary, RotaryEmbedding)


def test_hf_overrides_flag_round_trips():
    """--hf-overrides takes a JSON object, and launchers that recreate the flags pass it on."""
    import argparse

    from splitserve.engine.arg_flags import add_engine_args, engine_args_from, engine_flags

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    args = engine_args_from(parser.parse_args(["--hf-overrides", '{"use_logn_attn": true}']))
    assert args.hf_overrides == {"use_logn_attn": True}
    assert engine_flags(args) == ["--hf-overrides", '{"use_logn_attn": true}']
    with pytest.raises(SystemExit):
        parser.parse_args(["--hf-overrides", "[1]"])
