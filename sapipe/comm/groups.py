"""Process groups sapipe creates for itself, and their release.

Every back-end instance and the control channel get a group of their own over the job's
ranks, so sync traffic, stale traffic and small agreements never queue behind each other.
Kept apart from the back-ends so that any of them (and the engine) can use it without an
import cycle.

**Release destroys the group now, not at interpreter exit** (docs/design.md §5.4). A Gloo
group's worker threads hold each work they ran (and through it the work's tensors and any
Python callback on its future) a little after the work completes, and may so hold the
*last* reference to a tensor whose Python object the caller has already dropped (torch
then keeps that object alive with the tensor, and frees it when the tensor goes). Freeing
it takes the GIL; a thread that asks for the GIL once the interpreter has begun finalising
is ended by ``pthread_exit``, whose unwinding through a ``noexcept`` C++ frame calls
``std::terminate``: SIGABRT, "terminate called without an active exception". Unregistering
a group (``dist.destroy_process_group(group)``) does not stop its threads: the C++ group,
and its threads, live as long as a Python reference to it does. Before this module let go
of them, sapipe's back-ends and control channel kept their groups until the optimizer was
garbage-collected, typically during finalisation, when the group's destructor joined
workers that might still have had such a release to do. :func:`release_group` therefore
takes the owner's reference away and drops it, so the group is destroyed inside
``close()`` (which the ``atexit`` handler calls at the latest, before finalisation): torch
releases the GIL while the C++ destructor joins the worker threads, so a worker that still
needs the GIL gets it, and no sapipe group's thread is left to ask for it later. Callers
wait for their work first (``close()`` does), so the join does not wait on a collective.
"""

from __future__ import annotations

from datetime import timedelta

import torch.distributed as dist

# Groups over a strict subset of the world (created with local synchronisation). torch
# names those by hashing their ranks with the number of live groups, so destroying one and
# creating another can reuse a name, and the new group's rendezvous then meets the old
# one's keys in the store and hangs. They are therefore kept (registered with torch) until
# the job ends: its ``dist.destroy_process_group()`` destroys them.
_SUBSET_GROUPS: set[str] = set()


def new_group_like(process_group, timeout: timedelta | None, backend: str | None = None):
    """A new process group over the same ranks as ``process_group`` (collective), on the
    same back-end unless ``backend`` names another (e.g. ``"gloo"`` for small CPU messages)."""
    ranks = dist.get_process_group_ranks(process_group)
    subset = len(ranks) != dist.get_world_size()
    kwargs = {
        "ranks": ranks,
        "backend": backend or dist.get_backend(process_group),
        "use_local_synchronization": subset,
    }
    if timeout is not None:
        kwargs["timeout"] = timeout
    group = dist.new_group(**kwargs)
    if subset:
        _SUBSET_GROUPS.add(group.group_name)
    return group


def new_subgroup(ranks, backend: str, timeout: timedelta | None):
    """A new process group over ``ranks`` (global ranks; only they call it, each with its own
    list), kept registered until the job ends as every subset group is (see above)."""
    kwargs = {"ranks": list(ranks), "backend": backend, "use_local_synchronization": True}
    if timeout is not None:
        kwargs["timeout"] = timeout
    group = dist.new_group(**kwargs)
    _SUBSET_GROUPS.add(group.group_name)
    return group


def release_group(owner, attr: str = "group") -> None:
    """Destroy the group made by :func:`new_group_like` that ``owner.<attr>`` holds, now,
    and set the attribute to None (a no-op if it is None already: ``close()`` is idempotent).

    The group is unregistered from torch (subset groups stay registered, see above), then
    the owner's reference, normally the last one, is dropped here, so the C++ group is
    destroyed and its worker threads joined before this returns (see the module docstring).
    Call it after every wait on the group. The owner must not use the group afterwards: a
    ``torch.distributed`` call given ``group=None`` would run on the default group.

    A job that ended with ``dist.destroy_process_group()`` has already dropped every group,
    sapipe's included, from torch's registry: only the reference is left to drop then.
    """
    group = getattr(owner, attr)
    if group is None:
        return
    setattr(owner, attr, None)
    if group.group_name not in _SUBSET_GROUPS and dist.is_initialized():
        try:
            dist.destroy_process_group(group)
        except (
            ValueError
        ):  # "Invalid process group": torch's registry was torn down and rebuilt since
            pass
    del group  # the last reference: torch's destructor joins the group's threads, the GIL released


__all__ = ["new_group_like", "new_subgroup", "release_group"]
