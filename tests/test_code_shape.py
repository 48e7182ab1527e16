"""The code under sapipe/ stays in small pieces: no class over 400 lines, no function over 80."""
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
