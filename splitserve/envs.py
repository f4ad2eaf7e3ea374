"""Every environment variable splitserve reads, declared once: its type, default and what it does.

Modules read them as attributes (`envs.SPLITSERVE_CPU_KERNELS`), which parse the environment at
that moment, so a test's monkeypatch or a launcher's child environment takes effect. A bad value
raises a ValueError naming the variable. `splitserve env` prints the table below with the values
set in this environment, and tests/unit/test_envs.py fails on a `SPLITSERVE_*` read that is not
declared here and keeps docs/envs.md equal to `markdown_table()`.

Variables of the specification documents' deployments (rank tables, NODE_PORTS, USE_OPENAI) and
of other tools (PROMETHEUS_MULTIPROC_DIR, RAY_ADDRESS) keep their own names and live with the code
that owns them.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def _flag(text: str) -> bool:
    value = text.strip().lower()
    if value in _TRUE:
        return True
    if value in _FALSE:
        return False
    raise ValueError(f"expected 1 or 0, got {text!r}")


def _optional_str(text: str) -> str | None:
    return text.strip() or None


def _choice(*options: str) -> Callable[[str], str]:
    def parse(text: str) -> str:
        value = text.strip().lower()
        if value not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {text!r}")
        return value

    parse.__name__ = " or ".join(options)
    return parse


def _optional_float(text: str) -> float | None:
    return float(text) if text.strip() else None


def _optional_int(text: str) -> int | None:
    return int(text) if text.strip() else None


@dataclass(frozen=True)
class EnvVar:
    name: str
    parse: Callable[[str], Any]
    default: str
    help: str
    group: str

    def read(self, environ=os.environ) -> Any:
        text = environ.get(self.name, self.default)
        try:
            return self.parse(text)
        except ValueError as exc:
            raise ValueError(f"{self.name}: {exc}") from None

    @property
    def kind(self) -> str:
        kinds = {_flag: "0/1", float: "number", int: "integer", _optional_float: "number", _optional_int: "integer"}
        return kinds.get(self.parse, "text" if self.parse is _optional_str else self.parse.__name__)


_DECLARED = [
    EnvVar(
        "SPLITSERVE_LOGGING_LEVEL",
        _choice("debug", "info", "warning", "error"),
        "info",
        "The level of splitserve's logs in every process (servers, engine, ranks); debug adds e.g. the tokens "
        "routed to each expert of an MoE model, logged at shutdown.",
        "logging",
    ),
    # kernels
    EnvVar("SPLITSERVE_CPU_KERNELS", _flag, "1", "0 runs plain torch ops instead of the C++ CPU kernels.", "kernels"),
    EnvVar(
        "SPLITSERVE_CPU_ISA",
        _choice("native", "avx2"),
        "native",
        "avx2 builds and runs the CPU kernels without AVX-512 (as on AVX2 hosts), under a build of its own.",
        "kernels",
    ),
    EnvVar(
        "SPLITSERVE_GPU_KERNELS",
        _flag,
        "1",
        "0 runs torch ops instead of splitserve's Triton kernels on CUDA (norm, rotary, SiLU, plain sampling, "
        "W4A16 products; int4 weights are then dequantized per forward).",
        "kernels",
    ),
    EnvVar(
        "SPLITSERVE_MOE_GROUPED_MM",
        _flag,
        "1",
        "0 rules out torch's grouped GEMM for a GPU's mixture-of-experts layers (SPLITSERVE_MOE_BACKEND).",
        "kernels",
    ),
    EnvVar(
        "SPLITSERVE_MOE_BACKEND",
        _choice("auto", "triton", "grouped_mm", "loop"),
        "auto",
        "How a GPU's unquantized mixture-of-experts layers run their experts: auto takes the Triton fused-MoE "
        "kernels, else torch's grouped GEMM (bfloat16, Hopper), else expert by expert; triton or grouped_mm takes "
        "that one where it fits, else expert by expert; loop is expert by expert (no CUDA graphs).",
        "kernels",
    ),
    EnvVar(
        "SPLITSERVE_CPU_PACKED_WEIGHTS",
        _flag,
        "1",
        "0 keeps bfloat16 and float32 weights unpacked (no oneDNN blocked layout).",
        "kernels",
    ),
    EnvVar(
        "SPLITSERVE_CPU_ROW_BUCKETS",
        _flag,
        "1",
        "0 stops padding CPU matmul rows to the bucket sizes oneDNN has kernels ready for.",
        "kernels",
    ),
    EnvVar(
        "SPLITSERVE_CPU_DECODE_STACK",
        _flag,
        "1",
        "0 runs CPU steps layer by layer in Python instead of one C++ call.",
        "kernels",
    ),
    EnvVar(
        "SPLITSERVE_CPU_ATTENTION_BRGEMM",
        _choice("auto", "1", "0"),
        "auto",
        "Prompt attention's products through oneDNN's block kernels: auto for float32 everywhere and bfloat16 where "
        "the CPU has AMX (on its tiles), 1 for bfloat16 wherever it is native too, 0 for neither (own vector loops).",
        "kernels",
    ),
    EnvVar(
        "SPLITSERVE_CPU_SHM_ALL_REDUCE",
        _flag,
        "1",
        "0 sums tensor-parallel CPU ranks of one machine through gloo instead of shared memory.",
        "kernels",
    ),
    EnvVar(
        "SPLITSERVE_BATCH_INVARIANT",
        _flag,
        "0",
        "1 turns on batch-invariant numerics by default (--batch-invariant; docs/determinism.md).",
        "kernels",
    ),
    EnvVar(
        "SPLITSERVE_CUDA_SYNC_DEBUG",
        _choice("", "warn", "error"),
        "",
        "warn (or error) has torch report each call that makes the host wait for the GPU "
        "(torch.cuda.set_sync_debug_mode) in the model runner: how the GPU check finds host stalls.",
        "kernels",
    ),
    EnvVar(
        "SPLITSERVE_ATTENTION_BACKEND",
        _optional_str,
        "",
        "Forces an attention backend: torch, cpu or triton (default: chosen by device and KV dtype).",
        "kernels",
    ),
    # resources
    EnvVar(
        "SPLITSERVE_CPU_KVCACHE_SPACE",
        float,
        "4",
        "GiB of KV cache on CPU when --kv-cache-memory-bytes is not given.",
        "resources",
    ),
    EnvVar(
        "SPLITSERVE_CPU_CORES",
        _optional_str,
        "",
        "Comma-separated cores this engine (or rank) runs on; set by launchers for each instance.",
        "resources",
    ),
    EnvVar(
        "SPLITSERVE_DATA_PARALLEL_RANK",
        _optional_int,
        "",
        "This engine's replica index under --data-parallel-size (set for each replica; its KV events sockets "
        "are offset by it).",
        "resources",
    ),
    EnvVar(
        "SPLITSERVE_RAY_CPUS_PER_RANK",
        int,
        "1",
        "CPU cores each rank's Ray placement-group bundle asks for.",
        "resources",
    ),
    EnvVar(
        "SPLITSERVE_CACHE_DIR",
        _optional_str,
        "",
        "Where parsed GGUF tokenizers, cached configs and kernel notes go (default ~/.cache/splitserve).",
        "resources",
    ),
    EnvVar(
        "SPLITSERVE_ENGINE_START_METHOD",
        _choice("auto", "fork", "spawn"),
        "auto",
        "How a server starts its engine process on the CPU. auto: forked from the server once it has read the "
        "model's config (torch and transformers are not imported twice) on a host without NVIDIA GPUs, spawned "
        "(a fresh interpreter) otherwise; fork: forked whenever the engine runs on the CPU; spawn: always spawned. "
        "Ranks (--tensor/--pipeline-parallel-size) are forked from a CPU engine that runs no native thread pool "
        "yet, unless this says spawn.",
        "resources",
    ),
    EnvVar(
        "SPLITSERVE_CONFIG_CACHE",
        _flag,
        "1",
        "0 parses model configs with transformers at every start instead of the cached copy.",
        "resources",
    ),
    # serving
    EnvVar("SPLITSERVE_API_KEY", _optional_str, "", "Default for --api-key.", "serving"),
    EnvVar(
        "SPLITSERVE_IMAGE_FETCH_TIMEOUT",
        float,
        "5",
        "Seconds an image_url fetched over http(s) may take (vLLM's VLLM_IMAGE_FETCH_TIMEOUT).",
        "serving",
    ),
    # diagnostics
    EnvVar(
        "SPLITSERVE_STARTUP_REPORT",
        _optional_str,
        "",
        "Directory where each process writes its start-up phases as JSON (bench startup sets it).",
        "diagnostics",
    ),
    EnvVar(
        "SPLITSERVE_TRACEMALLOC",
        _optional_int,
        "",
        "Frames per tracemalloc trace: the engine logs where its Python memory grows.",
        "diagnostics",
    ),
    EnvVar(
        "SPLITSERVE_TRACEMALLOC_INTERVAL_S",
        float,
        "60",
        "Seconds between SPLITSERVE_TRACEMALLOC reports.",
        "diagnostics",
    ),
    # fault injection (tests)
    EnvVar(
        "SPLITSERVE_FAULT_STEP_STALL_S",
        _optional_float,
        "",
        "Testing: the engine's first busy step sleeps this long (the watchdog's test).",
        "fault injection",
    ),
    EnvVar(
        "SPLITSERVE_FAULT_KV_BLOCK_DELAY_S",
        _optional_float,
        "",
        "Testing: a KV pull's blocks are held back this long, as a slow link would.",
        "fault injection",
    ),
    EnvVar(
        "SPLITSERVE_FAULT_KV_LEASE_DELAY_S",
        _optional_float,
        "",
        "Testing: the prefill side answers KV lease requests this much later.",
        "fault injection",
    ),
]
VARIABLES: dict[str, EnvVar] = {var.name: var for var in _DECLARED}


def __getattr__(name: str) -> Any:
    if name in VARIABLES:
        return VARIABLES[name].read()
    raise AttributeError(f"module 'splitserve.envs' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(list(globals()) + list(VARIABLES))


def is_set(name: str) -> bool:
    """Whether the variable is given a non-empty value in this environment."""
    assert name in VARIABLES, name
    return bool(os.environ.get(name, "").strip())


def cache_root() -> str:
    """splitserve's own cache directory (GGUF tokenizers, configs, kernel notes)."""
    return VARIABLES["SPLITSERVE_CACHE_DIR"].read() or os.path.join(os.path.expanduser("~"), ".cache", "splitserve")


def markdown_table() -> str:
    """The table of docs/envs.md."""
    rows = ["| variable | type | default | what it does |", "|---|---|---|---|"]
    for group in dict.fromkeys(var.group for var in _DECLARED):
        rows.append(f"| **{group}** | | | |")
        for var in (v for v in _DECLARED if v.group == group):
            rows.append(f"| `{var.name}` | {var.kind} | {var.default or '(unset)'} | {var.help} |")
    return "\n".join(rows) + "\n"


def describe(environ=os.environ) -> str:
    """Every variable with its value here (for `splitserve env`)."""
    width = max(map(len, VARIABLES))
    lines = []
    for var in _DECLARED:
        value = environ.get(var.name)
        shown = f"{value!r} (set)" if value is not None else f"{var.default or '(unset)'} (default)"
        lines.append(f"{var.name:<{width}}  {shown:<24}  {var.help}")
    return "\n".join(lines)
