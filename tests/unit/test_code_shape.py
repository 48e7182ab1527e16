"""The code keeps its shape: no import runs up sapipe's layers, no module defines a name twice
(the later definition would silently replace the first), and the kernels' argument checks
build their messages themselves (csrc/check.h)."""

import pathlib

from support.paths import ROOT

#: sapipe's layers, bottom first: a module may import, at its top level, only from its own
#: layer and those before it (docs/design.md §1.2). An import inside a function may reach up.
LAYERS = [
    "errors",
    "kernels",
    "optim",
    "compression",
    "layout",
    "tracing",
    "schedule",
    "comm",
    "config",
    "state",
    "runtime",
    "rendezvous",
    "auto",
    "optimizer",
    "checkpoint",
    "ddp_hook",
    "elastic",
    "integrations",
    "launch",
    "__init__",
]


def _layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports_running_up(package: pathlib.Path):
    import ast

    up = []
    for path in package.rglob("*.py"):
        module = ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(
            ".__init__"
        )
        mine = LAYERS.index(_layer(module))
        for node in ast.parse(path.read_text()).body:
            if not (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.module.split(".")[0] == package.name
            ):
                continue
            targets = (
                [node.module]
                if node.module != package.name
                else [f"{node.module}.{a.name}" for a in node.names]
            )
            for target in targets:
                if LAYERS.index(_layer(target)) > mine:
                    up.append(f"{path.relative_to(package.parent)}:{node.lineno} imports {target}")
    return up


def test_no_import_runs_up_the_layers():
    assert (ROOT / "sapipe" / "layout").is_dir()  # the layers are folders
    assert _imports_running_up(ROOT / "sapipe") == []


def test_an_import_running_up_is_found(tmp_path):
    package = tmp_path / "sapipe"
    (package / "kernels").mkdir(parents=True)
    (package / "kernels" / "ops.py").write_text("from sapipe.runtime.engine import Runtime\n")
    assert _imports_running_up(package) == ["sapipe/kernels/ops.py:1 imports sapipe.runtime.engine"]


def _redefined(path: pathlib.Path, root: pathlib.Path = ROOT):
    """Names a module defines twice at its top level (a later def silently replaces the first)."""
    import ast

    seen, twice = set(), []
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            if node.name in seen:
                twice.append(f"{path.relative_to(root)}:{node.lineno} {node.name}")
            seen.add(node.name)
    return twice


def test_no_module_defines_a_name_twice():
    files = [
        p
        for d in ("sapipe", "tests", "benchmarks", "tools", "examples")
        for p in (ROOT / d).rglob("*.py")
    ]
    assert len(files) > 50
    assert [line for path in files for line in _redefined(path)] == []


def test_a_name_defined_twice_is_found(tmp_path):
    (tmp_path / "twice.py").write_text("def f():\n    pass\n\n\ndef f():\n    pass\n")
    assert _redefined(tmp_path / "twice.py", tmp_path) == ["twice.py:5 f"]


def test_the_extension_checks_arguments_with_its_own_messages():
    """TORCH_CHECK with several message parts crashed a GPU machine's interpreter instead of
    raising (csrc/check.h): every check in csrc is SAPIPE_CHECK, which formats its own."""
    sources = [p for p in (ROOT / "csrc").rglob("*") if p.suffix in {".h", ".cuh", ".cpp", ".cu"}]
    assert len(sources) > 10
    uses = [
        f"{p.name}:{n}"
        for p in sources
        if p.name != "check.h"
        for n, line in enumerate(p.read_text().splitlines(), 1)
        if "TORCH_CHECK" in line
    ]
    assert uses == []
