"""Many 2-rank sapipe jobs that end without ``opt.close()`` (used by tests/test_exit.py).

    python tests/exit_job.py --runs 100 [--parallel 2] [--endings destroy,neither] [--peer ok|dies|hangs]
                             [--setups trace,pushpull,plain]

Each job: 2 Gloo ranks train a small MLP for 4 steps with ``stale_layers=2``, so the last
stale all-reduce (and the last sync all-reduces) are still in flight after the last
``step()``. Then each rank ends as the job's *ending* says:

* ``destroy``: ``dist.destroy_process_group()``, never ``opt.close()`` (the DDP habit, nanoGPT);
* ``neither``: nothing at all;
* ``destroy-close``: ``dist.destroy_process_group()``, then ``opt.close()`` twice;

and leaves through the interpreter's normal exit: the end of the script, then ``atexit``
handlers and interpreter finalisation, which is where the crash this guards against lives.

Job ``i`` takes ``--endings[i % len]`` and one of ``--setups`` in turn (``(i // len) % n``),
by default these three, each with a different thread that finishes the in-flight work:

* ``trace``: the torch back-end with ``trace=True``: a Python callback on each all-reduce's
  future, run (and freed) by Gloo's worker thread;
* ``pushpull``: push-pull's Python daemon worker, inside a collective;
* ``plain``: the default torch back-end.

One rank (alternating) lags by a random 0-200 ms before its last iteration, as a rank 0
that logs or saves does, so the other rank reaches its exit with the work still running.

``--peer dies`` / ``hangs``: rank 1 instead ``os._exit(1)``s / sleeps before its last
iteration (``timeout=2``): rank 0 must still exit 0, within the timeout, having abandoned
the work.

Two more set-ups end with a *finished* collective whose
tensor the caller has dropped, which a Gloo worker thread may still hold (and release
last, taking the GIL) when finalisation begins:

* ``control``: a BatchNorm model (``stale_layers=1``, globals); after training, an
  evaluation forward, before which rank 0's buffers are broadcast on sapipe's control group;
* ``demo``: examples/demo.py's ending: the optimizer lives in a function (and is left to the
  garbage collector), ``opt.synchronize()``, then the script's own blocking all-reduces of
  fresh scalars on the default group, as the demo's timing and loss reductions; use it with
  the ``destroy`` ending (without it torch itself keeps that group until finalisation).

Before those last collectives each rank of these two set-ups is pinned to one core and
puts every thread but its main one in ``SCHED_IDLE``: a worker that finishes a work runs
again only when the main thread sleeps, as on a machine whose cores are busy, so it often
still holds that work when the main thread reaches its exit. (On the demo under
``sapipe-launch --emulate-net`` that happened by itself in 1-4 runs of 10.)

Why forked children and not 2 fresh interpreters per job: importing torch and its optimizer
machinery costs each process ~1-2 s of CPU, 100 jobs ~4 CPU-minutes. This process imports
once and forks both ranks of each job; each child then runs the job as a script would
(model and optimizer in module globals) and exits with ``SystemExit`` from the top level,
so ``atexit`` and finalisation run exactly as after a script's last line. The children
create every thread they use after the fork; ``gc.freeze()`` keeps their exit from copying
the parent's heap.

Prints one JSON list: per job its ending, set-up, and per rank the exit code (negative: the
signal), seconds from the end of training to the process's exit, the tail of its
stdout+stderr, and how many Gloo worker threads (``pt_gloo_runloop``) it had after
``init_process_group`` and once every ``atexit`` handler, sapipe's included, had run: those
still there at that point belong to groups that will be destroyed, or their threads
stopped, during finalisation.
"""
from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import sapipe

SETUPS = ("trace", "pushpull", "plain")
MORE_SETUPS = ("control", "demo")
STEPS = 4


def gloo_workers() -> int:
    """This process's Gloo worker threads (two per group)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return names.count("pt_gloo_runloop")


def report_gloo_workers_at_exit() -> None:
    """Print the default group's count now, and the count after every later-registered
    ``atexit`` handler (sapipe's) has run."""
    dist.barrier()  # the default group's workers have started (and named themselves) by now or soon
    counts = [gloo_workers()]
    while len(counts) < 200 and (len(counts) < 4 or len(set(counts[-4:])) > 1):
        time.sleep(0.005)
        counts.append(gloo_workers())
    print(f"gloo workers after init {counts[-1]}", flush=True)
    atexit.register(lambda: print(f"gloo workers at exit {gloo_workers()}", flush=True))


def starve_other_threads(rank: int) -> None:
    """Pin this rank to one core and put every thread but this one in ``SCHED_IDLE``."""
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    me = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid != me:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:  # the thread ended meanwhile
                pass


def train(rank: int, run: int, setup: str, peer: str, store) -> None:
    """The job's body (as a script's top level would run it: its objects stay in globals)."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    report_gloo_workers_at_exit()
    torch.manual_seed(0)
    if setup == "control":
        model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 4))
        opt = sapipe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.01), model, stale_layers=1)
        globals().update(model=model, opt=opt)
        for _ in range(STEPS):
            opt.zero_grad()
            model(torch.randn(8, 32)).pow(2).mean().backward()
            opt.step()
        starve_other_threads(rank)
        with torch.no_grad():
            model(torch.randn(8, 32))  # rank 0's buffers first, on the control group
        return
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), model, stale_layers=2,
        backend="pushpull" if setup == "pushpull" else "torch", trace=setup == "trace",
        timeout=timedelta(seconds=2) if peer != "ok" else None,
        # With p.grad exposed, the end of rank 0's last backward waits for the sync all-reduces
        # and raises CommunicationError (tests/test_errors.py); deferred, rank 0 finishes training
        # with them in flight, the exit path under test.
        expose_gradients=peer == "ok",
    )
    globals().update(model=model, opt=opt)
    rng = random.Random(run)
    for i in range(STEPS):
        if i == STEPS - 1 and rank == 1 and peer == "dies":
            opt.wait_for_communication()  # die with nothing of its own in flight:
            time.sleep(0.2)  # rank 0 finishes training, its last all-reduces have no peer
            os._exit(1)
        if i == STEPS - 1 and rank == 1 and peer == "hangs":
            time.sleep(60)
        if i == STEPS - 1 and rank == run % 2 and peer == "ok":
            time.sleep(rng.uniform(0.0, 0.2))
        opt.zero_grad()
        model(torch.randn(8, 32)).pow(2).mean().backward()
        opt.step()


def train_in_a_function(rank: int, store) -> None:
    """examples/demo.py's shape: the optimizer is a local of a function that returns, the
    script's own all-reduces of fresh scalars come last."""
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
    report_gloo_workers_at_exit()

    def run_mode():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4))
        opt = sapipe.DistributedOptimizer(torch.optim.Adam(model.parameters(), lr=0.01), model, stale_layers=2)
        info = lambda: opt.stale_layers  # noqa: E731 - as the demo's, returned to the caller
        for _ in range(STEPS):
            opt.zero_grad()
            model(torch.randn(8, 32)).pow(2).mean().backward()
            opt.step()
        opt.synchronize()
        starve_other_threads(rank)
        elapsed = torch.tensor(1.0)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        loss = torch.tensor(2.0)
        dist.all_reduce(loss)
        return {"elapsed": elapsed.item(), "loss": loss.item(), "stale layers": info()}

    run_mode()


def end(ending: str) -> None:
    if ending in ("destroy", "destroy-close"):
        dist.destroy_process_group()
    if ending == "destroy-close":
        opt = globals()["opt"]
        opt.close()
        opt.close()


def start_rank(rank: int, run: int, ending: str, setup: str, peer: str, port_pipe, logdir: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    # the child: from here on it is rank `rank` of job `run`, and never returns to the loop
    log = os.open(os.path.join(logdir, f"{run}.{rank}"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(log, 1)
    os.dup2(log, 2)
    torch.set_num_threads(1)
    read_end, write_end = port_pipe
    if rank == 0:
        store = dist.TCPStore("127.0.0.1", 0, 2, True, wait_for_workers=False)
        os.write(write_end, store.port.to_bytes(4, "little"))
    else:
        store = dist.TCPStore("127.0.0.1", int.from_bytes(os.read(read_end, 4), "little"), 2, False)
    if setup == "demo":
        train_in_a_function(rank, store)
    else:
        train(rank, run, setup, peer, store)
    del store
    end(ending)
    print(f"trained {time.monotonic():.6f}", flush=True)
    raise SystemExit(0)  # out of the top level: atexit handlers, then finalisation


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--parallel", type=int, default=2, help="jobs at a time")
    parser.add_argument("--endings", default="destroy,neither")
    parser.add_argument("--peer", default="ok", choices=("ok", "dies", "hangs"))
    parser.add_argument("--job-timeout", type=float, default=60.0)
    parser.add_argument("--setups", default=",".join(SETUPS), help="rotated over, from " + ",".join(SETUPS + MORE_SETUPS))
    args = parser.parse_args()
    endings = args.endings.split(",")
    setups = args.setups.split(",")
    torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.1)  # imports torch's lazy optimizer modules once
    gc.freeze()
    logdir = tempfile.mkdtemp(prefix="sapipe-exit-")
    running = {}  # pid -> (run, rank, started)
    status = {}  # (run, rank) -> (exit code, monotonic time of exit)
    next_run = 0
    while next_run < args.runs or running:
        while next_run < args.runs and len(running) < 2 * args.parallel:
            run = next_run
            ending, setup = endings[run % len(endings)], setups[(run // len(endings)) % len(setups)]
            port_pipe = os.pipe()
            for rank in (0, 1):
                pid = start_rank(rank, run, ending, setup, args.peer, port_pipe, logdir)
                running[pid] = (run, rank, time.monotonic())
            for fd in port_pipe:
                os.close(fd)
            next_run += 1
        pid, wait_status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            time.sleep(0.005)
            now = time.monotonic()
            for other, (run, rank, started) in list(running.items()):
                peer_of_done = args.peer == "hangs" and rank == 1 and (run, 0) in status
                if now - started > args.job_timeout or peer_of_done:
                    os.kill(other, signal.SIGKILL)  # a hang (or the hung peer, once rank 0 is out)
            continue
        run, rank, _ = running.pop(pid)
        status[(run, rank)] = (os.waitstatus_to_exitcode(wait_status), time.monotonic())
    results = []
    for run in range(args.runs):
        ranks = []
        for rank in (0, 1):
            with open(os.path.join(logdir, f"{run}.{rank}")) as f:
                text = f.read()
            code, exited = status[(run, rank)]
            trained = [float(line.split()[1]) for line in text.splitlines() if line.startswith("trained ")]
            workers = {line.split()[2]: int(line.split()[-1]) for line in text.splitlines()
                       if line.startswith("gloo workers ")}
            ranks.append({"exit": code, "exit_seconds": exited - trained[0] if trained else None,
                          "output": text[-2000:], "gloo_workers_after_init": workers.get("after"),
                          "gloo_workers_at_exit": workers.get("at")})
        results.append({"run": run, "ending": endings[run % len(endings)],
                        "setup": setups[(run // len(endings)) % len(setups)], "ranks": ranks})
    shutil.rmtree(logdir, ignore_errors=True)
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
