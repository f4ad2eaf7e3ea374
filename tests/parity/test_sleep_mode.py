"""Sleep mode (vLLM's LLM.sleep / wake_up / is_sleeping / reset_prefix_cache) on a tiny model: an idle
engine releases its KV cache (level 1) or its weights too (level 2), refuses requests while it
sleeps, and after waking gives the same greedy tokens as before, with an empty prefix cache; a busy
engine refuses to sleep. LLM.update_weights: a new checkpoint's tokens, refusals that change nothing.
(The server's routes: tests/e2e/test_sleep_mode_server.py.)"""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.errors import EngineAsleepError
from tests.helpers.models import perturbed_copy

PROMPTS = [{"prompt_token_ids": list(range(5, 40))}, {"prompt_token_ids": [7, 8, 9]}]
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def llm(tiny_models):
    return LLM(tiny_models["qwen3"], dtype="float32", max_num_seqs=4, use_tqdm_on_load=False)


def _tokens(llm) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)]


@pytest.mark.parametrize("level", [1, 2])
def test_sleep_and_wake_give_the_same_tokens(llm, level):
    before = _tokens(llm)
    executor = llm.llm_engine.engine_core.executor
    assert executor.kv_cache_memory()[0] > 0
    llm.sleep(level)
    assert llm.is_sleeping()
    assert executor.kv_cache_memory() == (0, 0)
    assert (executor.runner is None) == (level == 2)
    with pytest.raises(EngineAsleepError, match="asleep"):
        llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    with pytest.raises(ValueError, match="already asleep"):
        llm.sleep(1)
    llm.wake_up()
    assert not llm.is_sleeping() and executor.kv_cache_memory()[0] > 0
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == before
    assert outputs[0].num_cached_tokens == 0  # the prefix cache starts empty after waking


def test_a_busy_engine_does_not_sleep(llm):
    llm.llm_engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="1 request"):
        llm.sleep(1)
    with pytest.raises(ValueError, match="level must be 1 or 2"):
        llm.sleep(3)
    llm.llm_engine.step()  # its prompt runs: it holds blocks
    assert not llm.reset_prefix_cache()
    llm.llm_engine.abort_request(["busy"])
    _tokens(llm)
    assert llm.reset_prefix_cache()
    assert _tokens(llm) and not llm.is_sleeping()


# --- weights updated from disk (engine/core/weight_update.py) ----------------------------------------
def test_update_weights_gives_the_new_checkpoints_tokens(llm, tiny_models, tmp_path):
    original = tiny_models["qwen3"]
    before = _tokens(llm)
    updated = perturbed_copy(original, str(tmp_path / "step1"), seed=1)
    fresh = LLM(updated, tokenizer=original, dtype="float32", max_num_seqs=4, use_tqdm_on_load=False)
    expected = _tokens(fresh)
    del fresh
    assert expected != before  # the test would prove nothing with the same tokens
    _tokens(llm)  # fills the prefix cache with the old weights' blocks
    llm.update_weights(updated)
    outputs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert outputs[0].num_cached_tokens == 0  # no block computed with the old weights is reused
    llm.update_weights(original)
    assert _tokens(llm) == before


def test_update_weights_refusals_change_nothing(llm, tiny_models, tmp_path):
    import shutil

    import transformers

    before = _tokens(llm)
    with pytest.raises(ValueError, match="does not exist"):
        llm.update_weights(str(tmp_path / "missing"))
    other = tmp_path / "other_shape"
    config = transformers.AutoConfig.from_pretrained(tiny_models["qwen3"])
    config.intermediate_size *= 2
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(other)
    with pytest.raises(ValueError, match="intermediate_size"):
        llm.update_weights(str(other))
    # A checkpoint whose config fits but whose weights cannot be read: the old weights come back.
    broken = tmp_path / "broken"
    shutil.copytree(tiny_models["qwen3"], broken)
    for file in broken.glob("*.safetensors"):
        file.write_bytes(file.read_bytes()[:1000])
    with pytest.raises(ValueError, match="previous weights were loaded again"):
        llm.update_weights(str(broken))
    assert _tokens(llm) == before
    llm.llm_engine.add_request("busy", PROMPTS[0], GREEDY)
    with pytest.raises(ValueError, match="1 request"):
        llm.update_weights(tiny_models["qwen3"])
    llm.llm_engine.abort_request(["busy"])
    llm.sleep(1)
    with pytest.raises(ValueError, match="asleep"):
        llm.update_weights(tiny_models["qwen3"])
    llm.wake_up()
    assert _tokens(llm) == before


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculative_engines_sleep_and_wake_to_the_same_tokens(tiny_models, method):
    """N-gram speculation keeps nothing on the device; a draft model's KV cache is released and its
    weights offloaded or dropped with the target's, and both come back: the same tokens after."""
    model = tiny_models["qwen3"]
    spec = {"method": "ngram"} if method == "ngram" else {"model": model}
    config = {**spec, "num_speculative_tokens": 3}
    llm = LLM(model, dtype="float32", max_num_seqs=4, use_tqdm_on_load=False, speculative_config=config)
    before = _tokens(llm)
    runner = llm.llm_engine.engine_core.executor.runner
    for level in (1, 2):
        llm.sleep(level)
        if method == "draft_model" and level == 1:
            assert all(layer.kv_cache is None for layer in runner.draft.model.attention_layers())
        llm.wake_up()
        assert _tokens(llm) == before
