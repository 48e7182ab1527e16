"""``backend="torch"`` with ``compression=``: each bucket summed in two collectives of
compressed bytes (sapipe.compression, docs/design.md §5.9).

A bucket's compressed sum is an all-to-all (each rank's shards, compressed, to the ranks
that sum them), a sum in the gradient's own dtype, and an all-gather of the compressed
sums. The sum in between is computation, so a worker thread of the back-end's own runs the
three steps, one bucket after another in start order (the same on every rank, so every
rank issues the same collectives in the same order), while the training thread goes on.
The group belongs to the worker: ``group`` stays None, so the scheduler's link probes
never interleave with its traffic. On CUDA the worker runs on a side stream ordered after
the stream that started the bucket, and ``wait`` orders the caller's stream after it.
"""
from __future__ import annotations

import collections
from datetime import timedelta
from typing import Deque, Optional, Tuple

import torch
import torch.distributed as dist

from ..compression import SlotCodec
from ..errors import UsageError
from ..trace import Tracer
from .base import Handle
from .groups import release_group
from .worker import Job, WorkerBackend, all_gather_single


class CompressedSum(WorkerBackend):
    """Compressed sums of flat buffers, run in start order by a worker thread."""

    operation = "compressed sum"

    def __init__(self, group, name: str, timeout: Optional[timedelta], tracer: Tracer):
        super().__init__(name, timeout, tracer)
        self._data = group
        self._queue: Deque[Job] = collections.deque()

    def start(self, tensor: torch.Tensor, what: str, priority: int = 0, codec: Optional[SlotCodec] = None) -> Handle:
        if codec is None:
            raise UsageError(f"sapipe: the compressed {self.name} sum of {what} was started without its codec")
        return self.submit(self.new_job(tensor, what, detail=codec), self._queue.append)

    def close(self) -> None:
        self.stop_worker()
        release_group(self, "_data")

    # ------------------------------------------------------------------ worker side

    def next_unit(self) -> Optional[Tuple[Job, None]]:
        with self.lock:
            while not self._queue and not self.closing:
                self.lock.wait()
            return (self._queue.popleft(), None) if self._queue else None

    def run_unit(self, job: Job, unit: None) -> None:
        group = self._data
        if group is None:
            raise RuntimeError("sapipe: the compressed back-end was closed with work in flight")
        codec: SlotCodec = job.detail
        outgoing = codec.scatter_messages(job.tensor)
        dist.all_to_all_single(codec.inbox(), outgoing, group=group)
        all_gather_single(codec.gathered(), codec.gather_message(), group=group)
        codec.decode_sum(job.tensor)


__all__ = ["CompressedSum"]
