"""The suite's optimizers: one factory, and the optimizers written in the tests.

Plain ``torch.optim.Optimizer`` subclasses; nothing here imports sapipe.

* ``make_optimizer(kind, params, **hyper)`` — the one factory every test builds its
  optimizers with; ``recipe(kind, **hyper)`` — the same as a factory of ``params`` alone
  (what ``reference.run_reference`` takes), a test's hyper-parameters bound.
* ``Lion`` — EvoLved Sign Momentum (Chen et al., 2023), per-parameter state ``exp_avg``.
* ``GroupStepAdam`` — keeps its step count in the param group, as some third-party
  optimizers do: not per parameter, so sapipe must refuse it.
* ``GENERIC`` — name -> factory of the optimizers the tests drive through the generic path
  (docs/design.md §3.10), each with its own hyper-parameters.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch


class Lion(torch.optim.Optimizer):
    """x ← x·(1 − lr·wd) − lr·sign(β1·m + (1 − β1)·g);  m ← β2·m + (1 − β2)·g."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p)
                m = state["exp_avg"]
                p.mul_(1 - group["lr"] * group["weight_decay"])
                p.add_(torch.sign(m * beta1 + p.grad * (1 - beta1)), alpha=-group["lr"])
                m.mul_(beta2).add_(p.grad, alpha=1 - beta2)


class GroupStepAdam(torch.optim.Adam):
    """Adam that also counts steps in its param group (group-level state)."""

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            group["group_step"] = group.get("group_step", 0) + 1
        return super().step(closure)


class GlobalStepRMSprop(torch.optim.RMSprop):
    """RMSprop that also counts steps in its state under a key that is no parameter."""

    @torch.no_grad()
    def step(self, closure=None):
        self.state["global_step"] = self.state.get("global_step", 0) + 1
        return super().step(closure)


class SGDSubclass(torch.optim.SGD):
    """A subclass of a fused-path class: its own step() must run (here, the same math)."""


GENERIC = {
    "rmsprop": lambda params, lr=0.01: torch.optim.RMSprop(
        params, lr=lr, alpha=0.9, momentum=0.5, centered=True, weight_decay=1e-3
    ),
    "adagrad": lambda params, lr=0.05: torch.optim.Adagrad(
        params, lr=lr, lr_decay=1e-3, weight_decay=1e-3, initial_accumulator_value=0.1
    ),
    "nadam": lambda params, lr=0.01: torch.optim.NAdam(params, lr=lr, weight_decay=1e-3),
    "radam": lambda params, lr=0.01: torch.optim.RAdam(params, lr=lr, weight_decay=1e-3),
    "adamax": lambda params, lr=0.01: torch.optim.Adamax(params, lr=lr, weight_decay=1e-3),
    "adam-amsgrad": lambda params, lr=0.01: torch.optim.Adam(
        params, lr=lr, amsgrad=True, weight_decay=1e-3
    ),
    "adadelta": lambda params, lr=1.0: torch.optim.Adadelta(params, lr=lr, weight_decay=1e-3),
    "asgd": lambda params, lr=0.05: torch.optim.ASGD(params, lr=lr, t0=3, weight_decay=1e-3),
    "rprop": lambda params, lr=0.01: torch.optim.Rprop(params, lr=lr),
    "adafactor": lambda params, lr=0.01: torch.optim.Adafactor(params, lr=lr, weight_decay=1e-3),
    "lion": lambda params, lr=0.002: Lion(params, lr=lr, weight_decay=0.1),
    "sgd-subclass": lambda params, lr=0.1: SGDSubclass(
        params, lr=lr, momentum=0.9, weight_decay=1e-3
    ),
}


#: the fused path's kinds (and one RMSprop): kind -> (class, the hyper-parameters it implies)
KINDS = {
    "sgd": (torch.optim.SGD, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9}),
    "sgd-nesterov": (torch.optim.SGD, {"momentum": 0.9, "nesterov": True}),
    "adam": (torch.optim.Adam, {}),
    "adamw": (torch.optim.AdamW, {}),
    "rmsprop-momentum": (torch.optim.RMSprop, {"momentum": 0.5}),
}
assert not set(KINDS) & set(GENERIC), "a kind names one optimizer"


def make_optimizer(kind: str, params, *, decay_matrices_only: bool = False, **hyper):
    """The optimizer ``kind`` over ``params``, with the hyper-parameters ``hyper``.

    ``kind``: one of ``KINDS`` — "sgd" (plain), "sgd-momentum" (momentum 0.9),
    "sgd-nesterov" (momentum 0.9, Nesterov), "adam", "adamw", "rmsprop-momentum" (momentum
    0.5) — that torch class with what the kind implies, updated by ``hyper`` (``lr`` and the
    rest, as the test states them; torch's defaults otherwise); or one of ``GENERIC``, that
    optimizer with its own hyper-parameters (``hyper`` may give ``lr`` only).

    ``decay_matrices_only``: two param groups (the empty one left out), weight decay on the
    matrices (``ndim > 1``) only: the other group has ``weight_decay=0``.
    """
    if decay_matrices_only:
        params = list(params)
        params = [
            group
            for group in (
                {"params": [p for p in params if p.ndim > 1]},
                {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
            )
            if group["params"]
        ]
    if kind in GENERIC:
        return GENERIC[kind](params, **hyper)
    try:
        cls, implied = KINDS[kind]
    except KeyError:
        raise ValueError(f"unknown optimizer kind {kind!r}") from None
    return cls(params, **{**implied, **hyper})


def recipe(kind: str, **hyper) -> Callable:
    """``params -> make_optimizer(kind, params, **hyper)``."""
    return functools.partial(make_optimizer, kind, **hyper)
