"""Flat gradient buckets, the staleness buffer, and the weight history used by DC / wp3.

docs/design.md §5: gradients are packed into flat buckets in reverse forward order, and the S/N
boundary is a bucket boundary. Inside a bucket, parameters are ordered by param group and
then by layer, so each param group is one contiguous *segment* that an optimizer rule can
update with a single flat call, whatever way the user interleaved groups across layers.
A bucket's parameters become views into one flat weight buffer (done once, at the first
``step()``), so updates and kernels run on whole segments without gathering.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from sapipe.compression.codec import intake_views
from sapipe.errors import ConfigurationError, UnsupportedOptimizerError
from sapipe.layout.layers import Layer
from sapipe.layout.packing import bucket_layout
from sapipe.optim.fused import SegmentState


@dataclass
class Segment:
    """A contiguous slice [start, end) of a bucket whose parameters share one param group."""

    group: int
    start: int
    end: int
    lengths: list[int]  # numel of each parameter tensor in the slice, in order
    state: SegmentState | None = None

    def of(self, flat: Tensor) -> Tensor:
        return flat[self.start : self.end]


class StalenessBuffer:
    """``depth`` flat gradient buffers rotated by pipeline step (2 for staleness 1).

    Backward writes pipeline step t's gradient into slot ``t % depth`` while the all-reduces
    of the previous ``depth - 1`` iterations are still in flight in the other slots. Slots
    are allocated once; nothing is allocated per step.

    What a slot's collective carries (``wire``) is its gradient (``slots``) followed by one
    flag per parameter (``flags``): whether this rank used the parameter (sapipe.runtime.unused);
    with ``verdict``, then one more value (``nonfinite``): 1 where this rank's gradient holds a
    NaN or inf, so that its sum counts such ranks (sapipe.runtime.nonfinite).
    """

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        depth: int,
        flags: int = 0,
        verdict: bool = False,
    ):
        self.wire = [
            torch.zeros(numel + flags + int(verdict), dtype=dtype, device=device)
            for _ in range(depth)
        ]
        self.slots = [w[:numel] for w in self.wire]
        self.flags = [w[numel : numel + flags] for w in self.wire]
        #: 0-dim views of the value behind the flags (None: the wire carries none)
        self.nonfinite: list[Tensor] | None = (
            [w[numel + flags] for w in self.wire] if verdict else None
        )
        #: per slot, this rank's own verdict on the gradient in flight there, as launched (None: not
        #: judged)
        self.verdicts: list[tuple | None] = [None] * depth
        self.unused_here: list[list[int]] = [
            [] for _ in range(depth)
        ]  # parameters this rank had no gradient for
        self.in_flight: list[object | None] = [None] * depth  # comm handles per slot
        self.codec = None  # with compression: the bucket's BucketCodec (sapipe.compression.codec)

    @property
    def depth(self) -> int:
        return len(self.slots)

    def index(self, iteration: int) -> int:
        return iteration % self.depth


class Arrived:
    """A collective that has already completed (restored from a checkpoint)."""

    def __init__(self, tensor: Tensor, what: str):
        self.tensor = tensor
        self.what = what

    def wait(self) -> Tensor:
        return self.tensor


class WeightHistory:
    """The last ``length`` real weights of a bucket, as a ring (for DC's Δx = x_{t-1} − x_{t-1-s}).

    The update kernel that reads the oldest slot (as DC's ``delta_ref``) also writes x_t into
    it, in the same pass (``hist=``); :meth:`advance` then makes it the newest. Only a step
    without an update copies (:meth:`push`).
    """

    def __init__(self, weights: Tensor, length: int):
        self._ring = [weights.clone() for _ in range(length)]
        self._oldest = 0

    def state_dict(self) -> dict:
        return {"ring": [w.clone() for w in self._ring], "oldest": self._oldest}

    def load_state_dict(self, state: dict) -> None:
        for mine, saved in zip(self._ring, state["ring"]):
            mine.copy_(saved)
        self._oldest = state["oldest"]

    def oldest(self) -> Tensor:
        return self._ring[self._oldest]

    def push(self, weights: Tensor) -> None:
        """``weights`` joins as the newest; the oldest is dropped."""
        self._ring[self._oldest].copy_(weights)
        self.advance()

    def advance(self) -> None:
        """The oldest slot already holds the newest weights (written by the update kernel)."""
        self._oldest = (self._oldest + 1) % len(self._ring)


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

        # Runtime state, set up by the engine.
        self.grads: StalenessBuffer | None = None
        self.local: Tensor | None = None  # this rank's gradient of the current iteration
        self.prev_local: Tensor | None = None  # ... of the previous iteration (wp3)
        self.weights: Tensor | None = None  # flat view holder of the model's weights
        self.real: Tensor | None = None  # real weights x (differs from weights under WP)
        self.history: WeightHistory | None = None
        self.ready = [False] * len(params)
        self.num_ready = 0
        self.pending_update = None  # hyper-parameter snapshot of a deferred sync update
        self._views: list[
            tuple[Tensor, list[Tensor]]
        ] = []  # per flat buffer: its per-parameter views
        self._message_views: dict[
            int, list[object]
        ] = {}  # per slot: each parameter's place in its messages
        # per target, each parameter's place there (a view, or its pieces across compressed
        # messages) for this iteration's gradients, set by its first one
        self.intake: list[list[object]] = []

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

    def message_views(self, slot: int) -> list[object]:
        """Each parameter's place in slot ``slot``'s outgoing compressed messages, where the
        bucket's codec ``encodes_on_intake`` (sapipe.compression.codec.intake_views): made once per
        slot, as :meth:`param_views`."""
        views = self._message_views.get(slot)
        if views is None:
            assert self.grads is not None and self.grads.codec is not None
            views = self._message_views[slot] = intake_views(
                self.grads.codec, slot, self.offsets, self.params
            )
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

    def flatten_weights(self) -> None:
        """Make every parameter a view into one flat buffer (values unchanged)."""
        flat = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        with torch.no_grad():
            for p, off in zip(self.params, self.offsets):
                flat[off : off + p.numel()].copy_(p.reshape(-1))
                p.data = flat[off : off + p.numel()].view_as(p)
        self.weights = flat

    def state_dict(self) -> dict:
        """Everything of this bucket a bit-exact resume needs (waits for in-flight collectives).

        An all-reduce still in flight is waited for and stored as its (summed) result, so
        the resumed run consumes exactly what the uninterrupted one would have.
        """
        assert self.grads is not None and self.weights is not None
        for handle in self.grads.in_flight:
            if handle is not None:
                handle.wait()
        slots = [slot.clone() for slot in self.grads.slots]
        arrived = [handle is not None for handle in self.grads.in_flight]
        return {
            "layers": [layer.name for layer in self.layers],
            "stale": self.stale,
            "segments": [seg.state.state_dict() for seg in self.segments if seg.state is not None],
            "segment_bounds": [[seg.start, seg.end] for seg in self.segments],
            "slots": slots,
            "flags": [flags.clone() for flags in self.grads.flags],
            "unused_here": [list(unused) for unused in self.grads.unused_here],
            "arrived": arrived,
            "real": None if self.real is None or self.real is self.weights else self.real.clone(),
            "local": None if self.local is None else self.local.clone(),
            "prev_local": None if self.prev_local is None else self.prev_local.clone(),
            "history": None if self.history is None else self.history.state_dict(),
            "pending_update": self.pending_update,
            "codec": None if self.grads.codec is None else self.grads.codec.state_dict(),
        }

    def check_state_dict(self, state: dict, path: str) -> None:
        """Raise, naming why, where :meth:`state_dict`'s ``state`` (of a bucket of the same
        layers) cannot be restored into this bucket updated on ``path`` ("fused" or "generic"):
        other param groups, state kept by the other path, residuals over other values."""
        bounds = [[seg.start, seg.end] for seg in self.segments]
        saved_bounds = state.get(
            "segment_bounds"
        )  # absent from checkpoints written before it was kept
        if len(state["segments"]) != len(bounds) or (
            saved_bounds is not None and [list(b) for b in saved_bounds] != bounds
        ):
            raise ConfigurationError(
                f"the checkpoint's {self.describe()} splits into other param groups "
                "than this job's (the optimizer's param groups changed)"
            )
        for saved in state["segments"]:
            if ("buffers" in saved) != (path == "fused"):
                kept = "fused" if "buffers" in saved else "generic"
                raise UnsupportedOptimizerError(
                    f"the checkpoint's optimizer state was kept by the {kept} "
                    f"update path; this job takes the {path} one"
                )
        if (
            self.grads is not None
            and self.grads.codec is not None
            and state.get("codec") is not None
        ):
            self.grads.codec.check_state_dict(state["codec"])

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s content into this (identically laid out) bucket."""
        assert self.grads is not None and self.weights is not None
        for seg, saved in zip(self.segments, state["segments"]):
            assert seg.state is not None
            seg.state.load_state_dict(saved)
        for i, (slot, arrived) in enumerate(zip(state["slots"], state["arrived"])):
            self.grads.slots[i].copy_(slot)
            self.grads.in_flight[i] = (
                Arrived(self.grads.slots[i], f"{self.describe()} (restored)") if arrived else None
            )
        for i, (flags, unused) in enumerate(
            zip(state.get("flags", []), state.get("unused_here", []))
        ):
            self.grads.flags[i].copy_(flags)
            self.grads.unused_here[i] = list(unused)
        if state["real"] is not None:
            self.real = state["real"].clone()
        for name in ("local", "prev_local"):
            if state[name] is not None:
                getattr(self, name).copy_(state[name])
        if state["history"] is not None:
            self.history = WeightHistory(self.real, len(state["history"]["ring"]))
            self.history.load_state_dict(state["history"])
        self.pending_update = state["pending_update"]
        if self.grads.codec is not None and state.get("codec") is not None:
            self.grads.codec.load_state_dict(state["codec"])


def build_buckets(
    layers: Sequence[Layer], stale_layers: int, cap_bytes: int, group_of: dict[int, int]
) -> list[Bucket]:
    """The buckets of :func:`sapipe.layout.packing.bucket_layout` for ``layers`` (forward order)."""
    sizes = [sum(p.numel() * p.element_size() for p in layer.params) for layer in layers]
    return [
        Bucket(index, [layers[i] for i in members], members[0] < stale_layers, group_of)
        for index, members in enumerate(bucket_layout(sizes, stale_layers, cap_bytes))
    ]
