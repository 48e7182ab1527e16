"""Back-ends whose collectives a worker thread of their own issues (push-pull, compressed sums).

Such a back-end turns each started bucket into a :class:`Job`, which its worker thread
works through in units (a push-pull chunk, a compressed sum) in an order every rank
computes alike. What is shared is the rest: starting the thread, handing a failure to
every waiter (a dead peer fails the worker's collective within the groups' timeout, and
every job still open then fails with it), the CUDA side stream (each job's first unit
ordered after the stream that started it, ``wait`` ordering the caller's stream after its
last), completion callbacks, and stopping the thread at ``close()``.
"""

from __future__ import annotations

import abc
import collections
import math
import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from sapipe.comm.base import CommBackend, Handle
from sapipe.errors import UsageError

_JOIN_SECONDS = 10.0  # how long close() waits for an idle worker to exit

# torch 2.13 renamed the single-tensor collectives (the old names warn there); sapipe supports
# torch >= 2.1, which has only the old ones.
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


class Scratch:
    """Reusable buffers of a worker, by name (grown when needed, never allocated per step)."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, numel: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._buffers.get(name)
        if (
            buf is None
            or buf.numel() < numel
            or buf.dtype != like.dtype
            or buf.device != like.device
        ):
            buf = self._buffers[name] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf[:numel]


def sum_by_shards(
    tensor: torch.Tensor, parts: int, group, scratch: Scratch, across=None, pieces: int = 1
) -> None:
    """``tensor`` summed in place by shards: reduce-scatter over ``group`` (``parts`` ranks;
    each receives the sum of its 1/parts), the shard all-reduced over ``across`` when given
    (the same shard's owners elsewhere), then all-gathered over ``group``. An uneven tensor
    goes through a zero-padded copy.

    With ``pieces`` > 1 the tensor is cut into that many pieces, each summed so, and the
    steps pipelined across them: a piece's all-reduce over ``across`` runs while the next
    pieces are reduce-scattered, and its all-gather while the next are all-reduced, so the
    steps on ``group`` hide behind those on ``across`` (every rank issues the same
    collectives on each group in the same order)."""
    per_piece = math.ceil(tensor.numel() / pieces)
    views = [tensor[lo : lo + per_piece] for lo in range(0, tensor.numel(), per_piece)] or [tensor]
    padded = [_padded(view, parts, scratch, f"padded{i}") for i, view in enumerate(views)]
    shards = [
        scratch.get(f"shard{i}", work.numel() // parts, tensor) for i, work in enumerate(padded)
    ]
    done = [
        reduce_scatter_sum(shard, work, group, scratch, f"received{i}", async_op=True)
        for i, (shard, work) in enumerate(zip(shards, padded))
    ]
    if across is not None:
        done = [
            _then(
                w,
                lambda s=shard: dist.all_reduce(
                    s, op=dist.ReduceOp.SUM, group=across, async_op=True
                ),
            )
            for w, shard in zip(done, shards)
        ]
    gathered = [
        _then(
            w,
            lambda work=work, shard=shard: all_gather_single(
                work, shard, group=group, async_op=True
            ),
        )
        for w, work, shard in zip(done, padded, shards)
    ]
    for w in gathered:
        w.wait()
    for view, work in zip(views, padded):
        if work is not view:
            view.copy_(work[: view.numel()])


def reduce_scatter_sum(
    shard: torch.Tensor,
    full: torch.Tensor,
    group,
    scratch: Scratch,
    name: str,
    async_op: bool = False,
):
    """A reduce-scatter: this rank's 1/W of ``full`` summed over ``group``'s W ranks, into
    ``shard``; its work when ``async_op``. On the CPU it is an all-to-all of the W shards and
    their sum in rank order (in ``scratch``'s buffer ``name``), faster than Gloo's own
    reduce-scatter (benchmarks/studies/reduce_scatter_cpu.py)."""
    if full.device.type != "cpu":
        return reduce_scatter_single(
            shard, full, op=dist.ReduceOp.SUM, group=group, async_op=async_op
        )
    received = scratch.get(name, full.numel(), full)
    done = _SumOnWait(
        dist.all_to_all_single(received, full, group=group, async_op=True), received, shard
    )
    if not async_op:
        return done.wait()
    return done


class _SumOnWait:
    """The work of an all-to-all whose ``wait`` also sums the received rows into ``shard``."""

    def __init__(self, work, received: torch.Tensor, shard: torch.Tensor):
        self._work, self._rows, self._shard = work, received.view(-1, shard.numel()), shard

    def wait(self) -> None:
        self._work.wait()
        self._shard.copy_(self._rows[0])  # then the other ranks' rows, in rank order
        for row in self._rows[1:]:
            self._shard.add_(row)


def _padded(view: torch.Tensor, parts: int, scratch: Scratch, name: str) -> torch.Tensor:
    """``view`` itself when it splits into ``parts`` equal shards, else a zero-padded copy."""
    shard_numel = math.ceil(view.numel() / parts)
    if shard_numel * parts == view.numel():
        return view
    work = scratch.get(name, shard_numel * parts, view)
    work[: view.numel()].copy_(view)
    work[view.numel() :].zero_()
    return work


def _then(work, issue: Callable[[], Any]):
    """Wait for ``work`` (the host blocks on Gloo; on NCCL the current stream waits), then
    issue the next collective; its work."""
    work.wait()
    return issue()


@dataclass
class Job:
    """One started bucket: its tensor, how many units are left, and whether it is done."""

    sequence: int  # start order, identical on every rank
    tensor: torch.Tensor
    what: str
    remaining: int = 1  # units not yet run
    done: threading.Event = field(default_factory=threading.Event)
    callbacks: list[Callable[[], None]] = field(default_factory=list)  # run by the worker when done
    ready_event: object | None = None  # CUDA: the caller's stream reached start()
    finished_event: object | None = None  # CUDA: the side stream finished the last unit
    error: BaseException | None = None
    detail: Any = None  # the back-end's own (push-pull: chunks and priority; compressed: the codec)
    values: int | None = None  # the leading elements that arrive as their mean (None: all)


class WorkerBackend(CommBackend):
    """A back-end whose worker thread runs the units of started jobs (see the module docstring).

    Subclasses say which unit comes next (:meth:`next_unit`, blocking; None stops the
    worker) and how to run it (:meth:`run_unit`), and call :meth:`submit` from ``start``.
    """

    operation = "sum"

    def __init__(self, name: str, timeout, tracer):
        super().__init__(name, timeout, tracer)
        self.lock = threading.Condition()
        self.unfinished: dict[int, Job] = {}  # sequence -> job, until its last unit has run
        self.num_started = 0
        self.error: BaseException | None = None
        self.closing = False
        self._worker: threading.Thread | None = None
        self._stream = None  # CUDA side stream, made by the worker

    # ------------------------------------------------------------------ engine side

    def new_job(
        self,
        tensor: torch.Tensor,
        what: str,
        units: int = 1,
        detail: Any = None,
        values: int | None = None,
    ) -> Job:
        job = Job(0, tensor, what, remaining=units, detail=detail, values=values)
        if tensor.is_cuda:
            job.ready_event = torch.cuda.Event()
            job.ready_event.record(torch.cuda.current_stream(tensor.device))
        return job

    def submit(self, job: Job, enqueue: Callable[[Job], None]) -> Handle:
        """Number ``job``, hand it to ``enqueue`` (under the lock), wake the worker; its handle."""
        with self.lock:
            if self.error is not None:
                raise self.failure(self.operation, job.what, self.error) from self.error
            if self.closing:
                raise UsageError(f"the {self.name} back-end was used after close()")
            job.sequence = self.num_started
            self.num_started += 1
            if self.tracer.enabled:  # before the worker can record the job's end
                self.trace_start(job.what)
            if job.remaining == 0:
                job.done.set()
            else:
                self.unfinished[job.sequence] = job
            enqueue(job)
            if self._worker is None:
                self._worker = threading.Thread(
                    target=self._run, name=f"sapipe-{self.name}-worker", daemon=True
                )
                self._worker.start()
            self.lock.notify_all()
        return Handle(job, job.tensor, job.what, self, job.values)

    def wait(self, handle: Handle) -> torch.Tensor:
        job: Job = handle.token
        self.trace_wait_start(handle.what)
        # The worker's own collectives time out after the group's limit and then fail
        # every job, so this returns; the extra bound only guards a wedged worker.
        limit = 2 * self.timeout.total_seconds() + 60 if self.timeout else None
        if not job.done.wait(limit):
            raise self.failure(
                self.operation, handle.what, TimeoutError(f"no result after {limit:g}s")
            )
        if job.error is not None:
            raise self.failure(self.operation, handle.what, job.error) from job.error
        if job.finished_event is not None:
            torch.cuda.current_stream(job.tensor.device).wait_event(job.finished_event)
        self.trace_wait_end(handle.what)
        return handle.tensor

    def when_done(self, handle: Handle, callback: Callable[[], None]) -> bool:
        job: Job = handle.token
        with self.lock:
            if not job.done.is_set():
                job.callbacks.append(callback)
                return True
        callback()
        return True

    def stop_worker(self) -> None:
        """Let the worker finish what was started, then end it (bounded: a wedged collective
        times out on its own)."""
        with self.lock:
            self.closing = True
            self.lock.notify_all()
        if self._worker is not None:
            self._worker.join(_JOIN_SECONDS)

    # ------------------------------------------------------------------ worker side

    @abc.abstractmethod
    def next_unit(self) -> tuple[Job, Any] | None:
        """The next (job, unit) to run, blocking until there is one; None once closing and idle."""

    @abc.abstractmethod
    def run_unit(self, job: Job, unit: Any) -> None:
        """Run one unit of ``job`` (its collectives, on the worker's thread and stream)."""

    def _run(self) -> None:
        try:
            while True:
                item = self.next_unit()
                if item is None:
                    return
                self._run_on_stream(*item)
        except BaseException as exc:  # noqa: BLE001 - handed to every waiter
            with self.lock:
                self.error = exc
                failed = list(self.unfinished.values())
                self.unfinished.clear()
            for job in failed:
                job.error = exc
                job.done.set()

    def _run_on_stream(self, job: Job, unit: Any) -> None:
        if job.ready_event is not None and self._stream is None:
            self._stream = torch.cuda.Stream(job.tensor.device)
        if self._stream is not None:
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(job.ready_event)  # ordered after start(); cheap once passed
                self.run_unit(job, unit)
                if job.remaining == 1:
                    job.finished_event = torch.cuda.Event()
                    job.finished_event.record(self._stream)
        else:
            self.run_unit(job, unit)
        job.remaining -= 1
        if job.remaining == 0:
            with self.lock:
                del self.unfinished[job.sequence]
                job.done.set()
            if self.tracer.enabled:
                self.trace_done(job.what)
            if job.callbacks and job.finished_event is not None:
                # the profiler's completion time is when the GPU finished, not when the work was
                # queued
                job.finished_event.synchronize()
            for callback in job.callbacks:
                callback()


class InStartOrder(WorkerBackend):
    """A worker back-end whose jobs are one unit each, run in start order (the same on every
    rank): compressed sums, hierarchical sums."""

    def __init__(self, name: str, timeout, tracer):
        super().__init__(name, timeout, tracer)
        self._queue: collections.deque[Job] = collections.deque()

    def enqueue(self, job: Job) -> Handle:
        return self.submit(job, self._queue.append)

    def next_unit(self) -> tuple[Job, None] | None:
        with self.lock:
            while not self._queue and not self.closing:
                self.lock.wait()
            return (self._queue.popleft(), None) if self._queue else None


__all__ = [
    "InStartOrder",
    "Job",
    "Scratch",
    "WorkerBackend",
    "all_gather_single",
    "reduce_scatter_single",
    "reduce_scatter_sum",
    "sum_by_shards",
]
