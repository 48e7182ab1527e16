"""Communication back-ends behind one narrow interface: start a bucket, get a handle; wait.

The engine never touches ``torch.distributed`` for bucket traffic directly, so a back-end
is one small class (see :mod:`sapipe.comm.base` for the contract):

=============  =====================================================================
``torch``      one all-reduce per bucket on a process group of its own (default);
               on several nodes: inside the node, across nodes, inside the node again
               (:mod:`sapipe.comm.hierarchical`); compressed: one compressed sum per
               bucket (all-to-all + all-gather), across nodes only where sums go node first
``pushpull``   BytePS's pattern on torch.distributed: 4 MB chunks, reduce-scatter +
               all-gather, in the order the next forward needs them; compressed: each
               chunk compressed and summed on its own, in the same order
``horovod``    ``horovod.torch.allreduce_async_`` (needs ``hvd.init()``); compressed:
               the compressed sum per bucket over Horovod's ``alltoall`` / ``allgather``
``byteps``     ``byteps.torch.push_pull_async_inplace`` — an adapter, never run; no
               compression
=============  =====================================================================

A compressed sum (:mod:`sapipe.comm.compressed`) takes the gradient's sum in its own dtype
between two collectives of compressed bytes, whichever back-end carries them, so
``torch`` and ``horovod`` deliver the same sums bit for bit (docs/design.md §5.9).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

from sapipe.comm import hierarchical
from sapipe.comm.base import CommBackend, Handle
from sapipe.comm.compressed import CompressedSum, TorchCollectives
from sapipe.comm.groups import new_group_like, release_group
from sapipe.comm.pushpull import DEFAULT_PARTITION_BYTES, PushPull
from sapipe.comm.topology import Topology
from sapipe.comm.torch_backend import AllReduce
from sapipe.errors import ConfigurationError
from sapipe.tracing.tracer import Tracer


@dataclass(frozen=True)
class BackendRequest:
    """What one back-end instance is built for: the job's group (the instance makes groups of
    its own over its ranks), the traffic it carries (``name``: "sync" or "stale"), sapipe's
    ``timeout``, the tracer, and the compression, partition size and nodes of the settings."""

    process_group: Any
    name: str
    timeout: timedelta | None
    tracer: Tracer
    partition_bytes: int = DEFAULT_PARTITION_BYTES
    compression: Any = None
    topology: Topology | None = None


def _always_available() -> str | None:
    return None


@dataclass(frozen=True)
class Backend:
    """A back-end under a name (:func:`register_backend`): how to build an instance, and what
    it can carry. ``compresses``: its ``start`` takes ``codec=`` (compression); ``partitions``:
    it compresses a bucket partition by partition (``partition_mb``), as push-pull does;
    ``availability``: why it cannot run in this process (None if it can), asked on every rank
    before anything is built."""

    build: Callable[[BackendRequest], CommBackend]
    compresses: bool = False
    partitions: bool = False
    availability: Callable[[], str | None] = _always_available


def _torch(request: BackendRequest) -> CommBackend:
    group, name, timeout, tracer = (
        request.process_group,
        request.name,
        request.timeout,
        request.tracer,
    )
    if request.topology is not None:
        return hierarchical.create(
            group, request.topology, request.compression, name, timeout, tracer
        )
    if request.compression is not None:
        return CompressedSum(
            TorchCollectives(new_group_like(group, timeout)), name, timeout, tracer
        )
    return AllReduce(new_group_like(group, timeout), name, timeout, tracer)


def _pushpull(request: BackendRequest) -> CommBackend:
    # The per-chunk agreement is one CPU integer: Gloo, whatever carries the data. Push-pull is
    # handed a codec with each bucket when compressed, and needs nothing else.
    group, timeout = request.process_group, request.timeout
    return PushPull(
        new_group_like(group, timeout),
        new_group_like(group, timeout, "gloo"),
        request.name,
        timeout,
        request.tracer,
        request.partition_bytes,
    )


def _horovod(request: BackendRequest) -> CommBackend:
    from sapipe.comm.horovod_backend import HorovodAllReduce, HorovodCollectives

    group, name, timeout, tracer = (
        request.process_group,
        request.name,
        request.timeout,
        request.tracer,
    )
    if request.compression is not None:
        return CompressedSum(HorovodCollectives(group, name, timeout), name, timeout, tracer)
    return HorovodAllReduce(new_group_like(group, timeout), name, timeout, tracer)


def _byteps(request: BackendRequest) -> CommBackend:
    from sapipe.comm.byteps_backend import BytePSPushPull

    return BytePSPushPull(
        new_group_like(request.process_group, request.timeout),
        request.name,
        request.timeout,
        request.tracer,
    )


def _horovod_availability() -> str | None:
    from sapipe.comm.horovod_backend import import_horovod

    return _unavailable_because(import_horovod)


def _byteps_availability() -> str | None:
    from sapipe.comm.byteps_backend import import_byteps

    return _unavailable_because(import_byteps)


def _unavailable_because(check: Callable[[], Any]) -> str | None:
    try:
        check()
    except ConfigurationError as exc:
        return str(exc)
    return None


#: ``backend=`` names and the back-end each builds (:func:`register_backend` adds one)
BACKENDS: dict[str, Backend] = {
    "torch": Backend(_torch, compresses=True),
    "pushpull": Backend(_pushpull, compresses=True, partitions=True),
    "horovod": Backend(_horovod, compresses=True, availability=_horovod_availability),
    "byteps": Backend(_byteps, availability=_byteps_availability),
}


def register_backend(
    name: str,
    build: Callable[[BackendRequest], CommBackend],
    *,
    compresses: bool = False,
    partitions: bool = False,
    availability: Callable[[], str | None] = _always_available,
) -> None:
    """Let ``backend=name`` build its back-ends with ``build(request)``: a :class:`CommBackend`
    (sapipe.comm.base says what it must do) for the :class:`BackendRequest`'s traffic."""
    if not isinstance(name, str) or not name or name in BACKENDS:
        raise ConfigurationError(
            f"backend {name!r} is not a new name (registered: {sorted(BACKENDS)})"
        )
    BACKENDS[name] = Backend(build, compresses, partitions, availability)


def availability(backend: str) -> str | None:
    """Why ``backend`` cannot run in this process (None if it can).

    Ranks compare this before building anything, so a library missing on one rank
    fails every rank at once instead of leaving the others waiting.
    """
    return BACKENDS[backend].availability()


def compressing_backends() -> list[str]:
    return [name for name, b in BACKENDS.items() if b.compresses]


def compression_refusal(backend: str, compression: Any) -> str | None:
    """Why ``backend`` cannot carry ``compression`` (None if it can)."""
    if compression is None or BACKENDS[backend].compresses:
        return None
    return (
        f"backend={backend!r} cannot carry compression={compression!r}; compressed sums run on "
        + ", ".join(f"backend={b!r}" for b in compressing_backends())
    )


def compression_partition(backend: str, partition_bytes: int) -> int | None:
    """The bytes of uncompressed gradient ``backend`` compresses and sums as one unit:
    push-pull's partitions (BytePS compresses each partition it pushes); None: the whole
    bucket. A bucket's codec is built to match (sapipe.compression.codec.make_codec)."""
    return partition_bytes if BACKENDS[backend].partitions else None


def create(backend: str, request: BackendRequest) -> CommBackend:
    """A back-end instance for one kind of traffic (``request.name``: "sync" or "stale"):
    every instance makes process groups of its own over the job's ranks. With compression,
    each start is handed the bucket's codec; with ``request.topology`` (``backend="torch"``),
    buckets are summed hierarchically over its nodes (:mod:`sapipe.comm.hierarchical`)."""
    return BACKENDS[backend].build(request)


__all__ = [
    "BACKENDS",
    "Backend",
    "BackendRequest",
    "CommBackend",
    "Handle",
    "availability",
    "compression_partition",
    "compression_refusal",
    "compressing_backends",
    "create",
    "new_group_like",
    "register_backend",
    "release_group",
]
