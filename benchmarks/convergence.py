"""Convergence benchmark: does partial staleness + compensation train as well as sync?

Trains each task of ``convergence_tasks.py`` with 4 ranks (Gloo, CPU) in these modes:

* ``sync``     k = 0: fully synchronous (sapipe equals DDP there)
* ``pipesgd``  k = m, compensation ``none``: every layer one step stale (Pipe-SGD)
* ``none``     sapipe's partial staleness alone (the fixed k below, no compensation), a
  reference column: how much of the gap the compensation closes
* ``dc``, ``wp1``, ``wp2``, ``wp3``, ``t2``: sapipe with the fixed k (default ``--k half``:
  k = m // 2, the first half of the layers in forward order) and that compensation,
  λ = 0.2 (the library default) for ``dc`` and ``wp3``
* ``auto``     the same k, ``compensation="auto"``: each stale bucket's prediction chosen
  online among none / wp1 / wp2 / wp3 (docs/design.md §3.14)

plus a λ sweep of ``dc`` and ``wp3`` on the task where staleness hurts (``--sweep-task``),
and the compression study: each task's best mode (``Task.best_mode``) also runs with
``compression="bf16"`` (``<mode>+bf16``), ``"int8"`` (``<mode>+int8``, error feedback on) and
``"int8", error_feedback=False`` (``<mode>+int8-noEF``), beside ``sync`` and the
uncompressed mode of the same seeds. ``--study main`` or ``--study compression`` runs one
of the two studies alone (default ``all``: both). A task runs in the studies its
``Task.studies`` names: ``units`` (a single layer, so its best mode is ``sync``) exists to
show what error feedback is for and runs in the compression study only.

Structure: one ``torchrun --standalone --nproc_per_node=4`` launch per (task, seed) runs
every mode inside the same process group (re-seeding and rebuilding model and optimizer,
with a fresh ``sapipe.DistributedOptimizer`` per mode); rank 0 writes one JSON file per
(task, seed). The ``report`` step (plain Python) aggregates those files into a markdown
report (``results/convergence.md``; ``results/convergence_compression.md`` when only the
compression study ran) with tables, plots and a λ-sweep table.

    python benchmarks/convergence.py                 # everything (make convergence)
    python benchmarks/convergence.py --quick         # smoke run, < 2 minutes
    python benchmarks/convergence.py --study compression   # the compression study alone
    python benchmarks/convergence.py report --out build/convergence
    python benchmarks/convergence.py --k auto        # pass stale_layers="auto" to sapipe

``--k`` takes ``half`` (m // 2), an int, or ``auto`` (handed to sapipe unchanged, for its
scheduler; the k sapipe actually used is read back from ``opt.stale_layers`` and recorded).
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import harness

HERE = Path(harness.BENCH_DIR)
REPO = Path(harness.REPO)

MAIN_MODES = ["sync", "pipesgd", "none", "dc", "wp1", "wp2", "wp3", "t2", "auto"]
SAPIPE_MODES = ["dc", "wp1", "wp2", "wp3", "t2", "auto"]
STUDIES = ("all", "main", "compression")
MAIN_COLORS = dict(
    sync="black",
    pipesgd="tab:red",
    none="tab:orange",
    dc="tab:blue",
    wp1="tab:green",
    wp2="tab:olive",
    wp3="tab:purple",
    t2="tab:brown",
    auto="tab:cyan",
)
# sync, the uncompressed best mode, then COMPRESSED_VARIANTS in order
COMPRESSION_COLORS = ["black", "tab:green", "tab:blue", "tab:orange", "tab:red"]
# The compression study's variants of a task's best mode: (name suffix, compression=,
# error_feedback=). None leaves error feedback at sapipe's default (on for int8).
COMPRESSED_VARIANTS = [("bf16", "bf16", None), ("int8", "int8", None), ("int8-noEF", "int8", False)]
DEFAULT_LAMBDA = 0.2
DEFAULT_LAMBDAS = [0.0, 0.1, 0.2, 0.5, 1.0]
DEFAULT_OUT = REPO / "build" / "convergence"
QUICK_OUT = REPO / "build" / "convergence-quick"
RESULTS = HERE / "results"


# ============================================================================ modes


def _spec(
    name: str,
    k: str,
    compensation: str,
    dc_lambda: float = DEFAULT_LAMBDA,
    compression: str | None = None,
    error_feedback: bool | None = None,
) -> dict[str, Any]:
    """One run of a launch: its name in the report and its ``DistributedOptimizer`` settings."""
    return dict(
        name=name,
        k=k,
        compensation=compensation,
        dc_lambda=dc_lambda,
        compression=compression,
        error_feedback=error_feedback,
    )


def main_specs(k_arg: str, sweep: bool, lambdas: list[float]) -> list[dict[str, Any]]:
    """The main study: sync, Pipe-SGD, ``none`` and every compensation, plus the λ sweep."""
    specs = [
        _spec("sync", "zero", "none"),
        _spec("pipesgd", "all", "none"),
        _spec("none", k_arg, "none"),
    ]
    specs += [_spec(comp, k_arg, comp) for comp in SAPIPE_MODES]
    if sweep:
        for comp in ("dc", "wp3"):
            for lam in lambdas:
                if lam == DEFAULT_LAMBDA:
                    continue  # the main run already is this point
                specs.append(_spec(f"{comp}@{lam:g}", k_arg, comp, dc_lambda=lam))
    return specs


def compressed_name(best: str, variant: str) -> str:
    """Report name of ``best`` run with a wire format of ``COMPRESSED_VARIANTS``, e.g.
    ``wp1+int8``."""
    return f"{best}+{variant}"


def compression_specs(k_arg: str, best: str) -> list[dict[str, Any]]:
    """The compression study: sync and the task's best mode uncompressed (the references),
    then the best mode with each wire format of ``COMPRESSED_VARIANTS``. A best mode of
    ``sync`` (a task with one layer) is its own uncompressed reference."""
    k, compensation = ("zero", "none") if best == "sync" else (k_arg, best)
    specs = [_spec("sync", "zero", "none")]
    if best != "sync":
        specs.append(_spec(best, k, compensation))
    specs += [
        _spec(compressed_name(best, variant), k, compensation, compression=fmt, error_feedback=ef)
        for variant, fmt, ef in COMPRESSED_VARIANTS
    ]
    return specs


def mode_specs(
    k_arg: str, best: str, study: str, sweep: bool, lambdas: list[float]
) -> list[dict[str, Any]]:
    """The runs inside one (task, seed) launch, in order; ``k`` is resolved per task.
    ``study``: ``main``, ``compression``, or ``all`` (both; runs they share appear once)."""
    specs = main_specs(k_arg, sweep, lambdas) if study in ("all", "main") else []
    if study in ("all", "compression"):
        names = {spec["name"] for spec in specs}
        specs += [spec for spec in compression_specs(k_arg, best) if spec["name"] not in names]
    return specs


def resolve_k(k: str, m: int):
    if k == "zero":
        return 0
    if k == "all":
        return m
    if k == "half":
        return m // 2
    if k == "auto":
        return "auto"
    return int(k)


# ============================================================================ worker


def worker(args) -> None:
    import torch
    import torch.distributed as dist
    from convergence_tasks import count_layers, get_tasks

    import sapipe

    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    task = get_tasks()[args.task]
    task.load()
    steps = args.steps or (task.quick_steps if args.quick else task.steps)
    eval_every = max(1, min(task.eval_every, steps // 4 if args.quick else task.eval_every))
    lambdas = [float(x) for x in args.lambdas.split(",")] if args.lambdas else DEFAULT_LAMBDAS
    specs = mode_specs(args.k, task.best_mode, args.study, args.sweep, lambdas)
    if args.modes:
        wanted = args.modes.split(",")
        specs = [s for s in specs if s["name"] in wanted]

    record: dict[str, Any] = dict(
        task=task.name,
        title=task.title,
        metric=task.metric,
        higher_is_better=task.higher_is_better,
        optimizer=task.optimizer,
        notes=task.notes,
        seed=args.seed,
        world_size=world,
        threads=args.threads,
        steps=steps,
        eval_every=eval_every,
        batch_per_rank=task.batch,
        k_arg=args.k,
        quick=args.quick,
        best_mode=task.best_mode,
        study=args.study,
        host=platform.node(),
        cpus=os.cpu_count(),
        torch=torch.__version__,
        started=_dt.datetime.now().isoformat(timespec="seconds"),
        runs=[],
    )
    t_launch = time.perf_counter()
    for spec in specs:
        torch.manual_seed(args.seed)
        model = task.build_model()
        m = count_layers(model)
        k = resolve_k(spec["k"], m)
        # Step 0 is scored before sapipe wraps the model, so the layer order sapipe records
        # comes from a training forward on every rank (identical weights on every rank).
        evals: list[dict[str, float]] = []
        if rank == 0:
            evals.append(dict(step=0, time=0.0, **task.evaluate(model)))
        base = task.build_optimizer(model)
        opt = sapipe.DistributedOptimizer(
            base,
            model,
            stale_layers=k,
            compensation=spec["compensation"],
            dc_lambda=spec["dc_lambda"],
            compression=spec["compression"],
            error_feedback=spec["error_feedback"],
        )
        gen = torch.Generator().manual_seed(1000 * args.seed + rank)
        losses: list[float] = []
        step_time: list[float] = []
        load0 = os.getloadavg()[0]
        wall0 = time.perf_counter()
        train_time = 0.0
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            x, y = task.sample(gen)
            opt.zero_grad()
            loss = task.loss(model, x, y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            train_time += time.perf_counter() - t0
            step_time.append(train_time)
            if step % eval_every == 0 or step == steps:
                # Real weights, after the pending synchronous updates; rank 0 scores, the
                # barrier keeps the others from running ahead into the timed steps.
                opt.synchronize()
                if rank == 0:
                    with opt.real_weights():
                        evals.append(dict(step=step, time=train_time, **task.evaluate(model)))
                dist.barrier()
        if opt.num_layers != m:
            raise RuntimeError(
                f"layer count mismatch: sapipe found {opt.num_layers}, benchmark counted {m}"
            )
        k_used = opt.stale_layers
        choice = opt.compensation_choice  # compensation="auto": what it chose, and why
        # Training loss averaged over ranks, per step (one collective, after training).
        gathered: list[Any] = [None] * world
        dist.all_gather_object(gathered, losses)
        mean_loss = [sum(col) / world for col in zip(*gathered, strict=True)]
        if rank == 0:
            final = evals[-1]
            run = dict(
                mode=spec["name"],
                compensation=spec["compensation"],
                dc_lambda=spec["dc_lambda"],
                compression=spec["compression"],
                error_feedback=spec["error_feedback"],
                k=k_used,
                m=m,
                steps=steps,
                train_loss=mean_loss,
                step_time=step_time,
                evals=evals,
                final_metric=final["metric"],
                final_test_loss=final["loss"],
                diverged=not all(math.isfinite(v) for v in mean_loss[-10:]),
                train_s=train_time,
                wall_s=time.perf_counter() - wall0,
                loadavg=[load0, os.getloadavg()[0]],
                compensation_choice=choice,
            )
            record["runs"].append(run)
            print(
                f"[{task.name} seed={args.seed}] {spec['name']:<14} k={k_used}/{m} "
                f"{steps} steps  final {task.metric} {final['metric']:.3f}  "
                f"train loss {sum(mean_loss[-10:]) / 10:.4f}  train {train_time:.1f}s  "
                f"load {load0:.1f}"
                + (
                    "  chose "
                    + ", ".join(f"{b}: {v['choice']}" for b, v in choice["buckets"].items())
                    if choice
                    else ""
                ),
                flush=True,
            )
        del opt, base, model
    if rank == 0:
        record["launch_s"] = time.perf_counter() - t_launch
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{task.name}_seed{args.seed}.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(path)
    dist.barrier()
    # Exit without tearing the process groups down: every DistributedOptimizer above left
    # its last stale all-reduce in flight on its own groups, and a full-run teardown once
    # aborted a rank ("terminate called without an active exception") after the results
    # were written. The results are on disk; nothing else needs a clean shutdown.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ============================================================================ driver


def default_out(quick: bool, study: str) -> Path:
    """Raw JSON directory: one per kind of run, so a compression-only or a quick run never
    overwrites the full run's files."""
    out = QUICK_OUT if quick else DEFAULT_OUT
    return out.with_name(out.name + "-compression") if study == "compression" else out


def task_study(task, study: str) -> str | None:
    """The study a launch of ``task`` runs when ``study`` is asked for: ``study`` itself,
    narrowed to the studies the task takes part in (``Task.studies``); None if none."""
    wanted = {"all": ("main", "compression")}.get(study, (study,))
    mine = [name for name in wanted if name in task.studies]
    if not mine:
        return None
    return "all" if len(mine) == 2 else mine[0]


def run_all(args) -> None:
    from convergence_tasks import get_tasks

    known = get_tasks()
    tasks = (
        args.tasks.split(",")
        if args.tasks
        else [t for t in known if task_study(known[t], args.study)]
    )
    seeds = list(range(args.seeds if args.seeds else (1 if args.quick else 3)))
    out = Path(args.out) if args.out else default_out(args.quick, args.study)
    out.mkdir(parents=True, exist_ok=True)
    manifest = dict(
        command=" ".join(
            shlex.quote(a)
            for a in [_rel(Path(sys.executable)), "benchmarks/convergence.py", *sys.argv[1:]]
        ),
        tasks=tasks,
        seeds=seeds,
        nproc=args.nproc,
        k=args.k,
        quick=args.quick,
        study=args.study,
        sweep_task=args.sweep_task,
        lambdas=args.lambdas or ",".join(f"{x:g}" for x in DEFAULT_LAMBDAS),
        started=_dt.datetime.now().isoformat(timespec="seconds"),
        loadavg_start=os.getloadavg(),
        cpus=os.cpu_count(),
    )
    t0 = time.perf_counter()
    env = harness.worker_env(OMP_NUM_THREADS=str(args.threads), PYTHONUNBUFFERED="1")
    failures: list[str] = []
    for task in tasks:
        study = task_study(known[task], args.study)
        if study is None:
            raise SystemExit(f"task {task} is not part of the {args.study} study")
        for seed in seeds:
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={args.nproc}",
                str(Path(__file__).resolve()),
                "worker",
                "--task",
                task,
                "--seed",
                str(seed),
                "--out",
                str(out),
                "--k",
                args.k,
                "--threads",
                str(args.threads),
                "--study",
                study,
            ]
            if args.quick:
                cmd.append("--quick")
            if task == args.sweep_task and not args.no_sweep and study != "compression":
                cmd.append("--sweep")
            if args.lambdas:
                cmd += ["--lambdas", args.lambdas]
            if args.steps:
                cmd += ["--steps", str(args.steps)]
            if args.modes:
                cmd += ["--modes", args.modes]
            result = out / f"{task}_seed{seed}.json"
            for attempt in (1, 2):
                print(
                    f"== {task} seed {seed} ({time.perf_counter() - t0:.0f}s elapsed)"
                    + (" -- retry" if attempt > 1 else ""),
                    flush=True,
                )
                started = time.time()
                rc = subprocess.run(cmd, env=env, cwd=REPO).returncode
                fresh = result.exists() and result.stat().st_mtime >= started
                if rc == 0 and fresh:
                    break
                failures.append(
                    f"{task} seed {seed} attempt {attempt}: exit status {rc}, "
                    f"results {'written' if fresh else 'missing'}"
                )
                print(f"!! {failures[-1]}", flush=True)
                if fresh:
                    break  # the launch failed after rank 0 wrote its results: keep them
            else:
                raise SystemExit(f"{task} seed {seed} failed twice; see the output above")
    manifest.update(
        total_s=time.perf_counter() - t0,
        loadavg_end=os.getloadavg(),
        failures=failures,
        finished=_dt.datetime.now().isoformat(timespec="seconds"),
    )
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(f"== all launches done in {manifest['total_s']:.0f}s", flush=True)
    results = Path(args.results) if args.results else (out if args.quick else RESULTS)
    report(out, results)


# ============================================================================ report


def _rel(path: Path) -> str:
    """``path`` relative to the repository when inside it (not resolving venv symlinks)."""
    path = Path(os.path.abspath(path))
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def _mean_std(xs: list[float]):
    xs = [x for x in xs if x is not None]
    if not xs:
        return float("nan"), float("nan")
    if len(xs) == 1:
        return xs[0], 0.0
    return statistics.fmean(xs), statistics.stdev(xs)


def _fmt(mean: float, std: float, n: int | None = None, digits: int = 2) -> str:
    """``mean ± std`` (``n``, the number of seeds, is accepted for ``_fmt(*stats)``)."""
    if not math.isfinite(mean):
        return "diverged"
    return f"{mean:.{digits}f} ± {std:.{digits}f}"


def _load(out: Path):
    records = [json.loads(p.read_text()) for p in sorted(out.glob("*_seed*.json"))]
    if not records:
        raise SystemExit(f"no results in {out}")
    by_task: dict[str, list[dict]] = {}
    for r in records:
        by_task.setdefault(r["task"], []).append(r)
    manifest_path = out / "manifest.json"
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    return by_task, manifest


def _runs(recs: list[dict], mode: str) -> list[dict]:
    return [run for r in recs for run in r["runs"] if run["mode"] == mode]


def _metric_stats(recs, mode):
    runs = _runs(recs, mode)
    vals = [run["final_metric"] if not run["diverged"] else float("nan") for run in runs]
    finite = [v for v in vals if math.isfinite(v)]
    if len(finite) < len(vals):
        return float("nan"), float("nan"), len(vals)
    mean, std = _mean_std(finite)
    return mean, std, len(vals)


def _plot_task(recs: list[dict], path: Path, modes: list[str], colors: dict[str, str]) -> None:
    """Training loss and test metric of ``modes`` against step and wall-clock time (one figure)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    meta = recs[0]
    fig, axes = plt.subplots(2, 2, figsize=(11, 7.5))
    for mode in modes:
        runs = _runs(recs, mode)
        if not runs:
            continue
        loss = np.array([run["train_loss"] for run in runs], dtype=float).mean(0)
        t_step = np.array([run["step_time"] for run in runs], dtype=float).mean(0)
        w = max(1, len(loss) // 30)
        smooth = np.convolve(loss, np.ones(w) / w, mode="valid")
        steps = np.arange(1, len(loss) + 1)[w - 1 :]
        ev_step = np.array([e["step"] for e in runs[0]["evals"]])
        ev_metric = np.array(
            [[e["metric"] for e in run["evals"]] for run in runs], dtype=float
        ).mean(0)
        ev_time = np.array([[e["time"] for e in run["evals"]] for run in runs], dtype=float).mean(0)
        k, m = runs[0]["k"], runs[0]["m"]
        diverged = sum(run["diverged"] for run in runs)
        label = f"{mode} (k={k}/{m})" + (
            f", {diverged} of {len(runs)} seeds diverged" if diverged else ""
        )
        c = colors.get(mode)
        axes[0, 0].plot(steps, smooth, color=c, label=label)
        axes[0, 1].plot(ev_step, ev_metric, color=c, marker=".", label=label)
        axes[1, 0].plot(t_step[w - 1 :], smooth, color=c, label=label)
        axes[1, 1].plot(ev_time, ev_metric, color=c, marker=".", label=label)
    axes[0, 0].set(xlabel="step", ylabel=f"train loss (mean of ranks, {w}-step avg)")
    axes[0, 1].set(xlabel="step", ylabel=meta["metric"])
    axes[1, 0].set(xlabel="training wall-clock time on rank 0 (s)", ylabel="train loss")
    axes[1, 1].set(xlabel="training wall-clock time on rank 0 (s)", ylabel=meta["metric"])
    for ax in axes.flat:
        ax.grid(alpha=0.3)
    if not meta["higher_is_better"]:
        for ax in (axes[0, 1], axes[1, 1]):
            ax.set_yscale("log")
    for ax in (axes[0, 0], axes[1, 0]):
        ax.set_yscale("log")
    from matplotlib.ticker import FormatStrFormatter, NullFormatter

    for ax in axes.flat:
        if ax.get_yscale() == "log":
            ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
            ax.yaxis.set_minor_formatter(NullFormatter())
    axes[0, 1].legend(fontsize=8)
    fig.suptitle(
        f"{meta['title']} — {meta['optimizer']}, {meta['world_size']} ranks, "
        f"mean of {len(recs)} seeds"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _sweep_points(recs: list[dict], comp: str):
    """λ -> (mean, std, n) of the final metric for ``comp`` (the λ = 0.2 point is the main run)."""
    points = {}
    for r in recs:
        for run in r["runs"]:
            if run["compensation"] == comp and (
                run["mode"] == comp or run["mode"].startswith(comp + "@")
            ):
                points.setdefault(run["dc_lambda"], []).append(
                    float("nan") if run["diverged"] else run["final_metric"]
                )
    out = {}
    for lam, vals in sorted(points.items()):
        if all(math.isfinite(v) for v in vals):
            out[lam] = (*_mean_std(vals), len(vals))
        else:
            out[lam] = (float("nan"), float("nan"), len(vals))
    return out


def _plot_sweep(task: str, recs: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    meta = recs[0]
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for comp, c in (("dc", "tab:blue"), ("wp3", "tab:purple")):
        pts = _sweep_points(recs, comp)
        lams = list(pts)
        ax.errorbar(
            lams,
            [pts[x][0] for x in lams],
            yerr=[pts[x][1] for x in lams],
            marker="o",
            capsize=3,
            color=c,
            label=f"{comp} (k={_runs(recs, comp)[0]['k']})",
        )
    for mode, c in (("sync", "black"), ("pipesgd", "tab:red")):
        mean, std, _ = _metric_stats(recs, mode)
        if math.isfinite(mean):
            ax.axhline(mean, color=c, ls="--", label=f"{mode}")
            ax.axhspan(mean - std, mean + std, color=c, alpha=0.08)
    ax.set(
        xlabel="λ (dc_lambda)",
        ylabel=meta["metric"],
        title=f"λ sensitivity on {meta['title']} ({len(recs)} seeds)",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def _ordered_tasks(by_task: dict[str, list[dict]]) -> list[str]:
    """The built-in tasks in their usual order, then any others."""
    known = ("digits", "lm", "deepmlp", "units")
    return [t for t in known if t in by_task] + [t for t in by_task if t not in known]


def _has_main_study(recs: list[dict]) -> bool:
    """Whether a task's launches ran the main study (records without ``study`` predate the
    option)."""
    return any(r.get("study", "all") in ("all", "main") for r in recs)


def _has_compression_study(recs: list[dict]) -> bool:
    """Whether a task's launches ran the compression study."""
    return any(r.get("study", "main") in ("all", "compression") for r in recs)


def _intro_lines(by_task: dict[str, list[dict]], manifest: dict, k_arg: str) -> list[str]:
    """Title, command, setup and the meaning of each mode name."""
    k_text = {
        "half": ": k = m // 2, the layers that run in the first half of the forward pass",
        "auto": ": k chosen by sapipe's scheduler",
    }.get(k_arg, "")
    cmd = manifest.get("command", "python benchmarks/convergence.py")
    quick = any(r["quick"] for recs in by_task.values() for r in recs)
    return [
        "# Convergence benchmark",
        "",
        "Generated by `benchmarks/convergence.py` (`make convergence`). "
        + (
            "**This is a --quick smoke run: too few steps and seeds to mean anything.**"
            if quick
            else ""
        ),
        "",
        f"Exact command (from the repository root): `{cmd}`. `make convergence` runs "
        "`.venv/bin/python benchmarks/convergence.py $(CONVERGENCE_ARGS)` after installing "
        "`benchmarks/requirements.txt` into the venv.",
        "",
        "Setup: 4 ranks, `torchrun --standalone --nproc_per_node=4`, Gloo on CPU, "
        "`torch.set_num_threads(1)` per rank; one launch per (task, seed) runs every mode in the "
        "same process group, re-seeding and rebuilding model, optimizer and "
        "`sapipe.DistributedOptimizer` per mode. Same initial weights and per-rank batch "
        "sequence in every mode of a seed. The test metric is measured after "
        "`opt.synchronize()` inside `opt.real_weights()` (so WP modes are scored on the real, "
        "not the predicted, weights).",
        "",
        "Modes: `sync` = k 0 (equal to DDP); `pipesgd` = k = m, no compensation (every layer "
        "one step stale); `none` = sapipe's partial staleness with the fixed k below and no "
        "compensation (a reference column, not one of the compared options); `dc`, `wp1`, "
        "`wp2`, `wp3` = sapipe with the same k "
        f"(`--k {k_arg}`{k_text}), "
        f"λ = {DEFAULT_LAMBDA} for `dc` and `wp3`. `<mode>+bf16`, `<mode>+int8`, "
        '`<mode>+int8-noEF` = that mode with `compression="bf16"`, `compression="int8"` '
        '(error feedback on, its default) and `compression="int8", error_feedback=False` '
        "(the compression study below).",
        "",
    ]


def _best_sapipe_mode(
    recs: list[dict], stats: dict[str, tuple], modes: list[str] = SAPIPE_MODES
) -> str | None:
    """The compensation mode of ``modes`` with the best finite mean final metric (None if none
    ran)."""
    sign = 1 if recs[0]["higher_is_better"] else -1
    finite = [m for m in modes if _runs(recs, m) and math.isfinite(stats[m][0])]
    return max(finite, key=lambda m: sign * stats[m][0]) if finite else None


def _better(meta: dict):
    """``better(a, b)``: a is a better metric value than b for this task."""
    return (lambda a, b: a > b) if meta["higher_is_better"] else (lambda a, b: a < b)


def _within_one_std(meta: dict, value: tuple, reference: tuple) -> bool:
    """The target's criterion: ``value`` is better than ``reference`` or within one std of it."""
    v_mean, r_mean, r_std = value[0], reference[0], reference[1]
    if not math.isfinite(v_mean):
        return False
    # The tolerance keeps "≤" true where the two are equal but for rounding: metrics are
    # float32 (test accuracy moves in steps of one image, so a difference of one step can
    # meet a std of one step), good to about 1e-7 of their value.
    return _better(meta)(v_mean, r_mean) or abs(v_mean - r_mean) <= r_std + 1e-6 * max(
        1.0, abs(r_mean)
    )


def _measurably_worse(meta: dict, value: tuple, reference: tuple) -> bool:
    """``value`` is worse than ``reference`` by more than the sum of their stds (the mean ± std
    intervals do not overlap), or diverged while the reference did not."""
    if not math.isfinite(value[0]):
        return math.isfinite(reference[0])
    return (
        _better(meta)(reference[0], value[0])
        and abs(value[0] - reference[0]) > value[1] + reference[1]
    )


def _main_table_lines(by_task: dict[str, list[dict]], tasks: list[str]) -> tuple:
    """The main results table, and one verdict dict per task for the targets."""
    lines = [
        "## Results (final test metric, mean ± sample std over seeds)",
        "",
        "| task | metric | k / m | " + " | ".join(f"`{m}`" for m in MAIN_MODES) + " |",
        "|" + " --- |" * (3 + len(MAIN_MODES)),
    ]
    verdicts = []
    for task in tasks:
        recs = by_task[task]
        meta = recs[0]
        stats = {mode: _metric_stats(recs, mode) for mode in MAIN_MODES}
        runs_k = _runs(recs, "dc") or _runs(recs, "wp1")
        km = f"{runs_k[0]['k']} / {runs_k[0]['m']}" if runs_k else "?"
        arrow = "↑" if meta["higher_is_better"] else "↓"
        best = _best_sapipe_mode(recs, stats)
        cells = []
        for mode in MAIN_MODES:
            cell = _fmt(*stats[mode]) if _runs(recs, mode) else "–"
            cells.append(f"**{cell}**" if mode == best else cell)
        lines.append(
            f"| {meta['title']} | {meta['metric']} {arrow} | {km} | " + " | ".join(cells) + " |"
        )
        sync, pipe = stats["sync"][:2], stats["pipesgd"][:2]
        v = dict(
            task=meta["title"],
            sync=sync,
            pipe=pipe,
            hurt=_measurably_worse(meta, pipe, sync),
            best=best,
        )
        if best is not None:
            v["best_stats"] = stats[best][:2]
            v["within"] = _within_one_std(meta, v["best_stats"], sync)
            v["beats_pipe"] = (not math.isfinite(pipe[0])) or _better(meta)(
                v["best_stats"][0], pipe[0]
            )
        fixed = _best_sapipe_mode(recs, stats, [m for m in SAPIPE_MODES if m != "auto"])
        if fixed is not None and _runs(recs, "auto"):
            v["best_fixed"] = fixed
            v["auto_within"] = _within_one_std(meta, stats["auto"][:2], stats[fixed][:2])
        verdicts.append(v)
    n_seeds = sorted({len(by_task[t]) for t in tasks})
    lines += [
        "",
        f"Seeds per cell: {', '.join(map(str, n_seeds))}. Bold: the best sapipe option per task. "
        '↑ higher is better, ↓ lower is better. "diverged": a seed\'s training loss was not '
        "finite.",
        "",
    ]
    return lines, verdicts


def _tasks_lines(by_task: dict[str, list[dict]], tasks: list[str]) -> list[str]:
    """The task table and where the data come from."""
    lines = [
        "### Tasks",
        "",
        "| task | model / data | optimizer | steps | batch per rank |",
        "| --- | --- | --- | --- | --- |",
    ]
    for task in tasks:
        meta = by_task[task][0]
        lines.append(
            f"| {meta['title']} | {meta['notes']} | `{meta['optimizer']}` | "
            f"{meta['steps']} (eval every {meta['eval_every']}) | {meta['batch_per_rank']} |"
        )
    return lines + [
        "",
        "Data: `digits` = scikit-learn's bundled 8x8 digits, fixed stratified 1437/360 "
        "train/test split (`random_state=0`); `lm` = the source of these standard-library "
        'modules, read from `sysconfig.get_paths()["stdlib"]` and concatenated in this order: '
        "`os.py random.py functools.py argparse.py textwrap.py string.py heapq.py bisect.py "
        "json/encoder.py json/decoder.py collections/__init__.py pathlib.py shutil.py "
        "tempfile.py` (first 90 % train, last 10 % held out); `units` = synthetic, from "
        "`make_units_data` in `benchmarks/convergence_tasks.py` (fixed seed 0, the same in every "
        "run). Each rank samples its own mini-batches (generator seeded by seed and rank).",
        "",
    ]


def _targets_lines(
    by_task: dict[str, list[dict]], tasks: list[str], verdicts: list[dict]
) -> list[str]:
    """Whether the main study's targets are met, and what compensation adds over ``none``."""
    lines = [
        "## Targets",
        "",
        "Criteria: Pipe-SGD is *measurably worse* than sync when its mean is worse by more than "
        "std(sync) + std(pipesgd) (the mean ± std intervals do not overlap) or it diverged. "
        "The best sapipe option is *within one std of sync* when it is better than sync or "
        "|best − sync| ≤ std(sync).",
        "",
    ]
    for v in verdicts:
        line = (
            f"* **{v['task']}**: sync {_fmt(*v['sync'])}, pipesgd {_fmt(*v['pipe'])} → Pipe-SGD "
            f"{'**measurably worse**' if v['hurt'] else 'not measurably worse'}"
        )
        if v.get("best"):
            line += (
                f"; best sapipe `{v['best']}` {_fmt(*v['best_stats'])}: "
                f"{'within' if v['within'] else '**NOT within**'} one std of sync"
            )
            if v["hurt"]:
                line += f", {'better' if v['beats_pipe'] else '**not better**'} than Pipe-SGD"
        if v.get("best_fixed"):
            line += (
                f"; `auto` {'within' if v['auto_within'] else '**NOT within**'} one std of the "
                f"best fixed option `{v['best_fixed']}`"
            )
        lines.append(line + ".")
    met = any(v["hurt"] for v in verdicts) and all(
        v.get("within", False) and (v.get("beats_pipe", True) or not v["hurt"]) for v in verdicts
    )
    lines += [
        "",
        f"Overall: targets {'**met**' if met else '**not met**'} "
        f"(Pipe-SGD measurably worse on {sum(v['hurt'] for v in verdicts)} of "
        f"{len(verdicts)} tasks).",
        "",
    ]
    lines += [
        "Compensation against partial staleness alone (`none`, same k), mean difference "
        "in the metric (positive = compensation helps):",
        "",
    ]
    for task in tasks:
        recs = by_task[task]
        base_mean = _metric_stats(recs, "none")[0]
        if not _runs(recs, "none") or not math.isfinite(base_mean):
            continue
        sign = 1 if recs[0]["higher_is_better"] else -1
        parts = [
            f"`{mode}` {sign * (_metric_stats(recs, mode)[0] - base_mean):+.2f}"
            for mode in SAPIPE_MODES
            if _runs(recs, mode)
        ]
        lines.append(f"* {recs[0]['title']} (`none` = {base_mean:.2f}): " + ", ".join(parts))
    if any(by_task[t][0]["optimizer"].startswith("Adam") for t in tasks):
        lines += [
            "",
            'Note: with `dc_form="outer"`, DC turns each tensor\'s gradient g into '
            "(1 + λ·g·Δ)·g, a per-tensor rescaling. Adam's update is nearly invariant to "
            "rescaling its gradient, so `dc` ≈ `none` is expected on the Adam task.",
        ]
    return lines + [""]


def _curves_lines(by_task: dict[str, list[dict]], tasks: list[str], results: Path) -> list[str]:
    """The main study's figures, one per task."""
    lines = ["## Curves", ""]
    for task in tasks:
        png = results / f"convergence_{task}.png"
        _plot_task(by_task[task], png, MAIN_MODES, MAIN_COLORS)
        lines += [f"![{task}]({png.name})", ""]
    return lines + [
        "Each figure: training loss (mean over ranks and seeds, moving average) and the "
        "test metric, against step and against rank 0's training wall-clock time "
        "(evaluation time excluded). Wall-clock time on this shared 2-core host is noisy; "
        "see the load column below.",
        "",
    ]


def _compression_modes(best: str) -> list[str]:
    """The compression study's columns for a task whose best mode is ``best`` (``sync``
    twice when the best mode is ``sync``: the reference and the uncompressed column)."""
    return ["sync", best] + [
        compressed_name(best, variant) for variant, _, _ in COMPRESSED_VARIANTS
    ]


def _compression_colors(modes: list[str]) -> dict[str, str]:
    """Each distinct mode of ``_compression_modes`` and its colour (the first one it gets)."""
    colors: dict[str, str] = {}
    for mode, color in zip(modes, COMPRESSION_COLORS, strict=True):
        colors.setdefault(mode, color)
    return colors


def _seed_cell(run: dict | None) -> str:
    """One run's final metric for the per-seed table."""
    if run is None:
        return "–"
    return "diverged" if run["diverged"] else f"{run['final_metric']:.2f}"


def _diverged_note(recs: list[dict], mode: str) -> str:
    """``diverged (n of N seeds, first non-finite training loss at steps …)`` for a mode's cell."""
    runs = _runs(recs, mode)
    bad = [run for run in runs if run["diverged"]]
    steps = [
        next((i + 1 for i, x in enumerate(run["train_loss"]) if not math.isfinite(x)), None)
        for run in bad
    ]
    where = ", ".join(str(s) for s in steps if s is not None)
    return f"diverged ({len(bad)} of {len(runs)} seeds; first non-finite loss at step {where})"


def _compression_table_lines(by_task: dict[str, list[dict]], tasks: list[str]) -> tuple:
    """The compression table (mean ± std per mode) and the per-seed table; verdicts per task."""
    header = (
        "| task | metric | best mode (k / m) | `sync` | uncompressed | `+bf16` | `+int8` "
        "| `+int8-noEF` |"
    )
    lines = [header, "|" + " --- |" * 8]
    seeds = _seeds(by_task, tasks)
    per_seed = [
        "| task | mode | " + " | ".join(f"seed {s}" for s in seeds) + " |",
        "|" + " --- |" * (2 + len(seeds)),
    ]
    verdicts = []
    for task in tasks:
        recs = by_task[task]
        meta = recs[0]
        best = meta["best_mode"]
        modes = _compression_modes(best)
        stats = {mode: _metric_stats(recs, mode)[:2] for mode in modes}
        cells = []
        for mode in modes:
            if not _runs(recs, mode):
                cells.append("–")
            elif math.isfinite(stats[mode][0]):
                cells.append(_fmt(*stats[mode]))
            else:
                cells.append(_diverged_note(recs, mode))
        k = _runs(recs, best)[0] if _runs(recs, best) else None
        km = f"`{best}` ({k['k']} / {k['m']})" if k else f"`{best}`"
        arrow = "↑" if meta["higher_is_better"] else "↓"
        lines.append(
            f"| {meta['title']} | {meta['metric']} {arrow} | {km} | " + " | ".join(cells) + " |"
        )
        for mode in dict.fromkeys(modes):
            by_seed = {r["seed"]: run for r in recs for run in r["runs"] if run["mode"] == mode}
            per_seed.append(
                f"| {meta['title']} | `{mode}` | "
                + " | ".join(_seed_cell(by_seed.get(s)) for s in seeds)
                + " |"
            )
        plain = stats[best]
        v = dict(task=meta["title"], best=best, stats=stats, modes=modes)
        v["within"] = {mode: _within_one_std(meta, stats[mode], plain) for mode in modes[2:]}
        v["noef_worse"] = _measurably_worse(meta, stats[modes[4]], stats[modes[3]])
        verdicts.append(v)
    return lines, per_seed, verdicts


def _seeds(by_task: dict[str, list[dict]], tasks: list[str]) -> list[int]:
    """The seeds present for any of ``tasks``."""
    return sorted({r["seed"] for t in tasks for r in by_task[t]})


def _compression_lines(
    by_task: dict[str, list[dict]], tasks: list[str], results: Path
) -> list[str]:
    """The compression study: table, per-seed values, targets, and one figure per task."""
    table, per_seed, verdicts = _compression_table_lines(by_task, tasks)
    one_layer = " (one layer, so k = 0 in every mode)"
    best_text = ", ".join(
        f"`{by_task[t][0]['best_mode']}` for {by_task[t][0]['title']}"
        + (one_layer if by_task[t][0]["best_mode"] == "sync" else "")
        for t in tasks
    )
    lines = [
        "## Compression on the wire (each task's best mode)",
        "",
        "Each task's best sapipe mode (`best_mode` in `benchmarks/convergence_tasks.py`, the best "
        "mean of the main study, or `sync` for a task with a single layer: "
        f'{best_text}) runs uncompressed, with `compression="bf16"`, '
        'with `compression="int8"` (error feedback on, the default) and with '
        '`compression="int8", error_feedback=False`, in the same launch, seeds, initial '
        "weights and batches as `sync`. Final test metric, mean ± sample std over seeds.",
        "",
        *table,
        "",
        "Per seed:",
        "",
        *per_seed,
        "",
        "Criteria: a compressed run is *within one std* of the uncompressed mode when it is better "
        "or |compressed − uncompressed| ≤ std(uncompressed). `int8-noEF` is *measurably worse* "
        "than `int8` when its mean is worse by more than std(int8) + std(int8-noEF) (the mean ± "
        "std intervals do not overlap), or it diverged and `int8` did not.",
        "",
    ]
    for v in verdicts:
        parts = [
            f"`{mode}` {'within' if v['within'][mode] else '**NOT within**'} one std"
            for mode in v["modes"][2:]
        ]
        parts[-1] += (
            f", {'**measurably worse**' if v['noef_worse'] else 'not measurably worse'} "
            f"than `{v['modes'][3]}`"
        )
        lines.append(
            f"* **{v['task']}** (uncompressed `{v['best']}` {_fmt(*v['stats'][v['best']])}): "
            + "; ".join(parts)
            + "."
        )
    met = all(all(v["within"][m] for m in v["modes"][2:4]) for v in verdicts)
    shown = [v["task"] for v in verdicts if v["noef_worse"]]
    lines += [
        "",
        f"Overall: bf16 and int8 within one std of the uncompressed mode on every task: "
        f"{'**met**' if met else '**not met**'}; int8 without error feedback measurably worse "
        f"than with it on {len(shown)} of {len(verdicts)} tasks"
        + (f" ({', '.join(shown)})." if shown else "."),
        "",
    ]
    for task in tasks:
        png = results / f"convergence_compression_{task}.png"
        colors = _compression_colors(_compression_modes(by_task[task][0]["best_mode"]))
        _plot_task(by_task[task], png, list(colors), colors)
        lines += [f"![compression {task}]({png.name})", ""]
    return lines


def _sweep_lines(by_task: dict[str, list[dict]], tasks: list[str], results: Path) -> list[str]:
    """The λ sweep's table and figure, for each task that ran one."""
    lines: list[str] = []
    for task in [
        t for t in tasks if any("@" in run["mode"] for r in by_task[t] for run in r["runs"])
    ]:
        recs = by_task[task]
        meta = recs[0]
        lines += [
            f"## λ sensitivity ({meta['title']}; paper Fig. 5d)",
            "",
            f"Final {meta['metric']}, mean ± std over {len(recs)} seeds, k = "
            f"{_runs(recs, 'dc')[0]['k']} / {_runs(recs, 'dc')[0]['m']}. λ = 0 makes `dc` "
            "plain partial staleness without compensation (vanilla SAPipe); `wp3` at λ = 0 "
            "predicts with the others' stale part of the gradient plus its own fresh part.",
            "",
        ]
        pts = {c: _sweep_points(recs, c) for c in ("dc", "wp3")}
        lams = sorted(set(pts["dc"]) | set(pts["wp3"]))
        lines += [
            "| λ | " + " | ".join(f"{x:g}" for x in lams) + " |",
            "| --- |" + " --- |" * len(lams),
        ]
        for c in ("dc", "wp3"):
            lines.append(
                f"| `{c}` | "
                + " | ".join(_fmt(*pts[c][x][:2]) if x in pts[c] else "–" for x in lams)
                + " |"
            )
        s, p = _metric_stats(recs, "sync"), _metric_stats(recs, "pipesgd")
        lines += ["", f"Reference: sync {_fmt(s[0], s[1])}, pipesgd {_fmt(p[0], p[1])}.", ""]
        png = results / f"convergence_lambda_{task}.png"
        _plot_sweep(task, recs, png)
        lines += [f"![lambda sweep]({png.name})", ""]
    return lines


def _timing_lines(
    by_task: dict[str, list[dict]], tasks: list[str], manifest: dict, out: Path
) -> list[str]:
    """Launch and training times, machine load, launch failures, where the raw JSON is."""
    lines = [
        "## Time and machine load",
        "",
        "| task | seeds | launch time per seed (s) | per mode: train s (mean) | 1-min load avg "
        "during runs |",
        "| --- | --- | --- | --- | --- |",
    ]
    for task in tasks:
        recs = by_task[task]
        launch = [r.get("launch_s", float("nan")) for r in recs]
        train = [run["train_s"] for r in recs for run in r["runs"]]
        loads = [x for r in recs for run in r["runs"] for x in run["loadavg"]]
        lines.append(
            f"| {recs[0]['title']} | {len(recs)} | {statistics.fmean(launch):.0f} | "
            f"{statistics.fmean(train):.1f} | {min(loads):.1f} – {max(loads):.1f} |"
        )
    if manifest.get("total_s"):
        lines += [
            "",
            f"Whole run: {manifest['total_s'] / 60:.1f} min on {manifest.get('cpus')} CPU "
            f"cores, started {manifest.get('started')}; load average at start "
            f"{manifest['loadavg_start'][0]:.1f}, at end {manifest['loadavg_end'][0]:.1f} "
            "(other jobs shared the machine; wall-clock numbers are indicative only).",
        ]
    if manifest.get("failures"):
        lines += [
            "",
            "Launch failures during this run (the driver retries a launch whose results "
            "are missing and keeps results written before a failure):",
            "",
        ]
        lines += [f"* {f}" for f in manifest["failures"]]
    return lines + ["", f"Raw per-(task, seed) JSON: `{_rel(out)}/`.", ""]


def report(out: Path, results: Path) -> None:
    """Aggregate the per-(task, seed) JSON files in ``out`` into ``results``: the markdown
    report (``convergence.md``, or ``convergence_compression.md`` when only the compression
    study ran, so that such a run never replaces the full report) and its figures."""
    by_task, manifest = _load(out)
    results.mkdir(parents=True, exist_ok=True)
    order = _ordered_tasks(by_task)
    main_tasks = [t for t in order if _has_main_study(by_task[t])]
    compression_tasks = [t for t in order if _has_compression_study(by_task[t])]
    k_arg = manifest.get("k") or next(iter(by_task.values()))[0].get("k_arg", "half")
    lines = _intro_lines(by_task, manifest, k_arg)
    if main_tasks:
        table, verdicts = _main_table_lines(by_task, main_tasks)
        lines += (
            table + _tasks_lines(by_task, order) + _targets_lines(by_task, main_tasks, verdicts)
        )
        lines += _curves_lines(by_task, main_tasks, results)
    else:
        lines += _tasks_lines(by_task, order)
    if compression_tasks:
        lines += _compression_lines(by_task, compression_tasks, results)
    lines += _sweep_lines(by_task, main_tasks, results)
    lines += _timing_lines(by_task, order, manifest, out)
    md = results / ("convergence.md" if main_tasks else "convergence_compression.md")
    md.write_text("\n".join(lines))
    print(f"wrote {md}")


# ============================================================================ CLI


def main() -> None:
    argv = sys.argv[1:]
    sub = argv[0] if argv and argv[0] in ("run", "worker", "report") else "run"
    if argv and argv[0] == sub:
        argv = argv[1:]
    p = harness.Parser(__doc__, quick="1 seed, few steps (under 2 minutes)")
    p.add_argument(
        "--out",
        default=None,
        help=f"raw JSON directory (default {DEFAULT_OUT.relative_to(REPO)}, "
        f"--quick: {QUICK_OUT.relative_to(REPO)}; --study compression adds -compression)",
    )
    p.add_argument(
        "--results",
        default=None,
        help="where convergence.md and the PNGs go (default benchmarks/results; --quick: the "
        "--out dir)",
    )
    p.add_argument(
        "--k",
        default="half",
        help="stale layers for the sapipe modes: half (m//2), an int, or auto",
    )
    p.add_argument("--tasks", default=None, help="comma-separated tasks (default: all)")
    p.add_argument(
        "--seeds", type=int, default=None, help="number of seeds (default 3; --quick: 1)"
    )
    p.add_argument("--steps", type=int, default=None, help="override every task's step count")
    p.add_argument(
        "--study",
        default="all",
        choices=STUDIES,
        help="main (sync, pipesgd, none, dc, wp1-3, λ sweep), compression (sync and each "
        "task's best mode, uncompressed and compressed), or all (default)",
    )
    p.add_argument(
        "--modes",
        default=None,
        help="comma-separated subset of the study's modes, by report name (e.g. sync,wp1+int8)",
    )
    p.add_argument(
        "--lambdas", default=None, help="λ values of the sweep (default 0,0.1,0.2,0.5,1)"
    )
    p.add_argument("--sweep-task", default="deepmlp", help="task that gets the λ sweep")
    p.add_argument("--no-sweep", action="store_true")
    p.add_argument("--nproc", type=int, default=4)
    p.add_argument("--threads", type=int, default=1)
    # worker-only
    p.add_argument("--task", default=None, help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--sweep", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if sub == "worker":
        worker(args)
    elif sub == "report":
        out = Path(args.out) if args.out else default_out(args.quick, args.study)
        report(out, Path(args.results) if args.results else (out if args.quick else RESULTS))
    else:
        run_all(args)


if __name__ == "__main__":
    main()
