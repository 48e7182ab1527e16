"""Where every parameter lives: layers, buckets, the lookup maps, and optimizer state on relayout.

A :class:`Layout` is fixed for one k (the number of stale layers). The scheduler may choose
another k while training; :meth:`Layout.relaid` then builds the new buckets and moves every
parameter's optimizer state from its old place to its new one (docs/design.md §5).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from sapipe.compression.codec import Codec, Compression, make_codec
from sapipe.layout.buckets import Bucket, StalenessBuffer, build_buckets
from sapipe.layout.layers import Layer
from sapipe.optim.compensation import Compensation
from sapipe.optim.fused import OptimizerRule


class CompressedSums(NamedTuple):
    """How the buckets' sums are compressed (sapipe.compression.codec): the format, the world size,
    the bytes of bucket compressed as one unit (the back-end's partition; None: the whole
    bucket), and the ranks per node where sums go node first (1: flat), which fix each
    bucket's codec."""

    compression: Compression
    world: int
    partition_bytes: int | None = None
    node_size: int = 1

    def codec(
        self, numel: int, nflags: int, dtype: torch.dtype, device: torch.device, slots: int = 1
    ) -> Codec:
        """The codec of a bucket of ``numel`` values and ``nflags`` flags."""
        return make_codec(
            self.compression,
            numel,
            nflags,
            self.world,
            dtype,
            device,
            slots=slots,
            partition_bytes=self.partition_bytes,
            node_size=self.node_size,
        )


class Layout:
    """The buckets of ``layers`` for ``k`` stale layers, with their gradient buffers."""

    def __init__(
        self,
        layers: list[Layer],
        k: int,
        cap_bytes: int,
        group_of: dict[int, int],
        staleness: int,
        compensation: Compensation,
        compression: CompressedSums | None = None,
        verdicts: bool = False,
    ):
        self.layers = layers
        self.k = k
        self._cap_bytes, self._group_of = cap_bytes, group_of
        self._staleness, self._compensation = staleness, compensation
        self._compression = compression
        self._verdicts = verdicts  # each slot carries a non-finite verdict behind its flags
        self.buckets: list[Bucket] = build_buckets(layers, k, cap_bytes, group_of)
        self.layer_of: dict[int, int] = {
            id(p): layer.index for layer in layers for p in layer.params
        }
        self.slot_of: dict[
            int, tuple[Bucket, int]
        ] = {}  # id(param) -> (its bucket, its position there)
        self.bucket_of_layer: dict[int, Bucket] = {}
        for bucket in self.buckets:
            self._add_buffers(bucket)
            for i, p in enumerate(bucket.params):
                self.slot_of[id(p)] = (bucket, i)
            for layer in bucket.layers:
                self.bucket_of_layer[layer.index] = bucket
        # Buckets with a layer no layer's pre-forward covers are updated when the model starts.
        self.eager = [
            b
            for b in self.buckets
            if any(not layer.executed and layer.host is None for layer in b.layers)
        ]

    def _add_buffers(self, bucket: Bucket) -> None:
        """The staleness double (or deeper) buffer, and this rank's own gradients where kept."""
        depth = self._staleness + 1 if bucket.stale else 1
        bucket.grads = StalenessBuffer(
            bucket.numel,
            bucket.dtype,
            bucket.device,
            depth,
            flags=len(bucket.params),
            verdict=self._verdicts,
        )
        if bucket.stale and self._compensation.needs_local:
            bucket.local = torch.zeros_like(bucket.grads.slots[0])
        if bucket.stale and self._compensation.needs_prev_local:
            bucket.prev_local = torch.zeros_like(bucket.grads.slots[0])
        if self._compression is not None:
            bucket.grads.codec = self._compression.codec(
                bucket.numel,
                bucket.grads.wire[0].numel() - bucket.numel,
                bucket.dtype,
                bucket.device,
                slots=depth,
            )  # every flag

    def relaid(self, k: int) -> Layout:
        """The same layers laid out for ``k`` stale layers (no weights or state moved yet)."""
        return Layout(
            self.layers,
            k,
            self._cap_bytes,
            self._group_of,
            self._staleness,
            self._compensation,
            self._compression,
            self._verdicts,
        )

    @torch.no_grad()
    def allocate_state(self, rule: OptimizerRule, previous: Layout | None = None) -> None:
        """Flatten the weights (parameters become views of each bucket's buffer) and create the
        optimizer state; with ``previous``, every parameter's state moves over from it."""
        moved = _state_places(previous.buckets) if previous is not None else {}
        for bucket in self.buckets:
            bucket.flatten_weights()
            bucket.real = bucket.weights
            for segment in bucket.segments:
                params = bucket.segment_params(segment)
                segment.state = rule.new_state(segment.of(bucket.weights), params)
                for p, offset in params:
                    if id(p) in moved:
                        old, old_offset = moved[id(p)]
                        segment.state.move_from(old.state, old_offset, offset, p.numel())
        if previous is not None and self._compression is not None:
            _move_residuals(previous.buckets, self.buckets)


def _move_residuals(old: list[Bucket], new: list[Bucket]) -> None:
    """Each parameter's error-feedback residual (what its rank's rounding kept back) to its
    new place. A residual of a sum (kept per shard, of a bucket or of a partition, whose
    bounds move) is dropped, as are the residuals of a node-first codec (kept per shard)."""
    places = {
        id(p): (b, off)
        for b in old
        for p, off in zip(b.params, b.offsets)
        if b.grads.codec.residual is not None
    }
    for bucket in new:
        residual = bucket.grads.codec.residual
        if residual is None:
            continue
        for p, offset in zip(bucket.params, bucket.offsets):
            if id(p) in places:
                source, source_offset = places[id(p)]
                residual[offset : offset + p.numel()].copy_(
                    source.grads.codec.residual[source_offset : source_offset + p.numel()]
                )


def _state_places(buckets: list[Bucket]) -> dict[int, tuple]:
    """id(param) -> (its segment, its offset in that segment)."""
    places: dict[int, tuple] = {}
    for bucket in buckets:
        for segment in bucket.segments:
            for p, offset in bucket.segment_params(segment):
                places[id(p)] = (segment, offset)
    return places


__all__ = ["Layout"]
