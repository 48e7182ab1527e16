"""A clean exit: no thread of a finished job may need Python once the interpreter finalises
(docs/design.md §5.4).

**Why a job can abort after its last line.** Once ``Py_FinalizeEx`` has begun, a thread that
asks for the GIL is ended by ``pthread_exit``; a C++ thread unwound that way through a
``noexcept`` frame calls ``std::terminate``: SIGABRT, "terminate called without an active
exception", and the cluster's scheduler reports the job failed whatever it trained. A Gloo
worker thread (``ProcessGroupGloo::runLoop``) is such a thread whenever it releases a work
it ran: the work holds its tensors, and a tensor whose Python object the script has already
dropped is kept alive by its C++ side, so freeing it means freeing that Python object
(``TensorImpl::decref_pyobject``, which takes the GIL). The worker does that release a
little after the work completes. If it is late (a loaded host: other processes, other
threads of the job, on the cores) and its group is still alive when finalisation begins,
the process aborts. A group outlives the job's ``dist.destroy_process_group()`` as long as
something holds it: a ``DistributedDataParallel`` wrapper (its reducer holds its group), a
script's own reference, an optimizer that was not closed. A job with no sapipe in it aborts
the same way (a DDP model kept in a global, a last ``dist.all_reduce`` of a fresh scalar, a
starved worker; ``benchmarks/exit_stress.py --no-exit-guard`` shows it).

Two ``atexit`` handlers, both run before finalisation, close that window:

* :func:`close_all` (registered at the first optimizer's construction) closes every live
  optimizer the job did not close: its in-flight work is waited for (each wait bounded by
  the groups' timeout; work that fails, a dead peer, is abandoned with a warning), its
  worker threads are stopped and its process groups destroyed (:mod:`sapipe.comm.groups`),
  so no sapipe group reaches finalisation. ``close()`` is idempotent: one the job closed
  costs nothing; optimizers are held weakly.
* :func:`settle_gloo_workers` (registered when sapipe is imported, so that it runs after
  the handlers registered later, ``close_all`` among them) waits, with the GIL released,
  until no Gloo worker thread of the process is running or about to run: each has finished
  releasing what it held, whichever group it serves (the job's own, a DDP wrapper's) and
  whether or not that group will be destroyed during finalisation. A worker that waits for
  the GIL gets it during that wait. The wait is bounded (:data:`SETTLE_LIMIT_SECONDS`) and
  costs a few milliseconds where the workers are idle; it reads the threads' scheduler
  state from ``/proc`` and does nothing where there is none (only Linux is supported).
"""

from __future__ import annotations

import atexit
import os
import time
import warnings
import weakref

_live: weakref.WeakSet = weakref.WeakSet()
_registered = False

#: The longest the exit waits for Gloo's workers to settle (a worker still running then is
#: inside a collective no peer completes; its group's timeout governs it, not this wait).
SETTLE_LIMIT_SECONDS = 2.0
#: Between two looks at the workers: each look releases the GIL for this long.
_SETTLE_POLL_SECONDS = 0.002
#: Looks in a row that must find every worker asleep and not run since the previous look.
_SETTLED_LOOKS = 2
_GLOO_WORKER = "pt_gloo_runloop"  # the name torch gives ProcessGroupGloo's worker threads
_TASKS = "/proc/self/task"


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
            warnings.warn(
                f"at exit, sapipe abandoned the work still in flight: {exc}",
                RuntimeWarning,
                stacklevel=1,
            )


def _gloo_workers() -> dict[int, tuple[str, int]]:
    """Each Gloo worker thread's (scheduler state, CPU time in ns so far), by thread id."""
    workers: dict[int, tuple[str, int]] = {}
    try:
        tids = os.listdir(_TASKS)
    except OSError:  # no /proc: nothing to look at
        return workers
    for tid in tids:
        try:
            with open(f"{_TASKS}/{tid}/comm") as f:
                if f.read().strip() != _GLOO_WORKER:
                    continue
            with open(f"{_TASKS}/{tid}/stat") as f:
                stat = f.read()
            # "pid (comm) state ...": the state follows the last ')'; fields 14-15 are the
            # user and system time in clock ticks, too coarse, so schedstat's ns where there is one
            fields = stat[stat.rindex(")") + 2 :].split()
            state, ticks = fields[0], int(fields[11]) + int(fields[12])
            workers[int(tid)] = (state, _cpu_ns(tid, ticks))
        except (OSError, ValueError, IndexError):  # the thread ended meanwhile
            continue
    return workers


def _cpu_ns(tid: str, ticks: int) -> int:
    try:
        with open(f"{_TASKS}/{tid}/schedstat") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):  # a kernel without schedstats
        return ticks * 10_000_000


def settle_gloo_workers(limit: float | None = None) -> bool:
    """Wait until every Gloo worker thread is asleep and has not run for
    :data:`_SETTLED_LOOKS` looks in a row, the GIL released between looks; at most ``limit``
    seconds (default :data:`SETTLE_LIMIT_SECONDS`). True once settled (or none exists)."""
    deadline = time.monotonic() + (SETTLE_LIMIT_SECONDS if limit is None else limit)
    previous = _gloo_workers()
    quiet_looks = 0
    while previous:
        time.sleep(_SETTLE_POLL_SECONDS)  # releases the GIL: a worker waiting for it runs now
        current = _gloo_workers()
        asleep = all(state == "S" for state, _ in current.values())
        idle = all(previous.get(tid, (None, -1))[1] == ns for tid, (_, ns) in current.items())
        quiet_looks = quiet_looks + 1 if asleep and idle else 0
        if quiet_looks >= _SETTLED_LOOKS:
            return True
        if time.monotonic() > deadline:
            return False
        previous = current
    return True


def _settle_at_exit() -> None:
    """The ``atexit`` form of :func:`settle_gloo_workers`: never raises."""
    try:
        settle_gloo_workers()
    except Exception:  # noqa: BLE001 - a look at /proc must never fail an exit
        pass


# Registered on import, before any optimizer exists, so that it runs after close_all and
# after whatever else the script registers later (atexit runs its handlers in reverse).
atexit.register(_settle_at_exit)


__all__ = ["SETTLE_LIMIT_SECONDS", "close_all", "close_at_exit", "settle_gloo_workers"]
