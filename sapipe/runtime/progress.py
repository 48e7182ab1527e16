"""Where the training loop stands, for the hooks that run inside it."""

from __future__ import annotations


class Progress:
    """The ``step()`` calls completed and whether the loop is inside ``no_sync()``.

    Written only by :class:`sapipe.DistributedOptimizer`; read by the forward hooks (which
    iteration a forward belongs to) and the buffer broadcast (DDP broadcasts none inside
    ``no_sync()``).
    """

    def __init__(self) -> None:
        self.completed = 0  # step() calls that ran (restored from a checkpoint)
        self.accumulating = False  # inside no_sync()

    @property
    def next_iteration(self) -> int:
        """The iteration the current forward and backward belong to."""
        return self.completed + 1


__all__ = ["Progress"]
