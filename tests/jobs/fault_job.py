"""sapipe jobs in which one rank fails (used by tests/system/test_faults.py, the fault
matrix).

    python tests/jobs/fault_job.py --case forward --world 2 --fail-rank 1 \
        [--fail-step 4] [--timeout 4]
    # several jobs, one after the other
    python tests/jobs/fault_job.py --jobs forward:2:1,relayout:3:1,...
    # the same job under torchrun
    torchrun --nproc-per-node 2 tests/jobs/fault_job.py --worker --case forward ...

Every rank trains a small MLP (4 layers) with ``sapipe.DistributedOptimizer`` on Gloo; rank
``--fail-rank`` fails as ``--case`` says:

* ``forward``: raises ``ValueError`` in its model's forward at iteration ``--fail-step``;
* ``backward``: raises ``ValueError`` in that iteration's backward, from a hook on a hidden
  activation's gradient (the buckets of the layers above it have started their all-reduces);
* ``decide``: ``stale_layers="auto"``; SIGKILLs itself after the last warm-up iteration's
  backward, before the ``step()`` whose end decides k (the peers are then in the decision's
  collectives: the link probes, the profile's reduction);
* ``relayout``: ``"auto"``; SIGKILLs itself inside the runtime's ``relayout`` at the end of
  warm-up (the peers re-lay their buckets out and train on);
* ``restart``: ``"auto"`` with the measured search's path pinned (the model's k = 1, then a
  trial of k = m, as tests/distributed/test_auto.py pins it); SIGKILLs itself inside the pipeline
  restart of that second trial;
* ``compressed``: ``compression="int8"``; SIGKILLs itself on the back-end's worker thread in
  the middle of a compressed sum (its all-to-all done, before its all-gather), at
  iteration ``--fail-step``.

The other ranks let every exception go uncaught, as a script does: it leaves through
``sys.excepthook`` (sapipe's, chained before torch's and Python's), the ``atexit``
handlers (sapipe closes the optimizer) and finalisation.

By default this process imports torch and sapipe once and forks every rank (as
benchmarks/exit_stress.py does: a fresh interpreter per rank costs seconds of imports), then hosts
the job's TCPStore itself, as torchrun's agent does, so that the store outlives every rank
(``--rank0-store``: rank 0 hosts it, as a plain ``init_process_group`` does, and it dies
with rank 0).
It kills every rank still alive ``--deadline`` seconds into a job. ``--jobs`` runs several
jobs one after the other from the one import. It prints one JSON object, ``{"jobs": [...]}``:
per job its case, and per rank its exit code (negative: the signal), the wall time it
exited, whether the deadline killed it, its events and the tail of its output. Events are
``EVENT {json}`` lines a rank prints (wall time ``time``): ``failing`` right before it fails,
``raised`` when an exception leaves a training iteration (type and message; it then goes on,
uncaught), ``done``.
"""

from __future__ import annotations

import argparse
import atexit
import dataclasses
import gc
import json
import os
import signal
import sys
import tempfile
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

import sapipe
from sapipe.auto.controller import FIRST_TRIAL_HEAD

CASES = ("forward", "backward", "decide", "relayout", "restart", "compressed")
PROFILE_STEPS = 2
WARMUP = PROFILE_STEPS + 5  # "auto"'s warm-up: k is decided at the step() of this iteration
TUNE_STEPS = 2
# the step() that restarts the pipeline for k = m: the first trial leaves the staleness (1) and
# FIRST_TRIAL_HEAD iterations unmeasured, then measures TUNE_STEPS
RESTART_STEP = WARMUP + 1 + FIRST_TRIAL_HEAD + TUNE_STEPS


def event(kind: str, **fields) -> None:
    rank = dist.get_rank() if dist.is_initialized() else None
    print("EVENT " + json.dumps(dict(fields, kind=kind, rank=rank, time=time.time())), flush=True)


def die(what: str) -> None:
    event("failing", what=what)
    os.kill(os.getpid(), signal.SIGKILL)


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(32, 64),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 64),
        nn.Tanh(),
        nn.Linear(64, 4),
    )


def options(case: str, timeout: float) -> dict:
    auto = dict(stale_layers="auto", profile_steps=PROFILE_STEPS, tune_steps=0)
    return dict(
        {
            "forward": dict(stale_layers=1),
            "backward": dict(stale_layers=1),
            "decide": auto,
            "relayout": auto,
            "restart": dict(auto, tune_steps=TUNE_STEPS),
            "compressed": dict(stale_layers=1, compression="int8"),
        }[case],
        timeout=timeout,
    )


class Fault:
    """What the failing rank does; ``step`` is the iteration under way (1-based)."""

    def __init__(self, case: str, rank: int, fail_step: int, model: nn.Module, opt):
        self.case, self.rank, self.fail_step, self.step = case, rank, fail_step, 0
        if case in ("forward", "backward"):
            model[2].register_forward_hook(self._in_forward)
        if case == "relayout":
            opt._runtime.relayout = lambda k: die("relayout")
        if case == "restart":
            opt._runtime.restart = lambda k, iteration, hyperparams: die(
                f"restart to k={k} after {iteration}"
            )
        if case == "compressed":
            from sapipe.comm.compressed import TorchCollectives

            all_gather = TorchCollectives.all_gather

            def gather_or_die(collectives, gathered, own, tag):
                if self.step >= self.fail_step:
                    die(f"compressed sum {tag}")
                all_gather(collectives, gathered, own, tag)

            TorchCollectives.all_gather = gather_or_die

    def _in_forward(self, module, inputs, output):
        if self.step != self.fail_step:
            return None
        message = f"boom in {self.case} at iteration {self.step} on rank {self.rank}"
        if self.case == "forward":
            event("failing", what="forward")
            raise ValueError(message)

        def in_backward(grad):
            event("failing", what="backward")
            raise ValueError(message)

        output.register_hook(in_backward)
        return None

    def before_step(self) -> None:
        if self.case == "decide" and self.step == WARMUP:
            die("before the step that decides k")


def pin_the_search() -> None:
    """The measured search's path, pinned: the model's k = 1 (of 4), measured, then k = m
    (as tests/distributed/test_auto.py pins it), so the pipeline restarts at RESTART_STEP."""
    import sapipe.auto.controller as controller
    from sapipe.auto import search as tuner
    from sapipe.schedule import solver

    real_choose = solver.choose_k
    solver.choose_k = lambda *a, **kw: dataclasses.replace(
        real_choose(*a, **kw),
        k=kw["only_k"] if kw.get("only_k") is not None else 1,
        comm_bound=False,
    )
    controller.TRIAL_MAX_ROUNDS = 1

    class Path(tuner.Tuner):
        def _next(self):
            return self.m if len(self.trials) == 1 else self._finish(self.m)

    tuner.Tuner = Path


def train(rank: int, args) -> None:
    """The job's body, as a script's top level would run it; exceptions go uncaught."""
    if args.case == "restart":
        pin_the_search()
    atexit.register(
        event, "closed"
    )  # runs after sapipe's exit handler (registered later), before finalisation
    model = make_model()
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model,
        **options(args.case, args.timeout),
    )
    fault = Fault(args.case, rank, args.fail_step, model, opt) if rank == args.fail_rank else None
    data = torch.Generator().manual_seed(rank)
    for t in range(1, args.steps + 1):
        x, y = torch.randn(16, 32, generator=data), torch.randn(16, 4, generator=data)
        if fault is not None:
            fault.step = t
        try:
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            if fault is not None:
                fault.before_step()
            opt.step()
        except Exception as exc:
            event("raised", step=t, type=type(exc).__name__, message=str(exc))
            raise
    event("done", stale_layers=opt.stale_layers)


# ------------------------------------------------------------------ the launcher


def start_rank(rank: int, args, pipes, logdir: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    # the child: rank `rank` from here on; it never returns to the launcher's loop
    log = os.open(os.path.join(logdir, str(rank)), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    torch.set_num_threads(1)
    if args.rank0_store and rank == 0:  # rank 0 hosts the store (a plain init_process_group's way)
        store = dist.TCPStore(
            "127.0.0.1", 0, args.world, True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        for _, write_end in pipes[1:]:
            os.write(write_end, store.port.to_bytes(4, "little"))
    else:
        port = int.from_bytes(os.read(pipes[rank][0], 4), "little")
        store = dist.TCPStore("127.0.0.1", port, args.world, False, timeout=timedelta(seconds=60))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=args.world, timeout=timedelta(seconds=60)
    )
    del store
    train(rank, args)
    raise SystemExit(0)  # out of the top level: atexit handlers, then finalisation


def wait_for(pids: dict, deadline: float) -> dict:
    """rank -> (exit code, wall time of the exit, killed at the deadline)."""
    exits = {}
    while len(exits) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            exits[pids[pid]] = (os.waitstatus_to_exitcode(status), time.time(), False)
            continue
        if time.monotonic() > deadline:
            for other, rank in pids.items():
                if rank not in exits:
                    os.kill(other, signal.SIGKILL)
                    os.waitpid(other, 0)
                    exits[rank] = (-signal.SIGKILL, time.time(), True)
        time.sleep(0.005)
    return exits


def report(exits: dict, logdir: str) -> list:
    ranks = []
    for rank in sorted(exits):
        with open(os.path.join(logdir, str(rank))) as f:
            text = f.read()
        os.remove(os.path.join(logdir, str(rank)))
        events = [json.loads(line[6:]) for line in text.splitlines() if line.startswith("EVENT ")]
        code, exited, killed = exits[rank]
        ranks.append(
            {
                "exit": code,
                "exited": exited,
                "killed": killed,
                "events": events,
                "output": text[-3000:],
            }
        )
    os.rmdir(logdir)
    return ranks


def parse(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("--case", choices=CASES, default="forward")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--fail-rank", type=int, default=1)
    parser.add_argument("--fail-step", type=int, default=4)
    parser.add_argument(
        "--rank0-store",
        action="store_true",
        help="rank 0 hosts the store (as a plain init_process_group does), not this process",
    )
    parser.add_argument(
        "--jobs",
        default=None,
        help="several jobs, one after the other: "
        "CASE:WORLD:FAIL_RANK[:FAIL_STEP[:rank0-store]],... "
        "(instead of --case, --world, --fail-rank, --fail-step, --rank0-store)",
    )
    parser.add_argument("--steps", type=int, default=None, help="default: a few past the failure")
    parser.add_argument("--timeout", type=float, default=4.0, help="sapipe's timeout=, seconds")
    parser.add_argument(
        "--deadline", type=float, default=60.0, help="seconds after which a job's ranks are killed"
    )
    parser.add_argument(
        "--worker", action="store_true", help="run as a torchrun worker (env:// rendezvous)"
    )
    return parser.parse_args(argv)


def job_arguments(args, spec: str = None):
    """The arguments of one job: ``args`` with ``spec`` in
    (``CASE:WORLD:FAIL_RANK[:FAIL_STEP[:rank0-store]]``)."""
    job = argparse.Namespace(**vars(args), spec=spec)
    if spec:
        case, world, fail_rank, *more = spec.split(":")
        job.case, job.world, job.fail_rank = case, int(world), int(fail_rank)
        job.fail_step = int(more[0]) if more and more[0] else args.fail_step
        job.rank0_store = more[1:] == ["rank0-store"] or args.rank0_store
    assert job.case in CASES, job.case
    last = {"decide": WARMUP, "relayout": WARMUP, "restart": RESTART_STEP}.get(
        job.case, job.fail_step
    )
    job.steps = args.steps or last + 4
    return job


def run_job(args) -> dict:
    """Fork the job's ranks, host its store, wait (killing at the deadline); its report."""
    logdir = tempfile.mkdtemp(prefix="sapipe-faults-")
    pipes = [os.pipe() for _ in range(args.world)]
    pids = {start_rank(rank, args, pipes, logdir): rank for rank in range(args.world)}
    # The store, created after the forks (no rank holds the server), outlives every rank, as
    # torchrun's agent's does; dropped before the next job's forks.
    store = (
        None
        if args.rank0_store
        else dist.TCPStore("127.0.0.1", 0, args.world, True, wait_for_workers=False)
    )
    for read_end, write_end in pipes:
        if store is not None:
            os.write(write_end, store.port.to_bytes(4, "little"))
        os.close(read_end)
        os.close(write_end)
    ranks = report(wait_for(pids, time.monotonic() + args.deadline), logdir)
    del store
    return {"spec": args.spec, "ranks": ranks}


def main() -> None:
    args = parse()
    if args.worker:
        dist.init_process_group("gloo", timeout=timedelta(seconds=60))
        train(dist.get_rank(), job_arguments(args))
        raise SystemExit(0)
    torch.optim.SGD(
        [nn.Parameter(torch.zeros(1))], lr=0.1
    )  # imports torch's lazy optimizer modules once
    gc.freeze()
    specs = args.jobs.split(",") if args.jobs else [None]
    json.dump({"jobs": [run_job(job_arguments(args, spec)) for spec in specs]}, sys.stdout)


if __name__ == "__main__":
    main()
