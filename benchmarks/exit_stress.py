"""Exit stress: many short sapipe jobs, each ending as real scripts end, counted for aborts.

    python benchmarks/exit_stress.py --runs 500 [--load 2] [--parallel 2] [--endings a,b]
        [--setups a,b] [--peer ok|dies|hangs|raises] [--emulate-net 3.5gbit] [--json out.json]

A job that aborts at its end is reported failed by the cluster's scheduler, whatever it
trained. This benchmark runs many jobs and counts the ones that do not exit 0: every
combination of a *set-up* (what the job trained, and so which threads finished its last
work) and an *ending* (its last lines), round-robin, optionally with the host loaded by busy
processes competing for the cores (as on a shared node), and optionally inside a network
namespace whose loopback is rate-limited (``--emulate-net``, as ``sapipe-launch`` does).

Each job's ranks are forked from this process, which has imported torch once: a rank then
runs its job as a script's top level would (model and optimizer in module globals) and
leaves with ``SystemExit`` from the top level, so ``atexit`` handlers and the interpreter's
finalisation run exactly as after a script's last line, while 500 jobs take minutes instead
of the CPU-hour that importing torch into 1,000 fresh interpreters costs on 2 cores.

Per rank it records the exit status (negative: the signal), the seconds from the end of its
last line to its exit, the tail of its output, the threads it had once every ``atexit``
handler had run (the ones finalisation meets: a thread that asks for the GIL then is ended
by ``pthread_exit``, which aborts the process when it unwinds a ``noexcept`` C++ frame), and,
for a rank that dumped core, every thread's backtrace (``gdb``), so that an abort names its
thread, object and destructor. Prints a table by set-up and ending; ``--json`` writes every
job's record. ``tests/system/test_exit.py`` runs samples of it.
"""

from __future__ import annotations

import atexit
import collections
import gc
import json
import os
import random
import resource
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import harness
import torch
import torch.distributed as dist
from torch import nn

import sapipe

STEPS = 4


# ---------------------------------------------------------------------------- in a rank


def thread_names() -> list[str]:
    """This process's threads, by their kernel names (Gloo's workers are ``pt_gloo_runloop``)."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # the thread ended meanwhile
            pass
    return sorted(names)


def report_threads_at_exit() -> None:
    """Print the Gloo workers the default group started, and every thread left once all later
    ``atexit`` handlers (sapipe's among them) have run: those meet finalisation."""
    if os.environ.get("EXIT_STRESS_NO_REPORT"):
        return
    dist.barrier()  # the default group's workers have started (and named themselves) by now or soon
    counts = [thread_names().count("pt_gloo_runloop")]
    # a new thread names itself a little after it starts (later still on a loaded host)
    while len(counts) < 400 and (len(counts) < 4 or len(set(counts[-4:])) > 1 or counts[-1] < 2):
        time.sleep(0.005)
        counts.append(thread_names().count("pt_gloo_runloop"))
    print(f"gloo workers after init {counts[-1]}", flush=True)

    def at_exit():
        names = thread_names()
        print(f"gloo workers at exit {names.count('pt_gloo_runloop')}", flush=True)
        print("threads at exit " + json.dumps(names), flush=True)
        print(
            "python threads at exit " + json.dumps([t.name for t in threading.enumerate()]),
            flush=True,
        )

    atexit.register(at_exit)  # registered before sapipe's handler, so it runs after it


def starve_other_threads(rank: int) -> None:
    """Pin this rank to one core and put every thread but this one in ``SCHED_IDLE``: a
    worker that finishes a collective runs again only when the main thread sleeps, as on a
    host whose cores are busy, so it often still holds that work when the main thread exits."""
    os.sched_setaffinity(0, {rank % os.cpu_count()})
    me = threading.get_native_id()
    for tid in map(int, os.listdir("/proc/self/task")):
        if tid != me:
            try:
                os.sched_setscheduler(tid, os.SCHED_IDLE, os.sched_param(0))
            except OSError:  # the thread ended meanwhile
                pass


@dataclass
class Job:
    """What one rank of one job knows about itself."""

    rank: int
    world: int
    run: int
    setup: str
    ending: str
    peer: str  # ok | dies | hangs | raises: what the last rank does before its last iteration
    starve: bool = False  # starve_other_threads() before the ending
    guard: bool = (
        True  # False: sapipe's settling of Gloo's workers at exit is unregistered (a control)
    )


def mlp() -> nn.Module:
    return nn.Sequential(
        nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 4)
    )


def keep(**objects) -> None:
    """Keep the job's objects in module globals, as a script's top level does."""
    globals().update(objects)


def train_loop(
    job: Job, model: nn.Module, opt, steps: int, batch: Callable[[], tuple], loss_fn
) -> None:
    """``steps`` iterations; the peer fault, if any, before the last; one rank (alternating)
    lags a random 0-200 ms before the last, as a rank 0 that logs or saves does, so that the
    other reaches its exit with the last all-reduces still running."""
    rng = random.Random(job.run)
    faulty = job.rank == job.world - 1
    for i in range(steps):
        if i == steps - 1 and faulty and job.peer == "dies":
            opt.wait_for_communication()  # dies with nothing of its own in flight:
            time.sleep(0.2)  # the others finish training, their last all-reduces have no peer
            os._exit(1)
        if i == steps - 1 and faulty and job.peer == "hangs":
            time.sleep(60)
        if i == steps - 1 and job.rank == job.run % job.world and job.peer == "ok":
            time.sleep(rng.uniform(0.0, 0.2))
        x, y = batch()
        opt.zero_grad()
        if i == steps - 1 and faulty and job.peer == "raises":
            raise RuntimeError(f"rank {job.rank}: the data loader failed (injected)")
        loss_fn(model(x), y).backward()
        opt.step()


def _mlp_job(job: Job, **options) -> None:
    torch.manual_seed(0)
    model = mlp()
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        model,
        stale_layers=2,
        timeout=timedelta(seconds=2) if job.peer != "ok" else None,
        # Exposed, the end of the last backward waits for the sync all-reduces (and raises
        # CommunicationError when the peer is gone); deferred, the rank finishes training
        # with them in flight, the exit path under test.
        expose_gradients=job.peer == "ok",
        **options,
    )
    keep(model=model, opt=opt)
    train_loop(
        job, model, opt, STEPS, lambda: (torch.randn(8, 32), None), lambda out, _: out.pow(2).mean()
    )


def _auto_job(
    job: Job, steps_after_warmup: int | None, compensation: str = "none", **options
) -> None:
    """``stale_layers="auto"`` on a GPT (benchmarks/bench_models.py, tiny: 15 layers): until k is
    final (``steps_after_warmup`` None) or that many iterations past the warm-up, when the
    measured search is still running its trials."""
    import bench_models  # benchmarks/, this script's folder

    spec = bench_models.build("gpt2", "tiny")
    model = spec.make_model()
    opt = sapipe.DistributedOptimizer(
        spec.make_optimizer(model.parameters()),
        model,
        stale_layers="auto",
        compensation=compensation,
        profile_steps=2,
        tune_steps=2,
        auto_budget=40,
        **options,
    )
    keep(model=model, opt=opt)
    gen = torch.Generator().manual_seed(job.rank)
    batches = [spec.make_batch(spec.batch_size, torch.device("cpu"), gen) for _ in range(2)]
    warmup = opt.settings.effective_warmup
    steps = 60 if steps_after_warmup is None else warmup + steps_after_warmup
    i = 0
    for i in range(steps):
        x, y = batches[i % 2]
        opt.zero_grad()
        spec.loss_fn(model(x), y).backward()
        opt.step()
        if steps_after_warmup is None and opt.stale_layers != "auto":
            break
    print(f"k {opt.stale_layers} after {i + 1} iterations", flush=True)


def _control_job(job: Job) -> None:
    """A BatchNorm model; after training an evaluation forward, before which rank 0's buffers
    are broadcast on sapipe's control group: the last collective is sapipe's, its tensor
    possibly still held by the group's worker when the rank reaches its exit."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Tanh(), nn.Linear(64, 4))
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01), model, stale_layers=1
    )
    keep(model=model, opt=opt)
    train_loop(
        job, model, opt, STEPS, lambda: (torch.randn(8, 32), None), lambda out, _: out.pow(2).mean()
    )
    starve_other_threads(job.rank)
    with torch.no_grad():
        model(torch.randn(8, 32))


def _demo_job(job: Job) -> None:
    """examples/demo.py's shape: the optimizer is a local of a function that returns, the
    script's own blocking all-reduces of fresh scalars come last (on the default group)."""

    def run_mode():
        torch.manual_seed(0)
        model = mlp()
        opt = sapipe.DistributedOptimizer(
            torch.optim.Adam(model.parameters(), lr=0.01), model, stale_layers=2
        )
        train_loop(
            job,
            model,
            opt,
            STEPS,
            lambda: (torch.randn(8, 32), None),
            lambda out, _: out.pow(2).mean(),
        )
        opt.synchronize()
        starve_other_threads(job.rank)
        elapsed = torch.tensor(1.0)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        loss = torch.tensor(2.0)
        dist.all_reduce(loss)
        return {"elapsed": elapsed.item(), "loss": loss.item(), "stale layers": opt.stale_layers}

    run_mode()


def _baselines_job(job: Job) -> None:
    """A throughput job's shape: DDP and a ceiling (an all-reduce on a second group of the
    script's own) run first and stay in globals, then sapipe trains. The DDP wrapper and the
    script's group hold their process groups past ``dist.destroy_process_group()``."""
    torch.manual_seed(0)
    ddp_model = nn.parallel.DistributedDataParallel(mlp())
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.01)
    side = dist.new_group()
    buffer = torch.zeros(4096)
    keep(ddp_model=ddp_model, ddp_opt=ddp_opt, side=side, buffer=buffer)
    for _ in range(2):
        work = dist.all_reduce(buffer, group=side, async_op=True)
        ddp_opt.zero_grad()
        ddp_model(torch.randn(8, 32)).pow(2).mean().backward()
        ddp_opt.step()
        work.wait()
    _mlp_job(job)


def _torch_only_job(job: Job) -> None:
    """No sapipe optimizer at all: the script keeps a reference to its group (as a DDP wrapper
    does) and all-reduces. Its exit is torch's alone, with sapipe imported."""
    keep(group=dist.group.WORLD)
    value = torch.ones(10)
    for _ in range(3):
        dist.all_reduce(value)


@dataclass(frozen=True)
class Setup:
    """What a job trains, and so which threads finish its last work."""

    train: Callable[[Job], None]
    doc: str
    world: int = 2
    keeps_optimizer: bool = True  # the optimizer is a global the ending can close
    env: Callable[[int], dict[str, str]] | None = None  # per rank: environment a launcher would set


def _two_nodes(rank: int) -> dict[str, str]:
    """torchrun's node numbering for 2 nodes of 2 ranks: sapipe then sums node first."""
    return {"GROUP_RANK": str(rank // 2), "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": str(rank % 2)}


SETUPS: dict[str, Setup] = {
    "plain": Setup(_mlp_job, "the default torch back-end: Gloo's workers finish the all-reduces"),
    "trace": Setup(
        lambda job: _mlp_job(job, trace=True),
        "trace=True: a Python callback on each all-reduce's future, run and freed by Gloo's worker",
    ),
    "pushpull": Setup(
        lambda job: _mlp_job(job, backend="pushpull"),
        "push-pull: sapipe's Python worker thread inside a collective",
    ),
    "int8": Setup(
        lambda job: _mlp_job(job, compression="int8"),
        "compressed sums (int8, error feedback): sapipe's worker thread encodes and sums",
    ),
    "pushpull-bf16": Setup(
        lambda job: _mlp_job(job, backend="pushpull", compression="bf16"),
        "push-pull with bf16 partitions",
    ),
    "hierarchical": Setup(
        lambda job: _mlp_job(job, compression="int8"),
        world=4,
        env=_two_nodes,
        doc="4 ranks as 2 nodes of 2: node-first sums (int8 across nodes), subset groups",
    ),
    "auto": Setup(
        lambda job: _auto_job(job, None, "wp3"),
        'stale_layers="auto", wp3, on a GPT: ends once k is final (profiling callbacks, trials, '
        "relayouts done)",
    ),
    "auto-searching": Setup(
        lambda job: _auto_job(job, 3, "wp1"),
        'stale_layers="auto", wp1: ends 3 iterations into the measured search (a trial running)',
    ),
    "auto-int8": Setup(
        lambda job: _auto_job(job, None, "none", compression="int8"),
        'stale_layers="auto" with int8: the codec timed, trials on compressed sums',
    ),
    "control": Setup(
        _control_job,
        "BatchNorm: the last collective is the buffer broadcast on sapipe's control group",
    ),
    "baselines": Setup(
        _baselines_job, "DDP and a ceiling on the script's own second group first, kept in globals"
    ),
    "torch-only": Setup(
        _torch_only_job,
        "no optimizer: the script's group kept in a global, its own all-reduces",
        keeps_optimizer=False,
    ),
    "demo": Setup(
        _demo_job,
        "examples/demo.py: optimizer local to a function, the script's own all-reduces last",
        keeps_optimizer=False,
    ),
}
DEFAULT_SETUPS = ("plain", "trace", "pushpull", "int8", "auto", "auto-searching", "control", "demo")


def _close() -> None:
    opt = globals()["opt"]
    opt.synchronize()
    opt.close()


def _own_collective() -> None:
    """The script's own blocking all-reduce of a fresh tensor on the default group, dropped at
    once (a final metric): the group's worker may hold the last reference to it."""
    value = torch.tensor([1.0])
    dist.all_reduce(value)
    del value


ENDINGS: dict[str, Callable[[], None]] = {
    "neither": lambda: None,  # the script just ends
    "destroy": dist.destroy_process_group,  # the DDP habit (nanoGPT), no close()
    "destroy-close": lambda: (
        dist.destroy_process_group(),
        globals()["opt"].close(),
        globals()["opt"].close(),
    ),
    "close": _close,  # close(), the process group left to torch
    "close-destroy": lambda: (_close(), dist.destroy_process_group()),
    "close-collective-destroy": lambda: (_close(), _own_collective(), dist.destroy_process_group()),
    "collective-destroy": lambda: (_own_collective(), dist.destroy_process_group()),  # no close()
}
NEEDS_OPTIMIZER = ("destroy-close", "close", "close-destroy", "close-collective-destroy")
DEFAULT_ENDINGS = (
    "neither",
    "destroy",
    "close-destroy",
    "close-collective-destroy",
    "collective-destroy",
    "destroy-close",
    "close",
)


def rank_main(job: Job, store) -> None:
    """One rank of one job, as a script's top level: train, end, leave through the normal exit."""
    dist.init_process_group("gloo", store=store, rank=job.rank, world_size=job.world)
    report_threads_at_exit()
    if not job.guard:
        from sapipe.runtime import shutdown

        atexit.unregister(shutdown._settle_at_exit)
    SETUPS[job.setup].train(job)
    if job.starve:
        starve_other_threads(job.rank)
    ENDINGS[job.ending]()
    print(f"trained {time.monotonic():.6f}", flush=True)
    raise SystemExit(0)  # out of the top level: atexit handlers, then finalisation


# ---------------------------------------------------------------------------- the harness


def start_rank(job: Job, port_pipe, jobdir: str) -> int:
    pid = os.fork()
    if pid:
        return pid
    # the child: rank `job.rank` of job `job.run` from here on, never returning to the loop
    try:
        coredir = os.path.join(jobdir, f"rank{job.rank}")
        os.mkdir(coredir)
        os.chdir(coredir)  # a core dump lands here (core_pattern "core")
        resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
        log = os.open(
            os.path.join(jobdir, f"rank{job.rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC
        )
        os.dup2(log, 1)
        os.dup2(log, 2)
        setup = SETUPS[job.setup]
        if setup.env is not None:
            os.environ.update(setup.env(job.rank))
        os.environ.update(RANK=str(job.rank), WORLD_SIZE=str(job.world))
        torch.set_num_threads(1)
        read_end, write_end = port_pipe
        if job.rank == 0:
            store = dist.TCPStore("127.0.0.1", 0, job.world, True, wait_for_workers=False)
            for _ in range(job.world - 1):
                os.write(write_end, store.port.to_bytes(4, "little"))
        else:
            store = dist.TCPStore(
                "127.0.0.1", int.from_bytes(os.read(read_end, 4), "little"), job.world, False
            )
    except BaseException:  # noqa: BLE001 - never back into the parent's loop
        import traceback

        traceback.print_exc()
        os._exit(3)
    rank_main(job, store)


def backtraces(core: str) -> str:
    """Every thread's backtrace in ``core`` (gdb), or why there is none."""
    if shutil.which("gdb") is None:
        return "(gdb not installed: no backtrace)"
    try:
        out = subprocess.run(
            ["gdb", "-batch", "-nx", "-ex", "thread apply all bt 40", sys.executable, core],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except subprocess.TimeoutExpired:
        return "(gdb timed out)"
    lines = [line for line in out.stdout.splitlines() if line.startswith(("Thread ", "#", "["))]
    return "\n".join(lines)[-30000:]


def parse_rank(text: str) -> dict[str, object]:
    lines = text.splitlines()
    out: dict[str, object] = {"trained": None}
    for line in lines:
        if line.startswith("trained "):
            out["trained"] = float(line.split()[1])
        elif line.startswith("gloo workers after init "):
            out["gloo_workers_after_init"] = int(line.split()[-1])
        elif line.startswith("gloo workers at exit "):
            out["gloo_workers_at_exit"] = int(line.split()[-1])
        elif line.startswith("threads at exit "):
            out["threads_at_exit"] = json.loads(line[len("threads at exit ") :])
        elif line.startswith("python threads at exit "):
            out["python_threads_at_exit"] = json.loads(line[len("python threads at exit ") :])
    return out


def crashed(rank: dict[str, object]) -> bool:
    """A rank that did not exit 0, or whose output shows C++'s terminate."""
    return rank["exit"] != 0 or "terminate called" in str(rank["output"])


class Load:
    """``n`` busy processes competing for the cores while the jobs run (a shared node)."""

    def __init__(self, n: int):
        self._procs = [
            subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)
        ]

    def stop(self) -> None:
        for proc in self._procs:
            proc.kill()
            proc.wait()


def plan(runs: int, setups: list[str], endings: list[str]) -> list[tuple]:
    """(setup, ending) of each run: every ending in turn, each full turn on the next set-up.
    Endings that close the optimizer are skipped for set-ups that keep none."""
    pairs = [
        (s, e)
        for s in setups
        for e in endings
        if SETUPS[s].keeps_optimizer or e not in NEEDS_OPTIMIZER
    ]
    if not pairs:
        raise SystemExit("exit_stress: no set-up and ending combine")
    by_ending = collections.defaultdict(list)
    for s, e in pairs:
        by_ending[e].append(s)
    order = []  # interleave endings, so that any prefix of the runs covers them alike
    while len(order) < len(pairs):
        for e in endings:
            if by_ending[e]:
                order.append((by_ending[e].pop(0), e))
    return [order[i % len(order)] for i in range(runs)]


def run_jobs(args) -> list[dict]:
    jobs = plan(args.runs, args.setups.split(","), args.endings.split(","))
    torch.optim.SGD(
        [nn.Parameter(torch.zeros(1))], lr=0.1
    )  # imports torch's lazy optimizer modules once
    gc.freeze()  # the children's exit does not copy the parent's heap
    root = tempfile.mkdtemp(prefix="sapipe-exit-")
    running: dict[int, tuple] = {}  # pid -> (run, rank, started)
    status: dict[tuple, tuple] = {}  # (run, rank) -> (exit code, monotonic time of exit)
    next_run = 0
    parent = os.getpid()
    load = Load(args.load)
    try:
        while next_run < len(jobs) or running:
            while next_run < len(jobs) and len(running) < 2 * args.parallel:
                setup, ending = jobs[next_run]
                world = SETUPS[setup].world
                jobdir = os.path.join(root, str(next_run))
                os.mkdir(jobdir)
                port_pipe = os.pipe()
                for rank in range(world):
                    job = Job(
                        rank, world, next_run, setup, ending, args.peer, args.starve, args.guard
                    )
                    running[start_rank(job, port_pipe, jobdir)] = (next_run, rank, time.monotonic())
                for fd in port_pipe:
                    os.close(fd)
                next_run += 1
            pid, wait_status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                time.sleep(0.005)
                now = time.monotonic()
                for other, (run, rank, started) in list(running.items()):
                    world = SETUPS[jobs[run][0]].world
                    hung_peer = (
                        args.peer == "hangs"
                        and rank == world - 1
                        and all((run, r) in status for r in range(world - 1))
                    )
                    if now - started > args.job_timeout or hung_peer:
                        os.kill(
                            other, signal.SIGKILL
                        )  # a hang (or the hung peer, once the others are out)
                continue
            run, rank, _ = running.pop(pid)
            status[(run, rank)] = (os.waitstatus_to_exitcode(wait_status), time.monotonic())
    finally:
        if os.getpid() == parent:  # a forked rank leaves through here too, by its SystemExit
            load.stop()
    results = []
    for run, (setup, ending) in enumerate(jobs):
        jobdir = os.path.join(root, str(run))
        ranks = []
        for rank in range(SETUPS[setup].world):
            with open(os.path.join(jobdir, f"rank{rank}.log"), errors="replace") as f:
                text = f.read()
            code, exited = status[(run, rank)]
            info = parse_rank(text)
            trained = info.pop("trained")
            ranks.append(
                dict(
                    exit=code,
                    exit_seconds=exited - trained if trained else None,
                    output=text[-3000:],
                    **info,
                )
            )
        cores = sorted(
            os.path.join(f"rank{rank}", f)
            for rank in range(SETUPS[setup].world)
            for f in os.listdir(os.path.join(jobdir, f"rank{rank}"))
            if f.startswith("core")
        )
        record = {
            "run": run,
            "setup": setup,
            "ending": ending,
            "load": args.load,
            "starve": args.starve,
            "guard": args.guard,
            "ranks": ranks,
        }
        if cores and args.backtraces:
            record["backtraces"] = {core: backtraces(os.path.join(jobdir, core)) for core in cores}
        if cores and args.keep_cores:
            kept = os.path.join(args.keep_cores, f"job{run}")
            shutil.copytree(jobdir, kept, dirs_exist_ok=True)
            record["kept"] = kept
        results.append(record)
    shutil.rmtree(root, ignore_errors=True)
    return results


def summary(results: list[dict]) -> str:
    """A table: per set-up and ending, the jobs and how many did not exit cleanly."""
    table = collections.defaultdict(lambda: [0, 0])
    for record in results:
        cell = table[(record["setup"], record["ending"])]
        cell[0] += 1
        cell[1] += any(crashed(rank) for rank in record["ranks"])
    lines = ["| set-up | ending | jobs | not clean |", "| --- | --- | ---: | ---: |"]
    lines += [f"| {s} | {e} | {n} | {bad} |" for (s, e), (n, bad) in sorted(table.items())]
    total = len(results)
    bad = sum(any(crashed(rank) for rank in record["ranks"]) for record in results)
    lines.append(f"| all | | {total} | {bad} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = harness.Parser(__doc__, quick=dict(runs=4))
    parser.epilog = "set-ups:\n" + "\n".join(f"  {k}: {v.doc}" for k, v in SETUPS.items())
    parser.add_argument("--runs", type=int, default=100, help="jobs in all (default 100)")
    parser.add_argument("--parallel", type=int, default=2, help="jobs at a time (default 2)")
    parser.add_argument(
        "--setups", default=",".join(DEFAULT_SETUPS), help="rotated over, from " + ",".join(SETUPS)
    )
    parser.add_argument(
        "--endings",
        default=",".join(DEFAULT_ENDINGS),
        help="rotated over, from " + ",".join(ENDINGS),
    )
    parser.add_argument(
        "--peer",
        default="ok",
        choices=("ok", "dies", "hangs", "raises"),
        help="what the last rank does before its last iteration (default: nothing)",
    )
    parser.add_argument(
        "--starve",
        action="store_true",
        help="before its ending, each rank pins itself to one core and puts its other threads in "
        "SCHED_IDLE: they run only when the main thread sleeps (the worst a loaded host can do)",
    )
    parser.add_argument(
        "--no-exit-guard",
        dest="guard",
        action="store_false",
        help="a control: unregister sapipe's settling of Gloo's workers at exit",
    )
    parser.add_argument(
        "--load", type=int, default=0, help="busy processes competing for the cores (default 0)"
    )
    parser.add_argument(
        "--emulate-net",
        metavar="RATE[,LATENCY]",
        help="run inside a network namespace whose loopback is limited to RATE (sapipe-launch's)",
    )
    parser.add_argument(
        "--job-timeout", type=float, default=120.0, help="a job still running then is killed"
    )
    parser.add_argument(
        "--no-backtraces",
        dest="backtraces",
        action="store_false",
        help="do not run gdb on the cores of aborted ranks",
    )
    parser.add_argument(
        "--keep-cores", metavar="DIR", help="copy the folders of jobs that dumped core here"
    )
    parser.add_argument(
        "--json", metavar="PATH", help="write every job's record here ('-': stdout, no table)"
    )
    args = parser.parse_args(argv)
    if args.emulate_net and not os.environ.get("SAPIPE_EXIT_STRESS_IN_NETNS"):
        from sapipe.launch import netns

        spec = netns.parse_spec(args.emulate_net)
        ok, why = netns.check(spec)
        if not ok:
            raise SystemExit(f"exit_stress: cannot emulate {args.emulate_net}: {why}")
        argv_in = [sys.executable, os.path.abspath(__file__)] + (
            argv if argv is not None else sys.argv[1:]
        )
        env = dict(os.environ, SAPIPE_EXIT_STRESS_IN_NETNS="1")
        return subprocess.run(netns.wrap(argv_in, spec), env=env).returncode
    start = time.monotonic()
    results = run_jobs(args)
    if args.json == "-":
        json.dump(results, sys.stdout)
        return 0
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    print(summary(results))
    print(
        f"{len(results)} jobs, load {args.load}, peer {args.peer}"
        f"{', starved' if args.starve else ''}"
        f"{', without the exit guard' if not args.guard else ''}"
        f"{', link ' + args.emulate_net if args.emulate_net else ''}, "
        f"{time.monotonic() - start:.0f} s"
    )
    for record in [r for r in results if any(crashed(rank) for rank in r["ranks"])][:3]:
        for r, rank in enumerate(record["ranks"]):
            if crashed(rank):
                print(
                    f"\njob {record['run']} ({record['setup']}, {record['ending']}) rank {r}: "
                    f"exit {rank['exit']}\n{str(rank['output'])[-1500:]}"
                )
        for core, text in record.get("backtraces", {}).items():
            print(f"\n{core}:\n{text[-6000:]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
