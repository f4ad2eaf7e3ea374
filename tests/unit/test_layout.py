"""The code's layout rules: no import cycle among splitserve's modules (imports inside functions
included: a lazy import only hides a cycle until the code path runs), layers that depend downwards
only, and modules small enough to read in one sitting."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "splitserve"
MAX_MODULE_LINES = 400
# Which layers each layer may import (DESIGN.md's table); a layer may always import itself and the
# package's leaf modules (config, sampling_params, outputs, tokenizer, kernels, process_utils).
LEAVES = {"splitserve", "config", "sampling_params", "outputs", "tokenizer", "kernels", "process_utils", "lora"}
ALLOWED = {
    "entrypoints": {
        "engine",
        "executor",
        "disagg",
        "loader",
        "models",
        "layers",
        "quantization",
        "benchmarks",
        "distributed",
    },
    "benchmarks": {"engine", "executor", "disagg", "loader", "models", "layers", "quantization", "entrypoints"},
    "disagg": {"engine", "executor", "quantization", "distributed"},
    "engine": {"executor", "disagg", "loader", "models", "layers", "quantization", "distributed"},
    "executor": {"loader", "models", "layers", "quantization", "distributed"},
    "loader": {"models", "layers", "quantization", "distributed"},
    "models": {"layers", "quantization", "distributed"},
    "layers": {"quantization", "distributed"},
    "quantization": {"layers", "models", "loader", "distributed"},
    "distributed": set(),
}


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
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "splitserve"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_layers_depend_downwards(name):
    layer = _layer(name)
    if layer in LEAVES:
        return
    wrong = sorted(m for m in GRAPH[name] if _layer(m) not in LEAVES | {layer} | ALLOWED.get(layer, set()))
    assert not wrong, f"{name} (layer {layer}) imports {wrong}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_modules_stay_small(name):
    lines = MODULES[name].read_text().count("\n")
    assert lines <= MAX_MODULE_LINES, f"{MODULES[name]} has {lines} lines (at most {MAX_MODULE_LINES})"


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
