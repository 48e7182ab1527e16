"""Compressed sums (sapipe.compression.codec, docs/design.md §5.9): the two collectives of
compressed
bytes, and the back-end that runs one per bucket (``backend="torch"`` and ``"horovod"``).

A compressed sum is an all-to-all (each rank's shards, compressed, to the ranks that sum
them), a sum in the gradient's own dtype, and an all-gather of the compressed sums
(:func:`sum_compressed`). Which library carries the two collectives is a small piece of its
own (:class:`Collectives`): ``torch.distributed`` on a group (:class:`TorchCollectives`) or
Horovod (:class:`sapipe.comm.horovod_backend.HorovodCollectives`). Both move the same bytes,
so the sums are bit-identical. Push-pull (:mod:`sapipe.comm.pushpull`) runs the same sum
on each partition of a bucket.

The sum in between is computation, so a worker thread of the back-end's own runs the
steps, one bucket after another in start order (the same on every rank, so every rank
issues the same collectives in the same order), while the training thread goes on. The
collectives belong to the worker: ``group`` stays None, so the scheduler's link probes
never interleave with its traffic. On CUDA the worker runs on a side stream ordered after
the stream that started the bucket, and ``wait`` orders the caller's stream after it.
"""

from __future__ import annotations

import abc
from datetime import timedelta

import torch
import torch.distributed as dist

from sapipe.comm.base import Handle
from sapipe.comm.groups import release_group
from sapipe.comm.worker import InStartOrder, Job, all_gather_single
from sapipe.compression.codec import Slot, SlotCodec
from sapipe.errors import UsageError
from sapipe.tracing.tracer import Tracer


class Collectives(abc.ABC):
    """The two collectives of a compressed sum over the job's ranks, on flat byte buffers.

    ``tag`` names the operation alike on every rank (libraries that match operations by
    name need it; ``torch.distributed`` matches them by order and ignores it).
    """

    @abc.abstractmethod
    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor, tag: str) -> None:
        """Row j of ``sent`` (W equal rows) to rank j; row r of ``received`` from rank r."""

    @abc.abstractmethod
    def all_gather(self, gathered: torch.Tensor, own: torch.Tensor, tag: str) -> None:
        """Every rank's ``own``, in rank order, into ``gathered``."""

    def close(self) -> None:  # noqa: B027 - optional: collectives that own nothing
        """Release what the collectives own (a process group); no collective runs afterwards."""


class TorchCollectives(Collectives):
    """``all_to_all_single`` / ``all_gather_single`` on a process group they own."""

    def __init__(self, group):
        self.group = group

    def live_group(self):
        """The group; raises once :meth:`close` has released it (given None, a collective
        would run on the default group)."""
        if self.group is None:
            raise RuntimeError(
                "sapipe: the back-end's process group was released with work in flight"
            )
        return self.group

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor, tag: str) -> None:
        dist.all_to_all_single(received, sent, group=self.live_group())

    def all_gather(self, gathered: torch.Tensor, own: torch.Tensor, tag: str) -> None:
        all_gather_single(gathered, own, group=self.live_group())

    def close(self) -> None:
        release_group(self)


def sum_compressed(
    codec: SlotCodec, wire: torch.Tensor, collectives: Collectives, tag: str
) -> None:
    """``wire`` reduced over the ranks in place, compressed on the wire: its values averaged,
    its flags summed. The all-to-all of its compressed shards, their sum in the gradient's
    dtype, the all-gather of the compressed sums, decoded as the mean."""
    outgoing = codec.scatter_messages(wire)
    collectives.all_to_all(codec.inbox(), outgoing, f"{tag}.scatter")
    collectives.all_gather(codec.gathered(), codec.gather_message(), f"{tag}.gather")
    codec.decode_mean(wire)


def check_codec(codec: Slot | None, tensor: torch.Tensor, name: str, what: str) -> Slot:
    """``codec`` if it was handed over and covers ``tensor``; else UsageError (a bug upstream)."""
    if codec is None:
        raise UsageError(f"the compressed {name} sum of {what} was started without its codec")
    end = codec.partitions()[-1][1]
    if end != tensor.numel():
        raise UsageError(
            f"the codec of {what} covers {end} values, its buffer holds {tensor.numel()}"
        )
    return codec


class CompressedSum(InStartOrder):
    """Compressed sums of flat buffers over ``collectives``, run in start order by a worker
    thread."""

    operation = "compressed sum"

    def __init__(
        self, collectives: Collectives, name: str, timeout: timedelta | None, tracer: Tracer
    ):
        super().__init__(name, timeout, tracer)
        self._collectives = collectives

    def start(
        self,
        tensor: torch.Tensor,
        what: str,
        priority: int = 0,
        *,
        values: int | None = None,
        codec: Slot | None = None,
    ) -> Handle:
        detail = check_codec(codec, tensor, self.name, what)
        return self.enqueue(self.new_job(tensor, what, detail=detail, values=values))

    def close(self) -> None:
        self.stop_worker()
        self._collectives.close()

    # ------------------------------------------------------------------ worker side

    def run_unit(self, job: Job, unit: None) -> None:
        codec: Slot = job.detail
        for index, (lo, hi, part) in enumerate(codec.partitions()):
            sum_compressed(part, job.tensor[lo:hi], self._collectives, f"{job.sequence}.{index}")


__all__ = ["Collectives", "CompressedSum", "TorchCollectives", "check_codec", "sum_compressed"]
