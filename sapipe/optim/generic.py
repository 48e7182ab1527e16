"""Which update path an optimizer takes, and the generic one (docs/design.md §3.10).

* **fused** (:mod:`sapipe.optim.fused`): the exact classes ``torch.optim.SGD``, ``Adam`` and
  ``AdamW``, when sapipe's kernels reproduce their options and their state exactly;
* **generic** (:class:`TorchStepRule`): every other ``torch.optim.Optimizer`` whose update is
  per parameter. To update a segment, sapipe points each of its parameters at the weights
  the rule updates (real ones under weight prediction) and its ``.grad`` at its slice of
  the gradient the staleness rules call for (g̃ composed by ``ops.compose_gradient``:
  ĝ with delay compensation, a prediction's mix), then runs the optimizer's own
  ``step()`` with one param group: the segment's parameters with the hyper-parameters of
  the step the update belongs to. Its math and its ``state[p]``; OPT_peek runs it on a
  copy of that state. Parameters, gradients and groups are put back afterwards;
* **refused by name** (:data:`REFUSED`, distributed wrappers): optimizers whose step is not
  per parameter or that communicate in ``step()`` themselves. An optimizer found keeping
  state in its param groups (a group-level step counter) is refused at its first update.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import Tensor

from sapipe.errors import UnsupportedOptimizerError
from sapipe.kernels import ops
from sapipe.kernels.gradient_spec import GradientSpec
from sapipe.optim.fused import FUSED_RULES, OptimizerRule, Places, SegmentState

logger = logging.getLogger("sapipe")

#: optimizers whose update sapipe cannot drive one bucket at a time, and why
REFUSED: dict[str, str] = {
    "torch.optim.LBFGS": (
        "its step() needs a closure that re-evaluates the loss, and its line search couples all "
        "parameters; sapipe updates each bucket on its own, at its own time"
    ),
    "torch.optim.SparseAdam": (
        "it takes sparse gradients only; sapipe averages gradients in dense buckets"
    ),
    "FusedLAMB": (
        "its step() scales updates by the gradient norm over all parameters (apex); sapipe "
        "updates each bucket on its own, at its own time"
    ),
    "ElasticAveraging": (
        "sapipe.ElasticAveraging averages models, not gradients (each rank steps on its own "
        "gradient), so there is no gradient all-reduce for stale layers to hide; use one or "
        "the other, each wrapping the plain torch optimizer"
    ),
}
#: modules of optimizers that communicate in step() themselves (ZeroRedundancyOptimizer, Horovod's,
#: ...)
DISTRIBUTED_MODULES = ("torch.distributed", "horovod", "byteps", "deepspeed")


def _qualified(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _refusal(optimizer: torch.optim.Optimizer) -> str | None:
    for cls in type(optimizer).__mro__:
        public = (
            f"torch.optim.{cls.__name__}"
            if cls.__module__.startswith("torch.optim")
            else cls.__name__
        )
        if public in REFUSED:  # a subclass says which refused class it is
            return REFUSED[public] if cls is type(optimizer) else f"a {public}: {REFUSED[public]}"
    module = type(optimizer).__module__
    if any(module == name or module.startswith(name + ".") for name in DISTRIBUTED_MODULES):
        return (
            "it is a distributed optimizer itself (it communicates in step()); "
            "wrap the local optimizer"
        )
    return None


def rule_for(optimizer: torch.optim.Optimizer) -> OptimizerRule:
    """The fused rule when it reproduces ``optimizer`` exactly, else the generic path; or a
    refusal naming why (:class:`UnsupportedOptimizerError`)."""
    name = _qualified(type(optimizer))
    why = _refusal(optimizer)
    if why is not None:
        raise UnsupportedOptimizerError(f"sapipe cannot wrap {name}: {why}")
    if any(group.get("differentiable") for group in optimizer.param_groups):
        raise UnsupportedOptimizerError(
            f"sapipe does not support differentiable=True ({name}): updates are applied outside "
            "autograd"
        )
    for fused in FUSED_RULES:
        if type(optimizer) in fused.classes:
            rule = fused(optimizer)
            why = rule.unsupported()
            if why is None:
                return rule
            logger.info("sapipe: %s takes the generic update path: %s", name, why)
    return TorchStepRule(optimizer)


@dataclass
class ParamState(SegmentState):
    """A segment's state on the generic path: the wrapped optimizer's own ``state[p]`` of each
    of its parameters (``places``: parameter, offset in the segment), kept where it is."""

    places: list[tuple[Tensor, int]] = field(default_factory=list)
    optimizer: torch.optim.Optimizer | None = None

    def state_dict(self) -> dict[str, Any]:
        assert self.optimizer is not None
        table = self.optimizer.state
        return {
            "torch_state": [copy.deepcopy(table[p]) if p in table else None for p, _ in self.places]
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        assert self.optimizer is not None
        if "torch_state" not in saved:
            raise UnsupportedOptimizerError(
                "the checkpoint's optimizer state was kept by the fused "
                "update path; this job takes the generic one"
            )
        step_on_device = _step_on_device(self.optimizer, self.places[0][0])
        table = self.optimizer.state
        for (p, _), kept in zip(self.places, saved["torch_state"]):
            table.pop(p, None)
            if kept is not None:  # tensors where torch.optim's load_state_dict would put them
                table[p] = {
                    k: _placed(v, p, k == "step" and not step_on_device) for k, v in kept.items()
                }

    def move_from(self, old: SegmentState, old_start: int, start: int, numel: int) -> None:
        """Nothing moves on a relayout: the optimizer keys its state by the parameter itself."""

    def part(self, lo: int, hi: int, counters: tuple[int, bool]) -> ParamState:
        """The parameters in [lo, hi) of the segment (a run updated alone: sapipe.runtime.unused);
        ``step()`` keeps each one's own step count."""
        mine = [(p, offset - lo) for p, offset in self.places if lo <= offset < hi]
        return replace(super().part(lo, hi, counters), places=mine)


def _step_on_device(optimizer: torch.optim.Optimizer, param: Tensor) -> bool:
    group = next(g for g in optimizer.param_groups if any(q is param for q in g["params"]))
    return bool(group.get("capturable") or group.get("fused"))


def _placed(value: Any, param: Tensor, keep_device: bool) -> Any:
    if not isinstance(value, Tensor):
        return copy.deepcopy(value)
    return value.clone() if keep_device else value.to(device=param.device, copy=True)


class TorchStepRule(OptimizerRule):
    """OPT and OPT_peek by the wrapped optimizer's own ``step()`` over one segment's parameters."""

    path = "generic"

    def __init__(self, optimizer: torch.optim.Optimizer):
        super().__init__(optimizer)
        self._grad: Tensor | None = None  # the composed gradient; one buffer, grown as needed
        self._first_step = (
            True  # state keyed by no parameter is looked at around the first step() only
        )

    def unsupported(self) -> str | None:
        return None

    def hyperparams(self, group):
        """The whole group but its parameters (tensors copied: schedulers may change them in
        place)."""
        return {
            k: v.clone() if isinstance(v, Tensor) else v for k, v in group.items() if k != "params"
        }

    def new_state(self, like: Tensor, params: Places = ()) -> SegmentState:
        return ParamState(places=list(params), optimizer=self.optimizer)

    def export_state(self, state, params):
        return {}  # it is the optimizer's own state already

    def update(self, weights, state, hp, spec):
        self._step(weights, state, hp, self._composed(spec))
        if spec.hist is not None:
            spec.hist.copy_(weights)

    def peek(self, weights, state, hp, spec, out):
        """OPT_peek: ``step()`` on ``out`` (a copy of the weights) and a copy of the state."""
        grad = self._composed(spec)
        out.copy_(weights)
        assert self.optimizer is not None and isinstance(state, ParamState)
        table = self.optimizer.state
        kept = {p: table.pop(p) for p, _ in state.places if p in table}
        table.update({p: copy.deepcopy(s) for p, s in kept.items()})
        try:
            self._step(out, state, hp, grad)
        finally:
            for p, _ in state.places:
                table.pop(p, None)
            table.update(kept)

    def update_and_peek(self, weights, state, hp, spec, peek, out):
        before = weights.clone() if peek.delta_is_step else None
        self.update(weights, state, hp, spec)
        if before is not None:  # Δ = x_t − x_{t−1}, the step just taken (wp3)
            peek = peek.replace(delta_is_step=False, delta=weights, delta_ref=before)
        self.peek(weights, state, hp, peek, out)

    def _composed(self, spec: GradientSpec) -> Tensor:
        """g̃ of ``spec`` in the work buffer (a copy even when plain: a step() may change its
        .grad)."""
        numel = spec.grad.numel()
        if self._grad is None or self._grad.numel() < numel:
            self._grad = torch.empty_like(spec.grad)
        return ops.compose_gradient(spec.replace(hist=None), self._grad[:numel])

    def _step(
        self, weights: Tensor, state: SegmentState, hp: Mapping[str, Any], grad: Tensor
    ) -> None:
        """The optimizer's ``step()`` over the segment's parameters, viewing ``weights`` and
        ``grad`` meanwhile, with one param group of hyper-parameters ``hp``."""
        optimizer = self.optimizer
        assert optimizer is not None and isinstance(state, ParamState)
        params = [p for p, _ in state.places]
        group = dict(hp, params=params)
        kept = [(p.data, p.grad) for p in params]
        shared = (
            _shared_state(optimizer) if self._first_step else None
        )  # a global count changes every step()
        groups, optimizer.param_groups = optimizer.param_groups, [group]
        try:
            for p, offset in state.places:
                p.data = weights[offset : offset + p.numel()].view_as(p)
                p.grad = grad[offset : offset + p.numel()].view_as(p)
            optimizer.step()
        finally:
            optimizer.param_groups = groups
            for p, (data, grad_before) in zip(params, kept):
                p.data = data
                p.grad = grad_before
        changed = sorted(
            k for k in group if k != "params" and (k not in hp or _changed(hp[k], group[k]))
        )
        where = "in its param group"
        if not changed and shared is not None:
            self._first_step = False
            after = _shared_state(optimizer)
            changed = sorted(
                str(k)
                for k in after.keys() | shared.keys()
                if not _equal(shared.get(k), after.get(k))
            )
            where = "in its state outside any parameter's"
        if changed:
            raise UnsupportedOptimizerError(
                f"sapipe cannot wrap {_qualified(type(optimizer))}: its step() changed {changed} "
                f"{where}. "
                "State kept per param group or per optimizer would advance once per bucket (sapipe "
                "runs step() "
                "over each bucket's parameters), not once per step; only per-parameter state can "
                "be kept"
            )


def _shared_state(optimizer: torch.optim.Optimizer) -> dict[Any, Any]:
    """The entries of ``optimizer.state`` keyed by something other than a parameter (a global
    step count, say), as they stand: copies of tensors, the values otherwise."""
    return {
        k: v.clone() if isinstance(v, Tensor) else copy.copy(v)
        for k, v in optimizer.state.items()
        if not isinstance(k, Tensor)
    }


def _equal(a: Any, b: Any) -> bool:
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.shape == b.shape
            and bool(torch.equal(a, b))
        )
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - not comparable: treat as changed
        return False


def _changed(before: Any, after: Any) -> bool:
    if after is before:
        return False
    if isinstance(before, Tensor) or isinstance(after, Tensor):
        return True
    try:
        return bool(after != before)
    except Exception:  # noqa: BLE001 - not comparable: treat as changed
        return True


__all__ = ["rule_for", "TorchStepRule", "ParamState", "REFUSED", "DISTRIBUTED_MODULES"]
