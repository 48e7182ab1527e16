"""Loads sapipe's compiled kernels (csrc/), when they were built.

* ``sapipe._C``      -- C++ CPU kernels (built by ``pip install --no-build-isolation -e .``).
* ``sapipe._C_cuda`` -- CUDA kernels (built only where torch has CUDA).

:func:`module_for` gives the module that handles tensors on a device, or None; the first
time a kernel needs a module that is absent, ONE warning says the pure-PyTorch path runs
instead. ``SAPIPE_DISABLE_EXT=1`` in the environment disables both modules (no warning).
"""
from __future__ import annotations

import os
import warnings
from types import ModuleType
from typing import Dict, Optional

import torch

DISABLED = os.environ.get("SAPIPE_DISABLE_EXT", "") not in ("", "0")

cpu: Optional[ModuleType] = None
cuda: Optional[ModuleType] = None
errors: Dict[str, str] = {}  # module name -> why it did not load
_warned: Dict[str, bool] = {}


def _load(name: str) -> Optional[ModuleType]:
    if DISABLED:
        errors[name] = "disabled by SAPIPE_DISABLE_EXT"
        return None
    try:
        import importlib

        return importlib.import_module(f"sapipe.{name}")
    except ImportError as exc:  # not built (pure-Python install) or broken build
        errors[name] = f"{type(exc).__name__}: {exc}"
        return None


cpu = _load("_C")
cuda = _load("_C_cuda")


def module_for(device: torch.device) -> Optional[ModuleType]:
    """The compiled module for tensors on ``device`` (None: use pure PyTorch)."""
    if device.type == "cpu":
        mod, name = cpu, "_C"
    elif device.type == "cuda":
        mod, name = cuda, "_C_cuda"
    else:
        return None
    if mod is None and not DISABLED and not _warned.get(name):
        _warned[name] = True
        warnings.warn(
            f"sapipe: compiled {device.type.upper()} kernels (sapipe.{name}) are not available "
            f"({errors.get(name, 'not built')}); running the pure-PyTorch kernels instead. "
            "Build them with `pip install --no-build-isolation -e .`.",
            RuntimeWarning,
            stacklevel=3,
        )
    return mod
