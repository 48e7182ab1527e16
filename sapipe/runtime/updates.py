"""The updates: deferred synchronous ones, stale ones with their compensation, and GradScaler.

* A **sync** bucket's update x_t = OPT(x_{t-1}, g_t) is recorded at ``step()`` with that
  step's hyper-parameters and applied just before the bucket's first layer runs forward
  again (or at ``synchronize()``), so its all-reduce overlaps the rest of backward.
* A **stale** bucket is updated at ``step()`` of pipeline step t with the averaged gradient
  of t − s, compensated (``dc``) or followed by a weight prediction (``wp1``–``wp3`` by the
  optimizer's peek, ``t2`` by extrapolating the weights' velocity).
* With a GradScaler (sapipe.runtime.scaling), each gradient is unscaled with its own
  iteration's scale wherever it is consumed, and dropped there if it was not finite
  (docs/design.md §3).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from sapipe.config import Settings
from sapipe.errors import ConfigurationError, UnsupportedOptimizerError
from sapipe.kernels.gradient_spec import GradientSpec
from sapipe.layout.buckets import Bucket, Segment
from sapipe.optim.compensation import ChooseOnline, Compensation, StaleStep
from sapipe.optim.fused import OptimizerRule, SegmentState
from sapipe.runtime import unused
from sapipe.runtime.exposure import GradientExposure
from sapipe.runtime.layout import Layout
from sapipe.runtime.pipeline import GradientPipeline
from sapipe.runtime.prediction_choice import PredictionChoice
from sapipe.runtime.scaling import LossScaling

Hyperparams = list[dict[str, Any]]  # one dict per param group, as the rule reads them


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


class BucketWeights:
    """One bucket's update side, written only by :class:`Updater`: the flat buffer the model's
    parameters are views of (``weights``: x, or x̃ under weight prediction), the real weights
    (``real``: the same tensor unless a compensation predicts), the weight history (DC, wp3),
    the optimizer state of each segment, and the deferred sync update, if one is pending
    (its step's hyper-parameters and iteration)."""

    def __init__(self, bucket: Bucket, weights: Tensor, states: list[SegmentState]):
        self.bucket = bucket
        self.weights = weights
        self.real = weights
        self.history: WeightHistory | None = None
        self.velocity: Tensor | None = None  # δ, where the compensation extrapolates (t2)
        self.states = states  # per segment of the bucket
        self.pending: tuple[Hyperparams, int] | None = None

    def segments(self) -> list[tuple[Segment, SegmentState]]:
        return list(zip(self.bucket.segments, self.states))

    @property
    def predicted(self) -> bool:
        """Whether the model holds predicted weights (x̃ ≠ x's tensor)."""
        return self.real is not self.weights


class Updater:
    """Applies every update of the runtime, with the optimizer's own rule and state.

    It owns each bucket's update side (:class:`BucketWeights`, built by :meth:`lay_out`). It
    reads the averaged gradients from the ``pipeline``, or, with ``p.grad`` exposed, as the
    ``exposure`` prepared them, and unscales them with the GradScaler's verdicts
    (``scaling``).
    """

    def __init__(
        self,
        rule: OptimizerRule,
        compensation: Compensation,
        settings: Settings,
        world_size: int,
        pipeline: GradientPipeline,
        scaling: LossScaling,
        exposure: GradientExposure | None,
    ):
        self.rule = rule
        self.compensation = compensation
        self._settings = settings
        self._world_size = world_size
        self._pipeline = pipeline
        self._exposure = exposure
        self._weights: list[BucketWeights] = []  # per bucket of the layout (empty: none yet)
        self._scaling = scaling
        #: compensation="auto": the probe and each stale bucket's chosen prediction
        self.choice = (
            PredictionChoice(compensation) if isinstance(compensation, ChooseOnline) else None
        )

    # ------------------------------------------------------------------ per-bucket state

    @property
    def allocated(self) -> bool:
        """Whether the weights are flat and the optimizer state made (the first ``step()``)."""
        return bool(self._weights)

    def weights(self, bucket: Bucket) -> BucketWeights:
        """``bucket``'s update side (a bucket of the current layout, once :attr:`allocated`)."""
        return self._weights[bucket.index]

    @torch.no_grad()
    def lay_out(self, layout: Layout) -> None:
        """Flatten ``layout``'s weights (parameters become views of each bucket's buffer) and
        make its optimizer state; every parameter's state moves over from the previous
        layout's, if there was one. The previous layout's deferred updates are dropped: a
        relayout applies them first, a restore replaces them with the checkpoint's."""
        moved = _state_places(self._weights)
        self._weights = []
        if self.choice is not None:
            self.choice.reset()
        for bucket in layout.buckets:
            flat = bucket.flatten_weights()
            states = []
            for segment in bucket.segments:
                params = bucket.segment_params(segment)
                state = self.rule.new_state(segment.of(flat), params)
                for p, offset in params:
                    if id(p) in moved:
                        old, old_offset = moved[id(p)]
                        state.move_from(old, old_offset, offset, p.numel())
                states.append(state)
            self._weights.append(BucketWeights(bucket, flat, states))

    def defer(self, bucket: Bucket, hyperparams: Hyperparams, iteration: int) -> None:
        """Record ``bucket``'s sync update of ``iteration``, to apply before it is next needed."""
        self._weights[bucket.index].pending = (hyperparams, iteration)

    def pending(self, bucket: Bucket) -> bool:
        """Whether ``bucket`` has a deferred sync update not yet applied."""
        return bool(self._weights) and self._weights[bucket.index].pending is not None

    def pending_buckets(self) -> list[Bucket]:
        return [w.bucket for w in self._weights if w.pending is not None]

    def discard_pending(self) -> None:
        """Forget the deferred updates (the job is closing: their gradients are abandoned)."""
        for weights in self._weights:
            weights.pending = None

    @torch.no_grad()
    def swap_in_real_weights(self) -> list[tuple[BucketWeights, Tensor]]:
        """Under weight prediction, put the real weights into the model; what to swap back."""
        predicted = [(w, w.weights.clone()) for w in self._weights if w.predicted]
        for weights, _ in predicted:
            weights.weights.copy_(weights.real)
        return predicted

    @staticmethod
    @torch.no_grad()
    def swap_back(predicted: list[tuple[BucketWeights, Tensor]]) -> None:
        for weights, saved in predicted:
            weights.weights.copy_(saved)

    def state_dict(self, bucket: Bucket) -> dict:
        """``bucket``'s update side, for a checkpoint."""
        w = self._weights[bucket.index]
        return {
            "segments": [state.state_dict() for state in w.states],
            "segment_bounds": [[seg.start, seg.end] for seg in bucket.segments],
            "real": w.real.clone() if w.predicted else None,
            # the predicted weights the model holds (this rank's own under wp1/wp3): restored
            # over the model's, which frameworks save and load as the real ones
            "predicted": w.weights.clone() if w.predicted else None,
            "history": None if w.history is None else w.history.state_dict(),
            "velocity": None if w.velocity is None else w.velocity.clone(),
            "pending_update": w.pending,
        }

    def check_state_dict(self, bucket: Bucket, state: dict) -> None:
        """Raise, naming why, where a checkpoint's ``state`` of a bucket of the same layers
        cannot be restored into ``bucket``: other param groups, state kept by the other
        update path."""
        bounds = [[seg.start, seg.end] for seg in bucket.segments]
        saved_bounds = state.get("segment_bounds")  # older checkpoints lack it
        if len(state["segments"]) != len(bounds) or (
            saved_bounds is not None and [list(b) for b in saved_bounds] != bounds
        ):
            raise ConfigurationError(
                f"the checkpoint's {bucket.describe()} splits into other param groups "
                "than this job's (the optimizer's param groups changed)"
            )
        path = self.rule.path
        for saved in state["segments"]:
            if ("buffers" in saved) != (path == "fused"):
                kept = "fused" if "buffers" in saved else "generic"
                raise UnsupportedOptimizerError(
                    f"the checkpoint's optimizer state was kept by the {kept} "
                    f"update path; this job takes the {path} one"
                )

    def load_state_dict(self, bucket: Bucket, state: dict) -> None:
        w = self._weights[bucket.index]
        for mine, saved in zip(w.states, state["segments"]):
            mine.load_state_dict(saved)
        if state["real"] is not None:
            w.real = state["real"].clone()
        if state.get("predicted") is not None and w.predicted:
            w.weights.copy_(state["predicted"])
        if state["history"] is not None:
            w.history = WeightHistory(w.real, len(state["history"]["ring"]))
            w.history.load_state_dict(state["history"])
        if state.get("velocity") is not None:
            w.velocity = state["velocity"].clone()
        w.pending = state["pending_update"]

    def export_state(self, bucket: Bucket) -> dict:
        """``bucket``'s optimizer state per parameter, as ``torch.optim`` keeps it."""
        table: dict = {}
        if self._weights:
            for segment, state in self._weights[bucket.index].segments():
                table.update(self.rule.export_state(state, bucket.segment_params(segment)))
        return table

    def _gradient(
        self, bucket: Bucket, slot: int, iteration: int
    ) -> tuple[torch.Tensor | None, list[int], float]:
        """(the averaged, unscaled gradient of ``iteration`` in ``slot`` or None, the parameters it
        leaves alone, seconds waited): as ``p.grad`` exposed it, or as it arrives."""
        exposure = self._exposure
        exposed = exposure.prepared.pop((bucket.index, slot), None) if exposure else None
        if exposed is not None:
            waited = exposed.settle()  # its all-reduce, if nothing read p.grad before
            return exposed.grad, exposed.skip, waited
        mean, waited = self._pipeline.take_mean(bucket, slot, iteration)
        grad = self._unscale(mean, iteration)
        buffer = self._pipeline.gradients(bucket).buffer
        return (grad, (unused.unused_everywhere(buffer, slot) if grad is not None else []), waited)

    def _unscale(self, grad: torch.Tensor, iteration: int) -> torch.Tensor | None:
        """The averaged gradient of ``iteration`` unscaled; None if it was not finite."""
        finite, inverse_scale = self._scaling.of(iteration)
        if not finite:
            return None
        return grad if inverse_scale == 1.0 else grad.mul_(inverse_scale)

    # ------------------------------------------------------------------ sync buckets

    @torch.no_grad()
    def apply_deferred(self, bucket: Bucket) -> float:
        """x_t = OPT(x_{t-1}, g_t) for a synchronously-behaving bucket, if one is pending.

        Returns the seconds spent waiting for its all-reduce (a stall, for the profiler).
        """
        if not self._weights:
            return 0.0
        w = self._weights[bucket.index]
        pending, w.pending = w.pending, None
        if pending is None:
            return 0.0
        hyperparams, iteration = pending
        grad, skip, waited = self._gradient(bucket, 0, iteration)
        if grad is not None:  # else a step GradScaler skipped
            for segment, state in unused.pieces(w, skip):
                self.rule.update(
                    segment.of(w.weights),
                    state,
                    hyperparams[segment.group],
                    GradientSpec.plain(segment.of(grad)),
                )
        return waited

    # ------------------------------------------------------------------ stale buckets

    def stale_hyperparams(self, hyperparams: Hyperparams, pipeline_step: int) -> Hyperparams:
        """PipeMare T1: lr / s^{p_t}, p_t = 1 − min(t/K, 1), for staleness s > 1."""
        s, ramp = self._settings.staleness, self._settings.lr_ramp_steps
        if s == 1 or ramp == 0:
            return hyperparams
        divisor = s ** (1.0 - min(pipeline_step / ramp, 1.0))
        return [dict(hp, lr=hp["lr"] / divisor) for hp in hyperparams]

    @torch.no_grad()
    def stale_update(
        self, bucket: Bucket, t: int, hyperparams: Hyperparams, iteration: int
    ) -> None:
        """``step()`` of pipeline step t (user iteration ``iteration``) for a stale bucket."""
        comp, s = self.compensation, self._settings.staleness
        w = self._weights[bucket.index]
        if t == 1:  # the pipeline starts: real weights and history begin at x_0
            w.real = w.weights.clone() if comp.predicts else w.weights
            if comp.history_length:
                w.history = WeightHistory(w.real, comp.history_length)
            if comp.extrapolates:
                w.velocity = torch.zeros_like(w.real)  # δ_0 = 0
        buffer = self._pipeline.gradients(bucket).buffer
        grad, skip = (
            self._gradient(bucket, buffer.index(t - s), iteration - s)[:2] if t > s else (None, [])
        )
        view = self._stale_view(w, grad, iteration)
        hyperparams = self.stale_hyperparams(hyperparams, t)
        # x̃_{t+1} = OPT_peek(x_t, g̃); recipes only describe, so g̃ can be known up front
        predicting = comp if self.choice is None else self.choice.compensation_for(bucket.index)
        predictor = predicting.prediction_gradient(view) if comp.predicts else None
        if comp.extrapolates:  # x̃_t served its forward: the buffer keeps x_{t-1} meanwhile
            w.weights.copy_(w.real)
        if grad is not None:
            self._real_update(w, view, hyperparams, predictor, skip)
            if self.choice is not None and not self.choice.decided:
                self.choice.observe(bucket.index, w.real, view, self._peek_into(w, hyperparams))
        else:
            self._no_update(w, hyperparams, predictor)
        if comp.extrapolates:
            self._extrapolate(w)
        elif comp.predicts and predictor is None:
            w.weights.copy_(w.real)  # no prediction: x̃_{t+1} = x_t

    def _peek_into(self, w: BucketWeights, hyperparams: Hyperparams):
        """OPT_peek of ``w``'s bucket from its real weights and state: (g̃, out) → x̃ in out."""

        def peek(spec: GradientSpec, out: torch.Tensor) -> None:
            for segment, state in unused.pieces(w):
                self.rule.peek(
                    segment.of(w.real),
                    state,
                    hyperparams[segment.group],
                    spec.slice(segment.start, segment.end, segment.lengths),
                    out=segment.of(out),
                )

        return peek

    def _extrapolate(self, w: BucketWeights) -> None:
        """PipeMare T2: δ_t = γ·δ_{t-1} + (1 − γ)·(x_t − x_{t-1}), then x̃_{t+1} = x_t + s·δ_t,
        with ``w.weights`` holding x_{t-1} on entry (stale_update) and x̃_{t+1} on return."""
        assert w.velocity is not None
        gamma = self.compensation.velocity_decay
        change = w.weights.sub_(w.real)  # x_{t-1} − x_t
        w.velocity.mul_(gamma).sub_(change, alpha=1.0 - gamma)
        torch.add(w.real, w.velocity, alpha=float(self._settings.staleness), out=w.weights)

    def _stale_view(self, w: BucketWeights, grad: torch.Tensor | None, iteration: int) -> StaleStep:
        """What the compensation sees at this step: ĝ, x, this rank's l_t and l_{t−1}, Δx's
        reference."""
        gradients = self._pipeline.gradients(w.bucket)
        local, prev_local = gradients.local, gradients.prev_local
        if local is not None and self._scaling.verdicts:
            finite, inverse_scale = self._scaling.of(iteration)
            local = local.mul_(inverse_scale) if self._usable(local, finite) else None
            if prev_local is not None and not self._usable(
                prev_local, self._scaling.of(iteration - 1)[0]
            ):
                prev_local = None
        history, settings = w.history, self._settings
        return StaleStep(
            g=grad,
            x=w.real,
            local=local,
            prev_local=prev_local,
            x_oldest=history.oldest() if history else None,
            world_size=self._world_size,
            lam=settings.dc_lambda,
            form=settings.dc_form,
        )

    def _usable(self, local: torch.Tensor, agreed_finite: bool) -> bool:
        """Whether this rank's own gradient l may enter a prediction under a GradScaler: its
        iteration's agreed verdict, and with ``p.grad`` exposed, where that verdict judged only
        what ``p.grad`` holds, l's own values too (docs/design.md §3.8)."""
        return agreed_finite and (
            not self._settings.expose_gradients or bool(torch.isfinite(local).all())
        )

    def _real_update(
        self,
        w: BucketWeights,
        view: StaleStep,
        hyperparams: Hyperparams,
        predictor,
        skip: list[int],
    ) -> None:
        """x_t = OPT(x_{t-1}, ĝ) in one pass over memory with what else this step writes: x_t
        into the history's oldest slot (the Δx reference it reads), and the prediction from
        the freshly updated weights and state. The ``skip`` parameters (no rank used them in
        ĝ's iteration) keep x_t = x_{t-1}, their state, and no prediction: x̃_{t+1} = x_t."""
        recipe = self.compensation.real_gradient(view)
        history = w.history
        for lo, hi in unused.skipped_ranges(w.bucket, skip):
            if history is not None:
                history.oldest()[lo:hi].copy_(w.real[lo:hi])
            if predictor is not None:
                w.weights[lo:hi].copy_(w.real[lo:hi])
        for segment, state in unused.pieces(w, skip):
            spec = recipe.slice(segment.start, segment.end, segment.lengths)
            if history is not None:
                spec = spec.with_history(segment.of(history.oldest()))
            if predictor is None:
                self.rule.update(segment.of(w.real), state, hyperparams[segment.group], spec)
            else:
                self.rule.update_and_peek(
                    segment.of(w.real),
                    state,
                    hyperparams[segment.group],
                    spec,
                    predictor.slice(segment.start, segment.end, segment.lengths),
                    out=segment.of(w.weights),
                )
        if history is not None:
            history.advance()  # x_t is in the oldest slot: it becomes the newest

    def _no_update(self, w: BucketWeights, hyperparams: Hyperparams, predictor) -> None:
        """A step without a gradient yet (t ≤ s): only a prediction (wp1/wp2 at t = 1), and x_t =
        x_{t-1}."""
        if predictor is not None:
            assert not predictor.delta_is_step
            self._peek_into(w, hyperparams)(predictor, w.weights)
        if w.history is not None:
            w.history.push(w.real)  # x_t = x_{t-1} joins; the oldest is dropped

    @torch.no_grad()
    def drain_stale(self, bucket: Bucket, t: int, hyperparams: Hyperparams, origin: int) -> None:
        """Apply ``bucket``'s stale gradients still in flight after pipeline step t, oldest first,
        as plain updates (no compensation: its correction assumes a next step that will not
        come); the model then holds the real weights. Used when the pipeline restarts."""
        w = self._weights[bucket.index]
        buffer = self._pipeline.gradients(bucket).buffer
        hyperparams = self.stale_hyperparams(hyperparams, t)
        for j in range(max(t - self._settings.staleness + 1, 1), t + 1):
            grad, skip, _ = self._gradient(bucket, buffer.index(j), origin + j)
            if grad is None:
                continue
            for segment, state in unused.pieces(w, skip):
                self.rule.update(
                    segment.of(w.real),
                    state,
                    hyperparams[segment.group],
                    GradientSpec.plain(segment.of(grad)),
                )
        if w.predicted:
            w.weights.copy_(w.real)  # the parameters are views of weights: re-laid out next


def _state_places(weights: list[BucketWeights]) -> dict[int, tuple[SegmentState, int]]:
    """id(param) -> (its segment's optimizer state, its offset in that segment)."""
    places: dict[int, tuple[SegmentState, int]] = {}
    for w in weights:
        for segment, state in w.segments():
            for p, offset in w.bucket.segment_params(segment):
                places[id(p)] = (state, offset)
    return places


__all__ = ["BucketWeights", "Hyperparams", "Updater", "WeightHistory"]
