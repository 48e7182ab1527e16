"""The benchmarks' entry point: list them, or run one.

    python -m benchmarks                      # every benchmark and study, one line each
    python -m benchmarks NAME [OPTIONS]       # run benchmarks/NAME.py (or studies/NAME.py)
    python -m benchmarks NAME --help          # its options
    python -m benchmarks NAME --quick         # a smoke run, where it has one

A benchmark is a script of ``benchmarks/`` (a study one of ``benchmarks/studies/``: a
question answered once, its answer in RESULTS.md) with a ``__main__`` guard; its line is
its docstring's first. NAME runs it by path with this interpreter, exactly as
``python benchmarks/NAME.py OPTIONS`` would (``.sh`` scripts with bash). Run from the
repository root (``python -m``), or as ``python benchmarks NAME``.
"""

from __future__ import annotations

import ast
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
FOLDERS = (("benchmarks", HERE), ("studies", os.path.join(HERE, "studies")))


def _describe(path: str) -> str | None:
    """The first line of a script's docstring, or None for a module without a ``__main__``."""
    with open(path) as f:
        text = f.read()
    if path.endswith(".sh"):
        comments = [line[2:] for line in text.splitlines()[1:] if line.startswith("# ")]
        return comments[0].rstrip(":").strip() if comments else ""
    if '__name__ == "__main__"' not in text:
        return None
    doc = ast.get_docstring(ast.parse(text)) or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def scripts() -> dict[str, list[tuple[str, str, str]]]:
    """Per folder: (name, path, description) of every runnable script, by name."""
    found: dict[str, list[tuple[str, str, str]]] = {}
    for label, folder in FOLDERS:
        rows = []
        for entry in sorted(os.listdir(folder)):
            path = os.path.join(folder, entry)
            if entry.startswith("_") or not entry.endswith((".py", ".sh")):
                continue
            about = _describe(path)
            if about is not None:
                rows.append((os.path.splitext(entry)[0], path, about))
        found[label] = rows
    return found


def main(argv: list[str]) -> int:
    found = scripts()
    if not argv or argv[0] in ("-h", "--help", "list"):
        print(__doc__.strip().split("\n\n")[0] + "\n")
        width = max(len(name) for rows in found.values() for name, _, _ in rows)
        for label, rows in found.items():
            print(f"{label}:")
            for name, _, about in rows:
                print(f"  {name:<{width}}  {about}")
        return 0
    name, rest = argv[0], argv[1:]
    by_name = {n: path for rows in found.values() for n, path, _ in rows}
    path = by_name.get(name.removesuffix(".py").removesuffix(".sh"))
    if path is None:
        print(f"no benchmark {name!r}; `python -m benchmarks` lists them", file=sys.stderr)
        return 2
    cmd = ["bash", path] if path.endswith(".sh") else [sys.executable, path]
    sys.stdout.flush()
    os.execvp(cmd[0], cmd + rest)
    return 1  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
