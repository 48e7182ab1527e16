"""Flat buckets: which parameters travel and are updated together, and where each one sits.

docs/design.md §5: gradients are packed into flat buckets in reverse forward order, and the S/N
boundary is a bucket boundary. Inside a bucket, parameters are ordered by param group and
then by layer, so each param group is one contiguous *segment* that an optimizer rule can
update with a single flat call, whatever way the user interleaved groups across layers.
A bucket's parameters become views into one flat weight buffer (done once, at the first
``step()``), so updates and kernels run on whole segments without gathering.

A :class:`Bucket` is geometry only and does not change once built. What changes while
training belongs to the part that writes it: a bucket's gradient buffers and in-flight
collectives to :class:`sapipe.runtime.pipeline.GradientPipeline`
(:class:`sapipe.runtime.gradients.BucketGradients`), its weights, optimizer state and
deferred update to :class:`sapipe.runtime.updates.Updater`
(:class:`sapipe.runtime.updates.BucketWeights`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sapipe.layout.layers import Layer
from sapipe.layout.packing import bucket_layout


@dataclass
class Segment:
    """A contiguous slice [start, end) of a bucket whose parameters share one param group."""

    group: int
    start: int
    end: int
    lengths: list[int]  # numel of each parameter tensor in the slice, in order

    def of(self, flat: Tensor) -> Tensor:
        return flat[self.start : self.end]


class Bucket:
    """One flat unit of communication and update: whole layers, adjacent in forward order,
    held in backward order (``layers``, as :func:`sapipe.layout.packing.bucket_layout` packs
    them)."""

    def __init__(self, index: int, layers: Sequence[Layer], stale: bool, group_of: dict[int, int]):
        self.index = index
        self.layers = list(layers)
        self.first_layer = min(layer.index for layer in self.layers)  # the first to run forward
        self.stale = stale
        params = [p for layer in self.layers for p in layer.params]
        # Stable sort by param group: each group becomes one contiguous segment.
        params.sort(key=lambda p: group_of[id(p)])
        self.params: list[nn.Parameter] = params
        self.offsets: list[int] = []
        self.segments: list[Segment] = []
        offset = 0
        for p in params:
            group = group_of[id(p)]
            if not self.segments or self.segments[-1].group != group:
                self.segments.append(Segment(group, offset, offset, []))
            self.offsets.append(offset)
            offset += p.numel()
            self.segments[-1].end = offset
            self.segments[-1].lengths.append(p.numel())
        self.numel = offset
        self.dtype = params[0].dtype
        self.device = params[0].device

        # each parameter's views of a flat buffer of this layout, per buffer (param_views): a
        # memo of views, filled as buffers are first sliced
        self._views: list[tuple[Tensor, list[Tensor]]] = []

    @property
    def nbytes(self) -> int:
        return self.numel * self.params[0].element_size()

    def param_views(self, flat: Tensor) -> list[Tensor]:
        """Each parameter's part of ``flat`` (one of this bucket's flat buffers, made once with
        its layout), shaped like the parameter: made once per buffer, so that backward's
        per-gradient copy and ``p.grad`` exposure slice nothing."""
        for buffer, views in self._views:
            if buffer is flat:
                return views
        views = [flat[o : o + p.numel()].view_as(p) for o, p in zip(self.offsets, self.params)]
        self._views.append((flat, views))
        return views

    def describe(self) -> str:
        names = ", ".join(layer.name or "<root>" for layer in self.layers[:3])
        more = f" (+{len(self.layers) - 3} more)" if len(self.layers) > 3 else ""
        kind = "stale" if self.stale else "sync"
        return f"{kind} bucket {self.index} [{names}{more}]"

    def segment_params(self, segment: Segment) -> list[tuple[nn.Parameter, int]]:
        """The parameters of ``segment``, each with its offset inside the segment."""
        return [
            (p, offset - segment.start)
            for p, offset in zip(self.params, self.offsets)
            if segment.start <= offset < segment.end
        ]

    def flatten_weights(self) -> Tensor:
        """Make every parameter a view into one new flat buffer (values unchanged); the buffer."""
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                flat[off : off + p.numel()].copy_(p.reshape(-1))
                p.data = flat[off : off + p.numel()].view_as(p)
        return flat


def build_buckets(
    layers: Sequence[Layer], stale_layers: int, cap_bytes: int, group_of: dict[int, int]
) -> list[Bucket]:
    """The buckets of :func:`sapipe.layout.packing.bucket_layout` for ``layers`` (forward order)."""
    sizes = [sum(p.numel() * p.element_size() for p in layer.params) for layer in layers]
    return [
        Bucket(index, [layers[i] for i in members], members[0] < stale_layers, group_of)
        for index, members in enumerate(bucket_layout(sizes, stale_layers, cap_bytes))
    ]
