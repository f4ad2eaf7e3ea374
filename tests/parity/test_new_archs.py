"""ERNIE 4.5, InternLM, InternLM2 and InternLM3 against transformers on tiny random-weight models.

transformers builds ERNIE 4.5 and InternLM3 (as its Llama) itself. InternLM and InternLM2 are
remote code that it cannot build offline, so their checkpoints are made here from a transformers
Llama: the Llama's weights converted into the InternLM / InternLM2 layout (this file's own inverse
of splitserve's mapping) next to a config.json in their format, and splitserve's tokens must be
that Llama's."""

from __future__ import annotations

import json
import os

import pytest
import torch

from tests.helpers.hf_reference import load_hf_model
from tests.helpers.parity import SHAPE, build, generate_and_check, llm, references


def write_checkpoint(directory: str, tensors: dict[str, torch.Tensor], config: dict, tokenizer) -> str:
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(directory, "model.safetensors"))
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config, f)
    tokenizer.save_pretrained(directory)
    return directory


# --- ERNIE 4.5 --------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "use_bias, tied, architecture", [(True, True, "Ernie4_5ForCausalLM"), (False, False, "Ernie4_5_ForCausalLM")]
)
def test_ernie4_5(tmp_path, smollm_tokenizer, use_bias, tied, architecture):
    """Interleaved rotary in float32, and biases on every linear with use_bias; under transformers'
    name for the architecture and under Baidu's (its checkpoints' config.json)."""
    import transformers

    config = transformers.Ernie4_5Config(
        **SHAPE, num_key_value_heads=2, head_dim=16, use_bias=use_bias, tie_word_embeddings=tied
    )
    model = build(config, seed=11)
    model.save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**raw, "architectures": [architecture]}, f)
    generate_and_check(llm(str(tmp_path)), references(model))


def test_ernie4_5_channel_permutation_keeps_attention_scores():
    """Pairs -> halves is a permutation of head channels applied to q and k alike: q.k is unchanged."""
    from splitserve.models.ernie4_5 import pairs_to_halves

    q, k = torch.randn(5, 2, 16), torch.randn(5, 2, 16)
    assert torch.allclose((q * k).sum(-1), (pairs_to_halves(q) * pairs_to_halves(k)).sum(-1), atol=1e-5)
    assert pairs_to_halves(torch.arange(8.0).view(1, 1, 8)).flatten().tolist() == [0, 2, 4, 6, 1, 3, 5, 7]


# --- InternLM (v1) ----------------------------------------------------------------------------------
def _internlm_json(model_type: str, architecture: str, config, **keys) -> dict:
    """A config.json as InternLM's remote code writes it: its own keys, not Llama's."""
    return {
        "architectures": [architecture],
        "model_type": model_type,
        "auto_map": {"AutoConfig": f"configuration_{model_type}.Config", "AutoModel": f"modeling_{model_type}.Model"},
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_hidden_layers": config.num_hidden_layers,
        "num_attention_heads": config.num_attention_heads,
        "hidden_act": "silu",
        "max_position_embeddings": config.max_position_embeddings,
        "rms_norm_eps": config.rms_norm_eps,
        "tie_word_embeddings": False,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "pad_token_id": 0,
        "torch_dtype": "float32",
        **keys,
    }


def test_internlm_v1(tmp_path, smollm_tokenizer):
    """Llama's tensor names with q/k/v/o biases (`bias`), and `rotary` dynamic NTK past a short
    max_position_embeddings (32), reached by the longer prompts and the generations."""
    import transformers

    rope = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    config = transformers.LlamaConfig(
        **SHAPE, max_position_embeddings=32, attention_bias=True, rope_parameters=rope, tie_word_embeddings=False
    )
    model = build(config, seed=12)
    rotary = {"base": 10000, "type": "dynamic", "scaling_factor": 2.0}
    raw = _internlm_json("internlm", "InternLMForCausalLM", config, bias=True, rotary=rotary)
    path = write_checkpoint(str(tmp_path), model.state_dict(), raw, smollm_tokenizer)
    generate_and_check(llm(path, trust_remote_code=True), references(model))


def test_internlm_v1_config_mapping():
    from splitserve.models.internlm import internlm_config

    base = {"architectures": ["InternLMForCausalLM"], "model_type": "internlm", "max_position_embeddings": 2048}
    origin = internlm_config({**base, "bias": False, "rotary": {"base": 500, "type": "origin"}})
    assert not origin.attention_bias and origin.rope_parameters == {"rope_type": "default", "rope_theta": 500.0}
    default = internlm_config(base)  # InternLMConfig's defaults: bias, dynamic rotary with base 10000
    assert default.attention_bias and default.rope_parameters["rope_type"] == "dynamic"
    assert default.rope_parameters["factor"] == 1.0 and default.rope_parameters["rope_theta"] == 10000.0
    with pytest.raises(ValueError, match="rotary type 'yarn'"):
        internlm_config({**base, "rotary": {"base": 1, "type": "yarn"}})


# --- InternLM2 --------------------------------------------------------------------------------------
_TO_INTERNLM2 = {
    "self_attn.o_proj": "attention.wo",
    "mlp.gate_proj": "feed_forward.w1",
    "mlp.up_proj": "feed_forward.w3",
    "mlp.down_proj": "feed_forward.w2",
    "input_layernorm": "attention_norm",
    "post_attention_layernorm": "ffn_norm",
}


def to_internlm2(state: dict[str, torch.Tensor], config) -> dict[str, torch.Tensor]:
    """A Llama state dict in InternLM2's layout: renamed, and q/k/v fused into wqkv with, for each
    KV head, its group's query heads, then its key head, then its value head."""
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    group, head_dim = heads // kv_heads, config.head_dim
    out = {"model.tok_embeddings.weight": state["model.embed_tokens.weight"], "output.weight": state["lm_head.weight"]}
    out["model.norm.weight"] = state["model.norm.weight"]
    for i in range(config.num_hidden_layers):
        prefix = f"model.layers.{i}."
        for llama, internlm2 in _TO_INTERNLM2.items():
            for suffix in ("weight", "bias"):
                if f"{prefix}{llama}.{suffix}" in state:
                    out[f"{prefix}{internlm2}.{suffix}"] = state[f"{prefix}{llama}.{suffix}"]
        for suffix in ("weight", "bias"):
            q, k, v = (state[f"{prefix}self_attn.{p}_proj.{suffix}"] for p in "qkv")
            rest = q.shape[1:]
            per_kv_head = [
                q.reshape(kv_heads, group, head_dim, *rest),
                k.reshape(kv_heads, 1, head_dim, *rest),
                v.reshape(kv_heads, 1, head_dim, *rest),
            ]
            out[f"{prefix}attention.wqkv.{suffix}"] = torch.cat(per_kv_head, dim=1).reshape(-1, *rest)
    return out


def test_internlm2(tmp_path, smollm_tokenizer):
    """Fused grouped wqkv (4 query heads over 2 KV heads) with biases, renamed tensors, linear rope
    scaling from `rope_scaling: {"type": "linear"}`; loaded without trust_remote_code (nothing
    remote runs either way)."""
    import transformers

    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5000.0}
    config = transformers.LlamaConfig(
        **SHAPE,
        num_key_value_heads=2,
        max_position_embeddings=512,
        attention_bias=True,
        rope_parameters=rope,
        tie_word_embeddings=False,
    )
    model = build(config, seed=13)
    raw = _internlm_json(
        "internlm2",
        "InternLM2ForCausalLM",
        config,
        num_key_value_heads=2,
        bias=True,
        rope_theta=5000.0,
        rope_scaling={"type": "linear", "factor": 2.0},
        attn_implementation="eager",
    )
    path = write_checkpoint(str(tmp_path), to_internlm2(model.state_dict(), config), raw, smollm_tokenizer)
    generate_and_check(llm(path), references(model))


def test_internlm2_refuses_a_quantized_wqkv_and_lora_on_it():
    from splitserve.models.internlm import InternLM2ForCausalLM

    model = InternLM2ForCausalLM.__new__(InternLM2ForCausalLM)
    with pytest.raises(ValueError, match="quantized fused wqkv"):
        list(model._as_llama("model.layers.0.attention.wqkv.qweight", torch.zeros(1)))
    with pytest.raises(ValueError, match="fused"):
        InternLM2ForCausalLM.lora_target("model.layers.0.attention.wqkv")
    assert InternLM2ForCausalLM.lora_target("model.layers.1.feed_forward.w3") == ("model.layers.1.mlp.gate_up_proj", 1)


# --- InternLM3 --------------------------------------------------------------------------------------
def test_internlm3(tmp_path, smollm_tokenizer):
    """transformers' InternLM3 is its Llama with qkv_bias / bias; its real config scales rope with
    dynamic NTK (factor 6), as this one does past max_position_embeddings=32."""
    import transformers

    rope = {"rope_type": "dynamic", "factor": 6.0, "rope_theta": 50000.0}
    config = transformers.InternLM3Config(
        **SHAPE,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=32,
        qkv_bias=True,
        bias=True,
        rope_parameters=rope,
    )
    model = build(config, seed=14)
    model.save_pretrained(tmp_path)
    smollm_tokenizer.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        raw = json.load(f)
    with open(tmp_path / "config.json", "w") as f:  # as the published checkpoints name it
        json.dump({**raw, "architectures": ["InternLM3ForCausalLM"]}, f)
    reference = load_hf_model(str(tmp_path))
    generate_and_check(llm(str(tmp_path)), references(reference))
