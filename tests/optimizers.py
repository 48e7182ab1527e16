"""Optimizers written in the tests, for sapipe's generic update path (docs/design.md §3.10).

Plain ``torch.optim.Optimizer`` subclasses; nothing here imports sapipe.

* ``Lion`` — EvoLved Sign Momentum (Chen et al., 2023), per-parameter state ``exp_avg``.
* ``GroupStepAdam`` — keeps its step count in the param group, as some third-party
  optimizers do: not per parameter, so sapipe must refuse it.
* ``GENERIC`` — name -> factory of the optimizers the tests drive through the generic path.
"""

from __future__ import annotations

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
