"""Tables of a sweep's results and ``throughput.md``."""

from __future__ import annotations

import os
import shlex
import statistics
from typing import Any

from . import compression_report
from .plots import plot
from .stats import paired_ratio
from .summary import (
    derived,
    is_deferred,
    result_of,
    summary_rows,
)

_OPTIMIZERS = {
    "sgd": "SGD",
    "adam": "Adam",
}  # bench_models.ModelSpec.optimizer -> torch.optim class


EXPOSURE_TARGET = 1.02  # T(expose_gradients=True) / T(False) at the same k: overlap lost within 2 %


def _ms(t):
    return "–" if t is None else f"{1e3 * t:.1f}"


# ----------------------------------------------------------------------------- one job


def format_job(job) -> str:
    d = derived(job)
    lines = [
        f"### {job['model']} ({job['size']}) — {job['rate']}"
        + (f", T_comm/T_compute = {d['ratio']:.2f}" if d["ratio"] else ""),
        "",
        f"{job['params'] / 1e6:.2f} M parameters ({job['grad_bytes'] / 2**20:.1f} MiB of "
        "gradients), "
        f"m = {job['m']} layers, largest: "
        + ", ".join(f"#{i} {n} ({s:.0%})" for i, n, s in job["largest_layers"])
        + f". {job['world']} ranks × {job['batch']} samples, {job['device']}, {job['backend']}"
        + (f", {job['threads']} thread(s)/rank" if job.get("threads") else "")
        + ".",
        "",
        f"T_compute (local) {_ms(d['t_local'])} ms · T_comm {_ms(d['t_comm'])} ms · "
        f"T_ceiling {_ms(d['t_ceiling'])} ms · T_ddp {_ms(d['t_ddp'])} ms · possible speedup "
        f"T_ddp/T_ceiling = {d['possible']:.2f}×"
        if d["possible"]
        else "(references incomplete)",
        "",
        "| mode | k | κ | step ms (median) | IQR | min ms | waits ms/step | samples/s | × DDP | "
        "efficiency |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    lines += [_mode_row(r, d, job["world"] * job["batch"]) for r in job["results"]]
    notes = list(job["notes"]) + [
        f"{r['mode']}: {r['note']}" for r in job["results"] if r.get("note") and r.get("t")
    ]
    notes += [
        f"{r['mode']} scheduler: {r['decision']}" for r in job["results"] if r.get("decision")
    ][:1]
    decided = [
        f"{r['mode']} at {r['decided_at']}"
        for r in job["results"]
        if r.get("decided_at") is not None
    ]
    notes += [f"auto's k final by iteration: {', '.join(decided)}"] if decided else []
    if notes:
        lines += [""] + [f"* {n}" for n in notes]
    return "\n".join(lines) + "\n"


def _mode_row(r, d, samples: int) -> str:
    """One mode's row of :func:`format_job`'s table."""
    if not r.get("t"):
        return f"| {r['mode']} | | | {r.get('note', 'skipped')} | | | | | | |"
    if r["mode"] == "comm":
        return (
            f"| comm | | | {_ms(r['t'])} | {r['iqr']:.0%} | {_ms(r['min'])} | | | | (one "
            "all-reduce of "
            f"{r['bytes'] / 2**20:.1f} MiB) |"
        )
    k, kappa = r.get("k"), r.get("kappa")
    sps = samples / r["t"]
    x = f"{d['t_ddp'] / r['t']:.2f}" if d["t_ddp"] and r["mode"] not in ("local",) else ""
    eff = (
        f"{d['t_ceiling'] / r['t']:.2f}"
        if d["t_ceiling"] and r["mode"] not in ("local", "ceiling")
        else ""
    )
    return (
        f"| {r['mode']}{' ⚠' if r.get('note') else ''} | {'' if k is None else k} | "
        f"{'' if kappa is None else f'{kappa:.2f}'} | {_ms(r['t'])} | {r['iqr']:.0%} | "
        f"{_ms(r['min'])} | "
        f"{_ms(r['wait']) if 'wait' in r else ''} | {sps:.1f} | {x} | {eff} |"
    )


# ----------------------------------------------------------------------------- all jobs


def format_summary(jobs) -> str:
    lines = [
        "| model | rate | T_comm/T_compute | possible (T_ddp/T_ceil) | sapipe config | k | κ | × "
        "DDP | efficiency "
        "| vs pipesgd | vs pipesgd, per round | waits ms/step (sapipe / pipesgd) | pipesgd × DDP | "
        "horovod × DDP |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    f = lambda v, fmt: "–" if v is None else format(v, fmt)  # noqa: E731
    for r in summary_rows(jobs):
        lines.append(
            f"| {r['model']} | {r['rate']} | {f(r['ratio'], '.2f')} | {f(r['possible'], '.2f')} | "
            f"{r['headline'] or '–'} | {f(r['k'], '')} | {f(r['kappa'], '.2f')} | "
            f"{f(r['speedup'], '.2f')} | "
            f"{f(r['eff'], '.2f')} | {f(r['vs_pipe'], '+.1%')} | {f(r['vs_pipe_paired'], '+.1%')} "
            "| "
            f"{_ms(r['wait'])} / {_ms(r['pipe_wait'])} | {f(r['pipe_speedup'], '.2f')} | "
            f"{f(r['horovod'], '.2f')} |"
        )
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------- targets


def format_targets(jobs) -> str:
    rows = summary_rows(jobs)
    out = [
        line
        for line in (
            _efficiency_target(rows),
            _gpt2_target(rows),
            _k0_overhead(jobs),
            _auto_target(rows),
            exposure_summary(jobs),
        )
        if line is not None
    ]
    no_auto = [r["model"] + " @ " + r["rate"] for r in rows if r["headline"] != "sapipe-auto"]
    if no_auto:
        out.append(
            "* sapipe-auto did not run (see the per-job notes) in: " + ", ".join(no_auto) + "."
        )
    return "\n".join(out) + "\n"


def _efficiency_target(rows) -> str | None:
    bound = [
        r for r in rows if r["ratio"] is not None and r["ratio"] <= 1.0 and r["eff"] is not None
    ]
    if not bound:
        return None
    miss = [r for r in bound if r["eff"] < 0.95 or r["speedup"] < 1.0]
    return (
        f"* **Efficiency ≥ 0.95 and never slower than DDP where T_comm ≤ T_compute**: "
        f"{len(bound) - len(miss)}/{len(bound)} jobs meet it."
        + (
            " Misses: "
            + "; ".join(
                f"{r['model']} @ {r['rate']} (ratio {r['ratio']:.2f}): efficiency {r['eff']:.2f}, "
                f"{r['speedup']:.2f}× DDP{_wait_evidence(r)}"
                for r in miss
            )
            if miss
            else ""
        )
    )


def _gpt2_target(rows) -> str | None:
    g = [r for r in rows if r["model"] == "gpt2" and r["ratio"] and r["speedup"]]
    if not g:
        return None
    r = min(g, key=lambda r: abs(r["ratio"] - 0.65))
    return (
        f"* **GPT-2 ≈ 1.4× DDP at T_comm ≈ 0.65 T_compute**: at ratio {r['ratio']:.2f} sapipe "
        f"({r['headline']}) is {r['speedup']:.2f}× DDP; the possible speedup there is "
        f"{r['possible']:.2f}× (T_ddp/T_ceiling)."
        if r["possible"]
        else ""
    )


def _k0_overhead(jobs) -> str | None:
    over = [
        result_of(j, "sapipe k=0")["t"] / result_of(j, "ddp")["t"] - 1
        for j in jobs
        if result_of(j, "sapipe k=0") and result_of(j, "ddp")
    ]
    if not over:
        return None
    return (
        "* sapipe k=0 (fully synchronous) vs DDP, step time: median "
        f"{statistics.median(over):+.1%} "
        f"(range {min(over):+.1%} … {max(over):+.1%}; positive = sapipe slower). With k = 0 sapipe "
        "communicates what DDP does, so this is its runtime overhead, plus noise."
    )


def _auto_target(rows) -> str | None:
    a = [r for r in rows if r["vs_pipe"] is not None and r["headline"] == "sapipe-auto"]
    if not a:
        return None
    gap = {
        id(r): r["vs_pipe_paired"] if r["vs_pipe_paired"] is not None else r["vs_pipe"] for r in a
    }
    within = [r for r in a if gap[id(r)] <= 0.03]
    fewer = [r for r in a if r["kappa"] is not None and r["kappa"] < 1.0]
    both = [r for r in within if r in fewer]
    missed = [r for r in a if r not in within]
    kappas = [r["kappa"] for r in a if r["kappa"] is not None] or [float("nan")]
    return (
        "* **sapipe-auto within 3 % of pipesgd while staling fewer layers** (step time, median "
        "over "
        f"rounds of the ratio within a round): within 3 % in "
        f"{len(within)}/{len(a)} jobs, κ < 1 in {len(fewer)}/{len(a)}, both in "
        f"{len(both)}/{len(a)} "
        f"(median κ {statistics.median(kappas):.2f}; "
        f"auto vs pipesgd: "
        + ", ".join(f"{r['model']} {gap[id(r)]:+.0%}" for r in a)
        + ")."
        + (
            " Misses: "
            + "; ".join(
                f"{r['model']} @ {r['rate']} {gap[id(r)]:+.1%} (k = {r['k']}, "
                f"κ {r['kappa']:.2f}){_wait_evidence(r, pipe=True)}"
                for r in missed
            )
            if missed
            else ""
        )
    )


# ----------------------------------------------------------------------------- p.grad exposure


def exposure_rows(jobs) -> list[dict[str, Any]]:
    """Per job and fixed k: the default (``expose_gradients=True``) against its ``deferred``
    twin."""
    rows = []
    for job in jobs:
        for twin in job["results"]:
            base = (
                result_of(job, twin["twin_of"]) if twin.get("twin_of") and twin.get("t") else None
            )
            if base is None or not is_deferred(twin) or is_deferred(base):
                continue
            rows.append(
                dict(
                    model=job["model"],
                    rate=job["rate"],
                    mode=base["mode"],
                    k=base.get("k"),
                    kappa=base.get("kappa"),
                    t=base["t"],
                    t_deferred=twin["t"],
                    ratio=base["t"] / twin["t"],
                    paired=paired_ratio(base, twin),
                    wait=base.get("wait"),
                    wait_deferred=twin.get("wait"),
                )
            )
    return rows


def format_exposure(jobs) -> str | None:
    """The "p.grad exposure cost" table (None when no deferred twin ran)."""
    rows = exposure_rows(jobs)
    if not rows:
        return None
    f = lambda v, fmt: "–" if v is None else format(v, fmt)  # noqa: E731
    lines = [
        "| model | rate | mode | k | κ | step ms exposed | step ms deferred | "
        "T(exposed)/T(deferred) "
        "| per round | waits ms/step (exposed / deferred) |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        paired = None if r["paired"] is None else 1 + r["paired"]
        lines.append(
            f"| {r['model']} | {r['rate']} | {r['mode']} | {f(r['k'], '')} | "
            f"{f(r['kappa'], '.2f')} | "
            f"{_ms(r['t'])} | {_ms(r['t_deferred'])} | {r['ratio']:.3f}"
            f"{' ⚠' if r['ratio'] > EXPOSURE_TARGET else ''} | {f(paired, '.3f')} | "
            f"{_ms(r['wait'])} / {_ms(r['wait_deferred'])} |"
        )
    return "\n".join(lines) + "\n"


def exposure_summary(jobs) -> str | None:
    """Median and max of T(exposed)/T(deferred) over all jobs and k, against the 2 % target."""
    rows = exposure_rows(jobs)
    if not rows:
        return None
    ratios = [r["ratio"] for r in rows]
    worst = max(rows, key=lambda r: r["ratio"])
    over = [r for r in rows if r["ratio"] > EXPOSURE_TARGET]
    paired = [1 + r["paired"] for r in rows if r["paired"] is not None]
    return (
        "* **p.grad exposure costs ≤ 2 % at the same k** (T with `expose_gradients=True`, the "
        "default, / T "
        f"with `False`, its `deferred` twin): median {statistics.median(ratios):.3f}, max "
        f"{max(ratios):.3f} "
        f"({worst['model']} @ {worst['rate']}, k = {worst['k']}) over {len(rows)} job × k pairs; "
        f"≤ {EXPOSURE_TARGET} in {len(rows) - len(over)}/{len(rows)}"
        + (
            f"; per round: median {statistics.median(paired):.3f}, max {max(paired):.3f}"
            if paired
            else ""
        )
        + "."
    )


def _wait_evidence(row: dict[str, Any], pipe: bool = False) -> str:
    """Where a miss's time went: the step's communication wait (sapipe's own counter,
    ``DistributedOptimizer.communication_wait``) against the rest of the step."""
    if row.get("wait") is None or not row.get("t"):
        return ""
    text = f": waits {_ms(row['wait'])} of {_ms(row['t'])} ms/step"
    if pipe and row.get("pipe_wait") is not None and row.get("pipe_speedup") and row.get("t_ddp"):
        text += f" (pipesgd {_ms(row['pipe_wait'])} of {_ms(row['t_ddp'] / row['pipe_speedup'])})"
    return text


# ----------------------------------------------------------------------------- output


def report(args, jobs, calib, out_dir, meta) -> int:
    """Print every table, draw the plots and write ``throughput.md`` into ``out_dir``."""
    for job in jobs:
        print("\n" + format_job(job))
    print(format_summary(jobs))
    exposure = format_exposure(jobs)
    if exposure:
        print("p.grad exposure cost (expose_gradients=True vs False at the same k):\n" + exposure)
    print(format_targets(jobs))
    compressed = compression_report.format_table(jobs)
    if compressed:
        print(
            "Compression (against the full-precision ceiling):\n"
            + compressed
            + (compression_report.format_targets(jobs) or "")
        )
    pngs = plot(jobs, out_dir)
    md = write_markdown(args, jobs, calib, pngs, out_dir, meta)
    print(f"wrote {md}" + "".join(f", {p}" for p in pngs))
    return 0


def write_markdown(args, jobs, calib, pngs, out_dir, meta) -> str:
    lines = _header(args, jobs, meta) + _calibration(args, calib)
    lines += [
        "## Summary",
        "",
        'sapipe config = `sapipe-auto` when sapipe supports `stale_layers="auto"`, else the '
        "*oracle* k "
        "(the smallest measured k within 3 % of pipesgd, compensation `none`); vs pipesgd = its "
        "step time "
        "relative to pipesgd's.",
        "",
        format_summary(jobs),
        "## Targets",
        "",
        format_targets(jobs),
    ]
    exposure = format_exposure(jobs)
    if exposure:
        lines += [
            "## p.grad exposure cost",
            "",
            "Each fixed k (`sapipe k=K`, `pipesgd`) also ran as a `deferred` twin, identical but "
            "for "
            "`expose_gradients=False` (the previous timeline: synchronous updates deferred to each "
            "layer's "
            "next forward, so a synchronous all-reduce's tail can also overlap `step()` and the "
            "first "
            "layers' forward), interleaved in the same rounds. T(exposed)/T(deferred) is what the "
            "default "
            "(`p.grad` holds the averaged gradient once backward ends) costs at that k; target ≤ "
            f"{EXPOSURE_TARGET} (the overlap lost within 2 %). *per round*: the median over rounds "
            "of the "
            "same ratio within each round. The twins take no part in the oracle k, the summary or "
            "the plots.",
            "",
            exposure,
        ]
    lines += compression_report.markdown(jobs)
    for p in pngs:
        lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})", ""]
    lines += ["## Per job", ""]
    for job in jobs:
        lines += [format_job(job), ""]
    path = os.path.join(out_dir, "throughput.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def _header(args, jobs, meta) -> list[str]:
    """Title, the exact command, the host, how each mode was timed, and the definitions."""
    argv, seconds = meta["argv"], meta["seconds"]
    cmd = (
        ("python benchmarks/throughput.py " + shlex.join(argv))
        if argv
        else "make bench   # = python benchmarks/throughput.py"
    )
    j0 = jobs[0]
    lines = [
        "# Throughput: sapipe vs DDP under an emulated network",
        "",
        f"Generated {meta['finished']} on {j0['host']} ({meta['cpus']} CPUs), torch {j0['torch']}, "
        f"in {seconds / 60:.1f} min (load average {meta['load'][0][0]:.1f} at the start, "
        f"{meta['load'][1][0]:.1f} at the end) by:",
        "",
        "```sh",
        cmd,
        "```",
        "",
    ]
    if meta["load"][0][0] > 0.75 * meta["cpus"] or meta["load"][1][0] > 0.75 * meta["cpus"]:
        lines += [
            "> **Noisy run.** The host was busy with other work (load average "
            f"{meta['load'][0][0]:.1f} / "
            f"{meta['load'][1][0]:.1f} on {meta['cpus']} CPUs), so each rank got a fraction of a "
            "core and step "
            "times vary by up to several × (see the IQR and min columns); ratios between modes, "
            "the "
            "calibrated T_comm/T_compute and the scheduler's own profile are unreliable. Rerun "
            "`make bench` "
            "on a quiet machine before drawing conclusions.",
            "",
        ]
    return lines + _method(args, j0) + _optimizer_note(jobs) + _definitions()


def _method(args, j0) -> list[str]:
    return [
        f"{j0['world']} ranks per job ({j0['device']}, {j0['backend']}, "
        f"{j0.get('threads')} thread(s) per rank), all in one fresh network namespace whose "
        "loopback is shaped by "
        "`tc qdisc add dev lo root tbf rate R` (sapipe/launch/netns.py): R is the aggregate rate "
        "of all ranks, and "
        "a ring all-reduce of S bytes puts 2(n−1)·S bytes through it. Each mode: "
        f"{j0['warmup']} warm-up steps (auto: untimed until its k is final, then "
        f"{args.auto_warmup}), then "
        f"{j0['steps']} timed steps, split into "
        f"{j0.get('rounds', 3)} rounds that interleave all modes of the job (alternating order, "
        "one extra untimed "
        "step per round), so that load drifts hit every mode alike; "
        "T = the slowest rank's median step time, IQR = its interquartile range / median. "
        "Synthetic data.",
        "",
    ]


def _optimizer_note(jobs) -> list[str]:
    """Which torch optimizer every mode stepped with: fused (the default) or not (older results)."""
    names = " / ".join(
        sorted({f"torch.optim.{_OPTIMIZERS.get(j['optimizer'], j['optimizer'])}" for j in jobs})
    )
    if all(j.get("fused") for j in jobs):
        return [
            f"**Baselines use fused optimizers.** Every mode's optimizer is {names} with "
            "`fused=True`: "
            "`local`, `ceiling`, DDP and Horovod step with torch's fastest update kernel, as their "
            "best "
            "users would run them, so × DDP measures the overlap, not the update kernel. sapipe "
            "wraps "
            "the same optimizer and updates with its own fused kernels.",
            "",
        ]
    return [
        f"**Baselines use torch's default (unfused) optimizers** ({names}, not `fused=True`): part "
        "of "
        "every × DDP is then sapipe's fused update kernel, not the overlap.",
        "",
    ]


def _definitions() -> list[str]:
    return [
        "Definitions (docs/design.md §6): T_compute = `local` (each rank trains alone, no "
        "communication); "
        "T_comm = one all-reduce of all gradients alone; T_ceiling = the local step while a buffer "
        "of all "
        "gradients is all-reduced on a second process group (perfect overlap; on a CPU host the "
        "busy link "
        "costs CPU, so this, not `local`, is the best any overlapping schedule can do). "
        "× DDP = T_ddp / T; efficiency = T_ceiling / T; possible speedup = T_ddp / T_ceiling; "
        "κ = fraction of parameters in the k stale layers. "
        "vs pipesgd = T / T_pipesgd − 1; *per round*: the median over rounds of the same ratio "
        "taken within "
        "each round (both modes timed minutes apart at most, so the host's slower drifts cancel). "
        "waits = the median time per step that sapipe blocked on its all-reduces "
        "(`DistributedOptimizer.communication_wait`): a slow step with few waits ran slow in "
        "compute, "
        "not for the network.",
        "",
    ]


def _calibration(args, calib) -> list[str]:
    if not calib:
        return []
    lines = [
        "Bandwidths were calibrated per model for target ratios T_comm/T_compute = "
        f"{args.ratios} from a probe job (T_compute and the unshaped all-reduce time):",
        "",
        "| model | probe T_compute ms | all-reduce floor ms | gradients MiB |",
        "| --- | --- | --- | --- |",
    ]
    for m, p in calib.items():
        lines.append(
            f"| {m} | {1e3 * p['t_local']:.1f} | {1e3 * p['t_comm_floor']:.1f} | "
            f"{p['grad_bytes'] / 2**20:.1f} |"
        )
    return lines + [""]
