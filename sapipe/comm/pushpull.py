"""``backend="pushpull"``: BytePS's push-pull pattern on ``torch.distributed``, in priority order.

BytePS splits every tensor into partitions (4 MB by default), *pushes* each to the
servers, which sum it, and *pulls* the sum back; a scheduler sends the partitions of the
layers the next forward needs first ahead of the rest. Without servers, the same two
halves are collectives: the push is a reduce-scatter (rank r receives the sum of the r-th
shard of the chunk) and the pull an all-gather of the summed shards. Every rank moves
(W−1)/W of each chunk each way, like a ring all-reduce, but in chunks small enough that a
high-priority bucket never waits for more than one chunk of a low-priority one.

Ordering collectives by priority is the delicate part: collectives must be issued in the
same order on every rank, but which buckets a rank has already started when it picks the
next chunk depends on its own timing. So one worker thread per instance, before each
chunk, *agrees* with the other ranks on how many buckets all of them have started (a
MIN all-reduce of one integer on a small group of its own — the role of Horovod's
coordinator and BytePS's scheduler), and then picks, from the chunks of those buckets
only, the one with the lowest ``priority`` (ties: first started, then first chunk). The
choice is a function of agreed values only, so every rank makes the same one.

With ``compression=``, each bucket arrives with a
:class:`~sapipe.compression.codec.PartitionedCodec`
slot, whose partitions are the chunks (``partition_mb`` of the uncompressed bucket, as
BytePS compresses each partition it pushes). A chunk is then summed as the two-stage
compressed sum of :mod:`sapipe.comm.compressed` (all-to-all of its compressed shards, a sum
in the gradient's dtype, all-gather of the compressed sums) instead of reduce-scatter +
all-gather; the order of the chunks is agreed as above.

On CUDA the worker runs its collectives on a side stream, ordered after the stream that
started each bucket, and ``wait`` makes the caller's stream wait for the result.
``close()`` stops the worker, then destroys both groups at once (their Gloo threads joined
before the interpreter can begin finalising, :mod:`sapipe.comm.groups`); the worker checks
for a released group before each collective, since given ``None`` torch would run it on the
default group.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from datetime import timedelta
from typing import NamedTuple

import torch
import torch.distributed as dist

from sapipe.comm.base import Handle
from sapipe.comm.compressed import TorchCollectives, check_codec, sum_compressed
from sapipe.comm.groups import release_group
from sapipe.comm.worker import Job, Scratch, WorkerBackend, sum_by_shards
from sapipe.compression.codec import Slot, SlotCodec, partition_bounds
from sapipe.errors import ConfigurationError
from sapipe.tracing.tracer import Tracer

DEFAULT_PARTITION_BYTES = 4 * 1024 * 1024  # BytePS's default partition size


class Chunks(NamedTuple):
    """A push-pull job's ``detail``: its priority, its chunks as [start, end) element ranges,
    and with compression each chunk's codec (None: the chunks travel uncompressed)."""

    priority: int
    bounds: list[tuple[int, int]]
    codecs: Sequence[SlotCodec] | None = None


class PushPull(WorkerBackend):
    """Chunked reduce-scatter + all-gather of flat buffers, issued in priority order; with a
    codec, each chunk a compressed sum instead. A job's units are chunk indices."""

    operation = "push-pull"

    def __init__(
        self,
        group,
        negotiation_group,
        name: str,
        timeout: timedelta | None,
        tracer: Tracer,
        partition_bytes: int = DEFAULT_PARTITION_BYTES,
    ):
        super().__init__(name, timeout, tracer)
        if partition_bytes <= 0:
            raise ConfigurationError(f"partition_bytes must be > 0; got {partition_bytes}")
        # Both groups belong to the worker thread alone; ``group`` stays None, so the
        # scheduler's link probes (main thread) never interleave with the worker's traffic.
        self._data = TorchCollectives(
            group
        )  # reduce-scatters and all-gathers (compressed: all-to-alls)
        self._negotiation = negotiation_group  # one int per chunk decision
        self.partition_bytes = partition_bytes
        self.world_size = dist.get_world_size(group)
        self._started: list[Job] = []  # in start order; drained as they are agreed on
        self._num_agreed = 0
        self._queue: list[tuple[int, int, int, Job]] = []  # (priority, sequence, chunk, job)
        self._scratch = Scratch()  # the padded chunk and this rank's shard, reused

    # ------------------------------------------------------------------ engine side

    def start(
        self,
        tensor: torch.Tensor,
        what: str,
        priority: int = 0,
        *,
        values: int | None = None,
        codec: Slot | None = None,
    ) -> Handle:
        """Begin the chunked sum of ``tensor``; with ``codec`` (compression), its partitions are
        the chunks, each a compressed sum."""
        if codec is None:
            self.divide_for_mean(tensor, values)
            per_chunk = max(1, self.partition_bytes // tensor.element_size())
            chunks = Chunks(priority, partition_bounds(tensor.numel(), per_chunk))
        else:
            parts = check_codec(codec, tensor, self.name, what).partitions()
            chunks = Chunks(
                priority, [(lo, hi) for lo, hi, _ in parts], [part for _, _, part in parts]
            )
        return self.submit(
            self.new_job(tensor, what, units=len(chunks.bounds), detail=chunks, values=values),
            self._started.append,
        )

    def close(self) -> None:
        self.stop_worker()
        # Destroyed now, their Gloo threads joined (sapipe.comm.groups). A worker still inside
        # a collective after the join's limit holds the group in that call's frame; the group
        # is then destroyed when the call returns (its own timeout bounds that).
        self._data.close()
        release_group(self, "_negotiation")

    # ------------------------------------------------------------------ worker side

    def next_unit(self) -> tuple[Job, int] | None:
        with self.lock:
            # Nothing agreed is left: wait until this rank has started something new.
            # (The queue is the same on every rank, so every rank waits here alike.)
            while not self._queue and self.num_started == self._num_agreed and not self.closing:
                self.lock.wait()
            if not self._queue and self.num_started == self._num_agreed:
                return None  # closing, and nothing in flight
            local = self.num_started
        self._agree(local)
        _, _, index, job = heapq.heappop(self._queue)
        return job, index

    def _agree(self, local: int) -> None:
        """Queue the chunks of every bucket that all ranks have started by now."""
        count = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self._negotiation_group())
        agreed = int(count.item())
        with self.lock:
            newly = self._started[: agreed - self._num_agreed]
            del self._started[: agreed - self._num_agreed]
            self._num_agreed = agreed
        for job in newly:
            for index in range(len(job.detail.bounds)):
                heapq.heappush(self._queue, (job.detail.priority, job.sequence, index, job))

    def run_unit(self, job: Job, index: int) -> None:
        """Sum chunk ``index`` of ``job`` over the ranks (with a codec: compressed)."""
        lo, hi = job.detail.bounds[index]
        if job.detail.codecs is None:
            self._push_pull(job.tensor[lo:hi])
        else:
            sum_compressed(
                job.detail.codecs[index], job.tensor[lo:hi], self._data, f"{job.sequence}.{index}"
            )

    def _push_pull(self, chunk: torch.Tensor) -> None:
        """``chunk`` summed over the ranks: reduce-scatter (push), then all-gather (pull)."""
        sum_by_shards(chunk, self.world_size, self._data.live_group(), self._scratch)

    def _negotiation_group(self):
        """The agreement's group; raises once close() has released it (given None, a
        collective would run on the default group)."""
        if self._negotiation is None:
            raise RuntimeError("sapipe: the push-pull back-end was closed with work in flight")
        return self._negotiation


__all__ = ["PushPull", "DEFAULT_PARTITION_BYTES"]
