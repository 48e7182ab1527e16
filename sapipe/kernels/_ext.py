"""Loads sapipe's compiled kernels (csrc/), when they were built.

* ``sapipe._C``      -- registers the ``torch.ops.sapipe`` operators (csrc/library.cpp) and
  their CPU kernels; holds the gradient intake (built by ``pip install --no-build-isolation -e .``).
* ``sapipe._C_cuda`` -- registers the operators' CUDA kernels (built only where torch has CUDA).

Callers do not choose a module: they call ``torch.ops.sapipe.*`` and the dispatcher picks
the kernel by device. :func:`compiled_for` says whether one is registered for a device; the
first time a kernel is wanted for a device that has none, ONE warning says the pure-PyTorch
path runs instead. ``SAPIPE_DISABLE_EXT=1`` in the environment disables both modules (no warning).
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
# _C_cuda registers kernels for the operators _C declares
cuda = _load("_C_cuda") if cpu is not None else None
if cpu is None and "_C_cuda" not in errors:
    errors["_C_cuda"] = "needs sapipe._C, which declares the operators"
if cpu is not None:
    from sapipe.kernels import library as _library  # noqa: F401  (the fake kernels)

#: the module that registers each device type's kernels
MODULE_OF_DEVICE = {"cpu": "_C", "cuda": "_C_cuda"}

CPU_ISAS = ("base", "avx2", "avx512")  # what SAPIPE_CPU_ISA may cap the CPU kernels at
_isa_cap = os.environ.get("SAPIPE_CPU_ISA", "")
if _isa_cap and _isa_cap not in CPU_ISAS:
    warnings.warn(
        f"sapipe: SAPIPE_CPU_ISA={_isa_cap!r} is not one of {', '.join(CPU_ISAS)}; it is ignored "
        f"and the CPU kernels use {cpu.cpu_isa() if cpu is not None else 'no compiled build'}",
        RuntimeWarning,
        stacklevel=2,
    )


def _registered(device_type: str) -> bool:
    if cpu is None:
        return False
    return torch._C._dispatch_has_kernel_for_dispatch_key("sapipe::sgd", device_type.upper())


_HAS_KERNELS = {kind: _registered(kind) for kind in MODULE_OF_DEVICE}


def has_kernels(device_type: str) -> bool:
    """Whether the sapipe operators have compiled kernels for ``device_type`` here."""
    return _HAS_KERNELS.get(device_type, False)


def compiled_for(device: torch.device) -> bool:
    """Whether ``torch.ops.sapipe`` runs compiled kernels for tensors on ``device`` (False:
    use pure PyTorch; the first miss for a device warns once)."""
    ok = has_kernels(device.type)
    name = MODULE_OF_DEVICE.get(device.type)
    if not ok and name is not None and not DISABLED and not _warned.get(name):
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
    return ok
