"""Fake (meta) implementations of the ``torch.ops.sapipe`` operators (csrc/library.cpp).

A fake implementation says what an operator returns without running it, from the shapes
alone, so that ``torch.compile`` can trace a call into a graph and ``torch.library.opcheck``
can test the schema. Every operator but ``dc_dots`` only writes into tensors it is given
(marked in its schema) and returns nothing; ``dc_dots`` returns one float64 per tensor of its
``offsets``. Imported by :mod:`sapipe.kernels._ext` once ``sapipe._C`` has declared the
operators.
"""

from __future__ import annotations

import torch
from torch import Tensor

_WRITES_ONLY = (
    "sapipe::compose",
    "sapipe::sgd",
    "sapipe::adam",
    "sapipe::codec_encode",
    "sapipe::codec_sum_encode",
    "sapipe::codec_decode",
)


def _returns_nothing(*args, **kwargs) -> None:
    return None


for _name in _WRITES_ONLY:
    torch.library.register_fake(_name)(_returns_nothing)


@torch.library.register_fake("sapipe::dc_dots")
def _dc_dots(
    grad: Tensor,
    prev_local: Tensor | None,
    n: float,
    delta: Tensor,
    delta_ref: Tensor | None,
    offsets: Tensor,
) -> Tensor:
    return grad.new_empty((offsets.shape[0] - 1,), dtype=torch.float64)
