"""splitserve.kernels.cpu_memory: glibc keeps a step's freed activation buffers for the next one.

Each case runs in a fresh interpreter: malloc's thresholds are per process and cannot be read back,
so the test counts the page faults of repeated steps (what the setting is for) with and without it.
"""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's malloc")

# Five "steps", each allocating and touching 3 to 24 MiB buffers (a 2048-token prefill step's
# activations) and freeing them; prints the minor page faults of the last four, counted in 4 KiB pages.
STEPS = """
import ctypes, resource, sys, torch
ctypes.CDLL(None).prctl(41, 1, 0, 0, 0)  # PR_SET_THP_DISABLE: 4 KiB pages, whatever the host's THP mode
from splitserve.kernels import cpu_memory
print(cpu_memory.keep_freed_buffers() if sys.argv[1] == "tuned" else "untouched")
def step():
    buffers = [torch.ones(n << 20, dtype=torch.uint8) for n in (3, 6, 12, 12, 24)]
    del buffers
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def run_steps(mode: str, **env: str) -> tuple[str, int]:
    clean = {k: v for k, v in os.environ.items() if k not in ("THP_MEM_ALLOC_ENABLE", "GLIBC_TUNABLES")}
    out = subprocess.run(
        [sys.executable, "-c", STEPS, mode], env={**clean, **env}, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1])


def test_later_steps_reuse_the_heap_instead_of_faulting_pages_in():
    applied, tuned = run_steps("tuned")
    assert applied == "True"
    _, default = run_steps("untouched")
    # 57 MiB a step is ~14,600 pages of 4 KiB: glibc's default maps many of them afresh every step
    # (34,000 faults over four steps measured), the fixed thresholds almost none (~800).
    assert default > 14_600, default
    assert tuned < default // 8, (tuned, default)


@pytest.mark.parametrize(
    "env", [{"MALLOC_MMAP_THRESHOLD_": "65536"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}]
)
def test_what_the_user_set_is_kept(env):
    applied, _ = run_steps("tuned", **env)
    assert applied == "False"


def test_engine_process_sets_both(monkeypatch):
    from splitserve.kernels import cpu_memory

    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    monkeypatch.setattr(cpu_memory, "_done", set())
    calls = []
    monkeypatch.setattr(cpu_memory, "keep_freed_buffers", lambda: calls.append("malloc") or True)
    cpu_memory.tune_for_activations()
    cpu_memory.tune_for_activations()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    assert calls == ["malloc"]  # once per process
