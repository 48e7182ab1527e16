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

On CUDA the worker runs its collectives on a side stream, ordered after the stream that
started each bucket, and ``wait`` makes the caller's stream wait for the result.
``close()`` stops the worker, then destroys both groups at once (their Gloo threads joined
before the interpreter can begin finalising, :mod:`sapipe.comm.groups`); the worker checks
for a released group before each collective, since given ``None`` torch would run it on the
default group.
"""
from __future__ import annotations

import heapq
import math
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from ..trace import Tracer
from .base import CommBackend, Handle
from .groups import release_group

DEFAULT_PARTITION_BYTES = 4 * 1024 * 1024  # BytePS's default partition size
_JOIN_SECONDS = 10.0  # how long close() waits for an idle worker to exit

# torch 2.13 renamed the single-tensor collectives (the old names warn there); sapipe supports
# torch >= 2.1, which has only the old ones.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


@dataclass
class _Job:
    """One started bucket: its chunks, how many are left, and whether it is done."""

    sequence: int  # start order, identical on every rank
    tensor: torch.Tensor
    what: str
    priority: int
    chunks: List[Tuple[int, int]]  # [start, end) element ranges
    remaining: int = 0
    done: threading.Event = field(default_factory=threading.Event)
    callbacks: List[Callable[[], None]] = field(default_factory=list)  # run by the worker when done
    ready_event: Optional[object] = None  # CUDA: the caller's stream reached start()
    finished_event: Optional[object] = None  # CUDA: the side stream finished the last chunk
    error: Optional[BaseException] = None


class PushPull(CommBackend):
    """Chunked reduce-scatter + all-gather of flat buffers, issued in priority order."""

    def __init__(
        self,
        group,
        negotiation_group,
        name: str,
        timeout: Optional[timedelta],
        tracer: Tracer,
        partition_bytes: int = DEFAULT_PARTITION_BYTES,
    ):
        super().__init__(name, timeout, tracer)
        if partition_bytes <= 0:
            raise ValueError(f"sapipe: partition_bytes must be > 0; got {partition_bytes}")
        # Both groups belong to the worker thread alone; ``group`` stays None, so the
        # scheduler's link probes (main thread) never interleave with the worker's traffic.
        self._data = group  # reduce-scatters and all-gathers
        self._negotiation = negotiation_group  # one int per chunk decision
        self.partition_bytes = partition_bytes
        self.world_size = dist.get_world_size(group)
        self._cond = threading.Condition()
        self._started: List[_Job] = []  # in start order; drained as they are agreed on
        self._unfinished: Dict[int, _Job] = {}  # sequence -> job, until its last chunk is summed
        self._num_started = 0
        self._num_agreed = 0
        self._queue: List[Tuple[int, int, int, _Job]] = []  # (priority, sequence, chunk, job)
        self._error: Optional[BaseException] = None
        self._closing = False
        self._worker: Optional[threading.Thread] = None
        self._stream = None  # CUDA side stream, made on first use
        self._staging: Optional[torch.Tensor] = None  # padded chunk, reused
        self._shard: Optional[torch.Tensor] = None  # this rank's summed shard, reused

    # ------------------------------------------------------------------ engine side

    def start(self, tensor: torch.Tensor, what: str, priority: int = 0) -> Handle:
        per_chunk = max(1, self.partition_bytes // tensor.element_size())
        chunks = [(lo, min(lo + per_chunk, tensor.numel())) for lo in range(0, tensor.numel(), per_chunk)]
        job = _Job(0, tensor, what, priority, chunks, remaining=len(chunks))
        if tensor.is_cuda:
            job.ready_event = torch.cuda.Event()
            job.ready_event.record(torch.cuda.current_stream(tensor.device))
        with self._cond:
            if self._error is not None:
                raise self.failure("push-pull", what, self._error) from self._error
            if self._closing:
                raise RuntimeError("sapipe: push-pull back-end used after close()")
            job.sequence = self._num_started
            self._num_started += 1
            if not chunks:
                job.done.set()
            else:
                self._unfinished[job.sequence] = job
            self._started.append(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._run, name=f"sapipe-pushpull-{self.name}", daemon=True)
                self._worker.start()
            self._cond.notify()
        if self.tracer.enabled:
            self.trace_start(what)
        return Handle(job, tensor, what, self)

    def wait(self, handle: Handle) -> torch.Tensor:
        job: _Job = handle.token
        self.trace_wait_start(handle.what)
        # The worker's own collectives time out after the group's limit and then fail
        # every job, so this returns; the extra bound only guards a wedged worker.
        limit = 2 * self.timeout.total_seconds() + 60 if self.timeout else None
        if not job.done.wait(limit):
            raise self.failure("push-pull", handle.what, TimeoutError(f"no result after {limit:g}s"))
        if job.error is not None:
            raise self.failure("push-pull", handle.what, job.error) from job.error
        if job.finished_event is not None:
            torch.cuda.current_stream(job.tensor.device).wait_event(job.finished_event)
        self.trace_wait_end(handle.what)
        return handle.tensor

    def when_done(self, handle: Handle, callback: Callable[[], None]) -> bool:
        job: _Job = handle.token
        with self._cond:
            if not job.done.is_set():
                job.callbacks.append(callback)
                return True
        callback()
        return True

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify()
        if self._worker is not None:
            self._worker.join(_JOIN_SECONDS)
        # Destroyed now, their Gloo threads joined (sapipe.comm.groups). A worker still inside
        # a collective after the join's limit holds the group in that call's frame; the group
        # is then destroyed when the call returns (its own timeout bounds that).
        release_group(self, "_data")
        release_group(self, "_negotiation")

    # ------------------------------------------------------------------ worker side

    def _run(self) -> None:
        try:
            if self._stream is None and self._started and self._started[0].tensor.is_cuda:
                self._stream = torch.cuda.Stream(self._started[0].tensor.device)
            while True:
                with self._cond:
                    # Nothing agreed is left: wait until this rank has started something new.
                    # (The queue is the same on every rank, so every rank waits here alike.)
                    while not self._queue and self._num_started == self._num_agreed and not self._closing:
                        self._cond.wait()
                    if not self._queue and self._num_started == self._num_agreed:
                        return  # closing, and nothing in flight
                    local = self._num_started
                self._agree(local)
                _, _, index, job = heapq.heappop(self._queue)
                self._push_pull(job, index)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            with self._cond:
                self._error = exc
                failed = list(self._unfinished.values())
                self._unfinished.clear()
                self._queue.clear()
                self._started = []
            for job in failed:
                job.error = exc
                job.done.set()

    def _agree(self, local: int) -> None:
        """Queue the chunks of every bucket that all ranks have started by now."""
        count = torch.tensor([local], dtype=torch.int64)
        dist.all_reduce(count, op=dist.ReduceOp.MIN, group=self._group("_negotiation"))
        agreed = int(count.item())
        with self._cond:
            newly = self._started[: agreed - self._num_agreed]
            del self._started[: agreed - self._num_agreed]
            self._num_agreed = agreed
        for job in newly:
            for index in range(len(job.chunks)):
                heapq.heappush(self._queue, (job.priority, job.sequence, index, job))

    def _push_pull(self, job: _Job, index: int) -> None:
        """Sum chunk ``index`` of ``job`` over the ranks: reduce-scatter, then all-gather."""
        lo, hi = job.chunks[index]
        chunk = job.tensor[lo:hi]
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                if index == 0:
                    self._stream.wait_event(job.ready_event)
                self._exchange(chunk)
                if job.remaining == 1:
                    job.finished_event = torch.cuda.Event()
                    job.finished_event.record(self._stream)
        else:
            self._exchange(chunk)
        job.remaining -= 1
        if job.remaining == 0:
            with self._cond:
                del self._unfinished[job.sequence]
                job.done.set()
            if self.tracer.enabled:
                self.trace_done(job.what)
            for callback in job.callbacks:
                callback()

    def _exchange(self, chunk: torch.Tensor) -> None:
        world = self.world_size
        shard_numel = math.ceil(chunk.numel() / world)
        padded = shard_numel * world
        if padded != chunk.numel():  # uneven tail: go through a zero-padded copy
            work = self._buffer("_staging", padded, chunk)
            work[: chunk.numel()].copy_(chunk)
            work[chunk.numel() :].zero_()
        else:
            work = chunk
        shard = self._buffer("_shard", shard_numel, chunk)
        group = self._group("_data")
        _reduce_scatter(shard, work, op=dist.ReduceOp.SUM, group=group)  # push
        _all_gather(work, shard, group=group)  # pull
        if work is not chunk:
            chunk.copy_(work[: chunk.numel()])

    def _group(self, attr: str):
        """One of the worker's groups; raises once close() has released it (given None, a
        collective would run on the default group)."""
        group = getattr(self, attr)
        if group is None:
            raise RuntimeError("sapipe: the push-pull back-end was closed with work in flight")
        return group

    def _buffer(self, attr: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        """A reusable scratch buffer of at least ``numel`` elements (grown, never per step)."""
        buf = getattr(self, attr)
        if buf is None or buf.numel() < numel or buf.dtype != like.dtype or buf.device != like.device:
            buf = torch.empty(numel, dtype=like.dtype, device=like.device)
            setattr(self, attr, buf)
        return buf[:numel]
