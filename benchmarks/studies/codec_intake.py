"""What backward's intake and a 16-bit sum's first stage cost: via the bucket, or cast on intake.

Per model: gradients copied into the float32 bucket and then encoded (what int8, error
feedback and node-first sums still do) against gradients cast straight into the outgoing
messages (fp16 / bf16 without error feedback, docs/design.md §5.9 *Encoded on intake*).

Each variant copies every parameter's gradient (one tensor per parameter, as backward hands
them over) and runs stage 1 (``scatter_messages``: the encode, or only the flags) of one
bucket holding the whole model over 2 ranks. The two alternate, 40 times each; the medians
are printed, and their ratio.

    python -m benchmarks codec_intake [--models vgg16,gpt2,resnet50] [--device cuda]
"""

from __future__ import annotations

import statistics
import time
from typing import Callable

import _on_path  # noqa: F401  (benchmarks/ on sys.path)
import bench_models
import harness
import torch

from sapipe.compression.codec import BucketCodec, Compression, intake_views


def timed(fn: Callable[[], None], device: torch.device) -> float:
    """Seconds of one call, the device caught up at both ends."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


def compare(params: list[torch.Tensor], kind: str, device: torch.device, rounds: int) -> tuple:
    """(ms via the float32 bucket + encode, ms cast on intake), medians of alternating calls."""
    grads = [torch.randn_like(p) for p in params]
    offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
    numel = sum(p.numel() for p in params)
    codec = BucketCodec(Compression.of(kind), numel, len(params), 2, torch.float32, device)
    wire = torch.zeros(numel + len(params), device=device)
    bucket_views = [wire[o : o + p.numel()].view_as(p) for o, p in zip(offsets, params)]
    message_views = intake_views(codec, 0, offsets, params)

    def via_bucket() -> None:
        for view, grad in zip(bucket_views, grads):
            view.copy_(grad)
        codec.scatter_messages(wire, 0)

    def on_intake() -> None:
        for view, grad in zip(message_views, grads):
            view.copy_(grad)
        codec.scatter_messages(wire, 0, encoded=True)

    times = {via_bucket: [], on_intake: []}
    for _ in range(3):  # warm caches and the allocator
        via_bucket()
        on_intake()
    for r in range(2 * rounds):
        order = (via_bucket, on_intake) if r % 2 else (on_intake, via_bucket)
        for fn in order:
            times[fn].append(timed(fn, device))
    return statistics.median(times[via_bucket]) * 1e3, statistics.median(times[on_intake]) * 1e3


def main() -> None:
    p = harness.Parser(
        __doc__, quick=dict(models="gpt2", rounds=3), device=("cpu", "cuda"), size="small"
    )
    p.add_argument("--models", default="vgg16,gpt2,resnet50")
    p.add_argument(
        "--threads", type=int, default=1, help="intra-op threads (the training thread's)"
    )
    p.add_argument("--rounds", type=int, default=20)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(
        f"torch {torch.__version__}, {device}, {args.threads} thread(s), "
        f"medians of {2 * args.rounds} alternating calls"
    )
    print("| model | values | format | float32 bucket + encode | cast on intake | ratio |")
    print("| --- | ---: | --- | ---: | ---: | ---: |")
    for name in args.models.split(","):
        params = [
            q.detach().to(device)
            for q in bench_models.build(name, args.size).make_model().parameters()
        ]
        for kind in ("bf16", "fp16"):
            old, new = compare(params, kind, device, args.rounds)
            numel = sum(q.numel() for q in params)
            print(
                f"| {name} | {numel / 1e6:.2f} M | {kind} | {old:.3f} ms | {new:.3f} ms "
                f"| {new / old:.2f} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
