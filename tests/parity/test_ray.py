"""The Ray executor on a Ray cluster of two nodes, both on this machine: `ray start --head` and a
second `ray start --address`, each offering one CPU, so that a tp=2 engine must put one rank on
each node. The engine joins the cluster through RAY_ADDRESS (and so picks the ray backend by
itself) and gives the tokens of a single-rank engine. Skipped, with its reason, where Ray cannot
start (not installed, or a Ray cluster of someone else's already runs here)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from splitserve import LLM, SamplingParams
from splitserve.process_utils import free_port

pytestmark = pytest.mark.slow  # starts a two-node Ray cluster

PROMPTS = [[5 + i + j for j in range(6 + 3 * i)] for i in range(3)]


def _ray(*args: str, env: dict) -> subprocess.CompletedProcess:
    ray = shutil.which("ray", path=os.path.dirname(sys.executable)) or "ray"
    return subprocess.run([ray, *args], env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def two_node_cluster():
    """One cluster for the module's tests (starting and stopping one takes about 18 s); each test
    shuts its engine down, which gives the cluster's CPUs back."""
    pytest.importorskip("ray", reason="ray is not installed (pip install splitserve[ray])")
    if os.path.exists("/tmp/ray/ray_current_cluster"):
        pytest.skip("a Ray cluster already runs on this machine; the test would join or stop it")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    address = f"127.0.0.1:{free_port()}"
    head = _ray(
        "start",
        "--head",
        f"--port={address.split(':')[1]}",
        "--num-cpus=1",
        '--resources={"node_a": 1}',
        "--include-dashboard=false",
        env=env,
    )
    try:
        if head.returncode != 0:
            pytest.skip(f"Ray could not start here: {head.stderr.strip()[-500:]}")
        second = _ray("start", f"--address={address}", "--num-cpus=1", '--resources={"node_b": 1}', env=env)
        assert second.returncode == 0, second.stderr
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("RAY_ADDRESS", address)
            patch.setenv("RAY_AUTH_MODE", "disabled")
            yield address
    finally:
        _ray("stop", "--force", env=env)


def _generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


def _llm(path: str, **kwargs) -> LLM:
    return LLM(path, dtype="float32", max_model_len=128, num_gpu_blocks_override=64, use_tqdm_on_load=False, **kwargs)


def test_one_rank_on_each_node(tiny_models, two_node_cluster):
    expected = _generate(_llm(tiny_models["qwen2"]))
    llm = _llm(tiny_models["qwen2"], tensor_parallel_size=2)
    executor = llm.llm_engine.engine_core.executor
    assert type(executor).__name__ == "RayDistributedExecutor"
    assert len(set(executor.node_ids)) == 2
    assert _generate(llm) == expected
    llm.llm_engine.engine_core.shutdown()


def test_expert_parallel_moe_across_two_nodes(tiny_moe_chat_model, two_node_cluster):
    """--enable-expert-parallel with one rank on each node: each holds half of the experts."""
    expected = _generate(_llm(tiny_moe_chat_model))
    llm = _llm(tiny_moe_chat_model, tensor_parallel_size=2, enable_expert_parallel=True)
    executor = llm.llm_engine.engine_core.executor
    assert type(executor).__name__ == "RayDistributedExecutor" and len(set(executor.node_ids)) == 2
    assert _generate(llm) == expected
    assert sorted(llm.llm_engine.expert_load()) == [1, 2]  # MoE from layer 1, counts merged from both nodes
    llm.llm_engine.engine_core.shutdown()


def test_data_parallel_replicas_on_ray(tiny_models, two_node_cluster):
    """--data-parallel-backend ray: each replica's rank is a Ray actor of one CPU, so with one CPU per
    node the two replicas compute on the two nodes; their tokens are one engine's."""
    expected = _generate(_llm(tiny_models["qwen2"]))
    llm = _llm(tiny_models["qwen2"], data_parallel_size=2, data_parallel_backend="ray")
    try:
        assert _generate(llm) == expected
        assert min(llm.llm_engine.engine_core.num_requests) >= 1  # both replicas served
    finally:
        llm.llm_engine.engine_core.shutdown()
