"""splitserve.executor.cpu_binding: how many threads a CPU engine computes on.

Each case runs in a fresh interpreter, as torch reads OMP_NUM_THREADS and the affinity at start-up.
Torch's default is one thread per physical core; the cases set it to 1 first, as it is on a host
whose CPUs are two hardware threads of one core, and check that the engine takes them all.
"""

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs at least 2 CPUs")

CPUS = len(os.sched_getaffinity(0))

CONFIGURE = """
import logging, sys, torch
logging.basicConfig(level=logging.INFO, format="%(message)s")
torch.set_num_threads(1)
from splitserve.executor.cpu_binding import configure_cpu_threads
configure_cpu_threads()
configure_cpu_threads()  # once per process
print(torch.get_num_threads())
"""

ENGINE = """
import sys, torch
torch.set_num_threads(1)
from splitserve import LLM, SamplingParams
llm = LLM(model=sys.argv[1], max_model_len=64, use_tqdm_on_load=False)
llm.generate({"prompt_token_ids": [1, 2, 3]}, SamplingParams(max_tokens=2, temperature=0.0))
print(torch.get_num_threads())
"""


def run(code: str, *args: str, **env: str) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    environ.pop("SPLITSERVE_CPU_CORES", None)
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-c", code, *args], env=environ, capture_output=True, text=True, timeout=300, check=True
    )


def test_one_thread_per_cpu_the_process_may_use():
    out = run(CONFIGURE)
    assert out.stdout.split() == [str(CPUS)]
    assert f"CPU: {CPUS} torch threads, one per CPU this process may use" in out.stderr
    assert "where torch's default was 1 (one per physical core)" in out.stderr
    assert out.stderr.count("torch threads") == 1


def test_the_users_thread_count_is_kept():
    out = run(CONFIGURE, OMP_NUM_THREADS="1")
    assert out.stdout.split() == ["1"]
    assert "CPU: 1 torch threads, as OMP_NUM_THREADS=1 says." in out.stderr


def test_a_launchers_cores_bind_the_process():
    out = run(CONFIGURE + "import os; print(sorted(os.sched_getaffinity(0)))", SPLITSERVE_CPU_CORES="1")
    assert out.stdout.split("\n")[:2] == ["1", "[1]"]


@pytest.mark.slow  # an engine in a fresh interpreter
def test_an_engine_in_the_callers_process_takes_every_cpu(tiny_models):
    out = run(ENGINE, tiny_models["llama"])
    assert out.stdout.split()[-1] == str(CPUS)


def test_an_engine_forked_from_its_server_starts_one_thread_short():
    """While the server it was forked from imports on one core, the engine loads on the others, and
    takes them all once it is ready; an engine not forked from a server keeps every thread."""
    code = (
        "import torch\n"
        "torch.set_num_threads(2)\n"
        "from splitserve.executor.cpu_binding import one_core_left_to_the_server\n"
        "with one_core_left_to_the_server(True):\n"
        "    beside = torch.get_num_threads()\n"
        "after = torch.get_num_threads()\n"
        "with one_core_left_to_the_server(False):\n"
        "    alone = torch.get_num_threads()\n"
        "torch.set_num_threads(1)\n"
        "with one_core_left_to_the_server(True):\n"
        "    single = torch.get_num_threads()\n"
        "print(beside, after, alone, single)\n"
    )
    assert run(code).stdout.split() == ["1", "2", "2", "1"]
