"""CUDA cases of a CPU test file: marked ``gpu`` and skipped without a CUDA device.

The files of ``tests/gpu/`` are marked ``gpu`` by their folder (tests/conftest.py); these are
for the CUDA cases of files that belong with their CPU cases elsewhere.
"""

from __future__ import annotations

import pytest
import torch

CUDA = torch.cuda.is_available()


def _marks(ok: bool | None, reason: str) -> list:
    return [pytest.mark.gpu, pytest.mark.skipif(not (CUDA if ok is None else ok), reason=reason)]


def cuda_param(*values, ok: bool | None = None, reason: str = "no CUDA device"):
    """A ``parametrize`` case on CUDA: ``pytest.param(*values)``, marked ``gpu``, skipped
    unless ``ok`` (by default: torch sees a CUDA device)."""
    return pytest.param(*values, marks=_marks(ok, reason))


def on_cuda(test=None, *, ok: bool | None = None, reason: str = "no CUDA device"):
    """A test on CUDA (a decorator, with or without arguments): marked ``gpu``, skipped
    unless ``ok`` (by default: torch sees a CUDA device)."""

    def mark(function):
        for marker in _marks(ok, reason):
            function = marker(function)
        return function

    return mark if test is None else mark(test)
