"""``backend="byteps"``: where BytePS's ``push_pull_async_inplace`` plugs in. UNTESTED.

BytePS cannot run on this project's machines: version 0.2.5's workers require CUDA, and
its PyTorch plug-in does not build against torch 2.x. This adapter is kept small so that
whoever has a working BytePS can try it; nothing here has ever executed. For BytePS's
partitioned, priority-ordered push-pull without BytePS, use ``backend="pushpull"``.

Launch as for BytePS (``bpslaunch``, or ``sapipe-launch`` with the ``DMLC_*`` variables)
and call ``bps.init()`` before :class:`sapipe.DistributedOptimizer`.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch

from sapipe.comm.base import LibraryBackend, import_library
from sapipe.tracing.tracer import Tracer


def import_byteps():
    """``byteps.torch``, with the job's ranks; else ConfigurationError."""
    return import_library(
        "byteps.torch", "byteps", "backend='pushpull' gives the same pattern on torch.distributed"
    )


class BytePSPushPull(LibraryBackend):
    """Sum of flat buffers through ``byteps.torch.push_pull_async_inplace`` (untested)."""

    operation = "byteps push-pull"

    def __init__(self, group, name: str, timeout: timedelta | None, tracer: Tracer):
        super().__init__(group, name, timeout, tracer)
        self._bps = import_byteps()

    def _submit(self, tensor: torch.Tensor, name: str, priority: int) -> Any:
        # BytePS schedules larger priorities first; sapipe's smaller-is-sooner is negated.
        return self._bps.push_pull_async_inplace(
            tensor, average=False, name=name, priority=-priority
        )

    def _poll(self, token: Any) -> bool:
        return self._bps.poll(token)

    def _finish(self, token: Any) -> None:
        self._bps.synchronize(token)
