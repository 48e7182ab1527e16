"""Packaging (setup.py, pyproject.toml, MANIFEST.in, build_backend/sapipe_build.py).

* the sdist carries every file of csrc/ and the in-tree build backend, and no top-level
  ``launcher``;
* a build that cannot import torch FAILS with the install instructions (it never silently
  installs a package without kernels), while an sdist still builds without torch;
* pip's isolated build (setuptools + wheel only, site-packages hidden) sees the installing
  environment's torch and never asks for torch as a build requirement;
* a real, non-editable ``pip install`` of the sdist with pip's defaults (build isolation)
  has the compiled CPU kernels, ``python -m sapipe.launch`` and ``sapipe-launch``, and no
  top-level ``launcher``.

Everything runs on a copy of the source tree, so nothing is written into the checkout.
The install test compiles the CPU kernels once (about 45 s on 2 cores).
"""

from __future__ import annotations

import fnmatch
import glob
import json
import os
import shutil
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

import pytest
from support.paths import ROOT

PY = sys.executable
# build outputs and caches: never part of the sources
BUILD_OUTPUTS = (
    ".git",
    ".venv",
    "venv",
    "build",
    "dist",
    "*.egg-info",
    "__pycache__",
    "*.pyc",
    "*.so",
    "*.o",
    ".pytest_cache",
    ".gl",
    ".whl",
    "gpu-results",
)
HOOK = "import sys; sys.path.insert(0, 'build_backend'); import sapipe_build as b; print(b.{})"
INSTRUCTIONS = (
    "pip install torch",
    "pip install --no-build-isolation .",
    "SAPIPE_NO_EXT=1 pip install .",
)

pytestmark = pytest.mark.skipif(sys.platform == "win32", reason="POSIX venv layout")


def _run(cmd, cwd, env=None, timeout=120):
    return subprocess.run(
        [str(c) for c in cmd],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=timeout,
    )


def _env(**extra):
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PYTHON", "SAPIPE_", "PIP_NO_BUILD_ISOLATION"))
    }
    env.update(extra)
    return env


def _is_output(name):
    return any(fnmatch.fnmatch(name, pat) for pat in BUILD_OUTPUTS)


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """A copy of the source tree without build outputs (setuptools writes egg-info there)."""
    dst = tmp_path_factory.mktemp("tree") / "sapipe-src"
    shutil.copytree(ROOT, dst, ignore=shutil.ignore_patterns(*BUILD_OUTPUTS), symlinks=True)
    return dst


def _build_sdist(python, tree, out, env=None):
    r = _run([python, "-c", HOOK.format("build_sdist(sys.argv[1])"), out], tree, env)
    assert r.returncode == 0, r.stdout[-3000:]
    return out / r.stdout.strip().splitlines()[-1]


@pytest.fixture(scope="module")
def sdist(tree, tmp_path_factory):
    """The sdist, built by the PEP 517 build_sdist hook (what pip / build call)."""
    return _build_sdist(PY, tree, tmp_path_factory.mktemp("dist"), _env())


def _csrc_files():
    files = set()
    for dirpath, dirnames, filenames in os.walk(ROOT / "csrc"):
        dirnames[:] = [d for d in dirnames if not _is_output(d)]
        rel = Path(dirpath).relative_to(ROOT)
        files |= {(rel / f).as_posix() for f in filenames if not _is_output(f)}
    return files


def _sdist_members(path):
    with tarfile.open(path) as tar:
        names = [m.name for m in tar.getmembers() if m.isfile()]
        top_level = tar.extractfile(next(n for n in names if n.endswith(".egg-info/top_level.txt")))
        return {n.split("/", 1)[1] for n in names}, top_level.read().decode().split()


def _assert_sdist_complete(path):
    members, top_level = _sdist_members(path)
    csrc = _csrc_files()
    assert csrc and any(f.endswith(".h") for f in csrc) and any(f.endswith(".cu") for f in csrc)
    assert not csrc - members, f"sdist misses csrc files: {sorted(csrc - members)}"
    for f in (
        "setup.py",
        "pyproject.toml",
        "MANIFEST.in",
        "build_backend/sapipe_build.py",
        "sapipe/__init__.py",
        "sapipe/launch/__main__.py",
        "sapipe/launch/main.py",
    ):
        assert f in members, f"sdist misses {f}"
    assert top_level == ["sapipe"], top_level
    assert not [m for m in members if m.split("/")[0] in ("launcher", "launcher.py")]
    assert not [m for m in members if _is_output(os.path.basename(m))], "build outputs in sdist"


def test_sdist_carries_every_csrc_file_and_no_launcher(sdist):
    _assert_sdist_complete(sdist)


# --- no torch at build time ---------------------------------------------------------------


@pytest.fixture(scope="module")
def build_env(tmp_path_factory):
    """What pip's isolated build environment holds: setuptools and wheel (links to ours)."""
    import setuptools

    site_dir = Path(setuptools.__file__).resolve().parents[1]
    env_dir = tmp_path_factory.mktemp("build-env")
    names = ("setuptools", "setuptools-*", "_distutils_hack", "pkg_resources", "wheel", "wheel-*")
    for entry in site_dir.iterdir():
        if any(fnmatch.fnmatch(entry.name, pat) for pat in names):
            (env_dir / entry.name).symlink_to(entry)
    return env_dir


@pytest.fixture(scope="module")
def torchless_python(tmp_path_factory, build_env):
    """(python, env): a fresh venv without torch, with only setuptools/wheel importable."""
    venv = tmp_path_factory.mktemp("torchless") / "venv"
    r = _run([PY, "-m", "venv", "--without-pip", venv], ROOT, _env())
    assert r.returncode == 0, r.stdout
    # HOME: no user site-packages that might hold a torch
    env = _env(PYTHONPATH=str(build_env), PYTHONNOUSERSITE="1", HOME=str(venv))
    python = venv / "bin" / "python"
    r = _run(
        [
            python,
            "-c",
            "import setuptools, importlib.util as u; assert u.find_spec('torch') is None",
        ],
        ROOT,
        env,
    )
    assert r.returncode == 0, r.stdout
    return python, env


def _assert_instructions(r):
    assert r.returncode != 0, r.stdout[-3000:]
    assert "torch is not importable" in r.stdout, r.stdout[-3000:]
    for line in INSTRUCTIONS:
        assert line in r.stdout, f"{line!r} missing from:\n{r.stdout[-3000:]}"


def test_wheel_build_without_torch_fails_with_instructions(tree, torchless_python):
    python, env = torchless_python
    # the PEP 517 hooks pip calls first: they fail before pip would resolve torch
    for hook in (
        "get_requires_for_build_wheel()",
        "get_requires_for_build_editable()",
        "build_wheel('dist')",
    ):
        _assert_instructions(_run([python, "-c", HOOK.format(hook)], tree, env))
    # setup.py run directly (e.g. `python setup.py build_ext --inplace`)
    _assert_instructions(_run([python, "setup.py", "-q", "build_ext", "--inplace"], tree, env))
    assert not list(tree.glob("sapipe/_C*.so"))


def test_a_compiler_that_does_not_run_is_explained(tree):
    """torch checks $CXX before any extension builds; that failure says what sapipe needs too."""
    env = _env(CC="/bin/false", CXX="/bin/false", SAPIPE_CUDA_EXT="0")
    r = _run([PY, "setup.py", "-q", "build_ext", "--inplace"], tree, env)
    assert r.returncode != 0 and "C++20 compiler" in r.stdout and "SAPIPE_NO_EXT=1" in r.stdout, (
        r.stdout[-3000:]
    )
    assert not list(tree.glob("sapipe/_C*.so"))


def test_opting_out_and_sdist_need_no_torch(tree, torchless_python, tmp_path):
    python, env = torchless_python
    r = _run(
        [python, "-c", HOOK.format("get_requires_for_build_wheel()")],
        tree,
        dict(env, SAPIPE_NO_EXT="1"),
    )
    assert r.returncode == 0 and "torch" not in r.stdout.strip().splitlines()[-1], r.stdout
    _assert_sdist_complete(_build_sdist(python, tree, tmp_path, env))


# --- pip's build isolation ----------------------------------------------------------------


def test_isolated_build_sees_installed_torch(tree, build_env, tmp_path):
    """pip's isolation as pip does it (sitecustomize on PYTHONPATH hiding site-packages):
    the backend makes the installed torch importable, after the build env's setuptools."""
    site_dir = tmp_path / "pip-site"
    site_dir.mkdir()
    (site_dir / "sitecustomize.py").write_text(
        textwrap.dedent(f"""\
        import os, site, sys
        original = sys.path[:]
        known = set()
        for path in site.getsitepackages():
            site.addsitedir(path, known_paths=known)
        hidden = {{os.path.normcase(p) for p in sys.path[len(original):]}}
        sys.path[:] = [p for p in original if os.path.normcase(p) not in hidden]
        site.addsitedir({str(build_env)!r})
        """)
    )
    import torch

    script = textwrap.dedent("""\
        import importlib.util, json, sys
        assert importlib.util.find_spec("torch") is None, "the simulated isolation leaks torch"
        sys.path.insert(0, "build_backend")
        import sapipe_build
        requires = sapipe_build.get_requires_for_build_wheel()
        import setuptools, torch
        print(json.dumps([requires, torch.__file__, setuptools.__file__]))
        """)
    env = _env(PYTHONPATH=str(site_dir), PYTHONNOUSERSITE="1", SAPIPE_CUDA_EXT="0")
    r = _run([PY, "-c", script], tree, env)
    assert r.returncode == 0, r.stdout[-3000:]
    requires, torch_file, setuptools_file = json.loads(r.stdout.strip().splitlines()[-1])
    assert not [q for q in requires if q.lower().startswith("torch")], requires
    assert os.path.realpath(torch_file) == os.path.realpath(torch.__file__)
    assert setuptools_file.startswith(str(build_env)), "the build env's setuptools must win"


# --- a real install -----------------------------------------------------------------------


@pytest.mark.slow  # builds the kernels
def test_pip_install_of_sdist_builds_kernels_and_launcher(sdist, tmp_path):
    """`pip install sapipe-*.tar.gz` with pip's defaults, non-editable, into --target."""
    target = tmp_path / "site"
    env = _env(SAPIPE_CUDA_EXT="0")  # the CPU kernels are what this test needs: keep it fast
    pip = [
        PY,
        "-m",
        "pip",
        "install",
        "--no-deps",
        "--no-cache-dir",
        "--disable-pip-version-check",
        "--retries",
        "0",
        "--timeout",
        "20",
        "--target",
        target,
    ]
    r = _run(pip + [sdist], tmp_path, env, timeout=600)
    if (
        r.returncode != 0
        and "Installing build dependencies: finished with status 'error'" in r.stdout
    ):
        # offline: pip could not install setuptools/wheel into the isolated build env
        shutil.rmtree(target, ignore_errors=True)
        print(
            "pip's isolated build env could not be set up (offline?); "
            "retrying with --no-build-isolation"
        )
        r = _run(pip + ["--no-build-isolation", sdist], tmp_path, env, timeout=600)
    assert r.returncode == 0, r.stdout[-5000:]

    top = {p.name for p in target.iterdir()}
    assert not top & {"launcher", "launcher.py"}, top
    assert {p for p in top if p not in ("bin", "sapipe")} == {"sapipe-0.1.0.dist-info"}, top
    dist_info = target / "sapipe-0.1.0.dist-info"
    if (dist_info / "top_level.txt").exists():
        assert (dist_info / "top_level.txt").read_text().split() == ["sapipe"]
    record = (dist_info / "RECORD").read_text().splitlines()
    assert not [line for line in record if line.startswith(("launcher/", "launcher.py"))]
    assert glob.glob(str(target / "sapipe" / "_C*.so")), "no compiled kernels installed"

    # from outside the source tree, the installed package (not the checkout's editable one)
    run_env = _env(PYTHONPATH=str(target), OMP_NUM_THREADS="1")
    check = (
        "import importlib.util, json, sapipe, sapipe.kernels.ops as o; "
        "print(json.dumps([sapipe.__file__, o.backend('cpu'), "
        "importlib.util.find_spec('launcher') is None]))"
    )
    r = _run([PY, "-c", check], tmp_path, run_env)
    assert r.returncode == 0, r.stdout
    sapipe_file, backend, no_launcher = json.loads(r.stdout.strip().splitlines()[-1])
    assert Path(sapipe_file).resolve().is_relative_to(target.resolve()), sapipe_file
    assert backend == "cpu-ext", r.stdout
    assert no_launcher

    for cmd in (
        [PY, "-m", "sapipe.launch", "--help"],
        [target / "bin" / "sapipe-launch", "--help"],
    ):
        r = _run(cmd, tmp_path, run_env)
        assert r.returncode == 0 and "usage: sapipe-launch" in r.stdout, (cmd, r.stdout[-2000:])
