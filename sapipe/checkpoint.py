"""Save and resume a sapipe job in one call per rank.

A sapipe checkpoint is per rank: under weight prediction each rank's model holds its own
predicted weights, and each rank keeps its own local gradients. ``path`` may contain
``{rank}``; otherwise ``.rank<r>`` is inserted before the extension when there are
several ranks. Works with ``torchrun --max-restarts``: on restart, construct the model and
optimizer as usual, then resume; :class:`Checkpointer` numbers checkpoints by step,
keeps the last two, and resumes every rank from the same step.
"""

from __future__ import annotations

import os
import re
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sapipe.errors import ConfigurationError
from sapipe.optimizer import DistributedOptimizer
from sapipe.tracing.timeline import per_rank_path


def _path(path: str, optimizer: DistributedOptimizer) -> str:
    return per_rank_path(path, optimizer.rank, optimizer.world_size)


def save_checkpoint(
    path: str, model: nn.Module, optimizer: DistributedOptimizer, **extra: Any
) -> str:
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
    """Whether :func:`save_checkpoint` wrote this rank's file of ``path`` (each rank has its
    own)."""
    return os.path.exists(_path(path, optimizer))


def load_checkpoint(path: str, model: nn.Module, optimizer: DistributedOptimizer) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote for this rank; returns its ``extra``."""
    state = torch.load(_path(path, optimizer), map_location="cpu", weights_only=False)
    optimizer.load_state_dict(state["optimizer"])
    model.load_state_dict(state["model"])
    return state["extra"]


class Checkpointer:
    """Numbered checkpoints of a job, the newest ``keep`` kept, and resumption after a restart.

    ``path`` contains ``{step}`` (and optionally ``{rank}``, see :func:`save_checkpoint`)::

        ckpt = sapipe.Checkpointer("ckpt/step{step}.pt", model, opt)
        start, extra = ckpt.resume()  # 0, {} on a fresh start
        for step in range(start + 1, steps + 1):
            ...; opt.step()
            if step % 100 == 0:
                ckpt.save(step, scheduler=sched.state_dict())

    Why ``keep=2`` and an agreement in :meth:`resume`: a rank can die after a peer has
    saved step t but before saving it itself. Ranks resuming from different steps would
    hang or silently diverge, so ``resume`` (collective: every rank calls it) loads the
    newest step that *every* rank has, and keeping two steps guarantees one exists.
    """

    def __init__(self, path: str, model: nn.Module, optimizer: DistributedOptimizer, keep: int = 2):
        if "{step}" not in path:
            raise ConfigurationError(f"Checkpointer path must contain {{step}}; got {path!r}")
        if not isinstance(keep, int) or isinstance(keep, bool) or keep < 2:
            raise ConfigurationError(
                f"Checkpointer keep must be an int >= 2 (see its docstring); got {keep!r}"
            )
        self.path, self.model, self.optimizer, self.keep = path, model, optimizer, keep

    def file(self, step: int) -> str:
        """This rank's file for ``step``."""
        return _path(self.path.replace("{step}", str(step)), self.optimizer)

    def steps(self) -> list[int]:
        """Steps this rank has a checkpoint of, oldest first."""
        pattern = _path(self.path, self.optimizer)
        directory = os.path.dirname(os.path.abspath(pattern))
        before, after = os.path.basename(pattern).split("{step}", 1)
        name = re.compile(re.escape(before) + r"(\d+)" + re.escape(after) + r"\Z")
        found = [
            int(m.group(1))
            for f in (os.listdir(directory) if os.path.isdir(directory) else [])
            if (m := name.match(f))
        ]
        return sorted(found)

    def save(self, step: int, **extra: Any) -> str:
        """Save ``step`` (call between ``step()`` and the next forward); drop the oldest beyond
        ``keep``."""
        written = save_checkpoint(
            self.path.replace("{step}", str(step)),
            self.model,
            self.optimizer,
            sapipe_step=step,
            **extra,
        )
        for old in self.steps()[: -self.keep]:
            os.remove(self.file(old))
        return written

    def resume(self) -> tuple[int, dict[str, Any]]:
        """Load the newest step every rank has; ``(step, extra)``, or ``(0, {})`` if there is
        none."""
        mine = set(self.steps())
        everyone: list[Any] = [None] * self.optimizer.world_size
        dist.all_gather_object(everyone, mine, group=self.optimizer.process_group)
        common = set.intersection(*everyone)
        if not common:
            return 0, {}
        step = max(common)
        extra = load_checkpoint(self.path.replace("{step}", str(step)), self.model, self.optimizer)
        extra.pop("sapipe_step", None)
        return step, extra
