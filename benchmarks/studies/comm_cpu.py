"""Where a rank's CPU goes per step: the training thread against every other thread.

On a CPU host the ranks share the cores with their own communication: Gloo's threads (the
transport, the sums), sapipe's back-end worker (a compressed sum's codec runs there) and
the kernel's networking. This splits each step's CPU time by thread from
``/proc/self/task/*/stat``: the training thread (the process's main thread) and the sum of
all others, per mode, so that a step slower than ``local`` can be accounted for.

Run under a launcher, e.g. on a loopback shaped to 2 Gbit/s::

    sapipe-launch --emulate-net 2gbit --nproc-per-node 2 benchmarks/studies/comm_cpu.py \\
        --model gpt2 --modes local,ddp,m,m:bf16,m:int8

``--peer-batch N`` has every rank but rank 0 train on N samples: with a light peer, rank 0
computes on a core of its own while its communication threads run beside the peer's, as a
GPU host's communication runs on cores its compute does not use. Rank 0 reports.

Modes: ``local`` (no communication), ``comm`` (no compute: one all-reduce of the gradient's
float32 values per step, T_comm), ``ddp`` (DistributedDataParallel), and ``K[:FORMAT]``
for sapipe at k = K (``m``: every layer) with ``compression=FORMAT``; ``--bucket-cap-mb``
sets both one's buckets. Each mode trains
``--steps`` timed steps after 5 untimed ones; rank 0 prints one row per mode. Every mode
uses the model's ``fused=True`` torch optimizer (bench_models).
"""

from __future__ import annotations

import os
import time

import _on_path  # noqa: F401  (benchmarks/ on sys.path)
import harness


def thread_cpu_seconds() -> dict[int, float]:
    """User + system CPU seconds of each thread of this process, by thread id."""
    tick = os.sysconf("SC_CLK_TCK")
    times = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except FileNotFoundError:  # the thread ended meanwhile
            continue
        times[int(tid)] = (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return times


def main() -> None:
    p = harness.Parser(__doc__, quick=dict(modes="local,m", steps=5), size="small")
    p.add_argument("--model", default="gpt2")
    p.add_argument("--modes", default="local,ddp,m,m:bf16,m:int8")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="sapipe's bucket size (and DDP's)"
    )
    p.add_argument(
        "--peer-batch",
        type=int,
        default=0,
        help="samples per step on every rank but rank 0 (0: the model's batch, as rank 0's)",
    )
    args = p.parse_args()
    import bench_models
    import torch
    import torch.distributed as dist

    import sapipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = bench_models.build(args.model, args.size)
    batch = args.peer_batch if rank > 0 and args.peer_batch > 0 else spec.batch_size
    x, y = spec.make_batch(batch, torch.device("cpu"), torch.Generator().manual_seed(rank))
    if rank == 0:
        peers = f", the others {args.peer_batch} samples" if args.peer_batch > 0 else ""
        print(
            f"{args.model}/{args.size}, {dist.get_world_size()} ranks, one thread each, rank 0 "
            f"{spec.batch_size} samples per step{peers}; {args.steps} steps per mode"
        )
        print(
            "| mode | buckets | step ms | training thread CPU ms/step | other threads CPU ms/step |"
        )
        print("| --- | ---: | ---: | ---: | ---: |")
    for mode in args.modes.split(","):
        model = spec.make_model()
        if mode == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(
                model, bucket_cap_mb=args.bucket_cap_mb
            )
        opt = spec.make_optimizer(model.parameters())
        flat = torch.zeros(sum(p.numel() for p in model.parameters())) if mode == "comm" else None
        if mode not in ("local", "ddp", "comm"):
            k, _, compression = mode.partition(":")
            m = len(bench_models.describe_layers(model, x))
            opt = sapipe.DistributedOptimizer(
                opt,
                model,
                stale_layers=m if k == "m" else int(k),
                compression=compression or None,
                bucket_cap_mb=args.bucket_cap_mb,
            )
        for step in range(5 + args.steps):
            if step == 5:
                dist.barrier()
                before, start = thread_cpu_seconds(), time.perf_counter()
            if flat is not None:  # the link alone: one all-reduce of the gradient's values
                dist.all_reduce(flat)
                continue
            opt.zero_grad()
            spec.loss_fn(model(x), y).backward()
            opt.step()
        elapsed, after = time.perf_counter() - start, thread_cpu_seconds()
        main_thread = os.getpid()
        training = after[main_thread] - before.get(main_thread, 0.0)
        others = sum(t - before.get(tid, 0.0) for tid, t in after.items() if tid != main_thread)
        if rank == 0:
            per = 1e3 / args.steps
            buckets = len(opt.buckets) if hasattr(opt, "buckets") else "–"
            print(
                f"| {mode} | {buckets} | {elapsed * per:.1f} | {training * per:.1f} "
                f"| {others * per:.1f} |",
                flush=True,
            )
        if hasattr(opt, "close"):
            opt.close()
        dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
