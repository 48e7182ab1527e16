"""Size limits of the code under sapipe/: no class over 400 lines, no function over 80.

    python tools/code_size.py [ROOT]

Prints every class and function over its limit (exit 1), or the largest of each (exit 0).
Lines are counted from the ``def``/``class`` line to the last line of the body, as the AST
gives them (decorators excluded, docstrings and comments inside included).
"""
from __future__ import annotations

import ast
import pathlib
import sys
from typing import List, Tuple

CLASS_LIMIT = 400
FUNCTION_LIMIT = 80

Entry = Tuple[int, str, str]  # (lines, "class" | "function", "path:line name")


def measure(root: pathlib.Path) -> List[Entry]:
    """Every class and function under ``root`` with its length in lines."""
    entries: List[Entry] = []
    for path in sorted(root.rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                kind = "class" if isinstance(node, ast.ClassDef) else "function"
                length = node.end_lineno - node.lineno + 1
                entries.append((length, kind, f"{path}:{node.lineno} {node.name}"))
    return entries


def over_limits(entries: List[Entry]) -> List[Entry]:
    limit = {"class": CLASS_LIMIT, "function": FUNCTION_LIMIT}
    return [e for e in entries if e[0] > limit[e[1]]]


def main(argv: List[str]) -> int:
    root = pathlib.Path(argv[1] if len(argv) > 1 else pathlib.Path(__file__).resolve().parent.parent / "sapipe")
    entries = measure(root)
    bad = over_limits(entries)
    for lines, kind, where in bad:
        print(f"{kind} over its limit: {lines} lines  {where}")
    if not bad:
        for kind in ("class", "function"):
            lines, _, where = max(e for e in entries if e[1] == kind)
            print(f"largest {kind}: {lines} lines  {where}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
