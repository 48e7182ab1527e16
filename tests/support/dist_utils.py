"""Run a function on N real Gloo ranks (processes of their own) and collect what each returns.

Each rank is a new process forked from multiprocessing's fork server, which has imported
torch and nothing else and never computed (forking a process that already ran OpenMP
regions can deadlock): a fresh interpreter's state without its 3 s of imports, which made
most of the suite's time. Each rank takes the parent's environment as it is at the call
(the server's is from its start) and a fresh NumPy seed (a fork would share the server's),
initialises a real ``torch.distributed`` Gloo group on loopback, and sends back a picklable
result (tensors are converted to numpy). A rank that raises sends its traceback, and the
test fails with it; a rank that hangs is killed at the deadline, so no test can hang CI.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback
from datetime import timedelta
from typing import Any, Callable

import numpy as np
import torch
import torch.multiprocessing as mp


class RankFailed(AssertionError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def to_numpy(obj: Any) -> Any:
    """Recursively turn tensors into numpy arrays (safe to send between processes)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().numpy().copy()
    if isinstance(obj, dict):
        return {k: to_numpy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_numpy(v) for v in obj)
    return obj


def _worker(
    rank: int, world_size: int, port: int, call: bytes, results, backend: str, environ: dict
) -> None:
    import torch.distributed as dist

    os.environ.clear()  # the parent's environment now, not the fork server's from its start
    os.environ.update(environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    np.random.seed()  # as a new interpreter's, from the OS
    torch.set_num_threads(1)
    try:
        # fn and args unpickled only now: the modules they import (sapipe, the test's) read
        # this environment, as they would in a new interpreter started with it
        fn, args = pickle.loads(call)
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
        )
        out = fn(rank, world_size, *args)
        results.put((rank, to_numpy(out), None))
    except BaseException:  # noqa: BLE001 - report everything to the parent
        results.put((rank, None, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001
                pass


def _context():
    """The fork server's context; it imports what every rank imports (torch, and the
    torch._dynamo that torch's optimizers import on first use) once."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "torch._dynamo"])
    return ctx


def as_torchrun(rank: int, world_size: int) -> None:
    """Set what torchrun sets for a rank (one node), which the frameworks read to find the
    job they are in; their process group is then the one already initialised here."""
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        NODE_RANK="0",
    )


def run_ranks(
    fn: Callable,
    world_size: int = 2,
    args: tuple = (),
    timeout: float = 180.0,
    allow_missing: list[int] | None = None,
    backend: str = "gloo",
) -> list[Any]:
    """``fn(rank, world_size, *args)`` on each rank; the list of their return values.

    ``allow_missing``: ranks that are expected to die without returning (failure tests);
    their entry is None. ``backend``: the process group's (``"nccl"`` needs a GPU per rank).
    """
    ctx = _context()
    results = ctx.Queue()
    port = free_port()
    call = pickle.dumps((fn, args))
    procs = [
        ctx.Process(
            target=_worker,
            args=(r, world_size, port, call, results, backend, dict(os.environ)),
            daemon=True,
        )
        for r in range(world_size)
    ]
    for p in procs:
        p.start()
    out: list[Any] = [None] * world_size
    expected = set(range(world_size)) - set(allow_missing or [])
    pending = set(range(world_size))
    errors = []
    import time

    deadline = time.monotonic() + timeout
    while pending & expected:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        try:
            rank, value, err = results.get(timeout=min(remaining, 1.0))
        except queue.Empty:
            if all(not p.is_alive() for p in procs):
                try:  # a final result may still be in the pipe
                    rank, value, err = results.get(timeout=2.0)
                except queue.Empty:
                    break
            else:
                continue
        pending.discard(rank)
        if err is not None:
            errors.append(f"rank {rank} raised:\n{err}")
        else:
            out[rank] = value
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise RankFailed("\n".join(errors))
    missing = sorted(pending & expected)
    if missing:
        raise RankFailed(f"ranks {missing} returned nothing within {timeout:.0f}s (hang or crash)")
    return out


def assert_close_dicts(
    actual: dict, expected: dict, rtol: float, atol: float, what: str = ""
) -> None:
    assert set(actual) == set(expected), f"{what}: names differ: {set(actual) ^ set(expected)}"
    for name in expected:
        a, e = np.asarray(actual[name]), np.asarray(expected[name])
        if not np.allclose(a, e, rtol=rtol, atol=atol):
            err = np.max(np.abs(a - e))
            raise AssertionError(
                f"{what}: {name} differs, max abs error {err:.3e} (rtol={rtol}, atol={atol})"
            )


def same_state(a: Any, b: Any) -> bool:
    """Whether two state dicts hold the same structure and bits."""
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return (
            isinstance(b, dict) and a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
        )
    if isinstance(a, (list, tuple)):
        return (
            isinstance(b, (list, tuple))
            and len(a) == len(b)
            and all(same_state(x, y) for x, y in zip(a, b))
        )
    return a == b


def k_once_decided(opt, one_step: Callable[[int], None], limit: int = 300) -> Any:
    """Run ``one_step(iteration)`` (zero_grad, forward, backward, step) until ``"auto"`` has
    decided, at most ``limit`` times; close ``opt`` and return its k."""
    for iteration in range(1, limit + 1):
        one_step(iteration)
        if opt.stale_layers != "auto":
            break
    k = opt.stale_layers
    opt.close()
    return k


def horovod_missing() -> str:
    """Why ``backend="horovod"`` cannot run here; ``""`` where ``horovod.torch`` imports."""
    try:
        import horovod.torch as hvd  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any failure means "not here"
        return f"horovod.torch does not import ({type(exc).__name__}); `make peers` builds it"
    return ""
