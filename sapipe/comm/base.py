"""The contract every communication back-end meets, and the pieces they share.

The engine hands a back-end one flat bucket at a time and later waits for it; what the
back-end does in between (one all-reduce, chunked push-pull, Horovod's or BytePS's own
queue) is its business. Every back-end must:

* **average** the tensor over the ranks of the job, in place: its first ``values`` elements
  (the gradient) arrive as their mean, the rest (the flags behind it: which ranks used each
  parameter, whose gradient held NaN) as their sum. A back-end that sums divides the values
  by the world size as it starts (:meth:`CommBackend.divide_for_mean`, DDP's way: a sum of
  the ranks' shares is their mean, exactly so on 2, 4, 8... ranks); a compressed sum, started
  with a ``codec``, averages by itself (its decode divides at no extra pass,
  sapipe.compression.codec);
* be **deterministic across ranks**: the engine calls ``start`` in the same order on every
  rank, and the back-end must turn that into the same collectives in the same order;
* **fail loudly within a bounded time**: a dead or hung peer surfaces as a
  :class:`CommunicationError` naming the bucket, never as a hang;
* **destroy its process groups in** ``close()`` (:func:`sapipe.comm.groups.release_group`),
  not leave them to the garbage collector: a Gloo group whose threads outlive the start of
  interpreter finalisation can abort the process at exit.
"""

from __future__ import annotations

import abc
import importlib
import itertools
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from sapipe.comm import failures
from sapipe.comm.groups import release_group
from sapipe.errors import CommunicationError, ConfigurationError
from sapipe.tracing.tracer import Tracer


@dataclass
class Handle:
    """An in-flight reduction of ``tensor``; ``what`` names it in errors and traces.

    ``token`` is the back-end's own record of the operation (a ``torch.distributed``
    work object, a Horovod handle, a push-pull job).
    """

    token: Any
    tensor: torch.Tensor
    what: str
    owner: CommBackend
    values: int | None = None  # the leading elements that arrive as their mean (None: all)

    def wait(self) -> torch.Tensor:
        """Block until the reduction is done; the tensor, averaged (see the module docstring)."""
        return self.owner.wait(self)


class CommBackend(abc.ABC):
    """Sum over ranks of flat buffers, started asynchronously and waited for explicitly.

    ``name`` ("sync" or "stale") says which traffic an instance carries; the engine keeps
    the two apart so stale traffic never queues in front of what the next forward needs.
    """

    #: A ``torch.distributed`` group over the job's ranks on which the *calling* thread may
    #: issue collectives of its own (the scheduler times the link on it); None if the
    #: back-end's groups are used by a thread of its own.
    group: Any | None = None

    #: A blocking sum of a tensor the way this back-end sums buckets, for the scheduler's link
    #: probes where one all-reduce on a group would time another link (hierarchical sums);
    #: None: the scheduler times all-reduces on ``group`` (or its own control group).
    sum_now: Callable[[torch.Tensor], None] | None = None

    #: The ranks it averages over (set by a back-end that sums, for :meth:`divide_for_mean`).
    world_size: int = 1

    def __init__(self, name: str, timeout: timedelta | None, tracer: Tracer):
        self.name = name
        self.timeout = timeout
        self.tracer = tracer

    @abc.abstractmethod
    def start(
        self, tensor: torch.Tensor, what: str, priority: int = 0, *, values: int | None = None
    ) -> Handle:
        """Begin averaging ``tensor`` over the ranks, in place: its first ``values`` elements
        (None: all) as their mean, the rest as their sum.

        ``priority``: lower is needed sooner (the engine passes the forward index of the
        bucket's first layer). Back-ends that can reorder traffic use it; others ignore it.
        A back-end that carries compression also takes ``codec=`` (the bucket's slot codec).
        """

    @abc.abstractmethod
    def wait(self, handle: Handle) -> torch.Tensor:
        """Block until ``handle``'s reduction is done; return its tensor, averaged."""

    def divide_for_mean(self, tensor: torch.Tensor, values: int | None) -> None:
        """Before a sum over :attr:`world_size` ranks: the first ``values`` elements of
        ``tensor`` (None: all) divided by the world size, so that the sum is their mean."""
        if self.world_size > 1:
            (tensor if values is None else tensor[:values]).div_(self.world_size)

    def close(self) -> None:  # noqa: B027 - optional: a back-end that owns nothing has nothing to do
        """Release what the back-end owns (threads, process groups). Call after every wait.

        Process groups are destroyed here, not left to the garbage collector
        (:func:`sapipe.comm.groups.release_group`): a Gloo group still alive when the
        interpreter finalises can abort it. The instance is unusable afterwards."""

    def when_done(self, handle: Handle, callback: Callable[[], None]) -> bool:
        """Arrange for ``callback()`` (any thread) when ``handle`` completes; False if this
        back-end cannot tell (the scheduler then times the link with probes only)."""
        return False

    def new_buffers(self) -> None:  # noqa: B027 - optional: most back-ends do not name buffers
        """The engine laid its buckets out anew (nothing in flight): buffers started from
        now on are new ones. Back-ends that name buffers across ranks start naming afresh."""

    # -------------------------------------------------------------- shared helpers

    def describe_limit(self) -> str:
        return (
            f"{self.timeout.total_seconds():g}s" if self.timeout else "the process group's timeout"
        )

    def failure(self, operation: str, what: str, exc: BaseException) -> CommunicationError:
        """The error every back-end raises when a collective of bucket ``what`` fails.

        Transports report a lost peer as ``RuntimeError`` (Gloo, NCCL, Horovod) or as a
        timeout or socket error; any other exception was raised by code on this rank, so it
        is not blamed on a peer. A lost peer's error names the rank that failed first and its
        exception where that rank published them (:mod:`sapipe.comm.failures`)."""
        head = f"{self.name} {operation} of {what} failed"
        if isinstance(exc, (RuntimeError, TimeoutError, OSError)):
            cause = (
                f"A peer rank has probably died, hung or lost its connection "
                f"(limit: {self.describe_limit()}). Underlying error: {exc}"
            )
            return failures.symptom(
                CommunicationError(f"{failures.with_first_failure(head)}. {cause}")
            )
        cause = f"The error was raised on this rank: {type(exc).__name__}: {exc}"
        return CommunicationError(f"{head}. {cause}")

    def trace_start(self, what: str) -> None:
        self.tracer.record("comm_start", what=what, stream=self.name)

    def trace_done(self, what: str) -> None:
        self.tracer.record("comm_done", what=what, stream=self.name)

    def trace_wait_start(self, what: str) -> None:
        self.tracer.record("comm_wait_start", what=what, stream=self.name)

    def trace_wait_end(self, what: str) -> None:
        self.tracer.record("comm_wait", what=what, stream=self.name)


class StableNames:
    """Rank-independent names for the buffers a back-end is handed, stable across steps.

    Libraries that match operations across ranks by name (Horovod, BytePS) need a name
    that is the same on every rank and unique among operations in flight; BytePS also
    declares one server-side key per name, and Horovod caches its negotiation per name, so
    the name of a given staleness slot should not change from step to step. The engine
    starts buffers in the same order on every rank, so numbering buffers by the order in
    which they are first seen gives exactly that.
    """

    def __init__(self, prefix: str):
        self._base = self.prefix = prefix
        self._ids: dict = {}
        self._layouts = 0

    def __call__(self, tensor: torch.Tensor) -> str:
        key = (tensor.data_ptr(), tensor.numel(), tensor.dtype)
        if key not in self._ids:
            self._ids[key] = len(self._ids)
        return f"{self.prefix}.{self._ids[key]}"

    def renew(self) -> None:
        """Forget every buffer: the engine laid its buckets out anew, and a new buffer may sit
        where an old one did on one rank and elsewhere on another (each rank's allocator
        decides), so names keyed by address would no longer match. New names, numbered
        afresh in start order, never repeat an old one."""
        self._layouts += 1
        self.prefix, self._ids = f"{self._base}.l{self._layouts}", {}


class LibraryBackend(CommBackend):
    """A back-end that hands buckets to an external library (Horovod, BytePS).

    Such libraries order operations across ranks themselves (matching them by name) and
    have no per-operation timeout, so ``wait`` polls the library's handle and gives up
    after ``timeout`` (:data:`DEFAULT_LIBRARY_TIMEOUT` when sapipe's is None) with a
    :class:`CommunicationError`. Subclasses say how to submit, poll and finish.
    """

    operation = "reduction"

    def __init__(self, group, name: str, timeout: timedelta | None, tracer: Tracer):
        super().__init__(name, timeout, tracer)
        require_whole_job(group, self.operation)
        self.group = group  # carries no bucket data; the scheduler times the link on it
        self.world_size = dist.get_world_size(group)
        self._limit = library_limit(timeout)
        self._names = StableNames(instance_prefix(name))

    @abc.abstractmethod
    def _submit(self, tensor: torch.Tensor, name: str, priority: int) -> Any:
        """Start the in-place sum of ``tensor``; the library's handle."""

    @abc.abstractmethod
    def _poll(self, token: Any) -> bool:
        """Whether the library has finished ``token``."""

    @abc.abstractmethod
    def _finish(self, token: Any) -> None:
        """Collect a finished ``token`` (raises the library's error, if any)."""

    def start(
        self, tensor: torch.Tensor, what: str, priority: int = 0, *, values: int | None = None
    ) -> Handle:
        self.divide_for_mean(tensor, values)
        try:
            token = self._submit(tensor, self._names(tensor), priority)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self.failure(self.operation, what, exc) from exc
        if self.tracer.enabled:
            self.trace_start(what)
        return Handle(token, tensor, what, self, values)

    def wait(self, handle: Handle) -> torch.Tensor:
        self.trace_wait_start(handle.what)
        try:
            wait_polled(self._poll, handle.token, self._limit)
            self._finish(handle.token)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise self.failure(self.operation, handle.what, exc) from exc
        self.trace_wait_end(handle.what)
        return handle.tensor

    def describe_limit(self) -> str:
        return f"{self._limit:g}s"

    def new_buffers(self) -> None:
        self._names.renew()

    def close(self) -> None:
        release_group(self)


DEFAULT_LIBRARY_TIMEOUT = timedelta(
    seconds=300
)  # a library op's limit when sapipe's timeout is None
_POLL_SECONDS = 0.0002
_instance_numbers = itertools.count(1)


def library_limit(timeout: timedelta | None) -> float:
    """Seconds an operation handed to a library (which has no timeout of its own) may take."""
    return (timeout or DEFAULT_LIBRARY_TIMEOUT).total_seconds()


def wait_polled(poll: Callable[[Any], bool], token: Any, limit: float) -> None:
    """Poll a library's ``token`` until done; TimeoutError after ``limit`` seconds."""
    deadline = time.monotonic() + limit
    while not poll(token):
        if time.monotonic() > deadline:
            raise TimeoutError(f"not done after {limit:g}s")
        time.sleep(_POLL_SECONDS)


def instance_prefix(name: str) -> str:
    """A prefix for the names a library matches operations by across ranks, new per back-end
    instance. Instances are created collectively, so the count agrees across ranks, and a new
    optimizer's names never collide with an old one's last operations in flight."""
    return f"sapipe{next(_instance_numbers)}.{name}"


def require_whole_job(group, operation: str) -> None:
    """ConfigurationError unless ``group`` spans the whole job (libraries run on all ranks)."""
    if dist.get_world_size(group) != dist.get_world_size():
        raise ConfigurationError(
            f"{operation} back-ends work on the whole job only; process_group has "
            f"{dist.get_world_size(group)} of the {dist.get_world_size()} ranks"
        )


def import_library(
    module: str, backend: str, hint: str, not_ready: Callable[[Any], str | None] = lambda _: None
):
    """Import ``module`` (``horovod.torch``, ``byteps.torch``) for ``backend=backend``.

    Raises :class:`ConfigurationError` naming the cause if it does not import, if
    ``not_ready(lib)`` returns a reason, or if the library numbers this rank differently
    from ``torch.distributed`` (sapipe uses both: the library for buckets,
    ``torch.distributed`` for set-up and control).
    """
    try:
        lib = importlib.import_module(module)
    except Exception as exc:  # noqa: BLE001 - any import failure means "not usable here"
        raise ConfigurationError(
            f"backend={backend!r} needs {module}, which does not import here "
            f"({type(exc).__name__}: {exc}). {hint}"
        ) from exc
    reason = not_ready(lib)
    if reason:
        raise ConfigurationError(f"backend={backend!r}: {reason}")
    if lib.size() != dist.get_world_size() or lib.rank() != dist.get_rank():
        raise ConfigurationError(
            f"backend={backend!r}: {module} numbers this rank {lib.rank()} of {lib.size()}, "
            f"torch.distributed {dist.get_rank()} of {dist.get_world_size()}; launch both the same "
            "way"
        )
    return lib
