"""Sleep mode (vLLM's LLM.sleep / wake_up / is_sleeping / reset_prefix_cache) on a tiny model: an idle
engine releases its KV cache (level 1) or its weights too (level 2), refuses requests while it
sleeps, and after waking gives the same greedy tokens as before, with an empty prefix cache; a busy
engine refuses to sleep. (The server's routes: tests/e2e/test_sleep_mode_server.py.)"""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.errors import EngineAsleepError

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
