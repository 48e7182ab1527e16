"""Loads sapipe's compiled kernels (csrc/), when they were built.

* ``sapipe._C``      -- C++ CPU kernels (built by ``pip install --no-build-isolation -e .``).
* ``sapipe._C_cuda`` -- CUDA kernels (built only where torch has CUDA).

:func:`module_for` gives the module that handles tensors on a device, or None; the first
time a kernel needs a module that is absent, ONE warning says the pure-PyTorch path runs
instead. ``SAPIPE_DISABLE_EXT=1`` in the environment disables both modules (no warning).
``SAPIPE_CPU_ISA=base|avx2|avx512`` caps the CPU kernels' instruction set
(csrc/cpu/cpu_dispatch.cpp);
another value is ignored, with a warning.
"""

from __future__ import annotations

import os
import warnings
from types import ModuleType

import torch

DISABLED = os.environ.get("SAPIPE_DISABLE_EXT", "") not in ("", "0")

cpu: ModuleType | None = None
cuda: ModuleType | None = None
errors: dict[str, str] = {}  # module name -> why it did not load
_warned: dict[str, bool] = {}


def _load(name: str) -> ModuleType | None:
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

CPU_ISAS = ("base", "avx2", "avx512")  # what SAPIPE_CPU_ISA may cap the CPU kernels at
_isa_cap = os.environ.get("SAPIPE_CPU_ISA", "")
if _isa_cap and _isa_cap not in CPU_ISAS:
    warnings.warn(
        f"sapipe: SAPIPE_CPU_ISA={_isa_cap!r} is not one of {', '.join(CPU_ISAS)}; it is ignored "
        f"and the CPU kernels use {cpu.cpu_isa() if cpu is not None else 'no compiled build'}",
        RuntimeWarning,
        stacklevel=2,
    )


def module_for(device: torch.device) -> ModuleType | None:
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
            "To build them, reinstall sapipe where a C++20 compiler (and for CUDA, nvcc) is found: "
            "`pip install --no-build-isolation .` in its source (`-e .` for a checkout). "
            "SAPIPE_DISABLE_EXT=1 chooses the pure-PyTorch kernels without this warning.",
            RuntimeWarning,
            stacklevel=3,
        )
    return mod
