"""All-reduce (sum) of flat buckets on a ``torch.distributed`` process group.

Each back-end instance owns its own process group, created with sapipe's ``timeout``:
synchronous and stale traffic use separate instances, so a stale all-reduce still in
flight never sits in the same queue in front of a synchronous one that the next forward
waits for, and a dead or hung peer surfaces as a :class:`CommunicationError` naming the
bucket within the timeout instead of a hang.
"""
from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import CommunicationError
from ..trace import Tracer


@dataclass
class Handle:
    """An in-flight collective on ``tensor``; ``what`` names it in errors and traces."""

    work: object
    tensor: torch.Tensor
    what: str
    owner: "AllReduce"

    def wait(self) -> torch.Tensor:
        """Block until the collective is done; the reduced tensor (summed over ranks)."""
        return self.owner.wait(self)


def new_group_like(process_group, timeout: Optional[timedelta]):
    """A new process group over the same ranks and back-end as ``process_group``."""
    ranks = dist.get_process_group_ranks(process_group)
    kwargs = {"ranks": ranks, "backend": dist.get_backend(process_group), "use_local_synchronization": True}
    if timeout is not None:
        kwargs["timeout"] = timeout
    return dist.new_group(**kwargs)


class AllReduce:
    """Sum-all-reduce of flat buffers, started asynchronously and waited for explicitly."""

    def __init__(self, group, name: str, timeout: Optional[timedelta], tracer: Tracer):
        self.group = group
        self.name = name
        self.timeout = timeout
        self.tracer = tracer

    def _fail(self, what: str, exc: BaseException) -> CommunicationError:
        limit = f"{self.timeout.total_seconds():g}s" if self.timeout else "the process group's timeout"
        return CommunicationError(
            f"sapipe: {self.name} all-reduce of {what} failed. A peer rank has probably died, "
            f"hung or lost its connection (limit: {limit}). Underlying error: {exc}"
        )

    def start(self, tensor: torch.Tensor, what: str) -> Handle:
        try:
            work = dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._fail(what, exc) from exc
        if self.tracer.enabled:
            self.tracer.record("comm_start", what=what, stream=self.name)
            work.get_future().then(lambda _: self.tracer.record("comm_done", what=what, stream=self.name))
        return Handle(work, tensor, what, self)

    def wait(self, handle: Handle) -> torch.Tensor:
        self.tracer.record("comm_wait_start", what=handle.what, stream=self.name)
        try:
            handle.work.wait()
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self._fail(handle.what, exc) from exc
        self.tracer.record("comm_wait", what=handle.what, stream=self.name)
        return handle.tensor
