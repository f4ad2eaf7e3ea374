"""docs/code-map.md lists every module and kernel source of the package with what it holds (written
by scripts/code_map.py from the docstrings and leading comments)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _code_map_script():
    spec = importlib.util.spec_from_file_location("code_map", ROOT / "scripts" / "code_map.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_code_map_is_current():
    expected = _code_map_script().code_map()
    assert (ROOT / "docs" / "code-map.md").read_text() == expected, (
        "docs/code-map.md is stale: run `python scripts/code_map.py > docs/code-map.md`"
    )


def test_first_sentence():
    first_sentence = _code_map_script().first_sentence
    assert first_sentence("One thing. And more.\n\nDetails.") == "One thing."
    assert first_sentence("The model (a.b.c) runs.\nNext line.") == "The model (a.b.c) runs."
    assert first_sentence("x " * 200).endswith(" ...")
