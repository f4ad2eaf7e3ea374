"""LoRA's pure parts: --lora-modules parsing, the scheduler's max_loras rule, prefix-cache keys per
adapter, the registry's ids, the batched delta against a per-row loop, and PEFT checkpoint checks."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve.engine.core.kv_cache_manager import KVCacheManager
from splitserve.engine.core.request import Request
from splitserve.layers.lora import LoRABatchContext, LoRASlots
from splitserve.lora.peft import BaseModelShapes, LoRALoadError, load_lora_model
from splitserve.lora.request import LoRAModulePath, LoRARequest, parse_lora_modules
from splitserve.sampling_params import SamplingParams
from tests.helpers.scheduling import BS, add, make_sched, plan, step


# --- --lora-modules ---------------------------------------------------------------------------------
def test_parse_lora_modules():
    assert parse_lora_modules(None) == []
    specs = ["sql=/a/sql", '{"name": "chat", "path": "/b", "base_model_name": "base"}']
    assert parse_lora_modules(specs) == [LoRAModulePath("sql", "/a/sql"), LoRAModulePath("chat", "/b", "base")]


@pytest.mark.parametrize(
    "specs, message",
    [
        (["sql"], "name=path"),
        (["=/a"], "name=path"),
        (['{"name": "x"'], "not valid JSON"),
        (['{"name": "x", "path": "/a", "rank": 8}'], "not rank"),
        (["a=/x", "a=/y"], "a appear twice"),
    ],
)
def test_parse_lora_modules_errors(specs, message):
    with pytest.raises(ValueError, match=message):
        parse_lora_modules(specs)


def test_lora_request_checks():
    with pytest.raises(ValueError, match="positive"):
        LoRARequest("a", 0, "/p")
    with pytest.raises(ValueError, match="needs a path"):
        LoRARequest("a", 1, "")


# --- scheduling ---------------------------------------------------------------------------------------
def lora_req(rid: str, lora_id: int | None, prompt_len: int = 5) -> Request:
    r = Request(rid, list(range(3, 3 + prompt_len)), SamplingParams(max_tokens=3), eos_token_id=2, max_tokens=3)
    r.lora_request = LoRARequest(f"a{lora_id}", lora_id, f"/p{lora_id}") if lora_id else None
    return r


def test_at_most_max_loras_adapters_run_together():
    sched = make_sched()
    sched.max_loras = 2
    add(sched, lora_req("x1", 1), lora_req("y2", 2), lora_req("z3", 3), lora_req("base", None), lora_req("x1b", 1))
    first = plan(step(sched))
    # Adapter 3 would be a third: it waits, keeping its place; the base model and adapter 1 go on.
    assert [rid for rid, _ in first] == ["x1", "y2", "base", "x1b"]
    assert [r.request_id for r in sched.waiting] == ["z3"]
    while sched.running:
        step(sched)
    assert [rid for rid, _ in plan(step(sched))] == ["z3"]


# --- prefix caching --------------------------------------------------------------------------------
def test_prefix_cache_keys_blocks_by_adapter():
    kv = KVCacheManager(32, BS, True)
    first = lora_req("a", 1, prompt_len=9)
    assert kv.allocate_slots(first, 9)
    kv.cache_blocks(first, 9)
    same_adapter, other_adapter, base = lora_req("b", 1, 9), lora_req("c", 2, 9), lora_req("d", None, 9)
    assert kv.get_computed_blocks(same_adapter)[1] == 8
    assert kv.get_computed_blocks(other_adapter)[1] == 0
    assert kv.get_computed_blocks(base)[1] == 0


# --- the batched delta --------------------------------------------------------------------------------
class _Linear:
    """What LoRASlots reads of a Linear: two stacked matrices (like gate/up), no parallelism."""

    in_features, output_sizes, out_features, dtype = 6, [4, 3], 7, torch.float64

    def checkpoint_slices(self, shard):
        return slice(0, self.output_sizes[shard]), slice(0, self.in_features)

    def shard_slice(self, shard):
        start = sum(self.output_sizes[:shard])
        return slice(start, start + self.output_sizes[shard])


def test_segments_add_each_rows_own_adapter():
    torch.manual_seed(0)
    layer, context = _Linear(), LoRABatchContext()
    slots = LoRASlots(layer, max_loras=2, max_rank=3, context=context, device=torch.device("cpu"))
    adapters = {
        0: [(torch.randn(3, 6, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)), None],
        1: [(torch.randn(2, 6, dtype=torch.float64), torch.randn(4, 2, dtype=torch.float64)),
            (torch.randn(1, 6, dtype=torch.float64), torch.randn(3, 1, dtype=torch.float64))],
    }  # fmt: skip
    for slot, shards in adapters.items():
        slots.set_slot(slot, shards)
    x = torch.randn(9, 6, dtype=torch.float64)
    rows = [0, 0, None, 1, 1, 1, None, 0, 1]
    context.set_step([(0, 2, 0), (3, 6, 1), (7, 8, 0), (8, 9, 1)], 9)
    y = torch.zeros(9, 7, dtype=torch.float64)
    slots.add_delta(x, y)
    _check_rows(layer, adapters, x, y, rows)
    # One adapter for every token: the path without a mask.
    context.set_step([(0, 9, 1)], 9)
    y = torch.zeros(9, 7, dtype=torch.float64)
    slots.add_delta(x, y)
    _check_rows(layer, adapters, x, y, [1] * 9)


def _check_rows(layer, adapters, x, y, rows) -> None:
    for i, slot in enumerate(rows):
        expected = torch.zeros(7, dtype=torch.float64)
        for shard, weights in enumerate(adapters[slot] if slot is not None else []):
            if weights is not None:
                a, b = weights
                expected[layer.shard_slice(shard)] = b @ (a @ x[i])
        torch.testing.assert_close(y[i], expected)


# --- PEFT checkpoints ----------------------------------------------------------------------------------
SHAPES = BaseModelShapes(2, {"q_proj": (8, 8), "v_proj": (8, 4), "o_proj": (8, 8)})


def write_adapter(path, config: dict, tensors: dict) -> LoRARequest:
    from safetensors.torch import save_file

    path.mkdir()
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 2, "lora_alpha": 4, **config}))
    save_file(tensors, str(path / "adapter_model.safetensors"))
    return LoRARequest(path.name, 1, str(path))


def _pair(module: str, r: int, fan_in: int, fan_out: int) -> dict:
    prefix = f"base_model.model.model.layers.0.self_attn.{module}"
    return {f"{prefix}.lora_A.weight": torch.ones(r, fan_in), f"{prefix}.lora_B.weight": torch.ones(fan_out, r)}


def test_scaling_rslora_and_alpha_pattern(tmp_path):
    tensors = {**_pair("q_proj", 2, 8, 8), **_pair("v_proj", 4, 8, 4)}
    plain = load_lora_model(write_adapter(tmp_path / "plain", {}, tensors), SHAPES, 8)
    assert plain.modules["model.layers.0.self_attn.q_proj"].b[0, 0] == 4 / 2  # alpha / r
    assert plain.modules["model.layers.0.self_attn.v_proj"].b[0, 0] == 4 / 4
    rs = load_lora_model(write_adapter(tmp_path / "rs", {"use_rslora": True}, tensors), SHAPES, 8)
    assert rs.modules["model.layers.0.self_attn.v_proj"].b[0, 0] == 4 / 2  # alpha / sqrt(r)
    pattern = write_adapter(tmp_path / "pat", {"alpha_pattern": {"v_proj": 16}}, tensors)
    assert load_lora_model(pattern, SHAPES, 8).modules["model.layers.0.self_attn.v_proj"].b[0, 0] == 16 / 4


@pytest.mark.parametrize(
    "config, tensors, message",
    [
        ({"use_dora": True}, _pair("q_proj", 2, 8, 8), "DoRA"),
        ({"bias": "lora_only"}, _pair("q_proj", 2, 8, 8), "biases"),
        ({"modules_to_save": ["lm_head"]}, _pair("q_proj", 2, 8, 8), "modules_to_save"),
        ({}, {"base_model.model.lm_head.lora_A.weight": torch.ones(2, 8)}, "not supported"),
        ({}, {"base_model.model.model.embed_tokens.lora_embedding_A": torch.ones(2, 8)}, "not a LoRA A/B"),
        ({}, _pair("q_proj", 2, 8, 6), "another model"),
        ({}, _pair("q_proj", 9, 8, 8), "above --max-lora-rank 8"),
        ({}, {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.ones(2, 8)}, "missing"),
        ({"peft_type": "IA3"}, _pair("q_proj", 2, 8, 8), "only LORA"),
    ],
)
def test_refused_checkpoints(tmp_path, config, tensors, message):
    with pytest.raises(LoRALoadError, match=message):
        load_lora_model(write_adapter(tmp_path / "a", config, tensors), SHAPES, 8)


def test_layer_past_the_model(tmp_path):
    prefix = "base_model.model.model.layers.5.self_attn.q_proj"
    tensors = {f"{prefix}.lora_A.weight": torch.ones(2, 8), f"{prefix}.lora_B.weight": torch.ones(8, 2)}
    with pytest.raises(LoRALoadError, match="past the base model's 2 layers"):
        load_lora_model(write_adapter(tmp_path / "a", {}, tensors), SHAPES, 8)
