"""Elastic averaging vs DDP and sapipe on a link slower than the compute: steps/s and final loss.

    python benchmarks/elastic.py                      # as root: T_comm = 4 T_compute, 3 seeds
    python benchmarks/elastic.py --ratios 1.6 --out benchmarks/results/elastic_1.6x.md
    python benchmarks/elastic.py --quick              # a smoke run (1 seed, 48 steps)
    python benchmarks/elastic.py --check              # exit 0 if this host can run it

**Needs root, network namespaces and tc** (``apt-get install iproute2 util-linux``); where
any is missing it says which and exits 2 (``--check``: 1), running nothing.

**The link.** The whole benchmark re-runs itself in a fresh network namespace
(``unshare -n``) whose loopback is shaped by tc as ``sapipe-launch --emulate-net`` shapes
it (:mod:`sapipe.launch.netns`: a tbf of rate R, the aggregate of both ranks). It first
times T_compute, one training step of a rank (forward, backward, the optimizer's step) with
both ranks computing and nothing sent (a job's median step, the faster of two jobs). Then,
for each ``--ratios`` r, it sets R so that T_comm, one all-reduce of the model's float32
parameters on the shaped link (median of 5, timed on its own), is r · T_compute: from the
tbf arithmetic (a 2-rank ring all-reduce of S bytes puts 2S on the shaped queue), then
corrected by what is measured until within 5% (at most 5 timings); the table gives the
ratio reached.

**The task**: the convergence benchmark's ``lm`` task made 4x wider (benchmarks/
convergence_tasks.py: the byte-level Transformer on the standard library's source, here
width 128, context 64, batch 8 per rank: 0.47 M parameters, 1.9 MB, so that an all-reduce
is 15x tc's 256 KiB burst and the burst does not shape the timing), Adam(lr=3e-3), 2 ranks,
each drawing its own batches from a generator seeded by (seed, rank); the same batches in
every mode. After ``--steps`` steps, the test loss (cross entropy per byte on the held-out
windows) of what each mode trains for: DDP's and sapipe's model, elastic averaging's centre.

**Modes** (``--modes``):

* ``ddp`` — ``DistributedDataParallel``;
* ``sapipe`` — ``sapipe.DistributedOptimizer(stale_layers="auto")``;
* ``ea2``, ``ea3``, ``ea4``, ``ea16`` — ``sapipe.ElasticAveraging(period=2, 3, 4 or 16)``,
  α = 0.9/n (β = 0.9), each sum overlapped with the next period;
* ``ea4-sync`` — the same as ``ea4`` but each sum waited for at once (``overlap=False``):
  the same trajectory (so the same loss), the cost of not overlapping;
* ``ea4-beta1`` — ``ea4`` with α = 1/n = 0.5 (β = 1: the centre becomes the ranks' mean at
  each sync, each rank moves half way to the old centre);
* ``torchft-localsgd4``, ``torchft-diloco16`` — torchft's ``LocalSGD`` / ``DiLoCo``, where
  ``torchft`` imports (it needs its lighthouse, started here in the namespace); else the row
  says why not.

steps/s is rank 0's over steps 31..S (sapipe's "auto" decides within 30), the mean of
the seeds; the table also gives each mode's seconds blocked on communication per step
where the mode reports it. Every rank's collectives have a 300 s limit.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import harness

UNAVAILABLE = 2
LIMIT_SECONDS = 300
WIDTH, CONTEXT, BATCH, LR = 128, 64, 8, 3e-3
MEASURED_FROM = 30  # steps timed: MEASURED_FROM + 1 .. S
CALIBRATIONS = 5  # at most this many all-reduces timed to set the link's rate
EVAL_WINDOWS = 128
MODES = (
    "ddp",
    "sapipe",
    "ea2",
    "ea3",
    "ea4",
    "ea16",
    "ea4-sync",
    "ea4-beta1",
    "torchft-localsgd4",
    "torchft-diloco16",
)


# ------------------------------------------------------------------ the host


def why_unavailable() -> str:
    """Why this host cannot run the benchmark ('' if it can)."""
    if os.geteuid() != 0:
        return "elastic needs root (a network namespace whose loopback tc shapes); run as root"
    missing = [b for b in ("unshare", "ip", "tc") if shutil.which(b) is None]
    if missing:
        return f"elastic needs {', '.join(missing)} (apt-get install iproute2 util-linux)"
    from sapipe.launch import netns

    ok, why = netns.check()
    return "" if ok else f"elastic cannot shape a namespace's loopback: {why}"


def shape(rate_bits: float | None) -> None:
    """The namespace's loopback shaped to ``rate_bits`` (None: unshaped)."""
    from sapipe.launch import netns

    subprocess.run(["tc", "qdisc", "del", "dev", "lo", "root"], capture_output=True)
    for command in netns.tc_commands(netns.NetSpec(rate_bits)):
        subprocess.run(command, check=True, capture_output=True)


# ------------------------------------------------------------------ one rank


def _text():
    """(train, test windows x, test windows y) of the lm task's text."""
    import convergence_tasks as ct
    import torch

    train, test = ct.load_stdlib_text()
    starts = torch.linspace(0, test.numel() - CONTEXT - 2, EVAL_WINDOWS).long().tolist()
    x_test = torch.stack([test[s : s + CONTEXT] for s in starts])
    y_test = torch.stack([test[s + 1 : s + CONTEXT + 1] for s in starts])
    return train, x_test, y_test


def _batch(train, generator):
    import torch

    starts = torch.randint(0, train.numel() - CONTEXT - 1, (BATCH,), generator=generator).tolist()
    return (
        torch.stack([train[s : s + CONTEXT] for s in starts]),
        torch.stack([train[s + 1 : s + CONTEXT + 1] for s in starts]),
    )


def _loss(model, x, y):
    import convergence_tasks as ct
    import torch.nn.functional as F

    return F.cross_entropy(model(x).reshape(-1, ct.VOCAB), y.reshape(-1))


def rank_main(rank: int, port: int, job: dict[str, Any], out: str) -> None:
    """One rank of one job: ``job["mode"]`` for ``job["steps"]`` steps; writes its result."""
    from datetime import timedelta

    import convergence_tasks as ct
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=LIMIT_SECONDS))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=LIMIT_SECONDS)
    )
    mode, steps, seed = job["mode"], job["steps"], job["seed"]
    result: dict[str, Any] = {"mode": mode}
    if mode == "allreduce":  # T_comm: the model's parameters, summed on their own
        torch.manual_seed(0)
        numel = sum(p.numel() for p in ct.CharLM(context=CONTEXT, d=WIDTH).parameters())
        flat = torch.ones(numel)
        times = []
        for _ in range(6):
            dist.barrier()
            start = time.perf_counter()
            dist.all_reduce(flat)
            times.append(time.perf_counter() - start)
        result.update(seconds=statistics.median(times[1:]), bytes=4 * numel)
        _finish(result, out, rank)
        return
    train, x_test, y_test = _text()
    torch.manual_seed(seed)
    model = ct.CharLM(context=CONTEXT, d=WIDTH)
    inner = torch.optim.Adam(model.parameters(), lr=LR)
    opt, net, finish = _wrap(mode, model, inner, rank, job)
    generator = torch.Generator().manual_seed(seed * 1000 + rank)
    times, losses = [], []
    for _ in range(steps):
        x, y = _batch(train, generator)
        start = time.perf_counter()
        opt.zero_grad()
        loss = _loss(net, x, y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    with finish() as evaluated, torch.no_grad():
        test_loss = _loss(evaluated, x_test, y_test).item()
    timed = times[MEASURED_FROM:]
    result.update(
        steps_per_s=len(timed) / sum(timed),
        step_ms=1e3 * statistics.median(timed),
        train_loss=statistics.fmean(losses[-20:]),
        test_loss=test_loss,
        wait_ms=1e3 * getattr(opt, "communication_wait", float("nan")) / steps,
        detail=_detail(mode, opt),
    )
    _finish(result, out, rank, opt)


def _wrap(mode: str, model, inner, rank: int, job: dict[str, Any]):
    """(the object stepped, the module called, a context manager giving what to evaluate)."""
    import contextlib

    import torch

    import sapipe
    from sapipe.elastic import ElasticAveraging

    if mode == "local":
        return inner, model, lambda: contextlib.nullcontext(model)
    if mode == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        return inner, ddp, lambda: contextlib.nullcontext(model)
    if mode == "sapipe":
        opt = sapipe.DistributedOptimizer(inner, model, stale_layers="auto", timeout=LIMIT_SECONDS)

        @contextlib.contextmanager
        def real():
            opt.synchronize()
            with opt.real_weights():
                yield model

        return opt, model, real
    if mode.startswith("ea"):
        period = int(mode[2:].split("-")[0])
        opt = ElasticAveraging(
            inner,
            model,
            period=period,
            alpha=0.5 if mode.endswith("-beta1") else None,  # β = 2α = 1, else the default 0.9
            overlap=not mode.endswith("-sync"),
            timeout=LIMIT_SECONDS,
        )
        return opt, model, opt.centre_weights
    if mode.startswith("torchft-"):
        return _torchft(mode, model, inner, rank, job)
    raise ValueError(mode)


def _torchft(mode: str, model, inner, rank: int, job: dict[str, Any]):
    """torchft's LocalSGD (``torchft-localsgdN``) or DiLoCo (``torchft-dilocoN``, outer
    optimizer Nesterov SGD lr 0.7 momentum 0.9 as in the DiLoCo paper), each rank a replica
    group of one with a TCPStore of its own, through the lighthouse the parent started."""
    import contextlib
    from datetime import timedelta

    os.environ.setdefault("RUST_LOG", "warn")  # torchft's runtime logs every quorum at INFO
    import torch
    import torch.distributed as dist
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo, LocalSGD

    every = int("".join(c for c in mode if c.isdigit()))
    store = dist.TCPStore("127.0.0.1", 0, 1, True, wait_for_workers=False)
    limit = timedelta(seconds=LIMIT_SECONDS)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=limit),
        min_replica_size=2,
        load_state_dict=model.load_state_dict,
        state_dict=model.state_dict,
        replica_id=f"replica{rank}",
        lighthouse_addr=job["lighthouse"],
        store_addr="127.0.0.1",
        store_port=store.port,
        rank=0,
        world_size=1,
        use_async_quorum=False,
        hostname="localhost",
        timeout=limit,
        quorum_timeout=limit,
    )
    if "localsgd" in mode:
        wrapper: Any = LocalSGD(manager, model, inner, sync_every=every)
    else:
        outer = torch.optim.SGD(model.parameters(), lr=0.7, momentum=0.9, nesterov=True)
        wrapper = DiLoCo(manager, [model], inner, outer, sync_every=every)
    wrapper.__enter__()  # its hooks on the inner optimizer's step() sync every N steps

    @contextlib.contextmanager
    def done():
        wrapper.__exit__(None, None, None)
        yield model
        manager.shutdown(wait=False)
        keep.clear()

    keep = [store]  # the replica group's store lives as long as its manager

    return inner, model, done


LIGHTHOUSE = """
import sys, time
from torchft.coordination import LighthouseServer
server = LighthouseServer(bind="[::]:" + sys.argv[1], min_replicas=2)
print("ready", flush=True)
time.sleep(3600)
"""


def start_lighthouse() -> tuple[subprocess.Popen, str]:
    """torchft's lighthouse in a process of its own (its threads must not be forked into the
    ranks); the process and the address the managers reach it at."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    process = subprocess.Popen(
        [sys.executable, "-c", LIGHTHOUSE, str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert process.stdout is not None
    if process.stdout.readline().strip() != "ready":
        raise RuntimeError("torchft's lighthouse did not start")
    return process, f"http://localhost:{port}"


def _detail(mode: str, opt) -> str:
    if mode == "sapipe":
        return f"k={opt.stale_layers}/{opt.num_layers}"
    return ""


def _finish(result: dict[str, Any], out: str, rank: int, opt=None) -> None:
    import torch.distributed as dist

    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if opt is not None and hasattr(opt, "close"):
        opt.close()
    dist.destroy_process_group()


# ------------------------------------------------------------------ jobs (in the namespace)


def run_job(job: dict[str, Any]) -> dict[str, Any]:
    """Fork the two ranks, host their store, wait; rank 0's result."""
    out = tempfile.mkdtemp(prefix="sapipe-elastic-")
    codes = harness.fork_ranks(rank_main, job, out)
    if any(codes):
        raise RuntimeError(f"job {job} failed (exit codes {codes})")
    with open(os.path.join(out, "rank0.json")) as f:
        result = json.load(f)
    shutil.rmtree(out)
    return result


def torchft_missing() -> str:
    """Why torchft's modes cannot run ('' where they can); tried in a process of its own, so
    that this one, which forks the ranks, never loads torchft's runtime."""
    probe = "import torchft.coordination, torchft.local_sgd, torchft.manager"
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["?"])[-1]
        return f"torchft does not import here ({last}); pip install torchft"
    return ""


def measure(args) -> dict[str, Any]:
    """Everything, inside the namespace: T_compute, then per ratio the rate, T_comm and every
    mode for every seed."""
    import torch  # noqa: F401 - imported once, before the forks

    import sapipe  # noqa: F401

    gc.freeze()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    shape(None)
    modes = [m for m in args.modes.split(",") if m]
    seeds = [int(s) for s in args.seeds.split(",")]
    ratios = [float(r) for r in args.ratios.split(",")]
    skipped = {}
    lighthouse = address = None
    if any(m.startswith("torchft") for m in modes):
        why = torchft_missing()
        if why:
            skipped = {m: why for m in modes if m.startswith("torchft")}
        else:
            lighthouse, address = start_lighthouse()
    # twice, the faster kept: the first job of the process pays one-off costs
    t_compute = 1e-3 * min(
        run_job({"mode": "local", "steps": MEASURED_FROM + 50, "seed": 0})["step_ms"]
        for _ in range(2)
    )
    report: dict[str, Any] = {
        "t_compute_ms": 1e3 * t_compute,
        "command": harness.command([a for a in sys.argv[1:] if a != "--inside"]),
        "steps": args.steps,
        "seeds": seeds,
        "skipped": skipped,
        "links": [],
    }
    for ratio in ratios:
        probe = run_job({"mode": "allreduce", "steps": 0, "seed": 0})
        size = probe["bytes"]
        rate = 2 * size * 8 / (ratio * t_compute)  # a 2-rank ring puts 2S on the queue
        for _ in range(CALIBRATIONS):  # the arithmetic, then corrections by what was measured
            shape(rate)
            t_comm = run_job({"mode": "allreduce", "steps": 0, "seed": 0})["seconds"]
            if abs(t_comm / (ratio * t_compute) - 1) < 0.05:
                break
            rate *= t_comm / (ratio * t_compute)
        link = {
            "ratio": ratio,
            "measured_ratio": t_comm / t_compute,
            "rate_mbit": rate / 1e6,
            "t_comm_ms": 1e3 * t_comm,
            "runs": [],
        }
        for seed in seeds:
            for mode in modes:
                if mode in skipped:
                    continue
                job = {"mode": mode, "steps": args.steps, "seed": seed}
                if address is not None:
                    job["lighthouse"] = address
                started = time.monotonic()
                result = run_job(job)
                result.update(seed=seed, wall_s=time.monotonic() - started)
                link["runs"].append(result)
                print(
                    f"ratio {ratio:g} seed {seed} {mode}: {result['steps_per_s']:.2f} steps/s, "
                    f"test loss {result['test_loss']:.4f} ({result['wall_s']:.0f} s)",
                    file=sys.stderr,
                    flush=True,
                )
        report["links"].append(link)
    shape(None)
    if lighthouse is not None:
        lighthouse.terminate()  # this process's own child, by its handle
        lighthouse.wait()
    return report


def table(report: dict[str, Any]) -> str:
    """The report as Markdown."""
    lines = [
        f"T_compute = {report['t_compute_ms']:.1f} ms per step (2 ranks, nothing sent); "
        f"{report['steps']} steps, seeds {report['seeds']}; steps/s over steps "
        f"{MEASURED_FROM + 1}..{report['steps']}, mean over seeds (± their spread where > 1)",
        "",
    ]
    for link in report["links"]:
        lines += [
            f"**T_comm ≈ {link['ratio']:g} × T_compute**: {link['rate_mbit']:.1f} Mbit/s "
            f"(aggregate); one all-reduce of the parameters, timed alone, "
            f"{link['t_comm_ms']:.0f} ms = {link['measured_ratio']:.2f} × T_compute",
            "",
            "| mode | steps/s | vs DDP | median step | blocked on comm / step "
            "| final train loss | test loss | note |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        by_mode: dict[str, list[dict[str, Any]]] = {}
        for run in link["runs"]:
            by_mode.setdefault(run["mode"], []).append(run)
        ddp_runs = by_mode.get("ddp", [])
        ddp = statistics.fmean(r["steps_per_s"] for r in ddp_runs) if ddp_runs else None
        for mode, runs in by_mode.items():
            speed = [r["steps_per_s"] for r in runs]
            mean = statistics.fmean(speed)
            wait = statistics.fmean(r["wait_ms"] for r in runs)
            notes = sorted({r["detail"] for r in runs if r["detail"]})
            lines.append(
                f"| {mode} | {_spread(speed, '{:.2f}')} | "
                f"{'' if ddp is None else f'{mean / ddp:.2f}x'} | "
                f"{statistics.fmean(r['step_ms'] for r in runs):.0f} ms | "
                f"{'' if math.isnan(wait) else f'{wait:.0f} ms'} | "
                f"{_spread([r['train_loss'] for r in runs], '{:.3f}')} | "
                f"{_spread([r['test_loss'] for r in runs], '{:.3f}')} | {', '.join(notes)} |"
            )
        for mode, why in report["skipped"].items():
            lines.append(f"| {mode} | not run | | | | | | {why} |")
        lines.append("")
    return "\n".join(lines)


def _spread(values: list[float], fmt: str) -> str:
    mean = fmt.format(statistics.fmean(values))
    if len(values) < 2:
        return mean
    return f"{mean} ± {fmt.format((max(values) - min(values)) / 2)}"


def main() -> None:
    parser = harness.Parser(
        __doc__,
        quick=dict(ratios="4", seeds="0", steps=48, modes="ddp,sapipe,ea4,torchft-localsgd4"),
        json=True,
        out=harness.result_path("elastic.md"),
    )
    parser.add_argument("--ratios", default="4", help="T_comm / T_compute of each link")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument(
        "--steps", type=int, default=160, help="a multiple of 16: every mode ends at a sync"
    )
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument(
        "--check", action="store_true", help="only say whether this host can run it"
    )
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps <= MEASURED_FROM:
        parser.error(f"--steps must exceed {MEASURED_FROM} (the steps not timed)")
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        parser.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.inside:
        report = measure(args)
        if args.json:
            print(json.dumps(report))
        else:
            harness.emit(f"`{report['command']}`\n\n" + table(report), args.out)
        return
    reason = why_unavailable()
    if args.check:
        print(reason or "ok: a network namespace's loopback can be shaped here")
        raise SystemExit(1 if reason else 0)
    if reason:
        print(reason, file=sys.stderr)
        raise SystemExit(UNAVAILABLE)
    command = [sys.executable, os.path.abspath(__file__), "--inside", *sys.argv[1:]]
    # the benchmarks' allocator settings (harness.STEADY_MALLOC), for this process and its ranks
    os.execvpe("unshare", ["unshare", "-n", *command], harness.worker_env())


if __name__ == "__main__":
    main()
