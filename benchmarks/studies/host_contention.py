"""What work on the other core costs this one: the host-bound part of the CPU figures.

On the 2-core CPU host a rank's communication (Gloo's threads, the shaped loopback, sapipe's
worker with the codec) runs on the core the other rank, or this rank's compute, also needs.
This benchmark pins one thread to core 0 and times a few workloads there, alone and while a
background process on core 1 loops one of:

* ``copy``: a float32 copy of VGG-16's (small) gradient size, streaming memory;
* ``matmul``: a 256×256 matrix product, in cache, compute only;
* ``int8``: the int8 codec's three stages (encode with error feedback, the owner's sum of
  two messages, the decode) on the same size, what the codec of a compressed sum runs.

The workloads on core 0: the same copy, a 512×512 matrix product, and one training step
(forward and backward, no update) of ``--model`` (``small``). Backgrounds alternate round by
round. ``--duty F`` has the background pause after each round of its work so that it works
a share F of the time, as a step's communication does, in bursts. Each cell is the median
over rounds of the round's median, and the table gives each against ``none``. Usage:
``OMP_NUM_THREADS=1 python -m benchmarks host_contention [--duty 0.2]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Callable

import _on_path  # noqa: F401  (benchmarks/ on sys.path)
import harness
import torch
from bench_models import build

BACKGROUNDS = ("none", "copy", "matmul", "int8")


def background_work(kind: str, numel: int) -> Callable[[], None]:
    """One round of ``kind``'s work."""
    if kind == "copy":
        x, y = torch.randn(numel), torch.empty(numel)
        return lambda: y.copy_(x)
    if kind == "matmul":
        a = torch.randn(256, 256)
        return lambda: torch.mm(a, a)
    from sapipe.compression.codec import WireFormat
    from sapipe.kernels import codec as codec_kernels

    fmt = WireFormat("int8", numel, 0, 2)
    grad, residual, out = torch.randn(numel), torch.zeros(numel), torch.empty(numel)
    q, scales = torch.zeros(2, fmt.shard, dtype=torch.int8), torch.zeros(2, fmt.blocks)
    own_q, own_scales = torch.zeros(1, fmt.shard, dtype=torch.int8), torch.zeros(1, fmt.blocks)
    server = torch.zeros(fmt.shard)

    def codec() -> None:
        codec_kernels.encode(grad, residual, q, scales)
        codec_kernels.sum_encode(q, scales, server, own_q, own_scales, 2.0, torch.float32)
        codec_kernels.decode(q, scales, out)

    return codec


def background_loop(kind: str, numel: int, duty: float) -> None:
    """Run ``kind`` forever on core 1 (in a child process), busy ``duty`` of the time: after
    each round it sleeps long enough for that share (1: no pause)."""
    os.sched_setaffinity(0, {1})
    torch.set_num_threads(1)
    work = background_work(kind, numel)
    while True:
        start = time.perf_counter()
        work()
        if duty < 1:
            time.sleep((time.perf_counter() - start) * (1 / duty - 1))


def workloads(model: str, numel: int) -> dict[str, Callable[[], None]]:
    spec = build(model, "small")
    net = spec.make_model()
    inputs, target = spec.make_batch(
        spec.batch_size, torch.device("cpu"), torch.Generator().manual_seed(0)
    )

    def step():
        net.zero_grad(set_to_none=True)
        spec.loss_fn(net(inputs), target).backward()

    x, y = torch.randn(numel), torch.empty(numel)
    a, b = torch.randn(512, 512), torch.randn(512, 512)
    return {"copy": lambda: y.copy_(x), "matmul 512": lambda: torch.mm(a, b), f"{model} step": step}


def timed(fn: Callable[[], None], calls: int) -> float:
    """Median seconds per call over ``calls`` calls (after one untimed)."""
    fn()
    samples = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples)


def main() -> None:
    parser = harness.Parser(__doc__, quick=dict(rounds=1, calls=3))
    parser.add_argument("--model", default="vgg16")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--calls", type=int, default=20, help="timed calls per workload per round")
    parser.add_argument("--background", help=argparse.SUPPRESS)
    parser.add_argument(
        "--numel", type=int, default=0, help="values copied / encoded (default: the model's)"
    )
    parser.add_argument(
        "--duty",
        type=float,
        default=1.0,
        help="share of the time the background works (it pauses after each round)",
    )
    args = parser.parse_args()
    if args.background:
        background_loop(args.background, args.numel, args.duty)
        return
    if len(os.sched_getaffinity(0)) < 2:
        sys.exit("host_contention: needs two cores (core 0 and core 1)")
    os.sched_setaffinity(0, {0})
    torch.set_num_threads(1)
    if not args.numel:
        args.numel = sum(p.numel() for p in build(args.model, "small").make_model().parameters())
    work = workloads(args.model, args.numel)
    results: dict[str, dict[str, list[float]]] = {w: {b: [] for b in BACKGROUNDS} for w in work}
    for _ in range(args.rounds):
        for kind in BACKGROUNDS:
            child = None
            if kind != "none":
                child = subprocess.Popen(
                    [
                        sys.executable,
                        __file__,
                        "--background",
                        kind,
                        "--numel",
                        str(args.numel),
                        "--duty",
                        str(args.duty),
                    ]
                )
                time.sleep(2.0)  # imported and looping
            try:
                for name, fn in work.items():
                    results[name][kind].append(timed(fn, args.calls))
            finally:
                if child is not None:
                    child.kill()
                    child.wait()
    print(
        f"{args.numel / 1e6:.2f} M values; one thread on core 0, core 1 busy {args.duty:.0%} of "
        f"the time; ms per call (× alone), median of {args.rounds} rounds of {args.calls} calls\n"
    )
    print("| on core 0 | " + " | ".join(f"core 1: {b}" for b in BACKGROUNDS) + " |")
    print("| --- |" + " ---: |" * len(BACKGROUNDS))
    for name, per_kind in results.items():
        alone = statistics.median(per_kind["none"])
        cells = [
            f"{statistics.median(v) * 1e3:.2f} ({statistics.median(v) / alone:.2f}×)"
            for v in per_kind.values()
        ]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
