"""Which layers share a gradient bucket: the one layout rule, for the runtime and the scheduler.

The runtime (:func:`sapipe.layout.buckets.build_buckets`) and the scheduler's simulator
(:func:`sapipe.schedule.simulator.plan_buckets`) both call :func:`bucket_layout`, so the
scheduler always predicts the buckets the runtime will build. Pure Python, no torch.
"""

from __future__ import annotations

from collections.abc import Sequence


def bucket_layout(
    bytes_per_layer: Sequence[int], stale_layers: int, cap_bytes: float
) -> list[list[int]]:
    """The 0-based layer indices of each bucket, buckets in launch order (docs/design.md §5).

    Layers are packed in reverse forward order, the order backward produces their
    gradients. A bucket closes when the next layer would take it over ``cap_bytes`` (so a
    layer larger than the cap gets a bucket of its own) and always at the boundary between
    layer ``stale_layers - 1`` and ``stale_layers``, so every bucket is wholly stale or
    wholly synchronous. Each bucket lists its layers in backward order. A zero-size layer
    joins its neighbour's bucket.
    """
    buckets: list[list[int]] = []
    current: list[int] = []
    current_bytes = 0
    for index in reversed(range(len(bytes_per_layer))):
        size = bytes_per_layer[index]
        crosses_boundary = bool(current) and (current[-1] < stale_layers) != (index < stale_layers)
        if current and (crosses_boundary or current_bytes + size > cap_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(index)
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


__all__ = ["bucket_layout"]
