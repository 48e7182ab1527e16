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

from datetime import timedelta

from sapipe.comm import hierarchical
from sapipe.comm.base import CommBackend, Handle
from sapipe.comm.compressed import CompressedSum, TorchCollectives
from sapipe.comm.groups import new_group_like, release_group
from sapipe.comm.pushpull import DEFAULT_PARTITION_BYTES, PushPull
from sapipe.comm.topology import Topology
from sapipe.comm.torch_backend import AllReduce
from sapipe.errors import ConfigurationError, SapipeError
from sapipe.tracing.tracer import Tracer

BACKENDS = ("torch", "pushpull", "horovod", "byteps")


def availability(backend: str) -> str | None:
    """Why ``backend`` cannot run in this process (None if it can).

    Ranks compare this before building anything, so a library missing on one rank
    fails every rank at once instead of leaving the others waiting.
    """
    try:
        if backend == "horovod":
            from sapipe.comm.horovod_backend import import_horovod

            import_horovod()
        elif backend == "byteps":
            from sapipe.comm.byteps_backend import import_byteps

            import_byteps()
    except ConfigurationError as exc:
        return str(exc)
    return None


COMPRESSING_BACKENDS = ("torch", "pushpull", "horovod")


def compression_refusal(backend: str, compression: str | None) -> str | None:
    """Why ``backend`` cannot carry ``compression`` (None if it can)."""
    if compression is None or backend in COMPRESSING_BACKENDS:
        return None
    return (
        f"backend={backend!r} cannot carry compression={compression!r}; compressed sums run on "
        + ", ".join(f"backend={b!r}" for b in COMPRESSING_BACKENDS)
    )


def compression_partition(backend: str, partition_bytes: int) -> int | None:
    """The bytes of uncompressed gradient ``backend`` compresses and sums as one unit:
    push-pull's partitions (BytePS compresses each partition it pushes); None: the whole
    bucket. A bucket's codec is built to match (sapipe.compression.codec.make_codec)."""
    return partition_bytes if backend == "pushpull" else None


def create(
    backend: str,
    process_group,
    name: str,
    timeout: timedelta | None,
    tracer: Tracer,
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
    compression: str | None = None,
    topology: Topology | None = None,
) -> CommBackend:
    """A back-end instance for one kind of traffic (``name``: "sync" or "stale").

    Every instance gets process groups of its own over ``process_group``'s ranks. With
    ``compression``, each start is handed the bucket's codec (see :func:`compression_refusal`).
    With ``topology`` (``backend="torch"``), buckets are summed hierarchically over its nodes
    (:mod:`sapipe.comm.hierarchical`), compressed across nodes with ``compression``.
    """
    refusal = compression_refusal(backend, compression)
    if refusal is not None:
        raise ConfigurationError(f"{refusal}")  # validated before; reached only by direct calls
    if backend == "torch":
        if topology is not None:
            return hierarchical.create(process_group, topology, compression, name, timeout, tracer)
        if compression is not None:
            return CompressedSum(
                TorchCollectives(new_group_like(process_group, timeout)), name, timeout, tracer
            )
        return AllReduce(new_group_like(process_group, timeout), name, timeout, tracer)
    if backend == "pushpull":
        # The per-chunk agreement is one CPU integer: Gloo, whatever carries the data. Push-pull
        # is handed a codec with each bucket when compressed, and needs nothing else.
        return PushPull(
            new_group_like(process_group, timeout),
            new_group_like(process_group, timeout, "gloo"),
            name,
            timeout,
            tracer,
            partition_bytes,
        )
    if backend == "horovod":
        from sapipe.comm.horovod_backend import HorovodAllReduce, HorovodCollectives

        if compression is not None:
            return CompressedSum(
                HorovodCollectives(process_group, name, timeout), name, timeout, tracer
            )
        return HorovodAllReduce(new_group_like(process_group, timeout), name, timeout, tracer)
    if backend == "byteps":
        from sapipe.comm.byteps_backend import BytePSPushPull

        return BytePSPushPull(new_group_like(process_group, timeout), name, timeout, tracer)
    raise SapipeError(f"unknown backend {backend!r}")  # validated before; a bug if reached


__all__ = [
    "BACKENDS",
    "COMPRESSING_BACKENDS",
    "CommBackend",
    "Handle",
    "availability",
    "compression_partition",
    "compression_refusal",
    "create",
    "new_group_like",
    "release_group",
]
