"""A two-level cluster's link as the simulator's α–β model: the time of one bucket's sum.

A cluster is N nodes of G ranks (P = N·G). Inside a node the ranks are joined by one link
(NVLink, PCIe, shared memory), between nodes by one NIC per node (the network). Each
level is a :class:`LinkSpec`: a rate in bytes per second per edge and direction, and a
latency per ring step (the wire's and the collective's own per-step cost). A sum of B bytes
of gradient then takes α + β·B:

* **Flat ring** over the P ranks, ordered by node (as ``torch.distributed``'s default
  ring and DDP's single all-reduce run it): 2(P−1) steps, each moving B/P over every
  edge at once and paced by the slowest edge. With N > 1 its edges are node-crossing ones
  (one per node and direction, so a node's NIC carries one ring edge) and, with G > 1,
  edges inside the nodes; the slower link sets the pace (the larger latency, the smaller
  rate; where the intra-node link is not given it is taken to be the faster):

      t = 2(P−1)·max(lat_inter, lat_intra) + 2(P−1)/P · B / min(rate_inter, rate_intra)   (N > 1)
      t = 2(G−1)·lat_intra + 2(G−1)/G · B / rate_intra     (N = 1)

* **Two-level** (``hierarchical``, :mod:`sapipe.comm.hierarchical`): a reduce-scatter
  inside the node, an all-reduce across nodes of each rank's 1/G share (G rings side by
  side, all through the node's one NIC), an all-gather inside the node:

      t = 2(G−1)·(lat_intra + B/G / rate_intra) + 2(N−1)·lat_inter + 2(N−1)/N · B / rate_inter

  The three steps are added, not overlapped: sapipe pipelines a large bucket's pieces
  (a piece crosses between nodes while the next is reduced inside the node), which this
  model leaves out, so it errs on the slow side by up to the node-internal terms.
  With G = 1 it is the flat ring.

* **Compressed** (``compression=``, :mod:`sapipe.comm.compressed`): two collectives, an
  all-to-all of compressed shards and an all-gather of the summed shards, each rank
  sending 2(P−1)/P of its compressed bucket (the bytes of a ring): 2α, and per byte of
  gradient ``wire_ratio`` × the wire's β plus the codec's local work ``codec_per_byte``
  (per byte of a bucket a rank compresses whole, as a flat sum does; a saved profile
  holds that whichever way its own sums went), as
  :func:`sapipe.schedule.profiler.compressed` models a measured link. Across nodes the
  all-to-all is not a ring: flat, each of a node's G ranks sends (N−1)/N of its compressed
  bucket to other nodes, through the node's one NIC, so the wire's β is
  2·G·(N−1)/N / rate_inter there (G times a ring's); inside one node it is the ring's.
  Node first (two-level), the node's steps carry full precision and the compressed sum
  runs across nodes on each rank's 1/G share, its local work on that share only:

      t = 2(G−1)·(lat_intra + B/G / rate_intra) + 2·2(N−1)·lat_inter
          + B · (wire_ratio · 2(N−1)/N / rate_inter + codec_per_byte / G)

The intra-node link can be *derived from a profile* measured on one node of W > 1 ranks
(:func:`intra_link_from_profile`): its flat ring gives β = 2(W−1)/W / rate and
α = 2(W−1)·lat, inverted here. The derived rate is that of one edge of the ring as the
profiled job saw it; it carries over to another G where the node's edges do not share a
medium (NVLink, NVSwitch), not where the ranks share one (a CPU host's loopback, whose
aggregate rate is split among the ranks).

Pure Python (no torch), like the simulator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sapipe.errors import ConfigurationError

__all__ = [
    "ClusterLink",
    "LinkSpec",
    "intra_link_from_profile",
    "parse_link",
    "sapipe_hierarchical",
]


@dataclass(frozen=True)
class LinkSpec:
    """One level of the cluster: ``rate`` bytes/s per edge and direction (``math.inf``:
    no limit), ``latency`` seconds per ring step."""

    rate: float
    latency: float = 0.0

    def __post_init__(self):
        if not self.rate > 0 or math.isnan(self.rate):
            raise ConfigurationError(f"a link's rate must be > 0 bytes/s; got {self.rate}")
        if not 0 <= self.latency < math.inf:
            raise ConfigurationError(
                f"a link's latency must be finite and >= 0 s; got {self.latency}"
            )

    @classmethod
    def parse(cls, text: str, what: str = "link") -> LinkSpec:
        """``RATE[,LATENCY]`` as ``sapipe-launch --inter-node`` takes it (``100gbit,5us``;
        ``gbit`` is bits, ``gbps`` bytes per second; ``unlimited`` for no limit)."""
        from sapipe.launch.netns import parse_spec  # pure Python

        try:
            spec = parse_spec(text)
        except ValueError as exc:
            raise ConfigurationError(f"cannot read the {what} {text!r}: {exc}") from exc
        return cls(math.inf if spec.rate_bits is None else spec.rate_bits / 8.0, spec.delay_s)

    def describe(self) -> str:
        rate = (
            "unlimited"
            if math.isinf(self.rate)
            else f"{self.rate * 8 / 1e9:.4g} Gbit/s ({self.rate / 1e9:.4g} GB/s)"
        )
        return rate + (f", {self.latency * 1e6:.3g} us/step" if self.latency else "")


def _per_byte(rate: float) -> float:
    return 0.0 if math.isinf(rate) else 1.0 / rate


@dataclass(frozen=True)
class ClusterLink:
    """N ``nodes`` of G ``ranks_per_node``; ``inter`` between nodes, ``intra`` inside one
    (None: unknown, refused where a sum needs it); ``hierarchical``: sums go node first
    (where N > 1 and G > 1; elsewhere a sum is the flat ring whatever it says)."""

    nodes: int
    ranks_per_node: int
    inter: LinkSpec
    intra: LinkSpec | None = None
    hierarchical: bool = False

    def __post_init__(self):
        for name in ("nodes", "ranks_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigurationError(f"a cluster needs {name} >= 1 (an integer); got {value!r}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    @property
    def two_level(self) -> bool:
        """Whether a sum goes node first: ``hierarchical`` on a cluster with two levels."""
        return self.hierarchical and self.nodes > 1 and self.ranks_per_node > 1

    def needs_intra(self) -> bool:
        """Whether a sum crosses an intra-node edge that sets its time."""
        return self.ranks_per_node > 1 and (self.nodes == 1 or self.two_level)

    def _intra(self) -> LinkSpec:
        if self.intra is None:
            raise ConfigurationError(
                f"the sums of {self.nodes} node(s) of {self.ranks_per_node} ranks cross the links "
                "inside a "
                "node, and no intra-node link was given (give one, or a profile measured on one "
                "node of several "
                "ranks to derive it from)"
            )
        return self.intra

    def allreduce(self) -> tuple[float, float]:
        """(α seconds, β seconds per byte) of one uncompressed sum (module docstring)."""
        n, g, p = self.nodes, self.ranks_per_node, self.world_size
        if p == 1:
            return 0.0, 0.0
        if self.two_level:
            intra = self._intra()
            alpha = 2 * (g - 1) * intra.latency + 2 * (n - 1) * self.inter.latency
            beta = 2 * (g - 1) / g * _per_byte(intra.rate) + 2 * (n - 1) / n * _per_byte(
                self.inter.rate
            )
            return alpha, beta
        edges = (
            [self._intra()]
            if n == 1
            else [self.inter] + ([self.intra] if g > 1 and self.intra else [])
        )
        latency, rate = max(e.latency for e in edges), min(e.rate for e in edges)
        return 2 * (p - 1) * latency, 2 * (p - 1) / p * _per_byte(rate)

    def compressed_sum(self, wire_ratio: float, codec_per_byte: float) -> tuple[float, float]:
        """(α, β per byte of gradient) of one compressed sum (module docstring): node first
        where :attr:`two_level`, else flat."""
        if not wire_ratio > 0 or not codec_per_byte >= 0:
            raise ConfigurationError(
                f"compression needs wire_ratio > 0 and codec_per_byte >= 0; "
                f"got {wire_ratio}, {codec_per_byte}"
            )
        n, g = self.nodes, self.ranks_per_node
        if self.world_size == 1:
            return 0.0, 0.0
        if self.two_level:
            intra = self._intra()
            across = 2 * (n - 1) / n * _per_byte(self.inter.rate) * wire_ratio
            alpha = 2 * (g - 1) * intra.latency + 2 * 2 * (n - 1) * self.inter.latency
            return alpha, 2 * (g - 1) / g * _per_byte(intra.rate) + across + codec_per_byte / g
        flat = ClusterLink(
            self.nodes, self.ranks_per_node, self.inter, self.intra, hierarchical=False
        )
        alpha, beta = flat.allreduce()
        if n > 1 and g > 1:  # G ranks' all-to-all through the node's NIC: G times a ring's bytes
            beta = max(beta, 2 * g * (n - 1) / n * _per_byte(self.inter.rate))
        return 2 * alpha, beta * wire_ratio + codec_per_byte

    def describe(self) -> str:
        intra = self.intra.describe() if self.intra is not None else "not given"
        how = "node first (two-level)" if self.two_level else "flat ring"
        return (
            f"{self.nodes} node(s) x {self.ranks_per_node} ranks; between nodes "
            f"{self.inter.describe()}, "
            f"inside a node {intra}; sums {how}"
        )


def intra_link_from_profile(profile) -> LinkSpec:
    """The intra-node link a one-node profile of W > 1 ranks measured (module docstring).

    ``profile`` is a :class:`~sapipe.schedule.saved_profile.SavedProfile`. A compressed
    profile's link is first turned back into the wire's: α/2, and β of the probes'
    full-precision sums (``wire_beta``; in profiles without it, (β − codec)/wire_ratio, which
    over-counts where the compressed sums were seen to take longer than modelled).
    ConfigurationError, naming why, where the profile cannot tell it.
    """
    w = profile.world_size
    if profile.nodes != 1:
        raise ConfigurationError(
            f"the intra-node link cannot be derived from a profile of {profile.nodes} nodes (its "
            "link mixes "
            "both levels); give the intra-node link"
        )
    if w < 2:
        raise ConfigurationError(
            "the intra-node link cannot be derived from a profile of 1 rank (nothing was sent); "
            "give the "
            "intra-node link"
        )
    alpha, beta = profile.alpha, profile.beta
    if (
        profile.compression is not None
    ):  # the wire's own: the probes' full-precision sum where recorded
        modelled = (beta - profile.codec_per_byte) / profile.wire_ratio
        alpha, beta = alpha / 2, profile.wire_beta if profile.wire_beta > 0 else modelled
    if not beta > 0:
        raise ConfigurationError(
            f"the profile's link has beta={profile.beta} s/byte, no rate to derive; give the "
            "intra-node link"
        )
    return LinkSpec(2 * (w - 1) / w / beta, alpha / (2 * (w - 1)))


def sapipe_hierarchical(
    requested: bool | None, backend: str, nodes: int, ranks_per_node: int
) -> bool:
    """Whether sapipe sums node first on ``nodes`` × ``ranks_per_node``: the rule of
    :func:`sapipe.comm.hierarchical.resolve` (None: on where there are two levels, with
    ``backend="torch"``, compressed or not; True with another back-end: refused). Unlike a
    job, which refuses True on a cluster of one level, a prediction then sums flat (a sweep
    over node counts starts at one node)."""
    two_level = nodes > 1 and ranks_per_node > 1
    if requested is None:
        return backend == "torch" and two_level
    if requested and backend != "torch":
        raise ConfigurationError(
            f"hierarchical=True runs on backend='torch'; the profile has backend={backend!r}"
        )
    return bool(requested) and two_level


def parse_link(value: str | LinkSpec | None, what: str) -> LinkSpec | None:
    """A :class:`LinkSpec` from ``RATE[,LATENCY]`` text, or one given as it is."""
    if value is None or isinstance(value, LinkSpec):
        return value
    return LinkSpec.parse(value, what)
