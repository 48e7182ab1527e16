"""Process groups sapipe creates for itself, and their release.

Every back-end instance and the control channel get a group of their own over the job's
ranks, so sync traffic, stale traffic and small agreements never queue behind each other.
Kept apart from the back-ends so that any of them (and the engine) can use it without an
import cycle.
"""
from __future__ import annotations

from datetime import timedelta
from typing import Optional

import torch.distributed as dist


# Groups over a strict subset of the world (created with local synchronisation). torch
# names those by hashing their ranks with the number of live groups, so destroying one and
# creating another can reuse a name, and the new group's rendezvous then meets the old
# one's keys in the store and hangs. They are therefore kept until the job ends.
_SUBSET_GROUPS: "set[str]" = set()


def new_group_like(process_group, timeout: Optional[timedelta], backend: Optional[str] = None):
    """A new process group over the same ranks as ``process_group`` (collective), on the
    same back-end unless ``backend`` names another (e.g. ``"gloo"`` for small CPU messages)."""
    ranks = dist.get_process_group_ranks(process_group)
    subset = len(ranks) != dist.get_world_size()
    kwargs = {"ranks": ranks, "backend": backend or dist.get_backend(process_group),
              "use_local_synchronization": subset}
    if timeout is not None:
        kwargs["timeout"] = timeout
    group = dist.new_group(**kwargs)
    if subset:
        _SUBSET_GROUPS.add(group.group_name)
    return group


def release_group(group) -> None:
    """Destroy a group made by :func:`new_group_like` (subset groups are kept, see above).

    A job that ended with ``dist.destroy_process_group()`` has already dropped every group,
    sapipe's included, from torch's registry (the group itself lives on, unregistered, until
    sapipe lets go of it): there is nothing left to destroy then.
    """
    if group.group_name in _SUBSET_GROUPS or not dist.is_initialized():
        return
    try:
        dist.destroy_process_group(group)
    except ValueError:  # "Invalid process group": torch's registry was torn down and rebuilt since
        pass


__all__ = ["new_group_like", "release_group"]
