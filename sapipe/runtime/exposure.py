"""``p.grad`` after backward: the averaged gradient ``step()`` applies, as under DDP (docs/design.md
§3.11).

Scripts read and change ``p.grad`` between ``backward()`` and ``step()``: gradient clipping,
``GradScaler.unscale_``, gradient-norm logging, hand-made edits. Under DDP they see the
averaged gradient, which is what the optimizer then applies. With ``expose_gradients=True``
(the default) sapipe keeps that contract: once backward ends, every ``p.grad`` points at its
slice of the all-reduce whose result this step applies —

* a synchronous layer's: the mean of this iteration's gradients, g_t;
* a stale layer's: the mean of g_{t-s} (at the current loss scale, when a GradScaler is in
  use), or ``None`` while the pipeline fills or when that iteration was skipped;
* ``None`` for a parameter no rank used (DDP's ``find_unused_parameters`` behaviour).

A synchronous layer's all-reduce may still be in flight when backward ends. Its ``p.grad``
is then a :class:`PendingGradient`: the first operation on it (a norm, an in-place edit, a
copy) waits for the all-reduce and averages it. A script that never reads ``p.grad`` never
waits there, and the update keeps the deferred timeline of §3.1: it runs just before the
layer's next forward, so the all-reduce overlaps ``step()`` and the stale layers' forward.
A gradient the script read is applied in ``step()``.

``step()`` applies exactly what ``p.grad`` holds: an in-place edit is already in sapipe's
buffers, a newly assigned tensor is copied in, and a gradient set to ``None`` leaves its
parameter alone this step, as ``torch.optim`` does. ``expose_gradients=False`` keeps this
rank's local gradient in ``p.grad``; a change to it then raises at ``step()``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from sapipe.errors import UsageError
from sapipe.layout.buckets import Bucket
from sapipe.runtime import unused
from sapipe.runtime.pipeline import GradientPipeline

if TYPE_CHECKING:  # scaling imports this module
    from sapipe.runtime.scaling import LossScaling


@dataclass
class ExposedGradient:
    """A bucket's gradient as ``p.grad`` shows it: the flat mean (None: nothing applied this
    step), the parameters (bucket indices) it does not update, and, while its all-reduce may
    still be in flight, ``arrival``: waits for it and averages it in place."""

    grad: Tensor | None
    skip: list[int] = field(default_factory=list)
    arrival: Callable[[], float] | None = None

    @property
    def settled(self) -> bool:
        return self.arrival is None

    def settle(self) -> float:
        """Make ``grad`` the mean (waiting for its all-reduce if need be); seconds waited."""
        arrival, self.arrival = self.arrival, None
        return arrival() if arrival is not None else 0.0


class PendingGradient(torch.Tensor):
    """A ``p.grad`` over a bucket whose all-reduce may be in flight: any operation on it first
    calls ``_sapipe_touch`` (which waits for the result and averages it), then runs as on a
    plain tensor and returns plain tensors. Checking ``p.grad is None`` does not touch it."""

    _sapipe_touch: Callable[[], None]

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        for value in _tensors_in(args, kwargs):
            if isinstance(value, PendingGradient):
                value._sapipe_touch()
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


def _tensors_in(args, kwargs):
    """The arguments of a torch function, one level of lists and tuples opened (``_foreach_*``)."""
    for value in (*args, *(kwargs or {}).values()):
        if isinstance(value, (list, tuple)):
            yield from value
        else:
            yield value


class GradientExposure:
    """Points ``p.grad`` at the gradient each parameter's update will use, once backward ends."""

    def __init__(
        self,
        pipeline: GradientPipeline,
        staleness: int,
        scaling: LossScaling,
        apply_pending: Callable[[Bucket], float],
    ):
        self._pipeline = pipeline
        self._scaling = scaling  # per iteration (finite, 1 / loss scale), as agreed at its step()
        self._apply_pending = apply_pending  # a bucket's deferred sync update; seconds waited
        #: step() has run its updates since backward ended: an unsettled p.grad left is that of
        #: a deferred sync update
        self._stepped = False
        self._staleness = staleness
        self.scaler = None  # the GradScaler the last step() received: the current loss scale
        self.iteration: int | None = None  # whose gradients p.grad holds
        self.waited = (
            0.0  # seconds waited for all-reduces because p.grad was read, since last taken
        )
        #: whether the script read a sync layer's p.grad before the last step(): its update then ran
        #: in step()
        self.read_before_step = False
        #: (bucket index, slot) -> the gradient exposed from that slot, for step() (or the
        #: deferred update) to apply; popped as it is consumed
        self.prepared: dict[tuple[int, int], ExposedGradient] = {}
        self._given: list[tuple[torch.Tensor, Tensor | None, ExposedGradient, int]] = []
        self._armed = False
        self._warned = False
        #: (bucket index, slot) -> (the slot's flat buffer, its parameters' views as
        #: PendingGradient), made once: every step exposes the same objects
        self._pending_views: dict[tuple[int, int], tuple[Tensor, list[PendingGradient]]] = {}

    def reset(self) -> None:
        """Forget what was exposed (a checkpoint was loaded, or the layout changed)."""
        self.iteration = None
        self._forget()
        self._pending_views.clear()  # the old layout's slots

    def _forget(self) -> None:
        for exposed in self.prepared.values():
            exposed.arrival = None  # a later read of an old p.grad waits for nothing
        self.prepared.clear()
        self._given.clear()

    def arm(self, iteration: int) -> None:
        """Called as backward hands over a gradient: expose once this backward pass ends."""
        if not self._armed and self.iteration != iteration:
            self._armed = True
            self._at_end_of_backward(iteration)

    def _at_end_of_backward(self, iteration: int) -> None:
        torch.autograd.Variable._execution_engine.queue_callback(
            lambda: self._backward_ended(iteration)
        )

    def _backward_ended(self, iteration: int) -> None:
        """The backward pass that armed the exposure ended. Where it was a reentrant one, run
        inside a node of an outer backward (activation checkpointing with
        ``use_reentrant=True``), the outer one goes on and may hand over more gradients: the
        exposure waits for the end of the outer one, armed again once that node is done."""
        outer = torch._C._current_autograd_node()
        if outer is None:
            self.expose(iteration)
        else:
            outer.register_hook(lambda *_: self._at_end_of_backward(iteration))

    @torch.no_grad()
    def expose(self, iteration: int) -> None:
        """Point every ``p.grad`` at the mean of the gradient its update uses (idempotent).

        A stale layer's all-reduce arrived long ago and is averaged now; a sync layer's is
        waited for only when its ``p.grad`` is first read (:class:`PendingGradient`), unless
        one of its parameters went unused here (``p.grad`` must then say None if no rank used it).
        """
        self._armed = False
        if self.iteration == iteration:
            return
        pipeline = self._pipeline
        pipeline.flush(iteration)  # buckets with parameters backward did not reach
        self._forget()
        scaling = self._scaling.verdicts
        scale = (
            self.scaler.get_scale() if self.scaler is not None else None
        )  # once: a host sync on CUDA
        for bucket in pipeline.buckets:
            slot, source = self._source(bucket, iteration)
            exposed = ExposedGradient(None)
            if source is not None:
                buffer = pipeline.gradients(bucket).buffer
                exposed = ExposedGradient(buffer.slots[slot])
                exposed.arrival = partial(
                    self._arrive,
                    bucket,
                    slot,
                    source,
                    exposed,
                    *self._scaled(source, scaling, scale),
                )
                lazy = source == iteration and not buffer.unused_here[slot]
                if not lazy:
                    self.waited += exposed.settle()
                self.prepared[(bucket.index, slot)] = exposed
            self._point_grads(bucket, slot, exposed)
        self.iteration = iteration
        self.read_before_step = False
        self._stepped = False

    def _source(self, bucket: Bucket, iteration: int) -> tuple[int, int | None]:
        """(the slot this step applies from, the iteration its gradient belongs to; None: no
        gradient)."""
        pipeline = self._pipeline
        if not pipeline.in_pipeline(bucket, iteration):
            return 0, iteration
        t, s = iteration - pipeline.origin, self._staleness
        if t <= s:
            return 0, None  # the pipeline fills: no stale gradient yet
        return pipeline.gradients(bucket).buffer.index(t - s), iteration - s

    def _scaled(
        self, source: int, scaling: dict[int, tuple[bool, float]], scale: float | None
    ) -> tuple[bool, float]:
        """(whether iteration ``source``'s step was finite, the factor from its loss scale to the
        current one ``scale``): a stale gradient is shown at this step's scale (§3.8)."""
        finite, inverse_scale = scaling.get(source, (True, 1.0))
        factor = scale * inverse_scale if scale is not None and source in scaling else 1.0
        return finite, factor

    def _arrive(
        self,
        bucket: Bucket,
        slot: int,
        source: int,
        exposed: ExposedGradient,
        finite: bool,
        factor: float,
    ) -> float:
        """The summed gradient in ``slot`` (of iteration ``source``) waited for and made the mean,
        or
        None if its step was skipped as not finite; its globally unused parameters skipped. Seconds
        waited."""
        mean, waited = self._pipeline.take_mean(bucket, slot, source)
        if not finite:
            exposed.grad = None
            return waited
        if factor != 1.0:
            mean.mul_(factor)
        buffer = self._pipeline.gradients(bucket).buffer
        exposed.skip.extend(unused.unused_everywhere(buffer, slot))
        return waited

    def _touch(self, bucket: Bucket, slot: int) -> None:
        """A ``p.grad`` of ``bucket`` over ``slot`` is read: its gradient must be there (unless it
        was consumed or forgotten already). After ``step()`` its deferred update is applied first
        (the read may be an edit, such as ``zero_()``)."""
        exposed = self.prepared.get((bucket.index, slot))
        if exposed is None or exposed.settled:
            return
        if self._stepped:  # its update was deferred: applied now, then the read
            self.waited += self._apply_pending(bucket)
        else:
            self.read_before_step = True
            self.waited += exposed.settle()

    def _point_grads(self, bucket: Bucket, slot: int, exposed: ExposedGradient) -> None:
        flat = exposed.grad
        views: list[Tensor] | list[PendingGradient] | None = None
        if flat is not None:
            views = (
                bucket.param_views(flat) if exposed.settled else self._pending(bucket, slot, flat)
            )
        skip = exposed.skip
        given = self._given
        for i, param in enumerate(bucket.params):
            view = views[i] if views is not None and not (skip and i in skip) else None
            param.grad = view
            given.append((param, view, exposed, i))

    @torch.no_grad()
    def settle_pending(self) -> None:
        """Before ``zero_grad(set_to_none=False)``: every ``p.grad`` still a
        :class:`PendingGradient` becomes the plain view of its mean, once its bucket is settled
        as the in-place edit would settle it (the deferred update applied first, after
        ``step()``). The zeroing is then one foreach call, not one touch per gradient."""
        buckets = self._pipeline.buckets
        for (index, slot), exposed in list(self.prepared.items()):
            flat = exposed.grad
            if exposed.settled or flat is None:
                continue
            bucket = buckets[index]
            self._touch(bucket, slot)
            made = self._pending_views.get((index, slot))
            if made is None or made[0] is not flat:
                continue
            for param, pending, plain in zip(bucket.params, made[1], bucket.param_views(flat)):
                if param.grad is pending:
                    param.grad = plain

    def _pending(self, bucket: Bucket, slot: int, flat: Tensor) -> list[PendingGradient]:
        """``bucket``'s parameters' views of ``flat``, its ``slot``, as :class:`PendingGradient`,
        made once."""
        key = (bucket.index, slot)
        made = self._pending_views.get(key)
        if made is not None and made[0] is flat:
            return made[1]
        touch = partial(self._touch, bucket, slot)
        views = []
        for view in bucket.param_views(flat):
            pending = torch.Tensor._make_subclass(PendingGradient, view, False)
            pending._sapipe_touch = touch
            views.append(pending)
        self._pending_views[key] = (flat, views)
        return views

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
                view.copy_(grad)  # waits for the all-reduce first, if need be
        self._given.clear()

    def defers(self, bucket: Bucket) -> bool:
        """Whether ``bucket``'s sync update may wait for its next forward: nothing read its
        gradient, so nothing waited for its all-reduce yet."""
        exposed = self.prepared.get((bucket.index, 0))
        return exposed is not None and not exposed.settled

    def end_step(self) -> None:
        """After ``step()``'s updates: only the deferred ones' gradients stay prepared."""
        for key in [key for key, exposed in self.prepared.items() if exposed.settled]:
            del self.prepared[key]
        self._stepped = True

    def _warn_once(self, param: torch.Tensor) -> None:
        if not self._warned:
            self._warned = True
            warnings.warn(
                f"sapipe: a gradient was given to a parameter (shape {tuple(param.shape)}) that "
                "this step() "
                "does not update (no rank used it, or it is a stale layer's while the pipeline "
                "fills: its "
                "p.grad was None after backward); the gradient is ignored. Reported once.",
                stacklevel=4,
            )

    def check_exposed(self, iteration: int, what: str) -> None:
        """Raise unless ``p.grad`` holds ``iteration``'s gradients (its backward has ended)."""
        if self.iteration != iteration:
            raise UsageError(
                f"call {what} between loss.backward() and step(): p.grad holds "
                "the averaged gradients only once backward has ended"
            )


__all__ = ["ExposedGradient", "GradientExposure", "PendingGradient"]
