"""``p.grad`` after backward: the averaged gradient ``step()`` applies, as under DDP (docs/design.md §3.11).

Scripts read and change ``p.grad`` between ``backward()`` and ``step()``: gradient clipping,
``GradScaler.unscale_``, gradient-norm logging, hand-made edits. Under DDP they see the
averaged gradient, which is what the optimizer then applies. With ``expose_gradients=True``
(the default) sapipe keeps that contract: once backward ends, it waits for the all-reduces
whose results this step applies and points every ``p.grad`` at its slice of them —

* a synchronous layer's: the mean of this iteration's gradients, g_t;
* a stale layer's: the mean of g_{t-s} (at the current loss scale, when a GradScaler is in
  use), or ``None`` while the pipeline fills or when that iteration was skipped;
* ``None`` for a parameter no rank used (DDP's ``find_unused_parameters`` behaviour).

``step()`` then applies exactly what ``p.grad`` holds: an in-place edit (``clip_grad_norm_``,
``unscale_``) is already in sapipe's buffers, a newly assigned tensor is copied in, and a
gradient set to ``None`` leaves its parameter alone this step, as ``torch.optim`` does.

What it costs: the synchronous all-reduces are waited for when backward ends, no longer
just before each layer's next forward, and their updates run inside ``step()``. Stale
layers keep their whole overlap. ``expose_gradients=False`` restores the deferred updates;
``p.grad`` then keeps this rank's local gradient and a change to it raises at ``step()``.
"""
from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
from torch import Tensor

from ..buckets import Bucket
from ..errors import UsageError
from . import unused
from .pipeline import GradientPipeline


@dataclass
class ExposedGradient:
    """A bucket's gradient as ``p.grad`` shows it: the flat mean (None: nothing applied this
    step) and the parameters (bucket indices) it does not update."""

    grad: Optional[Tensor]
    skip: List[int] = field(default_factory=list)


class GradientExposure:
    """Points ``p.grad`` at the gradient each parameter's update will use, once backward ends."""

    def __init__(self, pipeline: GradientPipeline, world_size: int, staleness: int,
                 scaling: Callable[[], Dict[int, Tuple[bool, float]]]):
        self._pipeline = pipeline
        self._scaling = scaling  # per iteration (finite, 1 / loss scale), as agreed at its step()
        self._world_size = world_size
        self._staleness = staleness
        self.scaler = None  # the GradScaler the last step() received: the current loss scale
        self.iteration: Optional[int] = None  # whose gradients p.grad holds
        self.waited = 0.0  # seconds the last exposure waited for all-reduces
        #: (bucket index, slot) -> the gradient exposed from that slot, for step() to apply
        self.prepared: Dict[Tuple[int, int], ExposedGradient] = {}
        self._given: List[Tuple[torch.Tensor, Optional[Tensor], ExposedGradient, int]] = []
        self._armed = False
        self._warned = False

    def reset(self) -> None:
        """Forget what was exposed (a checkpoint was loaded: iterations count from it again)."""
        self.iteration = None
        self.prepared.clear()
        self._given.clear()

    def arm(self, iteration: int) -> None:
        """Called as backward hands over a gradient: expose once this backward pass ends."""
        if not self._armed and self.iteration != iteration:
            self._armed = True
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self.expose(iteration))

    @torch.no_grad()
    def expose(self, iteration: int) -> None:
        """Wait for this step's gradients and point every ``p.grad`` at its mean (idempotent)."""
        self._armed = False
        if self.iteration == iteration:
            return
        pipeline = self._pipeline
        pipeline.flush(iteration)  # buckets with parameters backward did not reach
        before = pipeline.waited
        self.prepared.clear()
        self._given.clear()
        scaling = self._scaling()
        scale = self.scaler.get_scale() if self.scaler is not None else None  # once: a host sync on CUDA
        for bucket in pipeline.buckets:
            slot, source = self._source(bucket, iteration)
            exposed = ExposedGradient(None)
            if source is not None:
                summed, _ = pipeline.take_arrived(bucket, slot)
                exposed = ExposedGradient(self._mean(summed, source, scaling, scale))
                if exposed.grad is not None:
                    exposed.skip = unused.unused_everywhere(bucket.grads, slot)
                self.prepared[(bucket.index, slot)] = exposed
            self._point_grads(bucket, exposed)
        self.iteration = iteration
        self.waited = pipeline.waited - before

    def _source(self, bucket: Bucket, iteration: int) -> Tuple[int, Optional[int]]:
        """(the slot this step applies from, the iteration its gradient belongs to; None: no gradient)."""
        pipeline = self._pipeline
        if not pipeline.in_pipeline(bucket, iteration):
            return 0, iteration
        t, s = iteration - pipeline.origin, self._staleness
        if t <= s:
            return 0, None  # the pipeline fills: no stale gradient yet
        return bucket.grads.index(t - s), iteration - s

    def _mean(self, summed: Tensor, source: int, scaling: Dict[int, Tuple[bool, float]],
              scale: Optional[float]) -> Optional[Tensor]:
        """The summed gradient of iteration ``source`` as a mean at the current loss ``scale``
        (None if that iteration's step was skipped as not finite)."""
        finite, inverse_scale = scaling.get(source, (True, 1.0))
        if not finite:
            return None
        summed.div_(self._world_size)
        if scale is not None and source in scaling:
            factor = scale * inverse_scale  # its scale -> this step's
            if factor != 1.0:
                summed.mul_(factor)
        return summed

    def _point_grads(self, bucket: Bucket, exposed: ExposedGradient) -> None:
        skip = set(exposed.skip)
        for i, param in enumerate(bucket.params):
            view = None
            if exposed.grad is not None and i not in skip:
                offset = bucket.offsets[i]
                view = exposed.grad[offset : offset + param.numel()].view_as(param)
            param.grad = view
            self._given.append((param, view, exposed, i))

    @torch.no_grad()
    def collect(self) -> None:
        """At ``step()``: take in what the script did to ``p.grad`` since backward ended."""
        for param, view, exposed, i in self._given:
            grad = param.grad
            if grad is view:
                continue  # untouched, or edited in place: already in the buffer
            if view is None:
                self._warn_once(param)
            elif grad is None:
                exposed.skip.append(i)  # dropped: this parameter keeps its weights and state
            else:
                view.copy_(grad)
        self._given.clear()

    def _warn_once(self, param: torch.Tensor) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"sapipe: a gradient was given to a parameter (shape {tuple(param.shape)}) that this step() "
                "does not update (no rank used it, or it is a stale layer's while the pipeline fills: its "
                "p.grad was None after backward); the gradient is ignored. Reported once.",
                stacklevel=4,
            )

    def check_exposed(self, iteration: int, what: str) -> None:
        """Raise unless ``p.grad`` holds ``iteration``'s gradients (its backward has ended)."""
        if self.iteration != iteration:
            raise UsageError(f"sapipe: call {what} between loss.backward() and step(): p.grad holds "
                             "the averaged gradients only once backward has ended")


__all__ = ["GradientExposure", "ExposedGradient"]
