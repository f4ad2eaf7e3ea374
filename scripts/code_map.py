"""Writes docs/code-map.md: every package and module of splitserve with the first sentence of its
docstring (tests/unit/test_code_map.py keeps the file equal to this output).

    python scripts/code_map.py > docs/code-map.md
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "splitserve"
HEADER = """# Code map

Every module of the `splitserve` package with the first sentence of its docstring, package by
package (the README's "Where things are" has the request path and the main concepts). Written by
`python scripts/code_map.py > docs/code-map.md`; a test fails when it is stale.
"""


def first_sentence(docstring: str) -> str:
    paragraph = " ".join(docstring.strip().split("\n\n")[0].split())
    match = re.match(r"(.+?\.)(\s|$)", paragraph)
    sentence = match.group(1) if match else paragraph
    return sentence if len(sentence) <= 240 else sentence[:240].rsplit(" ", 1)[0] + " ..."


def describe(path: Path) -> str | None:
    """The module's first docstring sentence; None for an empty __init__.py."""
    text = path.read_text()
    if not text.strip():
        return None
    docstring = ast.get_docstring(ast.parse(text))
    if not docstring:
        raise SystemExit(f"{path.relative_to(ROOT)} has no docstring: say in one sentence what it holds.")
    return first_sentence(docstring)


def describe_cpp(path: Path) -> str:
    """The first sentence of a C++ file's leading // comment."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("//"):
            break
        lines.append(line[2:].strip() or "\n\n")
    if not lines:
        raise SystemExit(f"{path.relative_to(ROOT)} has no leading // comment: say in one sentence what it holds.")
    return first_sentence(" ".join(lines).replace(" \n\n ", "\n\n"))


def kernel_sources(directory: Path) -> list[Path]:
    return sorted(p for p in directory.iterdir() if p.suffix in (".cpp", ".h"))


def code_map() -> str:
    lines = [HEADER]
    for directory in sorted({p.parent for p in PACKAGE.rglob("*.py")}):
        rows = [(p.name, describe(p)) for p in sorted(directory.glob("*.py"))]
        rows = [(name, text) for name, text in rows if text is not None]
        rows += [(p.name, describe_cpp(p)) for p in kernel_sources(directory)]
        if not rows:
            continue
        lines.append(f"## `{directory.relative_to(ROOT)}/`\n")
        lines += [f"- `{name}`: {text}" for name, text in rows]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(code_map())
