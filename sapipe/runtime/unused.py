"""Parameters no rank used: told apart on the wire, left untouched by the update (docs/design.md
§3.9).

As with ``DistributedDataParallel(find_unused_parameters=True)``, a parameter that got no
gradient on any rank in an iteration is not updated with that iteration's gradient: its
weights, its optimizer state and its own step count stay as they are. A parameter unused on
some ranks only is averaged with zeros from those ranks, as DDP does.

**Agreeing on it costs no collective.** Each gradient slot's all-reduce carries, after the
gradient, one flag per parameter of the bucket: 1 where this rank produced a gradient, 0
where it did not, so the sum is 0 exactly for the parameters no rank used. A rank that used
every parameter of a bucket knows without looking that each was used somewhere, and never
reads the flags: the common case costs a fill of a few elements per bucket and nothing
else (no extra collective, no host synchronisation). Only a rank that missed a parameter
reads the flags of that slot, after its all-reduce has arrived.

**Per-parameter counters.** ``torch.optim`` keeps a step count per parameter, so a parameter
skipped once stays behind its segment (Adam's bias correction; SGD's momentum buffer is
seeded at a parameter's own first update). A segment keeps one count for all and, in
``SegmentState.param_counters``, the counters of the parameters that differ. Where there are
any, or a parameter is skipped, the segment is updated in runs of consecutive parameters
that share their counters (:func:`pieces`).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

from torch import Tensor

from sapipe.layout.buckets import Bucket, Segment
from sapipe.optim.fused import SegmentState
from sapipe.runtime.gradients import StalenessBuffer

if TYPE_CHECKING:  # updates imports this module
    from sapipe.runtime.updates import BucketWeights


def write_flags(flags: Tensor, missing: Sequence[int]) -> None:
    """This rank's contribution: 1 per parameter, 0 for the ``missing`` (bucket indices) ones."""
    flags.fill_(1)
    if missing:
        flags[list(missing)] = 0


def unused_everywhere(grads: StalenessBuffer, slot: int) -> list[int]:
    """The parameters (bucket indices) no rank used in the gradient of ``slot``, which has
    arrived; ``[]`` without reading anything when this rank used them all."""
    mine = grads.unused_here[slot]
    if not mine:
        return []
    summed = grads.flags[slot].tolist()
    return [i for i in mine if summed[i] == 0]


def skipped_ranges(bucket: Bucket, skip: Sequence[int]) -> list[tuple[int, int]]:
    """[start, end) in ``bucket``'s flat buffers of each skipped parameter."""
    return [(bucket.offsets[i], bucket.offsets[i] + bucket.params[i].numel()) for i in skip]


def pieces(
    weights: BucketWeights, skip: Sequence[int] = ()
) -> Iterator[tuple[Segment, SegmentState]]:
    """What to update in a bucket, as (segment, its optimizer state): its own segments when no
    parameter is skipped and every parameter of a segment is at the same step (always, unless
    some parameter was skipped before); else runs of used parameters that share their counters,
    each with a state whose buffers are views of the segment's. Each run's counters are taken
    back into the segment once the caller has updated it (iterate to the end)."""
    bucket = weights.bucket
    if not skip and not any(state.param_counters for state in weights.states):
        yield from weights.segments()
        return
    skipped = set(skip)
    for segment, state in weights.segments():
        members = [
            (i, off - segment.start)
            for i, off in enumerate(bucket.offsets)
            if segment.start <= off < segment.end
        ]
        counters = {rel: state.counters_at(rel) for _, rel in members}
        runs: list[tuple[tuple, list[tuple[int, int]]]] = []
        for i, rel in members:
            key = (i not in skipped, counters[rel])
            if runs and runs[-1][0] == key:
                runs[-1][1].append((i, rel))
            else:
                runs.append((key, [(i, rel)]))
        for (used, (steps, started)), run in runs:
            if not used:
                continue
            lengths = [bucket.params[i].numel() for i, _ in run]
            lo = run[0][1]
            hi = lo + sum(lengths)
            part = state.part(lo, hi, (steps, started))
            yield (Segment(segment.group, segment.start + lo, segment.start + hi, lengths), part)
            for _, rel in run:
                counters[rel] = (part.steps, part.momentum_started)
        state.settle(counters)


__all__ = ["pieces", "skipped_ranges", "unused_everywhere", "write_flags"]
