"""The environment-variable registry: every SPLITSERVE_* name the package mentions is declared in
splitserve/envs.py, only envs.py reads them from the environment, values parse or fail naming the
variable, and docs/envs.md is the registry's table."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from splitserve import envs

PACKAGE = Path(__file__).resolve().parents[2] / "splitserve"
NAME = re.compile(r"SPLITSERVE_[A-Z0-9_]*[A-Z0-9]")


def _sources() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.name != "envs.py"]


def test_every_mentioned_variable_is_declared():
    undeclared = {
        f"{path.relative_to(PACKAGE.parent)}: {name}"
        for path in _sources()
        for name in NAME.findall(path.read_text())
        if name not in envs.VARIABLES
    }
    assert not undeclared, f"declare these in splitserve/envs.py: {sorted(undeclared)}"


def _environment_reads(tree: ast.AST):
    """The first argument of os.environ.get / os.getenv / os.environ[...] calls, where it is a literal."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            target = ast.unparse(node.func)
            if target in ("os.environ.get", "os.getenv", "environ.get") and isinstance(node.args[0], ast.Constant):
                yield node.args[0].value
        if isinstance(node, ast.Subscript) and ast.unparse(node.value) in ("os.environ", "environ"):
            if isinstance(node.slice, ast.Constant) and not isinstance(node.ctx, ast.Store):
                yield node.slice.value


def test_only_the_registry_reads_splitserve_variables():
    readers = {
        f"{path.relative_to(PACKAGE.parent)} reads {name}"
        for path in _sources()
        for name in _environment_reads(ast.parse(path.read_text()))
        if isinstance(name, str) and name.startswith("SPLITSERVE_")
    }
    assert not readers, f"read these through splitserve.envs: {sorted(readers)}"


def test_the_read_check_sees_a_direct_read():
    tree = ast.parse('import os\nos.environ.get("SPLITSERVE_X", "1")\nos.environ["SPLITSERVE_Y"]')
    assert list(_environment_reads(tree)) == ["SPLITSERVE_X", "SPLITSERVE_Y"]


def test_values_parse_and_bad_ones_name_the_variable(monkeypatch):
    monkeypatch.setenv("SPLITSERVE_CPU_KERNELS", "0")
    assert envs.SPLITSERVE_CPU_KERNELS is False
    monkeypatch.setenv("SPLITSERVE_CPU_KERNELS", "true")
    assert envs.SPLITSERVE_CPU_KERNELS is True
    monkeypatch.delenv("SPLITSERVE_CPU_KVCACHE_SPACE", raising=False)
    assert envs.SPLITSERVE_CPU_KVCACHE_SPACE == 4.0
    monkeypatch.setenv("SPLITSERVE_CPU_KVCACHE_SPACE", "lots")
    with pytest.raises(ValueError, match="SPLITSERVE_CPU_KVCACHE_SPACE"):
        _ = envs.SPLITSERVE_CPU_KVCACHE_SPACE
    monkeypatch.setenv("SPLITSERVE_CPU_ISA", "sse")
    with pytest.raises(ValueError, match="SPLITSERVE_CPU_ISA.*native, avx2"):
        _ = envs.SPLITSERVE_CPU_ISA
    with pytest.raises(AttributeError):
        _ = envs.SPLITSERVE_NOT_A_VARIABLE


def test_cache_root_follows_the_variable(monkeypatch, tmp_path):
    monkeypatch.setenv("SPLITSERVE_CACHE_DIR", str(tmp_path))
    assert envs.cache_root() == str(tmp_path)
    monkeypatch.delenv("SPLITSERVE_CACHE_DIR")
    assert envs.cache_root().endswith(".cache/splitserve")


def test_docs_table_is_the_registry():
    docs = (PACKAGE.parent / "docs" / "envs.md").read_text()
    assert envs.markdown_table() in docs, "docs/envs.md is stale: regenerate it with `splitserve env --markdown`"
