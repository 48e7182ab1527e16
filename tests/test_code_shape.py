"""The code stays in small pieces (no class over 400 lines, no function over 80), no module
defines a name twice (the later definition would silently replace the first), and the
kernels' argument checks build their messages themselves (csrc/check.h)."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _code_size():
    spec = importlib.util.spec_from_file_location("code_size", ROOT / "tools" / "code_size.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_no_class_or_function_over_its_limit():
    code_size = _code_size()
    entries = code_size.measure(ROOT / "sapipe")
    assert len(entries) > 100  # it did read the package
    assert code_size.over_limits(entries) == []


def test_the_limits_are_enforced(tmp_path):
    code_size = _code_size()
    (tmp_path / "big.py").write_text("def f():\n" + "    x = 1\n" * 80 + "\n\nclass C:\n" + "    y = 2\n" * 400)
    over = code_size.over_limits(code_size.measure(tmp_path))
    assert sorted(kind for _, kind, _ in over) == ["class", "function"]


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
    files = [p for d in ("sapipe", "tests", "benchmarks", "tools", "examples") for p in (ROOT / d).rglob("*.py")]
    assert len(files) > 50
    assert [line for path in files for line in _redefined(path)] == []

def test_a_name_defined_twice_is_found(tmp_path):
    (tmp_path / "twice.py").write_text("def f():\n    pass\n\n\ndef f():\n    pass\n")
    assert _redefined(tmp_path / "twice.py", tmp_path) == ["twice.py:5 f"]


def test_the_extension_checks_arguments_with_its_own_messages():
    """TORCH_CHECK with several message parts crashed a GPU machine's interpreter instead of
    raising (csrc/check.h): every check in csrc is SAPIPE_CHECK, which formats its own."""
    sources = [p for p in (ROOT / "csrc").iterdir() if p.suffix in {".h", ".cuh", ".cpp", ".cu"}]
    assert len(sources) > 10
    uses = [f"{p.name}:{n}" for p in sources if p.name != "check.h"
            for n, line in enumerate(p.read_text().splitlines(), 1) if "TORCH_CHECK" in line]
    assert uses == []

