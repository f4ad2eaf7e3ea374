"""The KV offloading tier (--kv-offloading-size, --kv-cache-dir): prefix blocks evicted from a small
device pool come back from host memory or disk instead of being computed again, and the greedy
tokens stay transformers' (float32 blocks are copied bit for bit)."""

from __future__ import annotations

import os

import pytest

from splitserve import LLM, SamplingParams
from tests.helpers.hf_reference import assert_greedy_match, hf_greedy, load_hf_model
from tests.helpers.parity import LOGPROB_ATOL

MAX_TOKENS = 8
# Four 40-token prompts sharing nothing: a 24-block pool of 4 tokens holds one at a time.
PROMPTS = [[(7 * i + 13 * j) % 900 + 5 for j in range(40)] for i in range(4)]


@pytest.fixture(scope="module")
def references(tiny_models):
    model = load_hf_model(tiny_models["qwen3"])
    return [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def _llm(path: str, **kwargs) -> LLM:
    return LLM(
        path,
        dtype="float32",
        use_tqdm_on_load=False,
        block_size=4,
        num_gpu_blocks_override=24,
        max_model_len=64,
        max_num_seqs=1,
        **kwargs,
    )


def _run(llm: LLM, references) -> list:
    """Each prompt twice in turn: the second pass finds its prefix evicted from the device."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outputs = []
    for _ in range(2):
        for prompt, ref in zip(PROMPTS, references):
            out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
            completion = out.outputs[0]
            logprobs = [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
            assert_greedy_match(completion.token_ids, logprobs, ref, LOGPROB_ATOL)
            outputs.append(out)
    return outputs


def _tier(llm: LLM):
    return llm.llm_engine.engine_core.kv_manager.pool.tier


def test_host_tier_serves_evicted_prefixes(tiny_models, references):
    llm = _llm(tiny_models["qwen3"], kv_offloading_size=0.001)
    outputs = _run(llm, references)
    tier = _tier(llm)
    stats = llm.llm_engine.engine_core.stats().kv_offload  # what /metrics exports
    assert stats.stored_blocks > 0 and stats.host_hit_blocks == tier.stats.host_hit_blocks > 0
    # The second pass computed only each prompt's last block: the rest came back from host memory.
    assert [o.num_cached_tokens for o in outputs[4:]] == [36] * 4
    without = _llm(tiny_models["qwen3"])
    assert [o.num_cached_tokens for o in _run(without, references)[4:]] == [0] * 4


def test_disk_tier_survives_a_restart(tiny_models, references, tmp_path):
    first = _llm(tiny_models["qwen3"], kv_cache_dir=str(tmp_path))
    _run(first, references)
    assert _tier(first).stats.disk_hit_blocks > 0  # no host tier: every hit is read from disk
    first.llm_engine.engine_core.shutdown()  # waits for the disk writes, as a server stopping does
    del first
    (directory,) = os.listdir(tmp_path)
    files = os.listdir(tmp_path / directory)
    assert files and all(f.endswith(".kv") for f in files)

    second = _llm(tiny_models["qwen3"], kv_cache_dir=str(tmp_path), kv_offloading_size=0.001)
    outputs = _run(second, references)
    assert [o.num_cached_tokens for o in outputs[:4]] == [36] * 4  # the first pass after the restart hits
    assert _tier(second).stats.disk_hit_blocks >= 4 * 9


def test_an_instance_reads_blocks_another_instance_wrote_after_it_started(tiny_models, references, tmp_path):
    """Two engines of one model on one host (PD prefill instances, replicas) share --kv-cache-dir."""
    reader = _llm(tiny_models["qwen3"], kv_cache_dir=str(tmp_path))
    writer = _llm(tiny_models["qwen3"], kv_cache_dir=str(tmp_path))
    _run(writer, references)
    writer.llm_engine.engine_core.shutdown()
    outputs = _run(reader, references)
    assert [o.num_cached_tokens for o in outputs[:4]] == [36] * 4  # its own first pass hits the writer's files
    assert _tier(reader).disk.num_skipped == 0


def test_corrupt_and_foreign_files_are_skipped(tiny_models, references, tmp_path):
    first = _llm(tiny_models["qwen3"], kv_cache_dir=str(tmp_path))
    _run(first, references)
    first.llm_engine.engine_core.shutdown()  # waits for the disk writes, as a server stopping does
    del first
    (directory,) = os.listdir(tmp_path)
    files = sorted(tmp_path.joinpath(directory).iterdir())
    for path in files[::2]:  # flip a byte in the payload of every other file
        data = bytearray(path.read_bytes())
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    # A model with other weights (layout key) never looks at these files at all.
    other = _llm(tiny_models["llama"], kv_cache_dir=str(tmp_path))
    assert _tier(other).disk.directory != str(tmp_path / directory)
    del other

    second = _llm(tiny_models["qwen3"], kv_cache_dir=str(tmp_path))
    _run(second, references)  # tokens still transformers': the corrupt blocks were computed again
    assert _tier(second).disk.num_skipped > 0


@pytest.mark.slow  # starts rank processes
def test_two_ranks_keep_their_own_files(tiny_models, references, tmp_path):
    """tp=2: each rank copies and writes its share; a block is a hit only when both ranks' files are there."""
    first = _llm(tiny_models["qwen3"], tensor_parallel_size=2, kv_offloading_size=0.002, kv_cache_dir=str(tmp_path))
    _run(first, references)
    assert _tier(first).stats.host_hit_blocks > 0
    first.llm_engine.engine_core.shutdown()
    del first
    (directory,) = os.listdir(tmp_path)
    names = os.listdir(tmp_path / directory)
    assert {n.split(".rank")[0] for n in names if ".rank0." in n} == {
        n.split(".rank")[0] for n in names if ".rank1." in n
    }
    second = _llm(tiny_models["qwen3"], tensor_parallel_size=2, kv_cache_dir=str(tmp_path))
    assert [o.num_cached_tokens for o in _run(second, references)[:4]] == [36] * 4


def test_a_draft_model_proposes_as_well_when_blocks_come_back_from_the_tier(tiny_models, references):
    """Speculative decoding with a draft model and the tier: the draft catches its own KV up from
    position 0 for every new request (executor/draft_model.py), so blocks the target loads back from
    the tier leave its proposals as good: a draft equal to the target is still accepted."""
    draft = {"model": tiny_models["qwen3"], "num_speculative_tokens": 2}
    llm = _llm(tiny_models["qwen3"], kv_offloading_size=0.002, speculative_config=draft)
    _run(llm, references)
    core = llm.llm_engine.engine_core
    assert core.kv_manager.pool.tier.stats.host_hit_blocks > 0
    stats = core.speculator.stats
    assert stats.num_accepted_tokens >= 0.95 * stats.num_draft_tokens > 0


def test_offloading_flags_are_checked(tiny_models):
    with pytest.raises(ValueError, match="LMCache is not integrated"):
        _llm(tiny_models["qwen3"], kv_offloading_size=1, kv_offloading_backend="lmcache")
    with pytest.raises(
        ValueError, match="with --no-enable-prefix-caching: the offloading tier keeps prefix-cache blocks"
    ):
        _llm(tiny_models["qwen3"], kv_offloading_size=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="smaller than one KV block"):
        _llm(tiny_models["qwen3"], kv_offloading_size=1e-9)


@pytest.mark.parametrize("level", [1, 2])
def test_the_tier_sleeps_and_wakes_with_the_engine(tiny_models, references, tmp_path, level):
    """Sleep mode with offloading: the tier's host memory and disk writer outlive the released KV
    cache and work on the new one (the host tier starts empty, as the prefix cache does)."""
    llm = _llm(tiny_models["qwen3"], kv_offloading_size=0.001, kv_cache_dir=str(tmp_path))
    _run(llm, references)
    llm.sleep(level)
    llm.wake_up()
    hits = _tier(llm).stats.host_hit_blocks
    outputs = _run(llm, references)  # the same tokens (checked against transformers)
    assert _tier(llm).stats.host_hit_blocks > hits  # the host copies made after waking come back
    assert all(o.num_cached_tokens == 36 for o in outputs)  # the first pass from disk, the second from host


def test_a_weight_update_moves_the_disk_tier_to_the_new_weights(tiny_models, references, tmp_path):
    """Blocks of the old weights are never read after a weight update: the disk tier's directory is
    keyed by the weights, so it changes with them."""
    from tests.helpers.models import perturbed_copy

    llm = _llm(tiny_models["qwen3"], kv_cache_dir=str(tmp_path / "tier"))
    _run(llm, references)
    old_dir = _tier(llm).disk_dir
    llm.update_weights(perturbed_copy(tiny_models["qwen3"], str(tmp_path / "new"), seed=3))
    assert _tier(llm).disk_dir != old_dir and os.path.dirname(_tier(llm).disk_dir) == os.path.dirname(old_dir)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], params, use_tqdm=False)[0]
    assert out.num_cached_tokens == 0  # nothing of the old weights' KV came back
