"""Where does a sapipe iteration's time go? Measured trace vs the scheduler's prediction.

For one model × emulated bandwidth, one ``torchrun`` job (2 ranks, in a rate-limited
network namespace as docs/design.md §6) trains with ``stale_layers="auto"`` and then, freshly,
with k = m (Pipe-SGD), both with sapipe's runtime tracer on. For the timed iterations of
each it splits the iteration time (rank 0) into

* **compute**: forward + backward + ``step()`` (everything that is not a wait),
* **forward waits**: waiting for synchronous all-reduces: before each layer's next forward
  (deferred updates), or, when the script reads ``p.grad`` before ``step()``, at that read,
* **step waits**: ``step()`` waiting for the previous iteration's stale all-reduces,

and sets the same split of the scheduler's simulated iteration beside it. A gap in
*compute* is the CPU that communication takes from computation on this host
(docs/design.md §6), which the scheduler's model does not charge; a gap in *waits* is the link
model.

    python benchmarks/explain_auto.py --model vgg16 --size small --rate 25gbit
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import harness

from sapipe.launch import netns


def _split(events, first_iteration: int):
    """Median per-iteration (total, compute, forward waits, step waits) in ms of a recorded
    trace."""
    iterations = [
        e
        for e in events
        if e.category == "iteration" and e.args.get("iteration", 0) >= first_iteration
    ]
    waits = [e for e in events if e.category == "wait"]
    rows = []
    for it in iterations:
        inside = [w for w in waits if w.start >= it.start and w.end <= it.end]
        stale = sum(w.end - w.start for w in inside if "stale" in str(w.args.get("stream", "")))
        sync = sum(w.end - w.start for w in inside) - stale
        total = it.end - it.start
        rows.append((total, total - sync - stale, sync, stale))
    return [1e3 * statistics.median(col) for col in zip(*rows)] if rows else [float("nan")] * 4


def _predicted(events):
    """(total, compute, forward waits, step waits) in ms of the simulated steady-state iteration.

    As :func:`_split` does, waits are told apart by what they wait for: a sync all-reduce
    ("wait sync bucket N" before a forward, or "step: wait sync all-reduces" at the end of
    backward when the simulator models a script that reads ``p.grad``) or a stale one."""
    compute = sum(
        e.end - e.start for e in events if e.category in ("forward", "backward", "update", "step")
    )
    waits = [e for e in events if e.category == "wait"]
    forward = sum(e.end - e.start for e in waits if "wait sync" in e.name)
    step = sum(e.end - e.start for e in waits if "wait stale" in e.name)
    return [1e3 * x for x in (compute + forward + step, compute, forward, step)]


def _train(spec, model, opt, batch, steps: int) -> None:
    for _ in range(steps):
        opt.zero_grad()
        spec.loss_fn(model(batch[0]), batch[1]).backward()
        opt.step()


def worker(args) -> None:
    import bench_models
    import torch
    import torch.distributed as dist

    import sapipe
    from sapipe.schedule import simulator
    from sapipe.tracing import chrome_trace

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = bench_models.build(args.model, args.size)
    batch = spec.make_batch(
        spec.batch_size, torch.device("cpu"), torch.Generator().manual_seed(rank)
    )
    out = {}
    k = "auto"
    for label in ("auto", "k=m"):
        torch.manual_seed(0)
        model = spec.make_model()
        opt = sapipe.DistributedOptimizer(
            spec.make_optimizer(model.parameters()),
            model,
            stale_layers=k,
            bucket_cap_mb=args.bucket_cap_mb,
            trace=True,
        )
        _train(spec, model, opt, batch, opt.settings.effective_warmup)
        while opt.stale_layers == "auto":  # profiled; now measuring its k on the job
            _train(spec, model, opt, batch, 1)
        _train(spec, model, opt, batch, 3)
        opt.tracer.clear()
        _train(spec, model, opt, batch, args.steps)
        measured = _split(chrome_trace.events_from_tracer(opt.tracer.events()), 0)
        row = {"k": opt.stale_layers, "measured": measured}
        auto = opt.auto  # None for the k = m run
        if auto is not None and auto.tuner is not None:
            row["tuning"] = auto.tuner.summary()
        if auto is not None and auto.decision is not None:
            # the decision's own inputs: its layer profiles and the simulator's other arguments
            sim = simulator.simulate(
                auto.layer_profiles, auto.decision.k, **auto.simulator_arguments()
            )
            row["predicted"] = _predicted(sim.events)
            row["summary"] = auto.decision.summary()
        out[label] = row
        k = opt.num_layers  # the second run: every layer stale (Pipe-SGD)
        opt.close()
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(out, f)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    p = harness.Parser(__doc__, quick=dict(size="tiny", steps=3), size="small", worker=True)
    p.add_argument("--model", default="vgg16")
    p.add_argument(
        "--rate",
        default="25gbit",
        help="loopback RATE[,LATENCY] in the namespace, e.g. 25gbit, 1gbit,2ms or unlimited",
    )
    p.add_argument("--steps", type=int, default=20, help="timed iterations per run")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = harness.torchrun(
            2,
            __file__,
            "--worker",
            "--model",
            args.model,
            "--size",
            args.size,
            "--steps",
            str(args.steps),
            "--bucket-cap-mb",
            str(args.bucket_cap_mb),
            "--result",
            out,
        )
        env = harness.worker_env(OMP_NUM_THREADS="1")
        proc = subprocess.run(
            netns.wrap(cmd, netns.parse_spec(args.rate)), capture_output=True, text=True, env=env
        )
        if proc.returncode != 0:
            sys.exit(f"job failed:\n{proc.stderr[-3000:]}")
        with open(out) as f:
            result = json.load(f)
    print(f"`{harness.command()}` (rank 0, median of {args.steps} iterations, ms)\n")
    print("| run | k | | iteration | compute | forward waits | step waits |")
    print("| --- | --- | --- | ---: | ---: | ---: | ---: |")
    for label, row in result.items():
        for what in ("measured", "predicted"):
            if what in row:
                print(
                    f"| {label} | {row['k']} | {what} | "
                    + " | ".join(f"{x:.1f}" for x in row[what])
                    + " |"
                )
    if "summary" in result.get("auto", {}):
        print(f"\n{result['auto']['summary']}")
    if "tuning" in result.get("auto", {}):
        print(f"measured on the job: {result['auto']['tuning']}")


if __name__ == "__main__":
    main()
