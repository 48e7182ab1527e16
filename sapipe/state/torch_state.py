"""State in and out: the wrapped optimizer's plain ``torch.optim`` state dict (docs/design.md
§3.10).

*In.* A wrapped optimizer that already holds state (trained before, or given a DDP job's
``optimizer.state_dict()``: its own ``load_state_dict`` before wrapping, or sapipe's
:meth:`~sapipe.DistributedOptimizer.load_state_dict` after) continues from it: the fused rules take
each parameter's state into their flat segments at the first
``step()`` (it leaves ``optimizer.state``); the generic path uses it where it is.

*Out.* :func:`export` is the wrapped optimizer's own ``state_dict()`` with every
parameter's state as it stands after the updates applied so far (the real weights'): what
the same optimizer would hold under DDP, loadable into it there.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from typing import Any

import torch

from sapipe.errors import UsageError
from sapipe.optim.fused import OptimizerRule
from sapipe.optim.generic import rule_for


def export(optimizer: torch.optim.Optimizer, fused: Mapping[Any, dict]) -> dict[str, Any]:
    """``optimizer.state_dict()`` with ``fused``, the state the fused segments hold, put back per
    parameter."""
    table = defaultdict(dict, optimizer.state)  # the generic path's, and untrained parameters'
    table.update(fused)
    live, optimizer.state = optimizer.state, table
    try:
        return optimizer.state_dict()
    finally:
        optimizer.state = live


def load(
    optimizer: torch.optim.Optimizer, state_dict: dict[str, Any], stepped: bool
) -> OptimizerRule:
    """``optimizer.load_state_dict(state_dict)`` into the wrapped optimizer before the first
    ``step()``, keeping the param-group dicts that sapipe and LR schedulers share; returns the
    rule for the loaded optimizer (its options decide it; state at any steps stays fused)."""
    if stepped:
        raise UsageError(
            "load a torch.optim state dict before the first step() (or into the optimizer before "
            "wrapping it); to resume a sapipe job mid-training, load its own state_dict()"
        )
    groups = optimizer.param_groups
    optimizer.load_state_dict(state_dict)  # checks the groups' sizes, casts to the parameters
    for mine, loaded in zip(groups, optimizer.param_groups):
        mine.update({k: v for k, v in loaded.items() if k != "params"})
    optimizer.param_groups = groups
    return rule_for(optimizer)


__all__ = ["export", "load"]
