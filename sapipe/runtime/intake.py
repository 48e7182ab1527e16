"""Where backward's gradients enter sapipe: one hook per trainable parameter, for the optimizer's
life, and which gradients of the current iteration have arrived, per bucket of the layout.

With sapipe's kernels built, :class:`sapipe._C.GradientIntake` hooks each parameter's
AccumulateGrad node in C++, as DDP's reducer does (csrc/runtime/gradient_intake.cpp). Python
is called twice per bucket and iteration rather than once per parameter:

* ``on_first(bucket_index)`` as the bucket's first gradient arrives: it applies what still
  reads the bucket's slot and returns, per target, each parameter's view there, or None for
  this bucket's gradients to go through ``on_slow`` this iteration (while the scheduler
  profiles, while tracing, for a codec whose messages a gradient may span). The gradient is
  copied into each view, unless ``p.grad`` is that view: ``zero_grad(set_to_none=False)``
  left the exposed view of the slot the iteration fills, and autograd accumulated into it in
  place, as into DDP's ``gradient_as_bucket_view``;
* ``on_complete(bucket_index)`` once every gradient of the bucket is in: it launches.

``on_slow(param)`` takes a gradient in Python: a parameter outside the layout (before the
first forward), a bucket ``on_first`` declined, a parameter's second gradient (the error is
raised there). While ``paused`` (inside ``no_sync()``) the hooks do nothing: gradients only
accumulate in ``p.grad``.

Without the kernels (``SAPIPE_DISABLE_EXT=1``, a build without them), :class:`PythonIntake`
keeps the same interface with a Python post-accumulate-grad hook per parameter, every
gradient through ``on_slow``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from sapipe.kernels import _ext


class Intake(Protocol):
    """What :class:`sapipe.runtime.pipeline.GradientPipeline` asks of an intake."""

    paused: bool

    def lay_out(self, bucket_of: list[int], position: list[int], sizes: list[int]) -> None:
        """Per parameter its bucket (-1: none) and place there, and each bucket's size;
        nothing has arrived."""

    def num_ready(self, bucket: int) -> int: ...

    def is_ready(self, bucket: int, index: int) -> bool: ...

    def mark(self, bucket: int, index: int) -> int:
        """A gradient taken in Python has arrived; the bucket's count after it."""

    def any_ready(self) -> bool: ...

    def clear(self) -> None:
        """Nothing has arrived: a new iteration."""

    def remove(self) -> None:
        """Unhook every parameter (``close()``)."""


class PythonIntake:
    """:class:`Intake` with a Python hook per parameter: every gradient goes to ``on_slow``."""

    def __init__(self, params: Sequence[torch.Tensor], on_slow: Callable[[torch.Tensor], None]):
        self.paused = False
        self._on_slow = on_slow
        self._handles = [p.register_post_accumulate_grad_hook(self._take) for p in params]
        self._ready: list[list[bool]] = []
        self._num_ready: list[int] = []

    def _take(self, param: torch.Tensor) -> None:
        if not self.paused:
            self._on_slow(param)

    def lay_out(self, bucket_of: list[int], position: list[int], sizes: list[int]) -> None:
        self._ready = [[False] * n for n in sizes]
        self._num_ready = [0] * len(sizes)

    def num_ready(self, bucket: int) -> int:
        return self._num_ready[bucket]

    def is_ready(self, bucket: int, index: int) -> bool:
        return self._ready[bucket][index]

    def mark(self, bucket: int, index: int) -> int:
        assert not self._ready[bucket][index], "a gradient taken twice"
        self._ready[bucket][index] = True
        self._num_ready[bucket] += 1
        return self._num_ready[bucket]

    def any_ready(self) -> bool:
        return any(self._num_ready)

    def clear(self) -> None:
        self._ready = [[False] * len(ready) for ready in self._ready]
        self._num_ready = [0] * len(self._num_ready)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []


def hook_parameters(
    params: Sequence[torch.Tensor],
    on_slow: Callable[[torch.Tensor], None],
    on_first: Callable[[int], list[list[torch.Tensor]] | None],
    on_complete: Callable[[int], None],
) -> Intake:
    """The intake of ``params``' gradients: in C++ where sapipe's kernels are built."""
    if _ext.cpu is not None and hasattr(_ext.cpu, "GradientIntake"):
        return _ext.cpu.GradientIntake(list(params), on_slow, on_first, on_complete)
    return PythonIntake(params, on_slow)


__all__ = ["Intake", "PythonIntake", "hook_parameters"]
