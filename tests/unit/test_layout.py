"""The code's layout rules: no import cycle among splitserve's modules (imports inside functions
included: a lazy import only hides a cycle until the code path runs), layers that depend downwards
only, and modules small enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "splitserve"
MAX_MODULE_LINES = 350
MAX_KERNEL_LINES = 600  # the C++ kernels' .cpp and .h files
# Modules any layer may import; they import only one another.
LEAVES = {
    "config",
    "sampling_params",
    "pooling_params",
    "outputs",
    "kernels",
    "process_utils",
    "lora",
    "envs",
    "version",
    "spec_decode",
    "tracing",
    "step_timing",
    "devices",
    "json_config",
}
# The layers each layer imports besides the leaves, top to bottom (docs/design.md's table): exactly the
# edges the code uses (test_allowed_edges_are_used), none both ways (test_no_layer_pair_both_ways).
# `splitserve` is the package's facade (splitserve/__init__.py); `cli` is the `splitserve` command,
# which dispatches to the entrypoints and the benchmarks, which drive the offline API.
ALLOWED = {
    "splitserve": {"entrypoints"},
    "cli": {"benchmarks", "deploy", "entrypoints", "engine"},
    "deploy": set(),  # Kubernetes manifests and their renderer: YAML, no engine
    "benchmarks": {"disagg", "engine", "entrypoints", "loader", "quantization", "tokenizer"},
    "entrypoints": {"disagg", "engine", "kv_tier", "loader", "multimodal", "quantization", "tokenizer"},
    "disagg": {"executor"},
    "engine": {"distributed", "executor", "kv_tier", "layers", "loader", "multimodal", "tokenizer"},
    "tokenizer": {"loader"},
    "executor": {"distributed", "kv_tier", "layers", "loader", "models", "multimodal", "quantization"},
    "kv_tier": set(),  # the KV offloading tier: the engine's index, the ranks' copier, the disk files
    "multimodal": set(),  # images in requests: loaded, processed, carried as data
    "vl": {"multimodal"},  # LMDeploy's lmdeploy.vl (load_image)
    "loader": {"layers", "models", "quantization"},
    "quantization": {"layers"},
    "models": {"distributed", "layers"},
    "layers": {"distributed"},
    "distributed": set(),
}
# Modules that form a layer of their own, apart from their package's.
OWN_LAYER = {"splitserve.entrypoints.cli": "cli"}


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported_modules(name: str) -> set[str]:
    """The splitserve modules `name` imports anywhere in its body. `from pkg import x` names the
    submodule pkg.x when there is one, else pkg itself."""
    tree = ast.parse(MODULES[name].read_text())
    is_package = MODULES[name].name == "__init__.py"
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, name, is_package)
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base)
    return {m for m in found if m in MODULES and m != name}


def _absolute(node: ast.ImportFrom, name: str, is_package: bool) -> str:
    if not node.level:
        return node.module
    parts = name.split(".")
    base = parts[: len(parts) - node.level + is_package]
    return ".".join(base + ([node.module] if node.module else []))


GRAPH = {name: imported_modules(name) for name in MODULES}


def find_cycle() -> list[str] | None:
    """A cycle of the import graph (depth-first, three colours), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for start in sorted(GRAPH):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_no_import_cycle():
    cycle = find_cycle()
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_cycles(monkeypatch):
    monkeypatch.setitem(GRAPH, "splitserve.config", GRAPH["splitserve.config"] | {"splitserve.entrypoints.cli"})
    assert find_cycle() is not None


def _layer(module: str) -> str:
    if module in OWN_LAYER:
        return OWN_LAYER[module]
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "splitserve"


def _layer_edges() -> dict[tuple[str, str], list[str]]:
    """(importing layer, imported layer) -> the module imports behind it, for every pair of layers."""
    edges: dict[tuple[str, str], list[str]] = {}
    for name, imported in GRAPH.items():
        for other in imported:
            if _layer(other) != _layer(name):
                edges.setdefault((_layer(name), _layer(other)), []).append(f"{name} -> {other}")
    return edges


def test_every_module_has_a_layer():
    unknown = sorted(name for name in MODULES if _layer(name) not in LEAVES | set(ALLOWED))
    assert not unknown, f"modules outside every layer of the table: {unknown}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_layers_depend_downwards(name):
    layer = _layer(name)
    allowed = LEAVES if layer in LEAVES else LEAVES | ALLOWED[layer]
    wrong = sorted(m for m in GRAPH[name] if _layer(m) not in allowed | {layer})
    assert not wrong, f"{name} (layer {layer}) imports {wrong}"


def test_allowed_edges_are_used():
    used = _layer_edges()
    unused = sorted(f"{a} -> {b}" for a, targets in ALLOWED.items() for b in targets if (a, b) not in used)
    assert not unused, f"allowed but not imported (remove them from ALLOWED): {unused}"


def test_no_layer_pair_both_ways():
    both = sorted(f"{a} <-> {b}" for a, targets in ALLOWED.items() for b in targets if a in ALLOWED.get(b, set()))
    assert not both, both


# What the engine core (engine/core/: the engine process's loop, scheduler, KV cache manager ...) may
# import of its front-ends' package (engine/): the messages between them and what both use.
ENGINE_SHARED = {"messages", "errors", "startup", "lora_registry"}


def test_the_engine_core_does_not_import_its_front_ends():
    """engine/core/ sits under engine/'s front-ends (AsyncLLM, LLMEngine, DP, processor, output
    processor, detokenizer, supervisor, args): they import it, it imports none of them."""
    wrong = sorted(
        f"{name} -> {other}"
        for name, imported in GRAPH.items()
        if name.startswith("splitserve.engine.core")
        for other in imported
        if other.startswith("splitserve.engine.")
        and not other.startswith("splitserve.engine.core")
        and other.rsplit(".", 1)[1] not in ENGINE_SHARED
    )
    assert not wrong, wrong


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_MODULE_LINES, f"{MODULES[name]} has {lines} lines (at most {MAX_MODULE_LINES})"


@pytest.mark.parametrize("path", sorted(p for p in (PACKAGE / "kernels").iterdir() if p.suffix in (".cpp", ".h")))
def test_kernel_sources_stay_small(path):
    lines = path.read_text().count("\n")
    assert lines <= MAX_KERNEL_LINES, f"{path} has {lines} lines (at most {MAX_KERNEL_LINES})"


@pytest.mark.parametrize("command", [["check"], ["format", "--check"]], ids=["lint", "format"])
def test_ruff_is_clean(command):
    """ruff's lint and format rules (pyproject.toml) hold for the package, the tests and the scripts."""
    import subprocess
    import sys

    root = PACKAGE.parent
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "splitserve", "tests", "scripts"],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_router_starts_without_torch():
    """The PD router (and serve --pd's launcher, which runs it) moves bytes between HTTP clients and
    instances: its start-up imports neither torch nor transformers (seconds of start-up and hundreds
    of MB it would never use). A lazily imported engine module that pulls them in breaks this. On a
    host without NVIDIA's driver, the launcher shares out the CPU cores without asking torch too."""
    import subprocess
    import sys

    probe = (
        "import sys, splitserve.entrypoints.router.app, splitserve.entrypoints.router.router\n"
        "from splitserve.disagg import launch\n"
        "if not launch.nvidia_driver_present(): launch.split_devices(2), launch.device_env([0])\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"the router imports {done.stdout.strip()}"
