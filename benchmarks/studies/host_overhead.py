"""What sapipe's runtime costs the host per iteration, where compute is negligible.

A model of many small layers keeps a GPU waiting on the host: its kernels are short, so
each Python hook sapipe adds per layer and per gradient lengthens the step as much as it
costs. This benchmark times that cost on the CPU, where it can be seen alone: ResNet-50's
layer structure (107 layers, 161 parameters; ``bench_models.ResNet`` at width 4, 8×8 images,
batch 1), one process (Gloo), torch's ``fused=True`` SGD alone against the same optimizer
wrapped by sapipe at k = 0 and k = m. Rounds alternate the two; the cost is the median over
rounds of (sapipe's median step − torch's), per iteration and per layer.

    python -m benchmarks host_overhead [--rounds 7] [--steps 40] [--compressions bf16,int8]
        [--device cuda]

The same model in torch's ``DistributedDataParallel`` (its default, and with
``gradient_as_bucket_view=True``) is timed the same way, so that sapipe's cost reads against
the peer's own (``--no-ddp`` leaves it out).

``--compressions`` adds k = m with each wire format (``compression=``): the codec's host cost
per bucket (its passes, the two collectives and the worker thread's hand-over), one rank.
``--keep-grads`` zeroes gradients in place (``zero_grad(set_to_none=False)``) rather than
dropping them: autograd then accumulates into the views ``p.grad`` already is (sapipe's exposed
slot, DDP's bucket with ``gradient_as_bucket_view=True``), and neither copies a gradient.
``--device cuda`` runs the same on a GPU (one NCCL rank): its kernels are too small to keep the
device busy, so a step lasts as long as the host takes to issue it, launches included.
"""

from __future__ import annotations

import statistics
import time

import _on_path  # noqa: F401  (benchmarks/ on sys.path)
import harness


def main() -> None:
    p = harness.Parser(__doc__, quick=dict(rounds=1, steps=8), device=("cpu", "cuda"))
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument(
        "--compressions",
        default="",
        help="comma-separated formats to add at k = m (bf16,int8,fp16)",
    )
    p.add_argument(
        "--no-ddp",
        dest="ddp",
        action="store_false",
        help="leave out the peer rows: torch's DDP (default, and with "
        "gradient_as_bucket_view=True)",
    )
    p.add_argument(
        "--keep-grads",
        action="store_true",
        help="zero_grad(set_to_none=False): gradients accumulate into the views p.grad holds",
    )
    args = p.parse_args()
    import bench_models
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from harness import init_one_rank_group, synchronize
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sapipe

    torch.set_num_threads(1)
    device = torch.device(args.device)
    init_one_rank_group(device)
    x, y = torch.randn(1, 3, 8, 8, device=device), torch.tensor([1], device=device)

    def make():
        torch.manual_seed(0)
        model = bench_models.ResNet(4, 10, imagenet_stem=False).to(device)
        return model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, fused=True)

    def median_step(model, opt) -> float:
        synchronize(device)  # nothing queued from before
        times = []
        for _ in range(args.steps):
            start = time.perf_counter()
            opt.zero_grad(set_to_none=not args.keep_grads)
            F.cross_entropy(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - start)
        return statistics.median(times[5:])

    plain = make()
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    print(
        f"torch {torch.__version__}, {where}, one thread; "
        f"{args.rounds} rounds of {args.steps} steps"
        + (", zero_grad(set_to_none=False)" if args.keep_grads else "")
    )
    print(
        "| wrapper | layers | torch alone ms | wrapper − torch, ms per iteration | per layer, µs |"
    )
    print("| --- | ---: | ---: | ---: | ---: |")
    m = len(bench_models.describe_layers(plain[0], x))  # sapipe's layers, by its own rule
    cases = [("sapipe, k = 0", 0, None), ("sapipe, k = m", m, None)]
    cases += [(f"sapipe, k = m, {c}", m, c) for c in filter(None, args.compressions.split(","))]
    cases += (
        [("DDP", None, False), ("DDP, gradient_as_bucket_view", None, True)] if args.ddp else []
    )
    for label, k, setting in cases:
        model, base = make()
        if k is None:  # the peer: torch's DDP around the same model, stepping the same optimizer
            model, opt = DDP(model, gradient_as_bucket_view=setting), base
        else:
            opt = sapipe.DistributedOptimizer(base, model, stale_layers=k, compression=setting)
        alone, extra = [], []
        for _ in range(args.rounds):
            a = median_step(*plain)
            extra.append(median_step(model, opt) - a)
            alone.append(a)
        cost = statistics.median(extra)
        print(
            f"| {label} | {m} | {statistics.median(alone) * 1e3:.2f} | {cost * 1e3:.2f} "
            f"| {cost / m * 1e6:.1f} |"
        )
        if k is not None:
            opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
