"""Hierarchical sums (``hierarchical=``): inside each node first, then across nodes.

A node's ranks talk over NVLink/PCIe (or shared memory), nodes over a much slower network.
A flat ring all-reduce over all W = N·L ranks puts 2(W − 1)/W of every bucket on the ring's
node-crossing links; Horovod's hierarchical all-reduce and BytePS's intra-node reduce cut
that traffic and spread it over all of a node's ranks. Here, per bucket (as NCCL's 2-D
algorithms do):

1. **reduce-scatter inside the node**: local rank j receives the node's sum of the bucket's
   j-th of L shards;
2. **all-reduce across nodes** of that shard, among the N ranks with local index j (L such
   all-reduces run side by side, one per local index, each 1/L of the bucket);
3. **all-gather inside the node**: every rank receives all L summed shards.

Each node's NIC then carries 2(N − 1)/N of the bucket each way, in L parallel streams; every
rank ends with the same sum. The three collectives depend on each other, so a worker thread
of the back-end runs them, one bucket after another in start order (the same on every rank).
A large bucket is cut into a few pieces whose steps are pipelined (``sum_by_shards``): a
piece crosses between nodes while the next is reduced inside the node, so the node's own
steps hide behind the slow one.

**Compressed** (``compression=``, :class:`HierarchicalCompressedSum`): the same three steps
on each bucket whole (not cut into pieces), the middle one a compressed sum
(sapipe.comm.compressed) of the shard over the N nodes, its bytes and its error feedback
those of a :class:`sapipe.compression.codec.NodeFirstCodec`. Only the
network carries compressed bytes; inside the node the shards travel at full precision. A
flat compressed sum over all W ranks would put each of a node's L ranks' all-to-all through
the node's NIC: L times the compressed bytes of a ring (sapipe.schedule.cluster_link).
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist

from sapipe.comm.base import Handle
from sapipe.comm.compressed import TorchCollectives, sum_compressed
from sapipe.comm.groups import new_subgroup, release_group
from sapipe.comm.topology import Topology
from sapipe.comm.worker import (
    InStartOrder,
    Job,
    Scratch,
    all_gather_single,
    reduce_scatter_sum,
    sum_by_shards,
)
from sapipe.compression.codec import NodeFirstSlot
from sapipe.errors import ConfigurationError, UsageError
from sapipe.tracing.tracer import Tracer

#: A bucket is cut into up to MAX_PIECES pieces of at least PIECE_BYTES, whose steps are
#: pipelined: one piece crosses between nodes while the next is reduced inside the node.
PIECE_BYTES = 1 << 20
MAX_PIECES = 4


def resolve(requested: bool | None, backend: str, topology: Topology) -> bool:
    """Whether buckets are summed hierarchically: ``requested`` (None: wherever the topology
    has two levels and the back-end is ``torch``, compressed or not), or ConfigurationError
    naming the contradiction when True cannot be honoured."""
    if requested is False:
        return False
    if requested is None:
        return backend == "torch" and topology.two_level
    if backend != "torch":
        raise ConfigurationError(
            f"hierarchical=True runs on backend='torch'; got backend={backend!r}"
        )
    if not topology.two_level:
        raise ConfigurationError(
            "hierarchical=True needs several nodes with the same number (> 1) of ranks each; this "
            "job "
            f"has {topology.describe()} (torchrun's GROUP_RANK, else the host name, tells a rank's "
            "node)"
        )
    return True


class HierarchicalAllReduce(InStartOrder):
    """Sums of flat buffers inside the node, across nodes, inside the node again (module
    docstring)."""

    operation = "hierarchical all-reduce"

    def __init__(
        self, intra, inter, local_size: int, name: str, timeout: timedelta | None, tracer: Tracer
    ):
        super().__init__(name, timeout, tracer)
        self._intra, self._inter = intra, inter  # the worker's alone: ``group`` stays None
        self.world_size = dist.get_world_size(intra) * dist.get_world_size(inter)
        self.local_size = local_size
        self._scratch = Scratch()  # a bucket padded to L equal shards, and this rank's shard

    @classmethod
    def create(
        cls,
        process_group,
        topology: Topology,
        name: str,
        timeout: timedelta | None,
        tracer: Tracer,
    ) -> HierarchicalAllReduce:
        """Its two groups over ``process_group``'s ranks: this rank's node, and the ranks of
        its local index on every node (collective on every rank)."""
        ranks = dist.get_process_group_ranks(process_group)
        me = dist.get_rank(process_group)
        backend = dist.get_backend(process_group)
        intra = new_subgroup([ranks[r] for r in topology.node_of(me)], backend, timeout)
        inter = new_subgroup([ranks[r] for r in topology.peers_across(me)], backend, timeout)
        return cls(intra, inter, topology.local_size, name, timeout, tracer)

    def start(
        self, tensor: torch.Tensor, what: str, priority: int = 0, *, values: int | None = None
    ) -> Handle:
        self.divide_for_mean(tensor, values)
        return self.enqueue(self.new_job(tensor, what, values=values))

    def sum_now(self, tensor: torch.Tensor) -> None:
        """``tensor`` summed now, as a bucket is: the scheduler's probe of this two-level link."""
        self.wait(self.start(tensor, "a link probe"))

    def close(self) -> None:
        self.stop_worker()
        release_group(self, "_intra")
        release_group(self, "_inter")

    # ------------------------------------------------------------------ worker side

    def run_unit(self, job: Job, unit: None) -> None:
        """Inside the node, across nodes, inside the node again (the module docstring)."""
        tensor = job.tensor
        pieces = max(1, min(MAX_PIECES, tensor.numel() * tensor.element_size() // PIECE_BYTES))
        sum_by_shards(
            tensor,
            self.local_size,
            self._group("_intra"),
            self._scratch,
            across=self._group("_inter"),
            pieces=pieces,
        )

    def _group(self, attr: str):
        group = getattr(self, attr)
        if group is None:  # given None, a collective would run on the default group
            raise UsageError("the hierarchical back-end was closed with work in flight")
        return group


class HierarchicalCompressedSum(HierarchicalAllReduce):
    """Compressed sums node first: full precision inside the node, compressed across nodes
    (module docstring). Each start is handed the bucket's :class:`NodeFirstSlot`."""

    operation = "hierarchical compressed sum"

    def __init__(
        self, intra, inter, local_size: int, name: str, timeout: timedelta | None, tracer: Tracer
    ):
        super().__init__(intra, inter, local_size, name, timeout, tracer)
        self._across = TorchCollectives(inter)

    def start(
        self,
        tensor: torch.Tensor,
        what: str,
        priority: int = 0,
        *,
        values: int | None = None,
        codec: NodeFirstSlot | None = None,
    ) -> Handle:
        if (
            not isinstance(codec, NodeFirstSlot)
            or codec.codec.numel + codec.codec.nflags != tensor.numel()
        ):
            raise UsageError(
                f"the node-first compressed sum of {what} was started without its codec "
                f"(or with another bucket's)"
            )
        return self.enqueue(self.new_job(tensor, what, detail=codec, values=values))

    def sum_now(self, tensor: torch.Tensor) -> None:
        """``tensor`` summed now at full precision over the two levels, in start order with
        the buckets: the scheduler's probe of the link, whose bytes across nodes
        :mod:`sapipe.auto` then scales to the format's."""
        self.wait(self.enqueue(self.new_job(tensor, "a link probe")))  # no codec: full precision

    def close(self) -> None:
        self.stop_worker()  # what was started finishes on the groups before they go
        self._across.group = None  # released with ``_inter`` by the parent
        super().close()

    def run_unit(self, job: Job, unit: None) -> None:
        """Reduce-scatter inside the node, the compressed sum of this rank's shard across
        nodes, all-gather inside the node."""
        slot: NodeFirstSlot | None = job.detail
        if slot is None:  # a link probe
            return super().run_unit(job, unit)
        codec, (_, _, shard_codec) = slot.codec, slot.partitions()[0]
        rows = self._scratch.get("rows", codec.node_size * codec.row_numel, job.tensor)
        shard = self._scratch.get("shard", codec.row_numel, job.tensor)
        codec.pack(job.tensor, rows)
        intra = self._group("_intra")
        reduce_scatter_sum(shard, rows, intra, self._scratch, "received")
        sum_compressed(shard_codec, shard, self._across, str(job.sequence))
        all_gather_single(rows, shard, group=intra)
        codec.unpack(rows, job.tensor)


def create(
    process_group,
    topology: Topology,
    compression: str | None,
    name: str,
    timeout: timedelta | None,
    tracer: Tracer,
) -> HierarchicalAllReduce:
    """The node-first back-end over ``topology``: compressed across nodes when ``compression`` is
    set."""
    kind = HierarchicalAllReduce if compression is None else HierarchicalCompressedSum
    return kind.create(process_group, topology, name, timeout, tracer)


__all__ = ["HierarchicalAllReduce", "HierarchicalCompressedSum", "create", "resolve"]
