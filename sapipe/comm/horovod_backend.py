"""``backend="horovod"``: buckets summed by Horovod's ``allreduce_async_``; compressed, by
Horovod's ``alltoall`` and ``allgather`` (:class:`HorovodCollectives`).

For clusters already tuned for Horovod (its NCCL/Gloo/MPI set-up, ``horovodrun``): sapipe
keeps its layers, buckets, staleness and compensation, and hands each bucket to Horovod.
Horovod's coordinator orders operations across ranks by name.

With ``compression=``, a bucket's compressed sum (:mod:`sapipe.comm.compressed`) runs its
two collectives through Horovod: the same bytes as on ``backend="torch"``, so the same sum,
bit for bit. (Horovod's own ``Compression.fp16`` instead sums in 16 bits, another rule.)

Requirements, checked at construction: ``horovod.torch`` imports, ``hvd.init()`` has been
called, and Horovod's ranks are the job's ``torch.distributed`` ranks (sapipe still uses
``torch.distributed`` for its set-up and small control collectives). Horovod has no
per-operation timeout; see :class:`~sapipe.comm.base.LibraryBackend` for how waits stay
bounded.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from sapipe.comm.base import (
    LibraryBackend,
    import_library,
    instance_prefix,
    library_limit,
    require_whole_job,
    wait_polled,
)
from sapipe.comm.compressed import Collectives
from sapipe.errors import ConfigurationError
from sapipe.tracing.tracer import Tracer


def import_horovod():
    """``horovod.torch``, initialised and matching torch.distributed; else ConfigurationError."""
    return import_library(
        "horovod.torch",
        "horovod",
        "Install Horovod with PyTorch support (HOROVOD_WITH_PYTORCH=1 pip install horovod; in a "
        "checkout of sapipe, `make peers`)",
        lambda hvd: None if hvd.is_initialized() else "call hvd.init() before DistributedOptimizer",
    )


class HorovodAllReduce(LibraryBackend):
    """Sum-all-reduce of flat buffers through ``horovod.torch.allreduce_async_``."""

    operation = "horovod all-reduce"

    def __init__(self, group, name: str, timeout: timedelta | None, tracer: Tracer):
        super().__init__(group, name, timeout, tracer)
        self._hvd = import_horovod()

    def _submit(self, tensor: torch.Tensor, name: str, priority: int) -> Any:
        return self._hvd.allreduce_async_(tensor, op=self._hvd.Sum, name=name)

    def _poll(self, token: Any) -> bool:
        return self._hvd.poll(token)

    def _finish(self, token: Any) -> None:
        self._hvd.synchronize(token)


class HorovodCollectives(Collectives):
    """A compressed sum's two collectives through ``horovod.torch`` (``alltoall_async``,
    ``allgather_async``), on the whole job.

    Horovod matches operations across ranks by name: each is named by this instance's
    prefix and the caller's ``tag`` (the job's start sequence, the same on every rank).
    Horovod has no timeout of its own, so each operation is polled and given up after
    ``timeout`` (300 s when None): the worker then fails every waiting bucket.
    """

    operation = "horovod compressed sum"

    def __init__(self, group, name: str, timeout: timedelta | None):
        require_whole_job(group, self.operation)
        self._hvd = import_horovod()
        self._prefix = instance_prefix(f"{name}.compressed")
        self._limit = library_limit(timeout)

    def all_to_all(self, received: torch.Tensor, sent: torch.Tensor, tag: str) -> None:
        output, _ = self._finish(self._hvd.alltoall_async(sent, name=f"{self._prefix}.{tag}"))
        received.copy_(output)

    def all_gather(self, gathered: torch.Tensor, own: torch.Tensor, tag: str) -> None:
        gathered.copy_(self._finish(self._hvd.allgather_async(own, name=f"{self._prefix}.{tag}")))

    def _finish(self, handle: Any) -> Any:
        wait_polled(self._hvd.poll, handle, self._limit)
        return self._hvd.synchronize(handle)


def init_horovod_for_torch_job(group=None):
    """Start Horovod with its Gloo controller inside a job launched by ``torchrun``.

    Horovod normally starts under ``horovodrun``, which runs a rendezvous server and sets
    ``HOROVOD_*`` variables in every worker. This does the same from inside an already
    initialised ``torch.distributed`` job (collective: every rank calls it): rank 0 runs
    Horovod's rendezvous server, and the ranks agree on the host layout over ``group``.
    ``torchrun`` numbers ranks node by node, the order Horovod assigns them when hosts are
    listed by node rank. Returns ``horovod.torch``, initialised.
    """
    import os

    import horovod.torch as hvd
    from horovod.runner.common.util import hosts as hv_hosts
    from horovod.runner.http.http_server import RendezvousServer

    if not hvd.gloo_built():
        raise ConfigurationError("this Horovod build has no Gloo controller")
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    local_size = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    node = int(os.environ.get("GROUP_RANK", 0))

    def gather(value):
        out = [None] * world
        dist.all_gather_object(out, value, group=group)
        return out

    slots = dict(gather((node, local_size)))
    port = None
    server = None
    if rank == 0:
        spec = ",".join(f"node{nd}:{slots[nd]}" for nd in sorted(slots))
        plan = hv_hosts.get_host_assignments(hv_hosts.parse_hosts(spec), world)
        server = RendezvousServer(verbose=0)
        port = server.start()
        server.init(plan)
    port = gather(port)[0]
    os.environ.update(
        {
            "HOROVOD_GLOO_RENDEZVOUS_ADDR": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "HOROVOD_GLOO_RENDEZVOUS_PORT": str(port),
            "HOROVOD_CONTROLLER": "gloo",
            "HOROVOD_CPU_OPERATIONS": "gloo",
            "HOROVOD_HOSTNAME": f"node{node}",
            "HOROVOD_RANK": str(rank),
            "HOROVOD_SIZE": str(world),
            "HOROVOD_LOCAL_RANK": str(local_rank),
            "HOROVOD_LOCAL_SIZE": str(local_size),
            "HOROVOD_CROSS_RANK": str(node),
            "HOROVOD_CROSS_SIZE": str(len(slots)),
        }
    )
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        os.environ["HOROVOD_GLOO_IFACE"] = os.environ["GLOO_SOCKET_IFNAME"]
    hvd.init()
    hvd._sapipe_rendezvous = server  # keep rank 0's server alive as long as Horovod runs
    if hvd.size() != world or hvd.rank() != rank:
        raise ConfigurationError(
            f"Horovod numbered this rank {hvd.rank()} of {hvd.size()}, torch.distributed {rank} of "
            f"{world}"
        )
    return hvd
