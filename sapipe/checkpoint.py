"""Save and resume a sapipe job in one call per rank.

A sapipe checkpoint is per rank: under weight prediction each rank's model holds its own
predicted weights, and each rank keeps its own local gradients. ``path`` may contain
``{rank}``; otherwise ``.rank<r>`` is inserted before the extension when there are
several ranks. Works with ``torchrun --max-restarts``: on restart, construct the model and
optimizer as usual, then resume; :class:`Checkpointer` numbers checkpoints by step,
keeps the last two, and resumes every rank from the same step. A restart with another
number of ranks (``torchrun --nnodes MIN:MAX``) resumes too, from the real weights and the
optimizer state (:meth:`DistributedOptimizer.load_state_dict` says what it does instead of
resuming bit-exactly); with ``{rank}`` in ``path`` the files are named alike at any world
size.
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


def _path(path: str, optimizer: DistributedOptimizer, rank: int | None = None) -> str:
    """The file of ``rank`` (default: this one's) of ``path``."""
    return per_rank_path(path, optimizer.rank if rank is None else rank, optimizer.world_size)


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


def load_checkpoint(
    path: str, model: nn.Module, optimizer: DistributedOptimizer, rank: int | None = None
) -> dict[str, Any]:
    """Restore what :func:`save_checkpoint` wrote for this rank (or for ``rank``: a rank
    that a job of another world size did not have resumes from another rank's checkpoint);
    returns its ``extra``."""
    state = torch.load(_path(path, optimizer, rank), map_location="cpu", weights_only=False)
    # the model first: the optimizer's state then decides what the model holds (the predicted
    # weights, or, resumed at another world size, the weights after the pipeline's restart)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
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
        """Load the newest complete step; ``(step, extra)``, or ``(0, {})`` if there is none.

        A step is complete when every rank of the job that wrote it saved it (its world size
        is read from rank 0's file): a step a rank died before saving is passed over. After
        an elastic restart (another number of ranks), each rank loads its own file of that
        step if the writing job had its rank, else rank 0's (see
        :meth:`DistributedOptimizer.load_state_dict`)."""
        mine = set(self.steps())
        everyone: list[Any] = [None] * self.optimizer.world_size
        dist.all_gather_object(everyone, mine, group=self.optimizer.process_group)
        for step in sorted(everyone[0], reverse=True):  # rank 0 saves every step
            writers = self._writers(step)
            if all(step in steps for steps in everyone[:writers]):
                extra = load_checkpoint(
                    self.path.replace("{step}", str(step)),
                    self.model,
                    self.optimizer,
                    rank=None if self.optimizer.rank < writers else 0,
                )
                extra.pop("sapipe_step", None)
                return step, extra
        return 0, {}

    def _writers(self, step: int) -> int:
        """The world size of the job that saved ``step`` (rank 0's file, memory-mapped)."""
        state = torch.load(
            _path(self.path.replace("{step}", str(step)), self.optimizer, rank=0),
            map_location="cpu",
            weights_only=False,
            mmap=True,
        )
        return int(state["optimizer"]["world_size"])
