"""Communication back-ends behind one narrow interface: start a bucket, get a handle; wait.

The engine never touches ``torch.distributed`` for bucket traffic directly, so a back-end
is one small class (see :mod:`sapipe.comm.base` for the contract):

=============  =====================================================================
``torch``      one all-reduce per bucket on a process group of its own (default)
``pushpull``   BytePS's pattern on torch.distributed: 4 MB chunks, reduce-scatter +
               all-gather, in the order the next forward needs them
``horovod``    ``horovod.torch.allreduce_async_`` (needs ``hvd.init()``)
``byteps``     ``byteps.torch.push_pull_async_inplace`` — an adapter, never run
=============  =====================================================================
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

from ..errors import ConfigurationError, SapipeError
from ..trace import Tracer
from .base import CommBackend, Handle
from .compressed import CompressedSum
from .pushpull import DEFAULT_PARTITION_BYTES, PushPull
from .groups import new_group_like, release_group
from .torch_backend import AllReduce

BACKENDS = ("torch", "pushpull", "horovod", "byteps")


def availability(backend: str) -> Optional[str]:
    """Why ``backend`` cannot run in this process (None if it can).

    Ranks compare this before building anything, so a library missing on one rank
    fails every rank at once instead of leaving the others waiting.
    """
    try:
        if backend == "horovod":
            from .horovod_backend import import_horovod

            import_horovod()
        elif backend == "byteps":
            from .byteps_backend import import_byteps

            import_byteps()
    except ConfigurationError as exc:
        return str(exc)
    return None


def compression_refusal(backend: str, compression: Optional[str]) -> Optional[str]:
    """Why ``backend`` cannot carry ``compression`` (None if it can)."""
    if compression is None or backend == "torch":
        return None
    return (f"backend={backend!r} cannot carry compression={compression!r} yet; "
            "compressed sums run on backend='torch' (NCCL or Gloo)")


def create(
    backend: str,
    process_group,
    name: str,
    timeout: Optional[timedelta],
    tracer: Tracer,
    partition_bytes: int = DEFAULT_PARTITION_BYTES,
    compression: Optional[str] = None,
) -> CommBackend:
    """A back-end instance for one kind of traffic (``name``: "sync" or "stale").

    Every instance gets process groups of its own over ``process_group``'s ranks. With
    ``compression``, each start is handed the bucket's codec (see :func:`compression_refusal`).
    """
    if compression is not None:
        return CompressedSum(new_group_like(process_group, timeout), name, timeout, tracer)
    if backend == "torch":
        return AllReduce(new_group_like(process_group, timeout), name, timeout, tracer)
    if backend == "pushpull":
        # The per-chunk agreement is one CPU integer: Gloo, whatever carries the data.
        return PushPull(new_group_like(process_group, timeout), new_group_like(process_group, timeout, "gloo"),
                        name, timeout, tracer, partition_bytes)
    if backend == "horovod":
        from .horovod_backend import HorovodAllReduce

        return HorovodAllReduce(new_group_like(process_group, timeout), name, timeout, tracer)
    if backend == "byteps":
        from .byteps_backend import BytePSPushPull

        return BytePSPushPull(new_group_like(process_group, timeout), name, timeout, tracer)
    raise SapipeError(f"sapipe: unknown backend {backend!r}")  # validated before; a bug if reached


__all__ = ["BACKENDS", "CommBackend", "Handle", "availability", "compression_refusal", "create", "new_group_like",
           "release_group"]
