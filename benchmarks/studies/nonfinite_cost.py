"""What the check for non-finite gradients costs (``nonfinite_gradients="warn"``, the default).

Each rank judges what it sends of each bucket as it launches the bucket's collective (one
``torch.aminmax`` over it and four scalar operations writing a value behind the flags), and
reads the summed count as the sum is consumed (sapipe.runtime.nonfinite). Two measurements:

1. **Per bucket**, in isolation: ``judge`` + ``arrived`` on one bucket slot of N float32
   values, against the division by the world size every uncompressed sum already costs
   (``take_mean``'s ``div_``, one pass over the bucket), by bucket size.
2. **Per step**, in a real job: the same model trained by two sapipe optimizers in the same
   ranks, one with ``"warn"``, one with ``"ignore"`` (the check off, nothing more on the
   wire), in alternating rounds of ``--steps`` steps (the order swapped every round), so that
   load from elsewhere hits both alike. The cost is the median over rounds of
   (warn's median step / ignore's − 1), in wall time and in the training thread's CPU time
   (which waits and load from elsewhere disturb less). CPU: ``--ranks`` Gloo processes;
   ``--device cuda``: one NCCL rank (each step ends with a device synchronisation).

    python -m benchmarks nonfinite_cost [--model gpt2] [--size small] [--ranks 2] [--rounds 9]
        [--steps 20]
    python -m benchmarks nonfinite_cost --device cuda --size full --ranks 1
"""

from __future__ import annotations

import socket
import statistics
import time

import _on_path  # noqa: F401  (benchmarks/ on sys.path)
import harness


def _timed(fn, reps: int, device) -> float:
    """Seconds per call of ``fn``: the best of 5 runs of ``reps`` calls, after one."""
    import torch

    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    best = []
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        if device.type == "cuda":
            torch.cuda.synchronize()
        best.append((time.perf_counter() - start) / reps)
    return min(best)


class _Bucket:  # what NonFiniteGradients.arrived reads of a bucket
    index = 0

    def __init__(self, grads):
        self.grads = grads


def _bucket_row(n: int, dev) -> str:
    """The per-bucket table's row for a bucket of ``n`` float32 values."""
    import torch

    from sapipe.runtime.gradients import StalenessBuffer
    from sapipe.runtime.nonfinite import NonFiniteGradients

    grads = StalenessBuffer(n, torch.float32, dev, 1, flags=8, verdict=True)
    grads.slots[0].normal_()
    check = NonFiniteGradients("warn", 0, 2)
    check.start(dev)
    bucket = _Bucket(grads)

    def arrived():
        check.arrived(bucket, 0, 1)
        for window in check._windows:  # noqa: SLF001 - each arrival is kept until its check
            window.arrivals.clear()

    def one():
        check.launched(grads, 0, [grads.slots[0]])
        arrived()

    def arrived_alone():
        grads.verdicts[0] = kept
        arrived()

    reps = max(3, min(2000, int(2e8 // (n * 4))))
    cost = _timed(one, reps, dev)
    check.launched(grads, 0, [grads.slots[0]])
    kept = grads.verdicts[0]
    on_arrival = _timed(arrived_alone, reps, dev)
    div = _timed(lambda: grads.slots[0].div_(1.0), reps, dev)
    return (
        f"| {n:,} | {n * 4 / 2**20:.2f} | {cost * 1e6:.1f} | {on_arrival * 1e6:.1f} "
        f"| {n * 4 / cost / 1e9:.1f} | {div * 1e6:.1f} | {cost / div:.2f} |"
    )


def per_bucket(device: str, sizes) -> None:
    import torch

    print(
        "| bucket values (float32) | MiB | check µs (launched + arrived) | of which arrived µs "
        "| GB/s | take_mean's div_ µs | check / div_ |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for n in sizes:
        print(_bucket_row(n, torch.device(device)))


def _job(rank, world, port, args, results) -> None:
    import bench_models
    import torch
    import torch.distributed as dist

    import sapipe

    torch.set_num_threads(1)
    device = torch.device(args.device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
    )
    spec = bench_models.build(args.model, args.size)
    gen = torch.Generator().manual_seed(rank)
    batches = [spec.make_batch(spec.batch_size, device, gen) for _ in range(4)]
    jobs = {}
    for setting in ("warn", "ignore"):
        model = spec.make_model().to(device)
        k = 0 if args.stale == "0" else len(bench_models.describe_layers(model, batches[0][0]))
        opt = sapipe.DistributedOptimizer(
            spec.make_optimizer(model.parameters()),
            model,
            stale_layers=k,
            compression=args.compression,
            nonfinite_gradients=setting,
        )
        jobs[setting] = (model, opt)

    def median_step(model, opt):
        """(median wall seconds, median seconds of the training thread's CPU) per step."""
        times, cpu = [], []
        for i in range(args.steps):
            x, y = batches[i % len(batches)]
            start, start_cpu = time.perf_counter(), time.thread_time()
            opt.zero_grad()
            spec.loss_fn(model(x), y).backward()
            opt.step()
            if device.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            cpu.append(time.thread_time() - start_cpu)
        return statistics.median(times[2:]), statistics.median(cpu[2:])

    for setting in ("warn", "ignore"):
        median_step(*jobs[setting])  # warm-up
    ratios, cpu_ratios, steps = [], [], {"warn": [], "ignore": []}
    for r in range(args.rounds):
        order = ("warn", "ignore") if r % 2 == 0 else ("ignore", "warn")
        got = {setting: median_step(*jobs[setting]) for setting in order}
        ratios.append(got["warn"][0] / got["ignore"][0] - 1)
        cpu_ratios.append(got["warn"][1] / got["ignore"][1] - 1)
        for setting in got:
            steps[setting].append(got[setting][0])
    opt = jobs["warn"][1]
    buckets = [(b.numel, b.stale) for b in opt.buckets]
    for _, o in jobs.values():
        o.close()
    if rank == 0:
        results.put(
            {"ratios": ratios, "cpu_ratios": cpu_ratios, "steps": steps, "buckets": buckets}
        )
    dist.destroy_process_group()


def per_step(args) -> None:
    import torch
    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_job, args=(r, args.ranks, port, args, results))
        for r in range(args.ranks)
    ]
    for p in procs:
        p.start()
    out = results.get(timeout=3600)
    for p in procs:
        p.join()
    ratios = out["ratios"]
    warn, ignore = (statistics.median(out["steps"][s]) * 1e3 for s in ("warn", "ignore"))
    values = sum(n for n, _ in out["buckets"])
    k = "0" if args.stale == "0" else "m"
    print(
        f"\n{args.model} ({args.size}), {args.ranks} rank(s) on {args.device}, k={k}, "
        f"compression={args.compression}, torch {torch.__version__}: "
        f"{len(out['buckets'])} buckets, {values:,} gradient values; "
        f"{args.rounds} rounds of {args.steps} steps"
    )
    print(
        f"median step: warn {warn:.2f} ms, ignore {ignore:.2f} ms; warn/ignore − 1 per round: "
        + ", ".join(f"{r * 100:+.2f}%" for r in ratios)
    )
    for what, values in (("step time", ratios), ("training thread's CPU time", out["cpu_ratios"])):
        quartiles = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
        print(
            f"cost in {what}: median {statistics.median(values) * 100:+.2f}% (quartiles "
            f"{quartiles[0] * 100:+.2f}% .. {quartiles[2] * 100:+.2f}%)"
        )


def main() -> None:
    p = harness.Parser(
        __doc__,
        quick=dict(size="tiny", rounds=2, steps=4, skip_buckets=True),
        device=("cpu", "cuda"),
        size="small",
    )
    p.add_argument("--model", default="gpt2", help="a bench_models family")
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--stale", choices=("0", "m"), default="0", help="k = 0 or every layer stale")
    p.add_argument("--compression", default=None)
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--skip-buckets", action="store_true", help="leave out the per-bucket table")
    args = p.parse_args()
    if not args.skip_buckets:
        per_bucket(args.device, (1_024, 65_536, 1_048_576, 6_553_600))
    per_step(args)


if __name__ == "__main__":
    main()
