"""A bucket's gradient side, written only by :class:`sapipe.runtime.pipeline.GradientPipeline`.

Per bucket of a layout (:class:`BucketGradients`): the slots backward writes into and their
collectives carry (:class:`StalenessBuffer`), this rank's own gradient where a compensation
keeps it (``local``, ``prev_local``), and where each gradient of the current iteration goes
(``intake``; which have arrived, the intake's hooks know: sapipe.runtime.intake). The update
side reads what it needs (the arrived means, ``local``) through the pipeline and never writes
here.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from sapipe.compression.codec import Codec, Compression, intake_views, make_codec
from sapipe.errors import ConfigurationError
from sapipe.layout.buckets import Bucket


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
        self,
        numel: int,
        nflags: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 1,
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


class GradientBuffers(NamedTuple):
    """What every bucket's gradient side is made of: the slots of a stale bucket
    (``staleness + 1``), whether this rank's own gradient is kept for the compensation
    (``keep_local``: l_t, wp1 and wp3; ``keep_prev_local``: l_{t-1}, wp3), how sums are
    compressed (None: not), and whether each slot carries a non-finite verdict."""

    staleness: int
    keep_local: bool
    keep_prev_local: bool
    compression: CompressedSums | None
    verdicts: bool

    def build(self, bucket: Bucket) -> BucketGradients:
        depth = self.staleness + 1 if bucket.stale else 1
        buffer = StalenessBuffer(
            bucket.numel,
            bucket.dtype,
            bucket.device,
            depth,
            flags=len(bucket.params),
            verdict=self.verdicts,
        )
        if self.compression is not None:
            buffer.codec = self.compression.codec(
                bucket.numel,
                buffer.wire[0].numel() - bucket.numel,  # every flag, and the verdict
                bucket.dtype,
                bucket.device,
                slots=depth,
            )
        local = prev_local = None
        if bucket.stale and self.keep_local:
            local = torch.zeros_like(buffer.slots[0])
        if bucket.stale and self.keep_prev_local:
            prev_local = torch.zeros_like(buffer.slots[0])
        return BucketGradients(bucket, buffer, local, prev_local)


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


class BucketGradients:
    """One bucket's gradient side (see the module's docstring)."""

    def __init__(
        self,
        bucket: Bucket,
        buffer: StalenessBuffer,
        local: Tensor | None,
        prev_local: Tensor | None,
    ):
        self.bucket = bucket
        self.buffer = buffer
        self.local = local  # this rank's gradient of the current iteration (wp1, wp3)
        self.prev_local = prev_local  # ... of the previous iteration (wp3)
        #: per target, each parameter's place there (a view, or its pieces across compressed
        #: messages) for this iteration's gradients, set by its first one
        self.intake: list[list[object]] = []
        self._message_views: dict[int, list[object]] = {}  # per slot, memo of message_views

    def message_views(self, slot: int) -> list[object]:
        """Each parameter's place in slot ``slot``'s outgoing compressed messages, where the
        bucket's codec ``encodes_on_intake`` (sapipe.compression.codec.intake_views): made once
        per slot."""
        views = self._message_views.get(slot)
        if views is None:
            codec = self.buffer.codec
            assert codec is not None
            bucket = self.bucket
            views = self._message_views[slot] = intake_views(
                codec, slot, bucket.offsets, bucket.params
            )
        return views

    def rotate_local(self) -> None:
        """l_t becomes l_{t-1} (wp3), once a stale step has read both."""
        if self.prev_local is not None:
            self.local, self.prev_local = self.prev_local, self.local

    def state_dict(self) -> dict:
        """This side's part of a bucket's checkpoint; in-flight collectives are waited for and
        stored as their results, so a resumed run consumes exactly what the uninterrupted one
        would have."""
        buffer = self.buffer
        for handle in buffer.in_flight:
            if handle is not None:
                handle.wait()
        return {
            "slots": [slot.clone() for slot in buffer.slots],
            "flags": [flags.clone() for flags in buffer.flags],
            "unused_here": [list(unused) for unused in buffer.unused_here],
            "arrived": [handle is not None for handle in buffer.in_flight],
            "local": None if self.local is None else self.local.clone(),
            "prev_local": None if self.prev_local is None else self.prev_local.clone(),
            "codec": None if buffer.codec is None else buffer.codec.state_dict(),
        }

    def check_state_dict(self, state: dict) -> None:
        """Raise, naming why, where ``state`` cannot be restored here (residuals of another
        compression)."""
        if self.buffer.codec is not None and state.get("codec") is not None:
            self.buffer.codec.check_state_dict(state["codec"])

    def load_state_dict(self, state: dict) -> None:
        buffer, what = self.buffer, f"{self.bucket.describe()} (restored)"
        for i, (slot, arrived) in enumerate(zip(state["slots"], state["arrived"])):
            buffer.slots[i].copy_(slot)
            buffer.in_flight[i] = Arrived(buffer.slots[i], what) if arrived else None
        for i, (flags, unused) in enumerate(
            zip(state.get("flags", []), state.get("unused_here", []))
        ):
            buffer.flags[i].copy_(flags)
            buffer.unused_here[i] = list(unused)
        for mine, saved in (
            (self.local, state["local"]),
            (self.prev_local, state["prev_local"]),
        ):
            if saved is not None:
                if mine is None:
                    raise ConfigurationError(
                        f"the checkpoint's {self.bucket.describe()} keeps this rank's own "
                        "gradient for a compensation this job does not use"
                    )
                mine.copy_(saved)
        if buffer.codec is not None and state.get("codec") is not None:
            buffer.codec.load_state_dict(state["codec"])


def move_residuals(old: list[BucketGradients], new: list[BucketGradients]) -> None:
    """Each parameter's error-feedback residual (what its rank's rounding kept back) to its
    new place. A residual of a sum (kept per shard, of a bucket or of a partition, whose
    bounds move) is dropped, as are the residuals of a node-first codec (kept per shard)."""
    places = {
        id(p): (g, off)
        for g in old
        if g.buffer.codec is not None and g.buffer.codec.residual is not None
        for p, off in zip(g.bucket.params, g.bucket.offsets)
    }
    for gradients in new:
        codec = gradients.buffer.codec
        if codec is None or codec.residual is None:
            continue
        for p, offset in zip(gradients.bucket.params, gradients.bucket.offsets):
            if id(p) in places:
                source, source_offset = places[id(p)]
                codec.residual[offset : offset + p.numel()].copy_(
                    source.buffer.codec.residual[source_offset : source_offset + p.numel()]
                )


__all__ = [
    "Arrived",
    "BucketGradients",
    "CompressedSums",
    "GradientBuffers",
    "StalenessBuffer",
    "move_residuals",
]
