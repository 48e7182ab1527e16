"""sapipe's in-tree PEP 517 build backend: setuptools.build_meta, built against the torch
of the environment being installed into.

sapipe's kernels (csrc/) are compiled with torch.utils.cpp_extension and must be built
against the torch that will run them. torch is deliberately NOT a build requirement: pip
would resolve it into its isolated build environment (downloading multi-GB CUDA wheels)
and the kernels would be compiled against that torch instead of the installed one.

pip's default build isolation runs the build with the installing interpreter, its
site-packages hidden (by a sitecustomize on PYTHONPATH). When torch is not importable in
the build, this backend asks the same interpreter, started without that isolation
(``python -E``), where its modules live, and appends that import path AFTER the build
environment's, so setuptools and wheel still come from the build environment and torch
(and its dependencies) from the target environment. Nothing is downloaded or installed.
``pip install .`` and ``pip install --no-build-isolation .`` therefore both build the
kernels against the installed torch.

If torch still cannot be found (it is not installed, or a front end isolated the build
in a separate venv: ``python -m build``, ``uv``), the wheel/editable hooks fail at once,
before pip resolves ``torch`` from an index, with :data:`MISSING_TORCH` (how to install).
``SAPIPE_NO_EXT=1`` builds the package without kernels (pure-PyTorch kernels at run
time). Building an sdist never needs torch.

setup.py imports this module too (for :func:`ext_disabled` and :func:`missing_torch`).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import subprocess
import sys

from setuptools import build_meta as _setuptools

MISSING_TORCH = """\
sapipe: cannot build the C++/CUDA kernels (csrc/): torch is not importable in this build
({why}).

The kernels are compiled against the torch that will run them, so torch must be installed
BEFORE sapipe; it is deliberately not a build requirement (pip would download multi-GB CUDA
wheels into an isolated build environment). Either

  * install torch first, then build sapipe against it:

        pip install torch            # or the torch build you want (CUDA/CPU)
        pip install --no-build-isolation .

    (with torch installed, plain `pip install .` also works; front ends that isolate the
    build in a fresh venv need their no-isolation flag: `python -m build --no-isolation`,
    `uv pip install --no-build-isolation .`)

  * or install without compiled kernels (sapipe.kernels.ops then runs the pure-PyTorch kernels):

        SAPIPE_NO_EXT=1 pip install .
"""


def ext_disabled() -> bool:
    """SAPIPE_NO_EXT=1: build without the compiled kernels."""
    return os.environ.get("SAPIPE_NO_EXT", "") not in ("", "0")


def missing_torch(why: str) -> str:
    return MISSING_TORCH.format(why=why)


def _target_sys_path():
    """(torch's origin or None, sys.path) of this interpreter without pip's isolation."""
    probe = (
        "import importlib.util, json, sys; s = importlib.util.find_spec('torch'); "
        "print(json.dumps([s.origin if s else None, sys.path]))"
    )
    try:
        out = subprocess.run(
            [sys.executable, "-E", "-c", probe],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            timeout=120,
            check=True,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        ).stdout
        origin, path = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None, []
    return origin, [p for p in path if isinstance(p, str) and p]


def expose_target_torch() -> str:
    """Make torch importable in this build; returns '' or why it is not."""
    if importlib.util.find_spec("torch") is not None:
        return ""
    origin, path = _target_sys_path()
    if origin is None:
        return f"no torch for {sys.executable}"
    known = {os.path.normcase(p) for p in sys.path}
    sys.path.extend(p for p in path if os.path.normcase(p) not in known)  # after the build env
    importlib.invalidate_caches()
    if importlib.util.find_spec("torch") is None:
        return f"torch at {origin} is not importable from the build environment"
    print(
        f"sapipe: building against the installing environment's torch ({origin})", file=sys.stderr
    )
    return ""


def _need_torch():
    if ext_disabled():
        return
    why = expose_target_torch()
    if why:
        raise SystemExit(missing_torch(why))


# --- PEP 517 / 660 hooks ------------------------------------------------------------------


def get_requires_for_build_wheel(config_settings=None):
    _need_torch()
    return _setuptools.get_requires_for_build_wheel(config_settings)


def prepare_metadata_for_build_wheel(metadata_directory, config_settings=None):
    _need_torch()
    return _setuptools.prepare_metadata_for_build_wheel(metadata_directory, config_settings)


def build_wheel(wheel_directory, config_settings=None, metadata_directory=None):
    _need_torch()
    return _setuptools.build_wheel(wheel_directory, config_settings, metadata_directory)


def get_requires_for_build_editable(config_settings=None):
    _need_torch()
    return _setuptools.get_requires_for_build_editable(config_settings)


def prepare_metadata_for_build_editable(metadata_directory, config_settings=None):
    _need_torch()
    return _setuptools.prepare_metadata_for_build_editable(metadata_directory, config_settings)


def build_editable(wheel_directory, config_settings=None, metadata_directory=None):
    _need_torch()
    return _setuptools.build_editable(wheel_directory, config_settings, metadata_directory)


get_requires_for_build_sdist = _setuptools.get_requires_for_build_sdist
build_sdist = _setuptools.build_sdist
