"""GradScaler under sapipe: whether an iteration's gradients are finite, agreed over all ranks.

An iteration's verdict decides its step on every rank alike (``scaler.update()`` backs off on
every rank or on none), and each of its gradients is unscaled with its own loss scale
wherever it is consumed: a stale one ``staleness`` steps later (docs/design.md §3.8).
"""

from __future__ import annotations

from typing import Any

import torch

from sapipe.runtime.exposure import ExposedGradient


class LossScaling:
    """The verdicts of the recent iterations' GradScaler steps; written only here."""

    def __init__(self, staleness: int):
        self._staleness = staleness
        #: iteration -> (gradients finite on every rank, 1 / loss scale); only with a GradScaler
        self.verdicts: dict[int, tuple[bool, float]] = {}

    def of(self, iteration: int) -> tuple[bool, float]:
        """(finite, 1 / loss scale) of ``iteration``'s step; (True, 1.0) without a verdict."""
        return self.verdicts.get(iteration, (True, 1.0))

    def state_dict(self) -> dict[int, tuple[bool, float]]:
        return dict(self.verdicts)

    def load_state_dict(self, state: dict[int, tuple[bool, float]]) -> None:
        self.verdicts = dict(state)

    def agree_on_scaling(self, iteration: int, grad_scaler, optimizer, control) -> None:
        """Decide over all ranks whether ``iteration``'s gradients are finite; tell the scaler.

        The scaler's private per-device check is the one it uses itself for optimizers that
        handle scaling: it records whether this rank's ``p.grad`` holds inf/NaN. No public API
        serves: ``GradScaler.step`` hands an optimizer with ``_step_supports_amp_scaling`` the
        decision to make, and the verdict must land in the scaler's own per-optimizer state
        for ``update()`` to read it. tests/unit/test_torch_internals.py fails if torch changes it.
        """
        found = grad_scaler._check_inf_per_device(optimizer)  # noqa: SLF001
        self._agree(iteration, grad_scaler, found, control)

    def _agree(self, iteration: int, grad_scaler, found: dict[Any, torch.Tensor], control) -> bool:
        """Whether the gradients are finite on every rank (``found``: this rank's inf flags per
        device, overwritten with the verdict so every rank's scale evolves alike); recorded."""
        local = max((float(t.item()) for t in found.values()), default=0.0)
        (flag,) = control.agree_on_max([local], "non-finite gradients")
        for tensor in found.values():
            tensor.fill_(flag)  # scaler.update() backs off on every rank or on none
        self.verdicts[iteration] = (flag == 0.0, 1.0 / grad_scaler.get_scale())
        self.verdicts.pop(iteration - self._staleness - 2, None)
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


__all__ = ["LossScaling"]
