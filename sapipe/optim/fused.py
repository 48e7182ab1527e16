"""OPT and OPT_peek (docs/design.md §2) as rules on flat segments; the fused ones for
SGD/Adam/AdamW.

sapipe applies updates itself, per bucket, at the moment the staleness rules demand
(deferred to a layer's pre-forward, or with a stale gradient at ``step()``). A rule reads
hyper-parameters from the wrapped optimizer's ``param_groups`` (snapshotted at each
``step()`` so LR schedulers keep working). The fused rules here (:class:`SGDRule`,
:class:`AdamRule`) run sapipe's kernels and keep the state (momentum, moments, step count)
in flat buffers owned by the bucket, taken over from the wrapped optimizer's own
``state[p]`` when it already holds some (state in) and given back as a ``torch.optim``
state (:meth:`OptimizerRule.export_state`, state out). Every other optimizer takes the
generic path (:mod:`sapipe.optim.generic`, which also chooses the path: ``rule_for``).
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from sapipe.errors import UnsupportedOptimizerError
from sapipe.kernels import ops
from sapipe.kernels.gradient_spec import GradientSpec

HyperParams = Mapping[str, Any]


@dataclass
class SegmentState:
    """Optimizer state of one segment (a slice of a bucket sharing one param group)."""

    buffers: dict[str, Tensor] = field(default_factory=dict)
    steps: int = 0  # real updates applied so far (Adam's bias-correction count)
    momentum_started: bool = False  # SGD: the momentum buffer holds data
    scratch: dict[str, Tensor] = field(default_factory=dict)  # reused work space; never saved
    #: offset in the segment -> (steps, momentum_started) of a parameter whose counters differ
    #: from the segment's: updates skipped it, unused (docs/design.md §3.9, sapipe.runtime.unused),
    #: or the state it came with was at another step
    param_counters: dict[int, tuple[int, bool]] = field(default_factory=dict)

    def counters_at(self, offset: int) -> tuple[int, bool]:
        """(steps, momentum_started) of the parameter at ``offset`` in the segment."""
        return self.param_counters.get(offset, (self.steps, self.momentum_started))

    def settle(self, counters: Mapping[int, tuple[int, bool]]) -> None:
        """Keep every parameter's ``counters`` (offset in the segment -> counters): the most
        common become the segment's own, the others its exceptions."""
        if not counters:
            return
        common = collections.Counter(counters.values()).most_common(1)[0][0]
        self.steps, self.momentum_started = common
        self.param_counters = {offset: c for offset, c in counters.items() if c != common}

    def part(self, lo: int, hi: int, counters: tuple[int, bool]) -> SegmentState:
        """The state of the slice [lo, hi) of the segment (whole parameters, all at ``counters``),
        its buffers views of this one's: to update a run of parameters (sapipe.runtime.unused)."""
        return dataclasses.replace(
            self,
            buffers={k: v[lo:hi] for k, v in self.buffers.items()},
            steps=counters[0],
            momentum_started=counters[1],
            scratch={},
            param_counters={},
        )

    def state_dict(self) -> dict[str, Any]:
        """A copy, for a sapipe checkpoint."""
        return {
            "steps": self.steps,
            "momentum_started": self.momentum_started,
            "param_counters": dict(self.param_counters),
            "buffers": {k: v.clone() for k, v in self.buffers.items()},
        }

    def load_state_dict(self, saved: Mapping[str, Any]) -> None:
        if "buffers" not in saved:
            raise UnsupportedOptimizerError(
                "the checkpoint's optimizer state was kept by the "
                "generic update path; this job takes the fused one"
            )
        self.steps, self.momentum_started = saved["steps"], saved["momentum_started"]
        self.param_counters = dict(saved.get("param_counters", {}))
        for name, buffer in self.buffers.items():
            buffer.copy_(saved["buffers"][name])

    def move_from(self, old: SegmentState, old_start: int, start: int, numel: int) -> None:
        """One parameter's state, at ``old_start`` in ``old``, moves to ``start`` here
        (relayout)."""
        self.steps, self.momentum_started = self.param_counters[start] = old.counters_at(
            old_start
        )  # settled at the next update
        for name, buffer in self.buffers.items():
            buffer[start : start + numel].copy_(old.buffers[name][old_start : old_start + numel])


#: the parameters of one segment with their offsets in it
Places = Sequence[tuple[Tensor, int]]


class OptimizerRule:
    """The update arithmetic of one optimizer family."""

    #: torch.optim classes this rule reproduces exactly.
    classes: tuple[type[torch.optim.Optimizer], ...] = ()
    #: names of the flat state buffers a segment needs (also the keys of ``torch.optim``'s state).
    buffer_names: tuple[str, ...] = ()
    #: "fused" (sapipe's kernels) or "generic" (the optimizer's own ``step()``)
    path = "fused"

    def __init__(self, optimizer: torch.optim.Optimizer | None = None):
        self.optimizer = optimizer  # the wrapped optimizer: its groups, and its state to take over

    def unsupported(self) -> str | None:
        """Why this rule cannot reproduce the wrapped optimizer exactly (an option it has no
        kernel for), or None. State at any steps is fine: each parameter keeps its counters."""
        assert self.optimizer is not None
        for group in self.optimizer.param_groups:
            option = next((name for name in self._unsupported_options if group.get(name)), None)
            if option is not None:
                return f"{option}=True has no fused rule"
        return None

    #: options of the optimizer the fused kernels do not implement
    _unsupported_options: tuple[str, ...] = ()

    def _counters(self, torch_state: Mapping[str, Any]) -> tuple[int, bool] | None:
        """(steps, momentum_started) of one parameter's ``torch.optim`` state; None: no state."""
        raise NotImplementedError

    def _torch_counters(self, state: SegmentState) -> dict[str, Any] | None:
        """The non-buffer entries of one parameter's ``torch.optim`` state (fresh objects), or
        None while the segment has taken no step ``torch.optim`` would keep state for."""
        raise NotImplementedError

    def hyperparams(self, group: Mapping[str, Any]) -> dict[str, Any]:
        """The numbers this rule needs from one param group, copied at ``step()`` time."""
        raise NotImplementedError

    def new_state(self, like: Tensor, params: Places = ()) -> SegmentState:
        """A segment's state: zeros, or (state in) the wrapped optimizer's own state of its
        ``params``, which moves here: it leaves ``optimizer.state``."""
        state = SegmentState({name: torch.zeros_like(like) for name in self.buffer_names})
        if self.optimizer is None or not params:
            return state
        counters = {}
        for p, offset in params:
            torch_state = self.optimizer.state.get(p) or {}
            taken = self._counters(torch_state)
            if taken is not None:
                for name, buffer in state.buffers.items():
                    buffer[offset : offset + p.numel()].copy_(torch_state[name].reshape(-1))
                del self.optimizer.state[p]
            counters[offset] = taken or (0, False)
        state.settle(counters)
        return state

    def export_state(self, state: SegmentState, params: Places) -> dict[Tensor, dict[str, Any]]:
        """State out: each parameter's ``torch.optim`` state (copies), as the wrapped optimizer
        would hold it after the same updates; none for a parameter before its first (each at its
        own step count: updates skip unused parameters, docs/design.md §3.9)."""
        exported = {}
        for p, offset in params:
            mine = state.part(offset, offset + p.numel(), state.counters_at(offset))
            counters = self._torch_counters(mine)
            if counters is not None:
                exported[p] = dict(
                    counters, **{name: b.view_as(p).clone() for name, b in mine.buffers.items()}
                )
        return exported

    def update(
        self, weights: Tensor, state: SegmentState, hp: HyperParams, spec: GradientSpec
    ) -> None:
        """OPT: apply one step of the gradient ``spec`` (evaluated inside the fused kernel;
        x_t also written to ``spec.hist`` when set) in place to ``weights`` and ``state``."""
        self._update(weights, state, hp, spec)

    def peek(
        self, weights: Tensor, state: SegmentState, hp: HyperParams, spec: GradientSpec, out: Tensor
    ) -> None:
        """OPT_peek: write the weights OPT would produce to ``out``; change nothing else."""
        raise NotImplementedError

    def update_and_peek(
        self,
        weights: Tensor,
        state: SegmentState,
        hp: HyperParams,
        spec: GradientSpec,
        peek: GradientSpec,
        out: Tensor,
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
        self,
        weights: Tensor,
        state: SegmentState,
        hp: HyperParams,
        spec: GradientSpec,
        peek: GradientSpec | None = None,
        out: Tensor | None = None,
    ) -> None:
        """OPT in place, with the state's bookkeeping; a ``peek`` (and its ``out``) rides along."""
        raise NotImplementedError


class SGDRule(OptimizerRule):
    classes = (torch.optim.SGD,)
    buffer_names = ("momentum_buffer",)

    def _counters(self, torch_state):
        return (0, True) if torch_state.get("momentum_buffer") is not None else None

    def _torch_counters(self, state):
        return {} if state.momentum_started else None

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
    _unsupported_options = ("amsgrad",)

    def _counters(self, torch_state):
        steps = int(torch_state.get("step", 0))
        return (steps, False) if steps else None

    def _torch_counters(self, state):
        if state.steps == 0:
            return None
        # torch.optim's scalar dtype for "step" (load_state_dict moves it where fused/capturable
        # want it)
        dtype = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        return {"step": torch.tensor(float(state.steps), dtype=dtype)}

    def hyperparams(self, group):
        beta1, beta2 = group["betas"]
        return {
            "lr": float(group["lr"]),
            "beta1": float(beta1),
            "beta2": float(beta2),
            "eps": group["eps"],
            "weight_decay": group["weight_decay"],
            # torch < 2.7's AdamW groups have no such key: the class says it then
            "decoupled": bool(
                group.get("decoupled_weight_decay", isinstance(self.optimizer, torch.optim.AdamW))
            ),
            "maximize": bool(group.get("maximize", False)),
        }

    def _run(self, weights, state, hp, spec, step, peek=None, out=None):
        hyper = ops.AdamHyperParams(step=step, **hp)
        ops.adam_fused(
            weights,
            state.buffers["exp_avg"],
            state.buffers["exp_avg_sq"],
            hyper,
            spec,
            peek=peek,
            out=out,
        )

    def _update(self, weights, state, hp, spec, peek=None, out=None):
        state.steps += 1
        self._run(weights, state, hp, spec, state.steps, peek, out)

    def peek(self, weights, state, hp, spec, out):
        self._run(weights, state, hp, spec, state.steps + 1, out=out)


#: the fused rules; each takes only the exact classes it names (a subclass may change step())
FUSED_RULES = (SGDRule, AdamRule)
