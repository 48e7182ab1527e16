"""Which ranks of a job share a node: the two levels a hierarchical sum works on.

Ranks name their node by torchrun's node rank (``GROUP_RANK``) where torchrun started them,
else by the host's name; every rank learns every rank's name in the construction-time
agreement (:func:`sapipe.rendezvous.agree`), so all of them build the same :class:`Topology`.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Sequence
from dataclasses import dataclass


def node_name() -> str:
    """This rank's node: torchrun's node rank where torchrun set it, else the host name (an
    emulated cluster's namespaces share one host name, and are told apart by the former)."""
    group_rank = os.environ.get("GROUP_RANK")
    return f"node {group_rank}" if group_rank is not None else f"host {socket.gethostname()}"


@dataclass(frozen=True)
class Topology:
    """The ranks (of the job's process group) on each node, nodes in order of their first rank."""

    nodes: tuple[tuple[int, ...], ...]

    @classmethod
    def from_names(cls, names: Sequence[str]) -> Topology:
        """``names[r]``: rank r's node name."""
        members: dict[str, list[int]] = {}
        for rank, name in enumerate(names):
            members.setdefault(name, []).append(rank)
        return cls(tuple(tuple(ranks) for ranks in members.values()))

    @property
    def world_size(self) -> int:
        return sum(len(node) for node in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def uniform(self) -> bool:
        """Every node has the same number of ranks."""
        return len({len(node) for node in self.nodes}) == 1

    @property
    def local_size(self) -> int:
        """Ranks per node (of the first node where they differ)."""
        return len(self.nodes[0])

    @property
    def two_level(self) -> bool:
        """Several nodes of the same number (> 1) of ranks: a sum can go node first."""
        return self.num_nodes > 1 and self.uniform and self.local_size > 1

    def node_of(self, rank: int) -> tuple[int, ...]:
        """The ranks on ``rank``'s node."""
        return next(node for node in self.nodes if rank in node)

    def local_index(self, rank: int) -> int:
        return self.node_of(rank).index(rank)

    def peers_across(self, rank: int) -> tuple[int, ...]:
        """The rank of each node with ``rank``'s local index (a uniform topology)."""
        index = self.local_index(rank)
        return tuple(node[index] for node in self.nodes)

    def describe(self) -> str:
        sizes = sorted({len(node) for node in self.nodes})
        per_node = str(sizes[0]) if len(sizes) == 1 else "/".join(map(str, sizes))
        return f"{self.num_nodes} node{'s' if self.num_nodes != 1 else ''} × {per_node} rank(s)"


__all__ = ["Topology", "node_name"]
