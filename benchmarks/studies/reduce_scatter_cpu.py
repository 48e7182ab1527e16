"""Gloo's reduce-scatter against sapipe's CPU one (an all-to-all plus a sum in rank order).

    OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node W \\
        benchmarks/studies/reduce_scatter_cpu.py [--mib 10] [--calls 20]

Times, on rank 0 (mean of ``--calls`` calls after one warm-up, ranks aligned by a barrier),
``dist.reduce_scatter_tensor``, :func:`sapipe.comm.worker.reduce_scatter_sum` and, for
scale, ``dist.all_reduce`` and ``dist.all_gather_into_tensor`` of the same float32 buffer.
"""

from __future__ import annotations

import time

import _on_path  # noqa: F401  (benchmarks/ on sys.path)
import harness
import torch
import torch.distributed as dist

from sapipe.comm.worker import (
    Scratch,
    all_gather_single,
    reduce_scatter_single,
    reduce_scatter_sum,
)


def timed(fn, calls: int) -> float:
    """Mean milliseconds per call of ``fn`` after one warm-up call."""
    fn()
    dist.barrier()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    p = harness.Parser(__doc__, quick=dict(mib=1.0, calls=3))
    p.add_argument("--mib", type=float, default=10.0)
    p.add_argument("--calls", type=int, default=20)
    args = p.parse_args()
    dist.init_process_group("gloo")
    world = dist.get_world_size()
    n = int(args.mib * 2**20 / 4) // world * world
    full, shard, gathered, scratch = (
        torch.randn(n),
        torch.empty(n // world),
        torch.empty(n),
        Scratch(),
    )
    rows = {
        "dist.reduce_scatter_tensor": lambda: reduce_scatter_single(shard, full),
        "sapipe reduce_scatter_sum": lambda: reduce_scatter_sum(
            shard, full, dist.group.WORLD, scratch, "received"
        ),
        "dist.all_reduce": lambda: dist.all_reduce(full),
        "dist.all_gather_into_tensor": lambda: all_gather_single(gathered, shard),
    }
    times = {name: timed(fn, args.calls) for name, fn in rows.items()}
    if dist.get_rank() == 0:
        print(f"{world} ranks, {n * 4 / 2**20:.1f} MiB of float32, {args.calls} calls")
        for name, ms in times.items():
            print(f"| {name} | {ms:.2f} ms |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
