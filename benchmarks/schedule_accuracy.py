"""How well does the scheduler predict? Predicted vs measured iteration time, k = 0 / auto / m.

For each model × emulated bandwidth one ``torchrun`` job runs inside a rate-limited network
namespace (docs/design.md §6, via :mod:`sapipe.launch.netns`). In that job:

1. a ``stale_layers="auto"`` run profiles its warm-up, the model picks k and the run
   measures that k on the job (``sapipe.auto.search``), and its final decision predicts
   the iteration time for k = 0, the chosen k and k = m (the simulator, docs/design.md §4, with
   the compute slow-down σ fitted to the search's trials where a search ran);
2. the same auto run is then timed once its k is final, and fresh runs with k = 0 and
   k = m are timed too — all in the same process group and network, interleaved in
   ``--rounds`` rounds so that load drifting on the host hits every k alike. Measured =
   the mean iteration time of rank 0 (a saturated link often alternates long and short
   iterations; only the mean is the rate).

Output: a markdown table (prediction error per k) on stdout, appended to
``benchmarks/results/schedule_accuracy.md`` with the exact command; and, per job, the raw
profile (every rank's timestamps, the link probes, the fitted model) with the measured
per-iteration times in ``--raw`` (JSON), so model variants can be evaluated offline
against one measured run. ``--sweep-k`` times extra k values (raw file only).
``--compare-search`` also runs ``"auto"`` twice without its iteration budget
(``auto_budget=None``, ``tune_steps=10``: the bisection) on the same job, times their picks
too, and tables how often the budgeted search agrees with the first (the same k, or one
within 3% of its measured time), and the second with the first (the noise floor).

    python benchmarks/schedule_accuracy.py --models gpt2,vgg16 --rates unlimited,100mbit
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time

import harness

from sapipe.launch import netns


def worker(args) -> None:
    import bench_models
    import torch
    import torch.distributed as dist

    import sapipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = bench_models.build(args.model, args.size)
    gen = torch.Generator().manual_seed(rank)
    batch = spec.make_batch(spec.batch_size, torch.device("cpu"), gen)

    def timed(opt, model, steps):
        """Per-iteration times: gaps between consecutive step ends (no barrier in the loop)."""
        dist.barrier()
        times, last = [], time.perf_counter()
        for _ in range(steps):
            opt.zero_grad()
            spec.loss_fn(model(batch[0]), batch[1]).backward()
            opt.step()
            now = time.perf_counter()
            times.append(now - last)
            last = now
        return times

    # k -> (start, done, stream, bytes-free name) of the timed iterations' all-reduces
    # (--trace-comm)
    comm_log = {}
    t0 = time.perf_counter_ns()  # the origin of those times

    def setup(stale_layers, **search):
        model = spec.make_model()
        opt = sapipe.DistributedOptimizer(
            spec.make_optimizer(model.parameters()),
            model,
            stale_layers=stale_layers,
            profile_steps=args.profile_steps,
            trace=args.trace_comm,
            **search,
        )
        for _ in range(
            500
        ):  # "auto" profiles, then measures its k on the job: train until k is final
            if opt.stale_layers != "auto":
                break
            opt.zero_grad()
            spec.loss_fn(model(batch[0]), batch[1]).backward()
            opt.step()
        timed(opt, model, 5)
        return opt, model

    def timed_chunk(opt, model, steps):
        """``steps`` timed iterations after one untimed one; the run's stale traffic finished
        after."""
        timed(opt, model, 1)  # caches and the link were another run's
        opt.tracer.clear()
        times = timed(opt, model, steps)
        if args.trace_comm:
            begun = {}
            spans = comm_log.setdefault(str(opt.stale_layers), [])
            for at, kind, fields in opt.tracer.events():
                key = (fields.get("what"), fields.get("stream"))
                if kind == "comm_start":
                    begun[key] = at
                elif kind == "comm_done" and key in begun:
                    spans.append(((begun.pop(key) - t0) / 1e9, (at - t0) / 1e9, key[1], key[0]))
            spans += [((s - t0) / 1e9, math.nan, key[1], key[0]) for key, s in begun.items()]
        # the last stale all-reduce must not overlap the next run's steps
        opt.wait_for_communication()
        return times

    auto_run = setup("auto")
    auto_opt, controller = auto_run[0], auto_run[0].auto  # controller: the public auto-k state
    d, tuner = controller.decision, controller.tuner
    results = {
        "m": d.m,
        "k": d.k,
        "kappa": d.kappa,
        "comm_bound": d.comm_bound,
        "summary": d.summary(),
        "model_k": tuner.first_k if tuner else d.k,
        "tuning": tuner.summary() if tuner else "not measured (model's k is 0 or m)",
    }
    results["predicted"] = {
        "0": d.iteration_time_sync,
        "auto": d.iteration_time,
        "m": d.iteration_time_all_stale,
    }
    runs = {str(d.k): auto_run}
    results["decided_at"] = controller.decided_at
    if (
        args.compare_search
    ):  # the search without a budget (bisection, trials of 10), twice, on the same job
        results["slow_search"] = []
        for _ in range(2):
            slow_run = setup("auto", auto_budget=None, tune_steps=10)
            slow = slow_run[0].auto
            results["slow_search"].append(
                {
                    "k": slow.decision.k,
                    "decided_at": slow.decided_at,
                    "tuning": slow.tuner.summary() if slow.tuner else "not measured",
                }
            )
            runs.setdefault(str(slow.decision.k), slow_run)
    for expr in ["0", "m"] + list(filter(None, args.sweep_k.split(","))):
        k = min(d.m, max(0, int(round(eval(expr, {"m": d.m})))))  # noqa: S307 - our own CLI, e.g. "m/2"
        if str(k) not in runs:
            runs[str(k)] = setup(k)
    # Runs interleaved in rounds (alternating order), so that load drifting on the host and
    # the order the models were built in hit every k alike.
    times = {key: [] for key in runs}
    per_round = max(1, math.ceil(args.steps / args.rounds))
    for r in range(args.rounds):
        for key in list(runs) if r % 2 == 0 else list(runs)[::-1]:
            times[key] += timed_chunk(*runs[key], per_round)
    # The mean: a saturated link often alternates long and short iterations; only the mean is the
    # rate.
    mean = {key: statistics.fmean(ts) for key, ts in times.items()}
    results["measured"] = {"0": mean["0"], "auto": mean[str(d.k)], "m": mean[str(d.m)]}
    if args.compare_search:
        results["measured"]["slow"] = [mean[str(slow["k"])] for slow in results["slow_search"]]
    prof = controller.profile  # what the decision was made from
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, prof.raw)
    element = next(spec.make_model().parameters()).element_size()
    results["raw"] = {
        "layers": [layer.name for layer in auto_opt.layers],
        "layer_bytes": [layer.numel * element for layer in auto_opt.layers],
        "numel": [layer.numel for layer in auto_opt.layers],
        "bucket_cap_bytes": int(auto_opt.settings.bucket_cap_mb * 1024 * 1024),
        "sync_at_step": bool(controller.sync_at_step),  # the timeline auto modelled
        "profile": {
            "forward": prof.forward,
            "backward": prof.backward,
            "step_time": prof.step_time,
            "alpha": prof.alpha,
            "beta": prof.beta,
            "slowdown": prof.slowdown,
            "beta_isolated": prof.beta_isolated,
            "beta_observed": prof.beta_observed,
            "update_time": prof.update_time,
        },
        "ranks": ranks,
        "measured_times": times,
        "comm_spans": comm_log,
        "load_before": os.getloadavg(),
    }
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(results, f, default=_jsonable)
    dist.barrier()
    # Each run leaves its last stale all-reduce in flight, never waited for (as a training
    # loop that just ends does); tearing Gloo down under it can abort the process at exit.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


VARIANTS = {  # name: (link fitted from, compute slow-down σ, shared link)
    "previous": ("isolated", False, False),  # isolated probes, one transfer at a time, no CPU cost
    "observed": ("observed", False, False),
    "runtime": (
        "observed",
        False,
        True,
    ),  # what stale_layers="auto" decides with (before σ is fitted to trials)
    "observed+slowdown": ("observed", True, False),  # σ only where the raw file has a probe sample
    "runtime+slowdown": ("observed", True, True),
}


def replay(path: str, variants) -> str:
    """Re-predict every job of a raw file with each model variant, against its measured times."""
    from sapipe.schedule import LayerProfile, profiler, simulate

    with open(path) as f:
        saved = json.load(f)
    lines = [
        "| job | k | measured ms | " + " | ".join(variants) + " |",
        "| --- | --- | ---: | " + " | ".join("---:" for _ in variants) + " |",
    ]
    for job, r in saved["jobs"].items():
        raw = r["raw"]
        m = len(raw["layers"])
        timers = [profiler.LayerTimer.from_raw(rank) for rank in raw["ranks"]]
        sigma = _slowdown(raw["ranks"])
        predictions = {}
        for name in variants:
            fit, slow, shared = VARIANTS[name]
            s = sigma if slow else 0.0
            rows = []
            for timer, rank in zip(timers, raw["ranks"]):
                u, b, step = timer.medians(s)
                rows.append(u + b + [step] + rank["probe_times"] + [timer.update_time()])
            link = [[tuple(x) for x in rank["link_samples"]] for rank in raw["ranks"]]
            prof = profiler.combine(rows, m, raw["ranks"][0]["probe_sizes"], link, s)
            beta = prof.beta if fit == "observed" else prof.beta_isolated
            profiles = [
                LayerProfile(n, u, b, prof.alpha + beta * nb, numel)
                for n, u, b, nb, numel in zip(
                    raw["layers"], prof.forward, prof.backward, raw["layer_bytes"], raw["numel"]
                )
            ]
            predictions[name] = {
                k: simulate(
                    profiles,
                    int(k),
                    bucket_cap_bytes=raw["bucket_cap_bytes"],
                    alpha=prof.alpha,
                    beta=beta,
                    bytes_per_layer=raw["layer_bytes"],
                    step_time=prof.step_time,
                    slowdown=s,
                    shared_link=shared,
                    record_events=False,
                    update_per_element=prof.update_time / sum(raw["numel"]),
                    sync_at_step=raw.get("sync_at_step", False),
                ).iteration_time
                for k in raw["measured_times"]
            }
        for k in sorted(raw["measured_times"], key=int):
            meas = statistics.fmean(raw["measured_times"][k])
            cells = [
                f"{predictions[v][k] * 1e3:.1f} ({(predictions[v][k] - meas) / meas:+.0%})"
                for v in variants
            ]
            lines.append(
                f"| {job} | {k}{' (auto)' if int(k) == r['k'] else ''} | {meas * 1e3:.1f} | "
                + " | ".join(cells)
                + " |"
            )
        lines.append(f"| {job} σ={sigma:.2f} | | | " + " | ".join("" for _ in variants) + " |")
    return "\n".join(lines)


def _slowdown(ranks) -> float:
    """σ from a raw file's contention samples (E, O), one per rank: compute that overlapped a
    transfer for O seconds took E seconds longer. Pooled over ranks, Σ E / Σ (O − E); 0 without
    samples (sapipe's profiler no longer takes them: only older raw files have them)."""
    samples = [tuple(rank["slowdown_sample"]) for rank in ranks if "slowdown_sample" in rank]
    extra = math.fsum(e for e, o in samples if o > 0)
    overlap = math.fsum(o for e, o in samples if o > 0)
    if overlap <= 0 or extra <= 0:
        return 0.0
    return extra / max(overlap - extra, 1e-3 * overlap)


def search_table(jobs) -> str:
    """The budgeted search's pick against the unbudgeted one's, per job: the iteration each
    decided by, the picks' measured times, and whether they agree (the same k, or within 3%).
    The unbudgeted search ran twice: how often it agrees with itself is the noise floor."""
    lines = [
        "| job | budget 30: k, decided by | no budget: k, decided by | again: k, decided by | "
        "ms/iter: budget / none / again | budget agrees | none agrees with itself |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    agreed = consistent = 0
    for job, r in jobs.items():
        slow, again = r["slow_search"]
        fast_t, (slow_t, again_t) = r["measured"]["auto"], r["measured"]["slow"]
        ok = r["k"] == slow["k"] or fast_t <= slow_t * 1.03
        same = again["k"] == slow["k"] or again_t <= slow_t * 1.03
        agreed, consistent = agreed + ok, consistent + same
        lines.append(
            f"| {job} | {r['k']}, {r['decided_at']} | {slow['k']}, {slow['decided_at']} | "
            f"{again['k']}, {again['decided_at']} | {fast_t * 1e3:.1f} / {slow_t * 1e3:.1f} / "
            f"{again_t * 1e3:.1f} | {'yes' if ok else 'NO'} | {'yes' if same else 'NO'} |"
        )
    lines.append(
        f"\nThe budgeted search agrees with the unbudgeted one in {agreed} of {len(jobs)} jobs; "
        "the "
        f"unbudgeted one with its own second run in {consistent} of {len(jobs)} (agree: the same "
        "k, "
        "or one within 3% of the first unbudgeted pick's measured time)."
    )
    return "\n".join(lines)


def _jsonable(value):
    return None if value is None else float(value)


def launch(model: str, size: str, rate: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = harness.torchrun(
            args.ranks,
            __file__,
            "--worker",
            "--model",
            model,
            "--size",
            size,
            "--result",
            out,
            "--steps",
            str(args.steps),
            "--profile-steps",
            str(args.profile_steps),
            "--sweep-k",
            args.sweep_k,
            "--rounds",
            str(args.rounds),
            *(["--trace-comm"] if args.trace_comm else []),
            *(["--compare-search"] if args.compare_search else []),
        )
        env = harness.worker_env(OMP_NUM_THREADS="1")
        proc = subprocess.run(
            netns.wrap(cmd, netns.parse_spec(rate)), capture_output=True, text=True, env=env
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{model} @ {rate} failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = harness.Parser(
        __doc__,
        quick=dict(models="gpt2", size="tiny", rates="unlimited", steps=8, rounds=2, raw=""),
        size="small",
        out=harness.result_path("schedule_accuracy.md"),
        out_help="the report: a dated section is appended",
        worker=True,
    )
    p.add_argument("--models", default="gpt2,vgg16")
    p.add_argument("--rates", default="unlimited,100mbit")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="timed steps are split into this many interleaved rounds",
    )
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument(
        "--raw",
        default=harness.result_path("schedule_accuracy_raw.json"),
        help="where to write every job's raw profile and measured times (JSON); '' for nowhere",
    )
    p.add_argument(
        "--trace-comm",
        action="store_true",
        help="record every timed all-reduce (start, done) into the raw file (adds tracing "
        "overhead)",
    )
    p.add_argument(
        "--sweep-k", default="", help="extra k to time, for the raw file: e.g. '1,m/4,m/2'"
    )
    p.add_argument(
        "--compare-search",
        action="store_true",
        help="also run auto without a budget (auto_budget=None, tune_steps=10) and compare the "
        "two picks",
    )
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument(
        "--replay",
        metavar="RAW_JSON",
        help="no run: re-predict a raw file's jobs with every model variant (offline evaluation)",
    )
    p.add_argument(
        "--variants",
        default=",".join(VARIANTS),
        help="with --replay: which, of " + ", ".join(VARIANTS),
    )
    args = p.parse_args()
    if args.worker:
        return worker(args)
    if args.replay:
        print(replay(args.replay, args.variants.split(",")))
        return
    ok, why = netns.check()
    if not ok:
        sys.exit(f"cannot emulate a network here: {why}")
    rows = []
    raw = {"command": harness.command(), "jobs": {}}
    for model in args.models.split(","):
        for rate in args.rates.split(","):
            print(
                f"[schedule_accuracy] {model}/{args.size} @ {rate} "
                f"(load {os.getloadavg()[0]:.2f}) ...",
                file=sys.stderr,
                flush=True,
            )
            r = launch(model, args.size, rate, args)
            raw["jobs"][f"{model}/{args.size}@{rate}"] = r
            if args.raw:
                with open(args.raw, "w") as f:
                    json.dump(raw, f)
            auto = f"auto={r['k']}" + (
                f" (model: {r['model_k']})" if r.get("model_k", r["k"]) != r["k"] else ""
            )
            for key, label in (("0", "0"), ("auto", auto), ("m", f"m={r['m']}")):
                pred, meas = r["predicted"][key], r["measured"][key]
                rows.append(
                    (
                        model,
                        rate,
                        label,
                        pred,
                        meas,
                        (pred - meas) / meas,
                        r["kappa"] if key == "auto" else None,
                    )
                )
            print(f"  {r['summary']}; {r.get('tuning')}", file=sys.stderr, flush=True)
    lines = [
        "| model | bandwidth | k | predicted ms/iter | measured ms/iter | error | κ (auto) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for model, rate, label, pred, meas, err, kappa in rows:
        kap = f"{kappa:.1%}" if kappa is not None else ""
        lines.append(
            f"| {model} | {rate} | {label} | {pred * 1e3:.1f} | {meas * 1e3:.1f} | {err:+.1%} "
            f"| {kap} |"
        )
    table = "\n".join(lines)
    if args.compare_search:
        table += "\n\n" + search_table(raw["jobs"])
    print(table)
    if not args.out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(
            f"\n## {time.strftime('%Y-%m-%d %H:%M')} — `{harness.command()}`\n\n"
            f"Optimizers: torch's with `fused=True` (bench_models).\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
