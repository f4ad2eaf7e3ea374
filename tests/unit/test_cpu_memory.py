"""splitserve.kernels.cpu_memory: glibc keeps a step's freed activation buffers for the next one.

Each case runs in a fresh interpreter (malloc's thresholds are per process) and reads glibc's own
counters (mallinfo2): where a step's blocks come from, and what is kept once they are freed.
"""

import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="the setting is glibc's malloc")

# A "step": 8 to 24 MiB blocks (a 2048-token prefill step's activations), 96 MiB in all, then
# freed; then one 200 MiB block, more than the heap keeps free. Prints: applied, MiB of the step's
# blocks mapped on their own (mmap), MiB kept at the heap's top after the frees, MiB mapped for the
# 200 MiB block.
STEP = """
import ctypes, sys
fields = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")
class MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in fields]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
from splitserve.kernels import cpu_memory
applied = cpu_memory.keep_freed_buffers() if sys.argv[1] == "tuned" else "untouched"
MiB = 1 << 20
before = libc.mallinfo2().hblkhd
blocks = [libc.malloc(n * MiB) for n in (8, 16, 24, 24, 24)]
mapped = libc.mallinfo2().hblkhd - before
for block in blocks:
    libc.free(block)
kept = libc.mallinfo2().keepcost
big = libc.malloc(200 * MiB)
big_mapped = libc.mallinfo2().hblkhd - before
libc.free(big)
print(applied, mapped // MiB, kept // MiB, big_mapped // MiB)
"""


def run_step(mode: str, **env: str) -> tuple[str, int, int, int]:
    clean = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES" and not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", STEP, mode], env={**clean, **env}, capture_output=True, text=True, check=True
    ).stdout.split()
    return out[0], int(out[1]), int(out[2]), int(out[3])


@pytest.mark.slow  # an engine in a fresh interpreter
def test_a_steps_blocks_come_from_the_heap_and_stay_there_once_freed():
    # glibc's default maps each block above 128 KiB on its own and unmaps it on free (then raises
    # its threshold): the next step's blocks come back as fresh pages, faulted in again.
    _, mapped, _, _ = run_step("untouched")
    assert mapped >= 96
    applied, mapped, kept, big_mapped = run_step("tuned")
    assert applied == "True"
    assert mapped == 0  # from the heap ...
    assert kept >= 96  # ... and kept there for the next step (trim threshold 512 MiB)
    assert big_mapped >= 200  # a block above 32 MiB that the free top cannot hold (a KV cache) is still mapped


@pytest.mark.parametrize(
    "env", [{"MALLOC_MMAP_THRESHOLD_": "65536"}, {"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1048576"}]
)
@pytest.mark.slow  # an engine in a fresh interpreter
def test_what_the_user_set_is_kept(env):
    applied, _, _, _ = run_step("tuned", **env)
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
