"""The updates: deferred synchronous ones, stale ones with their compensation, and GradScaler.

* A **sync** bucket's update x_t = OPT(x_{t-1}, g_t) is recorded at ``step()`` with that
  step's hyper-parameters and applied just before the bucket's first layer runs forward
  again (or at ``synchronize()``), so its all-reduce overlaps the rest of backward.
* A **stale** bucket is updated at ``step()`` of pipeline step t with the averaged gradient
  of t − s, compensated (``dc``) or followed by a weight prediction (``wp1``–``wp3``).
* With a GradScaler, whether an iteration's gradients are finite is agreed over all ranks;
  each gradient is unscaled with its own iteration's scale wherever it is consumed, and
  dropped there if it was not finite (docs/design.md §3).
"""

from __future__ import annotations

from typing import Any

import torch

from sapipe.config import Settings
from sapipe.kernels.gradient_spec import GradientSpec
from sapipe.layout.buckets import Bucket, WeightHistory
from sapipe.optim.compensation import Compensation, StaleStep
from sapipe.optim.fused import OptimizerRule
from sapipe.runtime import unused
from sapipe.runtime.exposure import ExposedGradient
from sapipe.runtime.pipeline import GradientPipeline

Hyperparams = list[dict[str, Any]]  # one dict per param group, as the rule reads them


class Updater:
    """Applies every update of the runtime, with the optimizer's own rule and state."""

    def __init__(
        self,
        rule: OptimizerRule,
        compensation: Compensation,
        settings: Settings,
        world_size: int,
        pipeline: GradientPipeline,
    ):
        self.rule = rule
        self.compensation = compensation
        self._settings = settings
        self._world_size = world_size
        self._pipeline = pipeline
        #: iteration -> (gradients finite on every rank, 1 / loss scale); only with a GradScaler
        self.scaling: dict[int, tuple[bool, float]] = {}
        #: with ``p.grad`` exposed: this step's gradients as exposed, by (bucket index, slot)
        self.prepared: dict[tuple[int, int], ExposedGradient] | None = None

    # ------------------------------------------------------------------ GradScaler

    def agree_on_scaling(self, iteration: int, grad_scaler, optimizer, control) -> None:
        """Decide over all ranks whether ``iteration``'s gradients are finite; tell the scaler.

        The scaler's private per-device check is the one it uses itself for optimizers that
        handle scaling: it records whether this rank's ``p.grad`` holds inf/NaN. No public API
        serves: ``GradScaler.step`` hands an optimizer with ``_step_supports_amp_scaling`` the
        decision to make, and the verdict must land in the scaler's own per-optimizer state
        for ``update()`` to read it. tests/unit/test_torch_internals.py fails if torch changes it.
        """
        self._agree(iteration, grad_scaler, grad_scaler._check_inf_per_device(optimizer), control)  # noqa: SLF001

    def _agree(self, iteration: int, grad_scaler, found: dict[Any, torch.Tensor], control) -> bool:
        """Whether the gradients are finite on every rank (``found``: this rank's inf flags per
        device, overwritten with the verdict so every rank's scale evolves alike); recorded."""
        local = max((float(t.item()) for t in found.values()), default=0.0)
        (flag,) = control.agree_on_max([local], "non-finite gradients")
        for tensor in found.values():
            tensor.fill_(flag)  # scaler.update() backs off on every rank or on none
        self.scaling[iteration] = (flag == 0.0, 1.0 / grad_scaler.get_scale())
        self.scaling.pop(iteration - self._settings.staleness - 2, None)
        return flag == 0.0

    def judge_exposed(
        self,
        iteration: int,
        grad_scaler,
        optimizer,
        control,
        prepared: dict[tuple[int, int], ExposedGradient],
    ) -> None:
        """With ``p.grad`` exposed (docs/design.md §3.11): the step is skipped when the gradient it
        applies is not finite, as GradScaler decides for any optimizer. ``p.grad`` is unscaled
        here unless the script did it (``scaler.unscale_(opt)``, e.g. before clipping)."""
        # the scaler's record of this optimizer (its unscale stage, its inf flags per device):
        # private, the state GradScaler.update() reads; no public API exposes it
        # (tests/unit/test_torch_internals.py)
        per_optimizer = grad_scaler._per_optimizer_states[id(optimizer)]  # noqa: SLF001
        if per_optimizer["stage"].name == "READY":
            grad_scaler.unscale_(optimizer)
        found = per_optimizer["found_inf_per_device"]
        if not found:  # no p.grad at all this step (every layer stale while the pipeline fills)
            device = optimizer.param_groups[0]["params"][0].device
            found[device] = torch.zeros((), dtype=torch.float32, device=device)
        if not self._agree(iteration, grad_scaler, found, control):
            for exposed in prepared.values():
                exposed.grad = None  # nothing of this step is applied

    def _gradient(
        self, bucket: Bucket, slot: int, iteration: int
    ) -> tuple[torch.Tensor | None, list[int], float]:
        """(the averaged, unscaled gradient of ``iteration`` in ``slot`` or None, the parameters it
        leaves alone, seconds waited): as ``p.grad`` exposed it, or as it arrives."""
        exposed = (
            self.prepared.pop((bucket.index, slot), None) if self.prepared is not None else None
        )
        if exposed is not None:
            waited = exposed.settle()  # its all-reduce, if nothing read p.grad before
            return exposed.grad, exposed.skip, waited
        mean, waited = self._pipeline.take_mean(bucket, slot, iteration)
        grad = self._unscale(mean, iteration)
        return (
            grad,
            (unused.unused_everywhere(bucket.grads, slot) if grad is not None else []),
            waited,
        )

    def _unscale(self, grad: torch.Tensor, iteration: int) -> torch.Tensor | None:
        """The averaged gradient of ``iteration`` unscaled; None if it was not finite."""
        finite, inverse_scale = self.scaling.get(iteration, (True, 1.0))
        if not finite:
            return None
        return grad if inverse_scale == 1.0 else grad.mul_(inverse_scale)

    # ------------------------------------------------------------------ sync buckets

    @torch.no_grad()
    def apply_deferred(self, bucket: Bucket) -> float:
        """x_t = OPT(x_{t-1}, g_t) for a synchronously-behaving bucket, if one is pending.

        Returns the seconds spent waiting for its all-reduce (a stall, for the profiler).
        """
        pending, bucket.pending_update = bucket.pending_update, None
        if pending is None:
            return 0.0
        hyperparams, iteration = pending
        assert bucket.weights is not None
        grad, skip, waited = self._gradient(bucket, 0, iteration)
        if grad is not None:  # else a step GradScaler skipped
            for segment in unused.pieces(bucket, skip):
                self.rule.update(
                    segment.of(bucket.weights),
                    segment.state,
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
        assert bucket.grads is not None and bucket.weights is not None
        if t == 1:  # the pipeline starts: real weights and history begin at x_0
            bucket.real = bucket.weights.clone() if comp.predicts else bucket.weights
            if comp.history_length:
                bucket.history = WeightHistory(bucket.real, comp.history_length)
        grad, skip = (
            self._gradient(bucket, bucket.grads.index(t - s), iteration - s)[:2]
            if t > s
            else (None, [])
        )
        view = self._stale_view(bucket, grad, iteration)
        hyperparams = self.stale_hyperparams(hyperparams, t)
        # x̃_{t+1} = OPT_peek(x_t, g̃); recipes only describe, so g̃ can be known up front
        predictor = comp.prediction_gradient(view) if comp.predicts else None
        if grad is not None:
            self._real_update(bucket, view, hyperparams, predictor, skip)
        else:
            self._no_update(bucket, hyperparams, predictor)
        if comp.predicts and predictor is None:
            bucket.weights.copy_(bucket.real)  # no prediction: x̃_{t+1} = x_t
        if comp.needs_prev_local:
            bucket.local, bucket.prev_local = bucket.prev_local, bucket.local

    def _stale_view(self, bucket: Bucket, grad: torch.Tensor | None, iteration: int) -> StaleStep:
        """What the compensation sees at this step: ĝ, x, this rank's l_t and l_{t−1}, Δx's
        reference."""
        local, prev_local = bucket.local, bucket.prev_local
        if local is not None and self.scaling:
            finite, inverse_scale = self.scaling.get(iteration, (True, 1.0))
            local = local.mul_(inverse_scale) if self._usable(local, finite) else None
            if prev_local is not None and not self._usable(
                prev_local, self.scaling.get(iteration - 1, (True, 1.0))[0]
            ):
                prev_local = None
        history, settings = bucket.history, self._settings
        return StaleStep(
            g=grad,
            x=bucket.real,
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
        self, bucket: Bucket, view: StaleStep, hyperparams: Hyperparams, predictor, skip: list[int]
    ) -> None:
        """x_t = OPT(x_{t-1}, ĝ) in one pass over memory with what else this step writes: x_t
        into the history's oldest slot (the Δx reference it reads), and the prediction from
        the freshly updated weights and state. The ``skip`` parameters (no rank used them in
        ĝ's iteration) keep x_t = x_{t-1}, their state, and no prediction: x̃_{t+1} = x_t."""
        recipe = self.compensation.real_gradient(view)
        history = bucket.history
        for lo, hi in unused.skipped_ranges(bucket, skip):
            if history is not None:
                history.oldest()[lo:hi].copy_(bucket.real[lo:hi])
            if predictor is not None:
                bucket.weights[lo:hi].copy_(bucket.real[lo:hi])
        for segment in unused.pieces(bucket, skip):
            spec = recipe.slice(segment.start, segment.end, segment.lengths)
            if history is not None:
                spec = spec.with_history(segment.of(history.oldest()))
            if predictor is None:
                self.rule.update(
                    segment.of(bucket.real), segment.state, hyperparams[segment.group], spec
                )
            else:
                self.rule.update_and_peek(
                    segment.of(bucket.real),
                    segment.state,
                    hyperparams[segment.group],
                    spec,
                    predictor.slice(segment.start, segment.end, segment.lengths),
                    out=segment.of(bucket.weights),
                )
        if history is not None:
            history.advance()  # x_t is in the oldest slot: it becomes the newest

    def _no_update(self, bucket: Bucket, hyperparams: Hyperparams, predictor) -> None:
        """A step without a gradient yet (t ≤ s): only a prediction (wp1/wp2 at t = 1), and x_t =
        x_{t-1}."""
        if predictor is not None:
            assert not predictor.delta_is_step
            for segment in unused.pieces(bucket):
                self.rule.peek(
                    segment.of(bucket.real),
                    segment.state,
                    hyperparams[segment.group],
                    predictor.slice(segment.start, segment.end, segment.lengths),
                    out=segment.of(bucket.weights),
                )
        if bucket.history is not None:
            bucket.history.push(bucket.real)  # x_t = x_{t-1} joins; the oldest is dropped

    @torch.no_grad()
    def drain_stale(self, bucket: Bucket, t: int, hyperparams: Hyperparams, origin: int) -> None:
        """Apply ``bucket``'s stale gradients still in flight after pipeline step t, oldest first,
        as plain updates (no compensation: its correction assumes a next step that will not
        come); the model then holds the real weights. Used when the pipeline restarts."""
        assert bucket.grads is not None and bucket.real is not None and bucket.weights is not None
        hyperparams = self.stale_hyperparams(hyperparams, t)
        for j in range(max(t - self._settings.staleness + 1, 1), t + 1):
            grad, skip, _ = self._gradient(bucket, bucket.grads.index(j), origin + j)
            if grad is None:
                continue
            for segment in unused.pieces(bucket, skip):
                self.rule.update(
                    segment.of(bucket.real),
                    segment.state,
                    hyperparams[segment.group],
                    GradientSpec.plain(segment.of(grad)),
                )
        if bucket.real is not bucket.weights:
            bucket.weights.copy_(
                bucket.real
            )  # the parameters are views of weights: re-laid out next


__all__ = ["Updater", "Hyperparams"]
