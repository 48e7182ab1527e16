"""How well does the scheduler predict? Predicted vs measured iteration time, k = 0 / auto / m.

For each model × emulated bandwidth one ``torchrun`` job runs inside a rate-limited network
namespace (DESIGN.md §6, via ``benchmarks/netem.py``). In that job:

1. a ``stale_layers="auto"`` run profiles its warm-up, and its decision predicts the
   iteration time for k = 0, the chosen k and k = m (the simulator, DESIGN.md §4);
2. the same auto run is then timed after its switch, and fresh runs with k = 0 and k = m
   are timed too — all in the same process group and network, one after the other.

Output: a markdown table (prediction error per k) on stdout, appended to
``benchmarks/results/schedule_accuracy.md`` with the exact command.

    python benchmarks/schedule_accuracy.py --models gpt2,vgg16 --rates unlimited,100mbit
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import netem  # noqa: E402


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import bench_models
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

    def run(stale_layers):
        model = spec.make_model()
        opt = sapipe.DistributedOptimizer(
            spec.make_optimizer(model.parameters()), model, stale_layers=stale_layers, profile_steps=args.profile_steps
        )
        warm = opt._warmup if stale_layers == "auto" else 3  # noqa: SLF001 - the switch point
        timed(opt, model, warm + 2)
        return opt, timed(opt, model, args.steps)

    auto, auto_times = run("auto")
    d = auto.decision
    results = {"m": d.m, "k": d.k, "kappa": d.kappa, "comm_bound": d.comm_bound, "summary": d.summary()}
    results["predicted"] = {"0": d.iteration_time_sync, "auto": d.iteration_time, "m": d.iteration_time_all_stale}
    _, sync_times = run(0)
    _, stale_times = run(d.m)
    results["measured"] = {
        "0": statistics.median(sync_times), "auto": statistics.median(auto_times), "m": statistics.median(stale_times),
    }
    if rank == 0:
        with open(args.out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


def launch(model: str, size: str, rate: str, args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "result.json")
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        cmd = [
            torchrun, "--standalone", f"--nproc_per_node={args.ranks}", os.path.abspath(__file__), "--worker",
            "--model", model, "--size", size, "--out", out, "--steps", str(args.steps),
            "--profile-steps", str(args.profile_steps),
        ]
        env = dict(os.environ, OMP_NUM_THREADS="1")
        proc = subprocess.run(netem.wrap(cmd, netem.parse_rate(rate)), capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RuntimeError(f"{model} @ {rate} failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            return json.load(f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", default="gpt2,vgg16")
    p.add_argument("--size", default="small")
    p.add_argument("--rates", default="unlimited,100mbit")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--profile-steps", type=int, default=5)
    p.add_argument("--output", default=os.path.join(HERE, "results", "schedule_accuracy.md"))
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    ok, why = netem.check()
    if not ok:
        sys.exit(f"cannot emulate a network here: {why}")
    rows = []
    for model in args.models.split(","):
        for rate in args.rates.split(","):
            print(f"[schedule_accuracy] {model}/{args.size} @ {rate} ...", file=sys.stderr, flush=True)
            r = launch(model, args.size, rate, args)
            for key, label in (("0", "0"), ("auto", f"auto={r['k']}"), ("m", f"m={r['m']}")):
                pred, meas = r["predicted"][key], r["measured"][key]
                rows.append((model, rate, label, pred, meas, (pred - meas) / meas, r["kappa"] if key == "auto" else None))
            print(f"  {r['summary']}", file=sys.stderr, flush=True)
    lines = [
        "| model | bandwidth | k | predicted ms/iter | measured ms/iter | error | κ (auto) |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for model, rate, label, pred, meas, err, kappa in rows:
        kap = f"{kappa:.1%}" if kappa is not None else ""
        lines.append(f"| {model} | {rate} | {label} | {pred * 1e3:.1f} | {meas * 1e3:.1f} | {err:+.1%} | {kap} |")
    table = "\n".join(lines)
    print(table)
    command = "python benchmarks/schedule_accuracy.py " + " ".join(sys.argv[1:])
    os.makedirs(os.path.dirname(args.output), exist_ok=True)
    with open(args.output, "a") as f:
        f.write(f"\n## {time.strftime('%Y-%m-%d %H:%M')} — `{command}`\n\n{table}\n")


if __name__ == "__main__":
    main()
