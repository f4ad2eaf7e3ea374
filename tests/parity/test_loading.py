"""Model sources: sharded safetensors, .bin checkpoints, hub ids through the local cache, dummy
weights, bfloat16; and clear errors for what cannot be loaded."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from splitserve import LLM, SamplingParams
from tests.helpers.hf_reference import assert_greedy_match, hf_greedy, load_hf_model
from tests.helpers.models import make_tiny_model

PROMPT = [17, 300, 45, 901, 12, 77, 5, 640, 33]


def _greedy_ids(llm: LLM, n: int = 16) -> list[int]:
    params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)
    return llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)[0].outputs[0].token_ids


def _llm(path: str, **kw) -> LLM:
    kw.setdefault("dtype", "float32")
    return LLM(path, max_model_len=128, use_tqdm_on_load=False, **kw)


@pytest.fixture(scope="module")
def reference(tiny_models):
    return hf_greedy(load_hf_model(tiny_models["qwen2"]), PROMPT, 16)


def test_sharded_safetensors(tmp_path, tiny_models, smollm_tokenizer, reference):
    model = load_hf_model(tiny_models["qwen2"])
    model.save_pretrained(tmp_path, max_shard_size="100KB")
    smollm_tokenizer.save_pretrained(tmp_path)
    assert os.path.exists(tmp_path / "model.safetensors.index.json")
    assert_greedy_match(_greedy_ids(_llm(str(tmp_path))), None, reference)


def test_pytorch_bin_checkpoint(tmp_path, tiny_models, smollm_tokenizer, reference):
    model = load_hf_model(tiny_models["qwen2"])
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny_models["qwen2"], name), tmp_path / name)
    assert_greedy_match(_greedy_ids(_llm(str(tmp_path))), None, reference)


def test_hub_id_from_local_cache(tmp_path, tiny_models, monkeypatch, reference):
    # The layout huggingface_hub keeps in its cache; HF_HUB_OFFLINE=1 (set by conftest) resolves it.
    snapshot = tmp_path / "models--tiny-org--tiny-qwen2" / "snapshots" / "abc123"
    shutil.copytree(tiny_models["qwen2"], snapshot)
    (tmp_path / "models--tiny-org--tiny-qwen2" / "refs").mkdir()
    (tmp_path / "models--tiny-org--tiny-qwen2" / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr("huggingface_hub.constants.HF_HUB_CACHE", str(tmp_path))
    assert_greedy_match(_greedy_ids(_llm("tiny-org/tiny-qwen2")), None, reference)


def test_unknown_hub_id_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match="no-such-org/no-such-model"):
        _llm("no-such-org/no-such-model")


def test_dummy_weights_run(tiny_models):
    ids = _greedy_ids(_llm(tiny_models["llama"], load_format="dummy"), 8)
    assert len(ids) == 8 and all(0 <= t < 1024 for t in ids)


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_bfloat16_matches_transformers_bfloat16(tiny_models, arch):
    reference = hf_greedy(load_hf_model(tiny_models[arch], dtype=torch.bfloat16), PROMPT, 16)
    ids = _greedy_ids(_llm(tiny_models[arch], dtype="bfloat16"))
    # bfloat16 rounds logits to ~3 significant digits, so a divergence is allowed where the
    # reference's top two logits are within 0.1.
    assert_greedy_match(ids, None, reference, tie_gap=0.1)


def test_unsupported_architecture_names_the_supported_ones(tmp_path, smollm_tokenizer):
    path = make_tiny_model(str(tmp_path / "m"), "llama", smollm_tokenizer)
    config_path = os.path.join(path, "config.json")
    config = json.load(open(config_path))
    config["architectures"] = ["FancyNetForCausalLM"]
    json.dump(config, open(config_path, "w"))
    with pytest.raises(ValueError, match="FancyNetForCausalLM.*Qwen3ForCausalLM"):
        _llm(path)


def test_refused_engine_settings(tiny_models):
    for kwargs, field in [
        ({"tensor_parallel_size": 3}, "tensor_parallel_size"),
        ({"pipeline_parallel_size": 4}, "pipeline_parallel_size"),
        ({"kv_cache_dtype": "fp16"}, "kv_cache_dtype"),
        ({"quantization": "awq"}, "quantization"),
        ({"max_model_len": 100000}, "max_model_len"),
    ]:
        with pytest.raises(ValueError, match=field):
            LLM(tiny_models["llama"], **kwargs)
    with pytest.raises(TypeError, match="no_such_flag"):
        LLM(tiny_models["llama"], no_such_flag=1)
