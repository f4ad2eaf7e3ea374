"""Shared fixtures: tiny random-weight models of every supported architecture, made with
transformers in a temporary directory (nothing is downloaded), plus the embedded default model."""

from __future__ import annotations

import itertools
import os

# `make test` runs one pytest-xdist worker per core (pytest_collection_modifyitems orders the modules for
# them): each worker, and the servers it starts, compute on one torch thread, so that two workers share two cores
# without OpenMP threads spinning against each other. Set before torch is imported.
if int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from tests.helpers.models import (  # noqa: E402
    TINY_ARCHS,
    make_tiny_chat_model,
    make_tiny_model,
    make_tiny_moe_chat_model,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("SPLITSERVE_CPU_KVCACHE_SPACE", "0.25")


def pytest_addoption(parser):
    parser.addoption(
        "--matrix-pairs",
        action="store_true",
        help="tests/parity/test_feature_matrix.py also runs every pair of deployment columns (minutes; not in CI)",
    )


def pytest_collection_modifyitems(items):
    """Modules in the order make test's workers take them (pytest-xdist --no-loadscope-reorder): the ones
    marked `heavy` (minutes in one worker) first, so that none ends the run alone; then the end-to-end ones
    (mostly waiting on servers) alternating with the parity ones (computing in the worker), so that a
    worker waiting on its servers leaves its core to the other; the short unit tests last, to even out the
    end. A module's tests keep their order."""
    modules: dict[str, list] = {}
    for item in items:
        modules.setdefault(item.nodeid.split("::")[0], []).append(item)
    groups: dict[str, list[str]] = {"heavy": [], "e2e": [], "parity": [], "unit": []}
    for name, tests in modules.items():
        kind = name.split("/")[1] if name.count("/") > 1 else "unit"
        heavy = any(item.get_closest_marker("heavy") for item in tests)
        groups["heavy" if heavy else kind if kind in groups else "unit"].append(name)
    interleaved = [m for pair in itertools.zip_longest(groups["e2e"], groups["parity"]) for m in pair if m]
    items[:] = [item for name in groups["heavy"] + interleaved + groups["unit"] for item in modules[name]]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With SPLITSERVE_TEST_TIMES=FILE, one line per test (set-up and teardown included): its wall time,
    the CPU time of this process and of the processes it waited for (servers, engines, ranks), the
    pytest-xdist worker and the start (monotonic seconds), tab-separated: which tests wait (wall far
    above CPU), which compute and which end the run alone, to keep the suite short."""
    path = os.environ.get("SPLITSERVE_TEST_TIMES")
    if not path:
        yield
        return
    import resource
    import time

    def cpu(who):
        usage = resource.getrusage(who)
        return usage.ru_utime + usage.ru_stime

    start, own, children = time.monotonic(), cpu(resource.RUSAGE_SELF), cpu(resource.RUSAGE_CHILDREN)
    yield
    worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
    with open(path, "a") as f:
        f.write(
            f"{item.nodeid}\t{time.monotonic() - start:.2f}\t{cpu(resource.RUSAGE_SELF) - own:.2f}"
            f"\t{cpu(resource.RUSAGE_CHILDREN) - children:.2f}\t{worker}\t{start:.1f}\n"
        )


@pytest.fixture(autouse=True)
def _splitserve_log_level():
    """pipeline() sets the `splitserve` logger's level for the process (log_level, 'ERROR' by
    default, as LMDeploy does), also from module-scoped fixtures: every test starts and ends with
    the level unset, so that each sees its own logs."""
    import logging

    logger = logging.getLogger("splitserve")
    logger.setLevel(logging.NOTSET)
    yield
    logger.setLevel(logging.NOTSET)


@pytest.fixture(scope="module")
def parallel_kernels():
    """Two torch threads for a module of kernel tests, whatever the worker runs (make test's run one):
    the kernels' split of their work over threads is tested too."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def default_gguf() -> str:
    from splitserve.loader.resolve import default_model_path

    return default_model_path()


@pytest.fixture(scope="session")
def smollm_tokenizer(default_gguf):
    from splitserve.tokenizer import get_tokenizer

    return get_tokenizer(default_gguf)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, smollm_tokenizer) -> dict[str, str]:
    root = tmp_path_factory.mktemp("tiny_models")
    return {arch: make_tiny_model(str(root / arch), arch, smollm_tokenizer) for arch in TINY_ARCHS}


@pytest.fixture(scope="session")
def tiny_chat_model(tmp_path_factory, smollm_tokenizer) -> str:
    """A tiny random Llama with the whole SmolLM2 vocabulary and chat template: the other tiny
    models stop at 1024 tokens, which the template's own tokens (a system prompt, role names) exceed."""
    return make_tiny_chat_model(str(tmp_path_factory.mktemp("tiny_chat_model")), smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_moe_chat_model(tmp_path_factory, smollm_tokenizer) -> str:
    """A tiny ERNIE 4.5 MoE with the whole SmolLM2 vocabulary and chat template (tests/helpers/models.py)."""
    return make_tiny_moe_chat_model(str(tmp_path_factory.mktemp("tiny_moe_chat_model")), smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory, smollm_tokenizer) -> str:
    """A tiny LLaVA (CLIP tower, projector, Llama) with its processor (tests/helpers/multimodal.py)."""
    from tests.helpers.multimodal import make_tiny_llava

    return make_tiny_llava(str(tmp_path_factory.mktemp("tiny_llava")), smollm_tokenizer)


@pytest.fixture(scope="session")
def tiny_qwen2_vl(tmp_path_factory, smollm_tokenizer) -> str:
    """A tiny Qwen2-VL with its image processor (tests/helpers/multimodal.py)."""
    from tests.helpers.multimodal import make_tiny_qwen2_vl

    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("tiny_qwen2_vl")), smollm_tokenizer)
