"""``broadcast_buffers=True``: rank 0's module buffers on every rank before a forward, as in DDP.

DDP (``torch/nn/parallel/distributed.py``) broadcasts rank 0's buffers in its pre-forward
when ``will_sync_module_buffers()``: ``broadcast_buffers`` is on, the module has buffers, and
``require_forward_param_sync`` holds. That flag starts True and is set at the end of every
forward to whether that forward ran with gradients enabled outside ``no_sync()``. The
module's ``training`` flag plays no part: an evaluation forward under ``torch.no_grad()``
still gets rank 0's buffers when the forward before it was a training one, and the forward
after it does not. This class follows the same rule, so the buffers every forward sees equal
DDP's.

The broadcast is coalesced (one collective per dtype and device) and runs on sapipe's
control group, so it never queues behind gradient traffic. Buffers are read from their
modules each time, since a module may replace them (DDP takes the tensors once); the modules
are the model's at construction, listed once, since walking the module tree before every
forward costs a model of many layers more host time than the rest of the check. Their
autograd version counters are kept, as DDP keeps them, so a graph that saved a buffer (an
evaluation-mode BatchNorm under autograd) can still run backward after the next forward's
broadcast.
"""

from __future__ import annotations

import torch
from torch import nn

from sapipe.config import Settings
from sapipe.runtime.progress import Progress


class BufferBroadcast:
    """Rank 0's buffers of ``model`` before the forwards DDP would broadcast them before.

    ``progress`` says whether the loop is inside ``no_sync()``.
    """

    def __init__(self, model: nn.Module, control, progress: Progress):
        self._modules = list(model.modules())
        self._control = control
        self._progress = progress
        self._due = True  # DDP's require_forward_param_sync starts True

    @classmethod
    def of(
        cls, settings: Settings, model: nn.Module, control, progress: Progress
    ) -> BufferBroadcast | None:
        """The broadcast ``settings.broadcast_buffers`` asks for, or None."""
        return cls(model, control, progress) if settings.broadcast_buffers else None

    @torch.no_grad()
    def before_forward(self) -> None:
        if not self._due:
            return
        buffers = self._buffers()
        if buffers:
            with torch.autograd._unsafe_preserve_version_counter(tuple(buffers)):
                self._control.broadcast(buffers, "the model's buffers")

    def _buffers(self) -> list[torch.Tensor]:
        """Each buffer of the model's modules once, in ``model.buffers()``'s order."""
        seen: set[int] = set()
        found = []
        for module in self._modules:
            for buffer in module._buffers.values():
                if buffer is not None and id(buffer) not in seen:
                    seen.add(id(buffer))
                    found.append(buffer)
        return found

    def after_forward(self) -> None:
        self._due = torch.is_grad_enabled() and not self._progress.accumulating


__all__ = ["BufferBroadcast"]
