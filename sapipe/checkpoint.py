"""Save and resume a sapipe job in one call per rank.

A sapipe checkpoint is per rank: under weight prediction each rank's model holds its own
predicted weights, and each rank keeps its own local gradients. ``path`` may contain
``{rank}``; otherwise ``.rank<r>`` is inserted before the extension when there are
several ranks. Works with ``torchrun --max-restarts``: on restart, construct the model and
optimizer as usual, then ``load_checkpoint`` if the file exists.
"""
from __future__ import annotations

import os
from typing import Any, Dict

import torch
from torch import nn

from .optimizer import DistributedOptimizer, per_rank_path


def _path(path: str, optimizer: DistributedOptimizer) -> str:
    return per_rank_path(path, optimizer._rank, optimizer._world_size)  # noqa: SLF001


def save_checkpoint(path: str, model: nn.Module, optimizer: DistributedOptimizer, **extra: Any) -> str:
    """Write model + optimizer state (and ``extra``, e.g. an LR scheduler's state) atomically.

    Call between ``step()`` and the next forward. Returns the file written.
    """
    target = _path(path, optimizer)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "extra": extra}
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    tmp = target + ".tmp"
    torch.save(state, tmp)
    os.replace(tmp, target)  # a rank killed mid-write never leaves a truncated checkpoint
    return target


def checkpoint_exists(path: str, optimizer: DistributedOptimizer) -> bool:
    return os.path.exists(_path(path, optimizer))


def load_checkpoint(path: str, model: nn.Module, optimizer: DistributedOptimizer) -> Dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote for this rank; returns its ``extra``."""
    state = torch.load(_path(path, optimizer), map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    model.load_state_dict(state["model"])
    return state["extra"]
