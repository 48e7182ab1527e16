"""The sweep: per model a calibration probe, then one ``torchrun`` job per bandwidth, each in
a fresh network namespace with a shaped loopback (:mod:`sapipe.launch.netns`); then the
``--clusters`` jobs, each on emulated nodes (:mod:`sapipe.launch.cluster`)."""

from __future__ import annotations

import copy
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from typing import Any

import bench_models
import harness

from sapipe.launch import cluster, netns

from . import ENTRY, PROGRESS_TAG, REPO, RESULTS_DIR
from .report import report

PROBE_COST = 0.15  # a calibration probe, in jobs (for the progress bar)


class Progress:
    """One-line progress bar on stderr (plain lines when not a terminal)."""

    def __init__(self, total: float):
        self.total, self.done, self.start = max(1, total), 0, time.time()
        self.tty = sys.stderr.isatty()
        self.last_print = 0.0

    def update(self, advance: float, text: str, at: float | None = None):
        self.done = at if at is not None else self.done + advance
        frac = min(1.0, self.done / self.total)
        el = time.time() - self.start
        eta = el / frac - el if frac > 0.01 else float("nan")
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        line = f"[{bar}] {100 * frac:5.1f}% {el / 60:5.1f} min, ~{eta / 60:4.1f} min left | {text}"
        if self.tty:
            print("\r" + line[:150].ljust(150), end="", file=sys.stderr, flush=True)
        elif time.time() - self.last_print > 20 or not text.split(": ")[-1].startswith("round"):
            print(line, file=sys.stderr, flush=True)  # a log, not a terminal: a line now and then
            self.last_print = time.time()

    def close(self):
        if self.tty:
            print(file=sys.stderr)


def worker_argv(args, model: str, json_path: str, extra: list[str]) -> list[str]:
    """The torchrun command of one job (``extra``: --probe, or --rate/--target-ratio)."""
    script, *rest = bench_argv(args, model, json_path, extra)
    return harness.torchrun(args.nproc, script, *rest)


def cluster_argv(args, topology: str, model: str, json_path: str, extra: list[str]) -> list[str]:
    """One emulated multi-node job: ``sapipe-launch --emulate-cluster`` around the worker. Its
    ranks share this host's cores, so it runs the modes that compare sums, not all of them:
    the baselines, k = 0 and k = m, sapipe-auto summing node first and flat."""
    lean = copy.copy(args)
    lean.k, lean.compressions, lean.backends = "0,m", "", ""
    lean.skip = set(args.skip) | {"comp", "deferred", "horovod"}
    return [
        sys.executable,
        "-m",
        "sapipe.launch",
        "--quiet",
        "--emulate-cluster",
        topology,
        "--inter-node",
        args.inter_node,
        "--monitor-interval=0.5",
        *bench_argv(lean, model, json_path, extra),
    ]


def bench_argv(args, model: str, json_path: str, extra: list[str]) -> list[str]:
    """The worker's own command line (what follows torchrun's options)."""
    cmd = [
        ENTRY,
        "--models",
        model,
        "--size",
        args.size,
        "--batch",
        str(args.batch),
        "--k",
        args.k,
        "--compensations",
        args.compensations,
        "--warmup",
        str(args.warmup),
        "--auto-warmup",
        str(args.auto_warmup),
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--threads",
        str(args.threads),
        "--device",
        args.device,
        "--bucket-cap-mb",
        str(args.bucket_cap_mb),
        "--timeout",
        str(args.timeout),
        "--result",
        json_path,
    ]
    if args.skip:
        cmd += ["--skip", ",".join(sorted(args.skip))]
    if args.backends:
        cmd += ["--backends", args.backends]
    cmd += ["--compressions", args.compressions]  # even when empty: the worker's default has some
    if args.trace:
        cmd += ["--trace", os.path.abspath(args.trace)]
    return cmd + extra


def launch(
    args, argv: list[str], bits: float | None, log, on_event=None, cluster: bool = False
) -> int:
    """Run one job (in a namespace whose loopback carries ``bits``/s, unless --no-netns, or
    ``cluster``: ``argv`` builds its own emulated nodes); its output goes to ``log``, its
    progress events to ``on_event``."""
    env = harness.worker_env(
        SAPIPE_BENCH_PROGRESS="1",
        OMP_NUM_THREADS=str(args.threads),
        PYTHONUNBUFFERED="1",
        TORCHELASTIC_ERROR_FILE="",
    )
    if not args.no_netns and not cluster:
        env["GLOO_SOCKET_IFNAME"] = "lo"
        env["MASTER_ADDR"] = "127.0.0.1"
        argv = netns.wrap(argv, netns.NetSpec(bits))
    log.write(f"\n$ {shlex.join(argv)}\n")
    log.flush()
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(PROGRESS_TAG):
            if on_event:
                on_event(json.loads(line[len(PROGRESS_TAG) :]))
        else:
            log.write(line)
    return proc.wait()


def cluster_jobs(args, models: list[str]) -> list[tuple[str, str]]:
    """(model, NODESxRANKS) of each ``--clusters`` job this host can run (none, with a note,
    where it cannot build an emulated cluster)."""
    jobs = [
        (m, t)
        for t in args.clusters.split(",")
        if t
        for m in args.cluster_models.split(",")
        if m in models
    ]
    if jobs and not args.no_netns:
        ok, why = cluster.check()
        if not ok:
            print(f"--clusters skipped: {why}", file=sys.stderr)
            return []
    return jobs if not args.no_netns else []


class Sweep:
    """Every model × bandwidth job of one sweep, with their logs and raw results."""

    def __init__(self, args, models: list[str]):
        self.args = args
        self.log_path = os.path.join(tempfile.gettempdir(), f"sapipe-throughput-{os.getpid()}.log")
        self.log = open(self.log_path, "w")
        self.explicit = (
            [netns.parse_rate(b) for b in args.bandwidths.split(",") if b.strip()]
            if args.bandwidths
            else None
        )
        if args.no_netns:
            self.explicit = [None]
        self.ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
        n_bw = len(self.explicit) if self.explicit else len(self.ratios)
        self.probe_cost = 0.0 if self.explicit else PROBE_COST
        self.clusters = cluster_jobs(args, models)
        self.progress = Progress(len(models) * (n_bw + self.probe_cost) + len(self.clusters))
        self.jobs: list[dict[str, Any]] = []
        self.calib: dict[str, Any] = {}
        self.tmp = tempfile.mkdtemp(prefix="sapipe-bench-json-")

    def rates(self, model: str) -> list[tuple[float | None, float | None]]:
        """(bits/s or None for unlimited, target ratio or None) of each job of ``model``."""
        if self.explicit:
            return [(b, None) for b in self.explicit]
        probe = self.calibrate(model)
        if probe is None:
            return []
        # A ring all-reduce puts 2(n-1)·S bytes on the one shaped loopback. Its CPU work (the
        # floor, T(∞)) runs while the bytes wait for the shaper, so T(R) = max(floor,
        # 16(n-1)S/R): at gpt2's 2.29 and 1.86 Gbit/s the all-reduce took the wire time alone
        # within 1%, where floor + wire (the model this replaces) landed 1.6 at 1.3.
        wire_bits = 16 * (probe["world"] - 1) * probe["grad_bytes"]
        rates: list[tuple[float | None, float | None]] = []
        for r in self.ratios:
            target = r * probe["t_local"]
            if target <= 1.05 * probe["t_comm_floor"]:
                rates.append((None, r))  # the all-reduce floor alone reaches the target
            else:
                rates.append((wire_bits / target, r))
        return rates

    def calibrate(self, model: str) -> dict[str, Any] | None:
        """The probe job's T_compute and all-reduce floor (None when it failed)."""
        self.progress.update(0, f"{model}: calibrating (probe job)")
        path = os.path.join(self.tmp, f"{model}-probe.json")
        rc = launch(self.args, worker_argv(self.args, model, path, ["--probe"]), None, self.log)
        self.progress.update(self.probe_cost, f"{model}: calibrated")
        if rc != 0 or not os.path.exists(path):
            print(f"\n{model}: probe job failed (rc {rc}); see {self.log_path}", file=sys.stderr)
            return None
        with open(path) as f:
            probe = json.load(f)[0]
        self.calib[model] = probe
        return probe

    def run_job(self, model: str, bits: float | None, ratio: float | None) -> None:
        """One job: every mode of ``model`` at ``bits``/s; its result joins ``self.jobs``."""
        path = os.path.join(self.tmp, f"{model}-{int(bits or 0)}.json")
        label = netns.format_rate(bits) if not self.args.no_netns else "not emulated"
        extra = ["--rate", label] + (["--target-ratio", str(ratio)] if ratio is not None else [])
        self._run(model, label, worker_argv(self.args, model, path, extra), path, bits)

    def run_cluster_job(self, model: str, topology: str) -> None:
        """One emulated multi-node job of ``model`` (``--clusters``); it joins ``self.jobs``."""
        path = os.path.join(self.tmp, f"{model}-{topology}.json")
        bits = netns.parse_rate(self.args.inter_node)
        label = f"{topology} nodes, {netns.format_rate(bits)} between"
        argv = cluster_argv(self.args, topology, model, path, ["--rate", label])
        self._run(model, label, argv, path, bits, cluster=True)

    def _run(
        self,
        model: str,
        label: str,
        argv: list[str],
        path: str,
        bits: float | None,
        cluster: bool = False,
    ) -> None:
        base = self.progress.done

        def on_event(ev):
            if ev["event"] == "mode":
                r = ev["result"]
                t = f"{1e3 * r['t']:.0f} ms" if r.get("t") else (r.get("note") or "skipped")[:40]
                self.progress.update(
                    0,
                    f"{model} @ {label}: round {ev['round']}/{ev['rounds']} {r['mode']} {t}",
                    at=base + min(1.0, ev["i"] / max(1, ev["n"])),
                )

        self.progress.update(0, f"{model} @ {label}: starting")
        rc = launch(self.args, argv, bits, self.log, on_event, cluster=cluster)
        self.progress.update(0, f"{model} @ {label}: done", at=base + 1)
        if rc != 0 or not os.path.exists(path):
            print(
                f"\n{model} @ {label}: job failed (rc {rc}); see {self.log_path}", file=sys.stderr
            )
            return
        with open(path) as f:
            job = json.load(f)[0]
        job["rate_bits"] = bits
        self.jobs.append(job)

    def close(self) -> None:
        self.progress.close()
        self.log.close()

    def save(self, meta: dict[str, Any]) -> str:
        """The raw results, for ``--render``."""
        saved = os.path.join(self.tmp, "sweep.json")
        with open(saved, "w") as f:
            json.dump({"meta": meta, "jobs": self.jobs, "calib": self.calib}, f, indent=1)
        return saved


def orchestrate(args) -> int:
    """The whole sweep; the report goes to ``--out`` (default benchmarks/results)."""
    models = [m for m in args.models.split(",") if m]
    for m in models:
        bench_models.build(m, args.size)  # fail early on a bad name
    out_dir = args.out or (tempfile.mkdtemp(prefix="sapipe-bench-") if args.quick else RESULTS_DIR)
    os.makedirs(out_dir, exist_ok=True)
    if not args.no_netns:
        ok, why = netns.check()
        if not ok:
            print(
                f"cannot emulate the network: {why}\n(use --no-netns to run without emulation)",
                file=sys.stderr,
            )
            return 2
        print(f"network emulation: {why}", file=sys.stderr)
    sweep = Sweep(args, models)
    print(f"log: {sweep.log_path}", file=sys.stderr)
    t_start, load_start = time.time(), os.getloadavg()
    for model in models:
        for bits, ratio in sweep.rates(model):
            sweep.run_job(model, bits, ratio)
    for model, topology in sweep.clusters:
        sweep.run_cluster_job(model, topology)
    sweep.close()
    if not sweep.jobs:
        print(f"no job finished; see {sweep.log_path}", file=sys.stderr)
        return 1
    meta = {
        "argv": sys.argv[1:],
        "seconds": time.time() - t_start,
        "load": [load_start, os.getloadavg()],
        "finished": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
    }
    saved = sweep.save(meta)
    print(f"raw results: {saved} (re-render with --render {saved})", file=sys.stderr)
    return report(args, sweep.jobs, sweep.calib, out_dir, meta)
