"""Where every parameter lives for one k: layers, buckets, and the lookup maps.

A :class:`Layout` is fixed for one k (the number of stale layers) and holds geometry only
(docs/design.md §5). The scheduler may choose another k while training; :meth:`Layout.relaid`
then gives the new buckets, and each part of the runtime moves its own per-bucket state
over: the pipeline its gradient buffers and residuals, the updater every parameter's
weights and optimizer state.
"""

from __future__ import annotations

from sapipe.layout.buckets import Bucket, build_buckets
from sapipe.layout.layers import Layer


class Layout:
    """The buckets of ``layers`` (forward order) for ``k`` stale layers, and where each
    parameter and layer sits in them."""

    def __init__(self, layers: list[Layer], k: int, cap_bytes: int, group_of: dict[int, int]):
        self.layers = layers
        self.k = k
        self._cap_bytes, self._group_of = cap_bytes, group_of
        self.buckets: list[Bucket] = build_buckets(layers, k, cap_bytes, group_of)
        #: id(param) -> the index of its layer
        self.layer_of: dict[int, int] = {
            id(p): layer.index for layer in layers for p in layer.params
        }
        #: id(param) -> (its bucket, its position there)
        self.slot_of: dict[int, tuple[Bucket, int]] = {}
        self.bucket_of_layer: dict[int, Bucket] = {}
        for bucket in self.buckets:
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

    def relaid(self, k: int) -> Layout:
        """The same layers laid out for ``k`` stale layers."""
        return Layout(self.layers, k, self._cap_bytes, self._group_of)


__all__ = ["Layout"]
