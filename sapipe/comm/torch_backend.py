"""``backend="torch"`` (the default): one all-reduce (sum) per bucket on a process group.

Each instance owns its own process group, created with sapipe's ``timeout``: synchronous
and stale traffic use separate instances, so a stale all-reduce still in flight never sits
in the same queue in front of a synchronous one that the next forward waits for, and a
dead or hung peer surfaces as a :class:`CommunicationError` naming the bucket within the
timeout instead of a hang. NCCL on GPUs, Gloo on CPUs: whatever the job's group uses.
``close()`` destroys the group at once, joining Gloo's worker threads before the interpreter
can begin finalising (:mod:`sapipe.comm.groups`); the instance cannot be used after it.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from sapipe.comm.base import CommBackend, Handle
from sapipe.comm.groups import release_group
from sapipe.errors import UsageError
from sapipe.tracing.tracer import Tracer


class AllReduce(CommBackend):
    """Sum-all-reduce of flat buffers on a ``torch.distributed`` group of its own."""

    def __init__(self, group, name: str, timeout: timedelta | None, tracer: Tracer):
        super().__init__(name, timeout, tracer)
        self.group = group
        self.world_size = dist.get_world_size(group)

    def start(
        self, tensor: torch.Tensor, what: str, priority: int = 0, *, values: int | None = None
    ) -> Handle:
        if self.group is None:  # given group=None, torch would run it on the default group
            raise UsageError(f"the {self.name} all-reduce of {what} was started after close()")
        self.divide_for_mean(tensor, values)
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self.failure("all-reduce", what, exc) from exc
        if self.tracer.enabled:
            self.trace_start(what)
            work.get_future().then(lambda _: self.trace_done(what))
        return Handle(work, tensor, what, self, values)

    def wait(self, handle: Handle) -> torch.Tensor:
        self.trace_wait_start(handle.what)
        try:
            handle.token.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self.failure("all-reduce", handle.what, exc) from exc
        self.trace_wait_end(handle.what)
        return handle.tensor

    def when_done(self, handle: Handle, callback) -> bool:
        handle.token.get_future().then(lambda _: callback())
        return True

    def close(self) -> None:
        release_group(self)
