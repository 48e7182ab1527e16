"""Why a peer is gone: a rank that dies of an uncaught exception says so in the job's store.

A rank whose script raises (a bug in its forward, a bad batch, an out-of-memory) leaves
its peers blocked in a collective it never joins. They raise
:class:`~sapipe.errors.CommunicationError` once its sockets close (or after ``timeout``),
naming the bucket but not the cause, which is only in the dead rank's own log, perhaps
on another machine, among the tracebacks of every other rank. So, once a sapipe optimizer
exists in a process (:func:`install`, called at construction), an uncaught exception
first writes one line into the job's ``torch.distributed`` store (the default group's,
which under torchrun lives in the agent and outlives the worker): ``rank R: Type:
message``. Only the first such line is kept (a compare-and-set), so it names the rank
that failed first. A surviving rank whose collective then fails reads it and adds
``rank R failed first: Type: message`` to its error (:func:`with_first_failure`, used by
:meth:`sapipe.comm.base.CommBackend.failure` and the control channel's failures).

What is published: the exception's type and the first line of its message, from a
chained ``sys.excepthook`` (the previous hook, torch's ``[rankN]`` prefixer or Python's,
still prints the traceback, after the line is written: the rank's sockets close only
later, at its ``atexit`` handlers, so its peers cannot fail before the line is there). A
``CommunicationError`` that blames a lost peer (:func:`symptom`) is not published: it is
the consequence of another rank's failure, and a survivor that dies of it would otherwise
hide the cause from the ranks that fail after it (a rank killed by a signal publishes
nothing, and the next error would then blame the first survivor). ``SystemExit`` never
reaches the hook.

Robustness: nothing here may turn one failure into another, or into a hang. The store is
used through a clone (a connection of its own, so a lookup never queues behind torch's own
use of the store) whose waits are bounded, and every operation runs on a helper thread
waited for at most :data:`STORE_SECONDS`: a store that is gone (rank 0 hosted it and died)
fails at once, a frozen one is abandoned after the bound and not asked again. The hook
never raises, and always hands the exception on to the previous hook. The key is scoped
to the torchrun run and attempt (``TORCHELASTIC_RUN_ID``, ``TORCHELASTIC_RESTART_COUNT``),
so a restarted job, whose rendezvous store may be the dead attempt's, never blames the
previous attempt's failure.
"""

from __future__ import annotations

import os
import sys
import threading
import weakref
from datetime import timedelta
from typing import Any, Callable, TypeVar

import torch.distributed as dist

#: How long one store operation (publish, lookup, the clone's connect) may take.
STORE_SECONDS = 2.0
#: The longest description published (characters); a longer message is cut.
MAX_CHARS = 400
_KEY = "sapipe/first_failure"
_E = TypeVar("_E", bound=BaseException)


class _State:
    """This process's publisher and lookup: the job's store (a clone), this rank, the key."""

    def __init__(self) -> None:
        self.source: weakref.ref | None = None  # the default store the clone was made of
        self.store: Any = None  # the clone; None: nothing to publish to or read from
        self.rank: int | None = None
        self.key = _KEY
        self.previous_hook: Callable | None = None
        self.found: str | None = None  # the first failure, once read (it never changes)
        self.unresponsive = (
            False  # an operation outlived STORE_SECONDS: the store is not asked again
        )
        self.pid = os.getpid()  # the process the clone's connection belongs to

    def usable(self) -> Any:
        """The clone, if this process may use it: not in a forked child (a DataLoader worker),
        whose writes would interleave with its parent's on the one connection they share."""
        return (
            self.store
            if self.store is not None and not self.unresponsive and os.getpid() == self.pid
            else None
        )


#: torch.distributed's errors of a lost peer, a broken transport or store (DistBackendError, ...)
_DIST_ERRORS = tuple(getattr(dist, name) for name in ("DistError",) if hasattr(dist, name))

_state = _State()
_lock = threading.Lock()


def install() -> None:
    """From now on, publish this process's uncaught exception, and read the job's first
    failure when a collective fails. Called at every optimizer construction (after
    ``init_process_group``); the hook is installed once, the store refreshed when the job's
    default store is another one (a new process group). Never raises."""
    try:
        from torch.distributed import distributed_c10d

        source = distributed_c10d._get_default_store()
        rank = dist.get_rank()
        with _lock:
            known = _state.source() if _state.source is not None else None
            if known is not source:
                _state.source = weakref.ref(
                    source
                )  # not the store itself: rank 0's may be the server
                _state.store, _state.unresponsive, _state.found = None, False, None
                _state.store = _bounded(lambda: _clone(source))
                _state.rank, _state.key, _state.pid = rank, scoped_key(), os.getpid()
            if sys.excepthook is not _excepthook and _state.previous_hook is None:
                _state.previous_hook = sys.excepthook
                sys.excepthook = _excepthook
    except Exception:  # noqa: BLE001 - no default group or store: nothing to publish to, nothing to fail
        return


def scoped_key() -> str:
    """The store key of the first failure, scoped to the torchrun run and attempt (if any)."""
    scope = [os.environ.get(name) for name in ("TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT")]
    return _KEY + "".join(f"/{part}" for part in scope if part)


def describe(exc: BaseException) -> str:
    """One line: the exception's type and the first line of its message, at most MAX_CHARS."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    text = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    return text if len(text) <= MAX_CHARS else text[: MAX_CHARS - 3] + "..."


def symptom(error: _E) -> _E:
    """Mark ``error`` (a CommunicationError blaming a lost peer) as the consequence of another
    rank's failure: the hook does not publish it as a cause. Returns it."""
    error.sapipe_lost_peer = True
    return error


def is_symptom(exc: BaseException) -> bool:
    """Whether ``exc`` is the consequence of another rank's failure, not a cause: a
    CommunicationError blaming a lost peer (:func:`symptom`), an error of torch.distributed's
    transport or store (``DistError``: NCCL's, the store's), a ``RuntimeError`` from Gloo's
    transport (its messages name their source file, ``gloo/transport/...``), or an exception
    raised while handling one of those (its ``__cause__`` / ``__context__`` chain)."""
    seen = 0
    while exc is not None and seen < 16:
        if getattr(exc, "sapipe_lost_peer", False) or isinstance(exc, _DIST_ERRORS):
            return True
        if isinstance(exc, RuntimeError) and "gloo/transport/" in str(exc):
            return True
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return False


def publish(exc: BaseException) -> bool:
    """Write ``exc`` as this job's first failure unless a rank wrote one already; whether
    this call wrote it. Bounded; never raises."""
    store = _state.usable()
    if store is None or is_symptom(exc):
        return False
    line = f"{_state.rank}:{describe(exc)}"
    try:
        current = _bounded(lambda: store.compare_set(_state.key, "", line))
        return current is not None and bytes(current) == line.encode()
    except Exception:  # noqa: BLE001
        return False


def first_failure() -> str | None:
    """``"rank R failed first: Type: message"`` if a rank of this job published its uncaught
    exception, else None. Bounded (a store that is gone or frozen gives None); never raises."""
    if _state.found is not None:
        return _state.found
    store, key = _state.usable(), _state.key
    if store is None:
        return None
    value = _bounded(lambda: store.get(key) if store.check([key]) else None)
    if not value:
        return None
    try:
        rank, _, description = bytes(value).decode("utf-8", errors="replace").partition(":")
    except Exception:  # noqa: BLE001
        return None
    _state.found = f"rank {rank} failed first: {description.rstrip('.')}"
    return _state.found


def with_first_failure(head: str) -> str:
    """``head`` (``"sapipe: ... failed"``) followed by ``"; rank R failed first: ..."`` when
    the job's first failure is known."""
    first = first_failure()
    return f"{head}; {first}" if first else head


def _excepthook(exc_type, exc, tb) -> None:
    """Publish an uncaught exception, then hand it to the previous hook (which prints it)."""
    try:
        publish(exc)
    except BaseException:  # noqa: BLE001 - the hook must print the exception whatever happens
        pass
    (_state.previous_hook or sys.__excepthook__)(exc_type, exc, tb)


def _clone(source: Any) -> Any:
    """A connection of our own to ``source`` with bounded waits (the store itself if it cannot
    be cloned: a single-process store has no connection to wait on)."""
    try:
        store = source.clone()
    except Exception:  # noqa: BLE001 - e.g. a store type without clone()
        store = source
    else:
        store.set_timeout(timedelta(seconds=STORE_SECONDS))
    return store


def _bounded(operation: Callable[[], Any]) -> Any:
    """``operation()`` on a helper thread, waited for at most STORE_SECONDS: its result, or
    None if it raised or took longer (the store is then marked unresponsive; the thread is
    a daemon, left blocked in the store's socket). Never raises."""
    result: list = []

    def run() -> None:
        try:
            result.append(operation())
        except Exception:  # noqa: BLE001
            pass

    try:
        thread = threading.Thread(target=run, name="sapipe-failure-store", daemon=True)
        thread.start()
    except Exception:  # noqa: BLE001 - e.g. no new threads at interpreter shutdown
        return None
    thread.join(STORE_SECONDS)
    if thread.is_alive():
        _state.unresponsive = True
        return None
    return result[0] if result else None


__all__ = [
    "MAX_CHARS",
    "STORE_SECONDS",
    "describe",
    "first_failure",
    "install",
    "is_symptom",
    "publish",
    "scoped_key",
    "symptom",
    "with_first_failure",
]
