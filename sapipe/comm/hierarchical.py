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
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..errors import ConfigurationError, UsageError
from ..trace import Tracer
from .base import Handle
from .groups import new_subgroup, release_group
from .topology import Topology
from .worker import InStartOrder, Job, Scratch, sum_by_shards


#: A bucket is cut into up to MAX_PIECES pieces of at least PIECE_BYTES, whose steps are
#: pipelined: one piece crosses between nodes while the next is reduced inside the node.
PIECE_BYTES = 1 << 20
MAX_PIECES = 4


def resolve(requested: Optional[bool], backend: str, compression: Optional[str], topology: Topology) -> bool:
    """Whether buckets are summed hierarchically: ``requested`` (None: wherever the topology
    has two levels and the back-end is ``torch`` without compression), or ConfigurationError
    naming the contradiction when True cannot be honoured."""
    if requested is False:
        return False
    if requested is None:
        return backend == "torch" and compression is None and topology.two_level
    if backend != "torch" or compression is not None:
        raise ConfigurationError(
            f"sapipe: hierarchical=True runs on backend='torch' without compression; got backend={backend!r}, "
            f"compression={compression!r}")
    if not topology.two_level:
        raise ConfigurationError(
            f"sapipe: hierarchical=True needs several nodes with the same number (> 1) of ranks each; this job "
            f"has {topology.describe()} (torchrun's GROUP_RANK, else the host name, tells a rank's node)")
    return True


class HierarchicalAllReduce(InStartOrder):
    """Sums of flat buffers inside the node, across nodes, inside the node again (module docstring)."""

    operation = "hierarchical all-reduce"

    def __init__(self, intra, inter, local_size: int, name: str, timeout: Optional[timedelta], tracer: Tracer):
        super().__init__(name, timeout, tracer)
        self._intra, self._inter = intra, inter  # the worker's alone: ``group`` stays None
        self.local_size = local_size
        self._scratch = Scratch()  # a bucket padded to L equal shards, and this rank's shard

    @classmethod
    def create(cls, process_group, topology: Topology, name: str, timeout: Optional[timedelta],
               tracer: Tracer) -> "HierarchicalAllReduce":
        """Its two groups over ``process_group``'s ranks: this rank's node, and the ranks of
        its local index on every node (collective on every rank)."""
        ranks = dist.get_process_group_ranks(process_group)
        me = dist.get_rank(process_group)
        backend = dist.get_backend(process_group)
        intra = new_subgroup([ranks[r] for r in topology.node_of(me)], backend, timeout)
        inter = new_subgroup([ranks[r] for r in topology.peers_across(me)], backend, timeout)
        return cls(intra, inter, topology.local_size, name, timeout, tracer)

    def start(self, tensor: torch.Tensor, what: str, priority: int = 0) -> Handle:
        return self.enqueue(self.new_job(tensor, what))

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
        sum_by_shards(tensor, self.local_size, self._group("_intra"), self._scratch, across=self._group("_inter"),
                      pieces=pieces)

    def _group(self, attr: str):
        group = getattr(self, attr)
        if group is None:  # given None, a collective would run on the default group
            raise UsageError("sapipe: the hierarchical back-end was closed with work in flight")
        return group


__all__ = ["HierarchicalAllReduce", "resolve"]
