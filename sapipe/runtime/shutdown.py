"""A clean exit for jobs that never call ``opt.close()`` (docs/design.md §5.4).

After the last ``step()`` the last stale all-reduce is still in flight (the pipeline never
consumes it), and the sync all-reduces of the last backward may be too. If the interpreter
starts finalising while one of them runs, the thread that finishes it has to take the GIL:
Gloo's worker thread to run or free a Python callback on the work's future (``trace``, the
``"auto"`` profiler), push-pull's daemon worker to return from a collective into Python.
A thread that asks for the GIL once finalisation has begun is ended by ``pthread_exit``,
and its forced unwind through a ``noexcept`` C++ frame calls ``std::terminate``: SIGABRT,
"terminate called without an active exception". That happens whether the job ends with
``dist.destroy_process_group()`` (which only unregisters sapipe's groups; they live on in
the optimizer) or with nothing at all.

So every live optimizer is closed by an ``atexit`` handler, which runs before
finalisation: its in-flight work is waited for (each wait bounded by the groups' timeout,
sapipe's ``timeout``), its threads are stopped and its groups released. Work that fails
(a dead peer) is abandoned with a warning; exit goes on. Optimizers are held weakly, and
one closed by the job (``close()`` is idempotent) costs nothing.

Waiting is not enough: a Gloo worker thread keeps a *finished* work, its tensors and the
callbacks on its future, a little after the wait returns, and may be the last to hold a
tensor whose Python object the caller has dropped (the control channel's agreements and
buffer broadcasts, the script's own reductions on the job's group). Its release then takes
the GIL, and aborts the process the same way once finalisation has begun. A group's worker
threads stop only when its C++ object is destroyed, and unregistering the group
(``dist.destroy_process_group``) does not destroy it while a Python reference is left: so
``close()`` drops sapipe's references to every group it holds, and the groups are destroyed
inside this handler, torch joining their workers with the GIL released
(:mod:`sapipe.comm.groups`). No sapipe group's thread is left for finalisation, and a job
that destroyed its own group has none left either once the optimizer lets go of it.
"""
from __future__ import annotations

import atexit
import warnings
import weakref

_live: "weakref.WeakSet" = weakref.WeakSet()
_registered = False


def close_at_exit(optimizer) -> None:
    """Call ``optimizer.close()`` at interpreter exit unless it is gone by then."""
    global _registered
    _live.add(optimizer)
    if not _registered:
        atexit.register(close_all)
        _registered = True


def close_all() -> None:
    """Close every live optimizer; never raises (runs at exit)."""
    for optimizer in list(_live):
        try:
            optimizer.close()
        except Exception as exc:  # noqa: BLE001 - exit must go on; say what was abandoned
            warnings.warn(f"at exit, sapipe abandoned the work still in flight: {exc}", RuntimeWarning)


__all__ = ["close_at_exit", "close_all"]
