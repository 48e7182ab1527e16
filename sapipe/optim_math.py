"""OPT and OPT_peek (docs/design.md §2) for the optimizers sapipe supports, on flat buffers.

sapipe applies updates itself, per bucket, at the moment the staleness rules demand
(deferred to a layer's pre-forward, or with a stale gradient at ``step()``), so it needs
the optimizer's arithmetic as a function rather than ``optimizer.step()``. A rule reads
hyper-parameters from the wrapped optimizer's ``param_groups`` (snapshotted at each
``step()`` so LR schedulers keep working) and keeps its state (momentum, moments, step
count) in flat buffers owned by the bucket.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple, Type

import torch
from torch import Tensor

from . import ops
from .errors import UnsupportedOptimizerError
from .gradient_spec import GradientSpec

HyperParams = Mapping[str, Any]


@dataclass
class SegmentState:
    """Optimizer state of one segment (a slice of a bucket sharing one param group)."""

    buffers: Dict[str, Tensor] = field(default_factory=dict)
    steps: int = 0  # real updates applied so far (Adam's bias-correction count)
    momentum_started: bool = False  # SGD: the momentum buffer holds data
    scratch: Dict[str, Tensor] = field(default_factory=dict)  # reused work space; never saved


class OptimizerRule:
    """The update arithmetic of one optimizer family."""

    #: torch.optim classes this rule reproduces exactly.
    classes: Tuple[Type[torch.optim.Optimizer], ...] = ()
    #: names of the flat state buffers a segment needs.
    buffer_names: Tuple[str, ...] = ()

    def check_group(self, group: Mapping[str, Any]) -> None:
        """Raise UnsupportedOptimizerError for options this rule cannot reproduce."""

    def hyperparams(self, group: Mapping[str, Any]) -> Dict[str, Any]:
        """The numbers this rule needs from one param group, copied at ``step()`` time."""
        raise NotImplementedError

    def new_state(self, like: Tensor) -> SegmentState:
        return SegmentState({name: torch.zeros_like(like) for name in self.buffer_names})

    def update(self, weights: Tensor, state: SegmentState, hp: HyperParams, spec: GradientSpec) -> None:
        """OPT: apply one step of the gradient ``spec`` (evaluated inside the fused kernel;
        x_t also written to ``spec.hist`` when set) in place to ``weights`` and ``state``."""
        self._update(weights, state, hp, spec)

    def peek(self, weights: Tensor, state: SegmentState, hp: HyperParams, spec: GradientSpec, out: Tensor) -> None:
        """OPT_peek: write the weights OPT would produce to ``out``; change nothing else."""
        raise NotImplementedError

    def update_and_peek(
        self, weights: Tensor, state: SegmentState, hp: HyperParams, spec: GradientSpec,
        peek: GradientSpec, out: Tensor,
    ) -> None:
        """OPT, then OPT_peek of ``peek`` from the updated weights and state into ``out`` (weight
        prediction).

        Both run in the update's single pass over memory (``peek=`` of the ops' fused entry
        points): the prediction costs one extra read per term of its gradient and the write of
        ``out``, not a second pass over the weights and state. ``peek.delta_is_step``: DC with
        Δ = x_t − x_{t−1}, the step this very update takes (wp3), so no weight history is read.
        The outer DC form's coefficient needs the whole step's dot products first: then the
        update also sums them (into ``peek.dots``) and a second call peeks given them.
        """
        if peek.delta is not None:  # an explicit Δ: two calls
            self.update(weights, state, hp, spec)
            self.peek(weights, state, hp, peek, out)
        elif peek.delta_is_step and peek.form == "outer":
            dots = state.scratch.get("step_dots")
            if dots is None or dots.numel() != len(peek.lengths):  # allocated once per segment
                dots = torch.empty(len(peek.lengths), dtype=torch.float64, device=weights.device)
                state.scratch["step_dots"] = dots
            self._update(weights, state, hp, spec, peek.with_dots(dots))
            self.peek(weights, state, hp, peek.replace(delta_is_step=False, dots=dots), out)
        else:
            self._update(weights, state, hp, spec, peek, out)

    def _update(
        self, weights: Tensor, state: SegmentState, hp: HyperParams, spec: GradientSpec,
        peek: Optional[GradientSpec] = None, out: Optional[Tensor] = None,
    ) -> None:
        """OPT in place, with the state's bookkeeping; a ``peek`` (and its ``out``) rides along."""
        raise NotImplementedError


def _reject(group: Mapping[str, Any], option: str, why: str) -> None:
    if group.get(option):
        raise UnsupportedOptimizerError(f"sapipe does not support {option}=True: {why}")


class SGDRule(OptimizerRule):
    classes = (torch.optim.SGD,)
    buffer_names = ("momentum_buffer",)

    def check_group(self, group):
        _reject(group, "differentiable", "updates are applied outside autograd")

    def hyperparams(self, group):
        hp = {k: group[k] for k in ("momentum", "dampening", "nesterov", "weight_decay")}
        hp.update(lr=float(group["lr"]), maximize=bool(group.get("maximize", False)))
        return hp

    def _run(self, weights, state, hp, spec, peek=None, out=None):
        hyper = ops.SGDHyperParams(**hp, first=not state.momentum_started)
        ops.sgd_fused(weights, state.buffers["momentum_buffer"], hyper, spec, peek=peek, out=out)

    def _update(self, weights, state, hp, spec, peek=None, out=None):
        self._run(weights, state, hp, spec, peek, out)
        # torch seeds the momentum buffer with the first gradient seen while momentum != 0.
        state.momentum_started = state.momentum_started or hp["momentum"] != 0
        state.steps += 1

    def peek(self, weights, state, hp, spec, out):
        self._run(weights, state, hp, spec, out=out)


class AdamRule(OptimizerRule):
    classes = (torch.optim.Adam, torch.optim.AdamW)
    buffer_names = ("exp_avg", "exp_avg_sq")

    def check_group(self, group):
        _reject(group, "amsgrad", "only Adam/AdamW without amsgrad have a staleness-aware rule")
        _reject(group, "differentiable", "updates are applied outside autograd")

    def hyperparams(self, group):
        beta1, beta2 = group["betas"]
        return {
            "lr": float(group["lr"]), "beta1": float(beta1), "beta2": float(beta2),
            "eps": group["eps"], "weight_decay": group["weight_decay"],
            "decoupled": bool(group.get("decoupled_weight_decay", False)),
            "maximize": bool(group.get("maximize", False)),
        }

    def _run(self, weights, state, hp, spec, step, peek=None, out=None):
        hyper = ops.AdamHyperParams(step=step, **hp)
        ops.adam_fused(
            weights, state.buffers["exp_avg"], state.buffers["exp_avg_sq"], hyper, spec, peek=peek, out=out
        )

    def _update(self, weights, state, hp, spec, peek=None, out=None):
        state.steps += 1
        self._run(weights, state, hp, spec, state.steps, peek, out)

    def peek(self, weights, state, hp, spec, out):
        self._run(weights, state, hp, spec, state.steps + 1, out=out)


_RULES: List[OptimizerRule] = [SGDRule(), AdamRule()]
SUPPORTED = "torch.optim.SGD, torch.optim.Adam (amsgrad=False), torch.optim.AdamW (amsgrad=False)"


def rule_for(optimizer: torch.optim.Optimizer) -> OptimizerRule:
    """The rule that reproduces ``optimizer`` exactly, or a clear refusal.

    Only the exact classes are accepted (not subclasses): a subclass may change ``step()``
    in ways sapipe cannot see, which would be silent wrong math.
    """
    for rule in _RULES:
        if type(optimizer) in rule.classes:
            for group in optimizer.param_groups:
                rule.check_group(group)
            return rule
    raise UnsupportedOptimizerError(
        f"sapipe cannot wrap {type(optimizer).__module__}.{type(optimizer).__qualname__}: "
        f"staleness-aware updates are implemented for {SUPPORTED}."
    )
