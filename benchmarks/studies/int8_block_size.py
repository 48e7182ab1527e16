"""What int8's block size does to the ``units`` task: a one-process simulation.

The convergence study's ``units`` task (benchmarks/convergence_tasks.py; RESULTS.md §5)
trains slightly worse with ``compression="int8"`` and error feedback than uncompressed where
its ×1 targets' gradients share int8 blocks with gradients about 1000 times larger: with
blocks of 256 or 128 values, not with sapipe's 64. This replays that task's training, 4
ranks simulated in one process with the same data, seeds and batches as the study, and
rounds the gradient as sapipe's compressed sum does (each rank's gradient plus its residual,
split into W shards of whole blocks, rounded per block; the sum of each shard plus the
server residual, rounded again; docs/design.md §5.9), with blocks of each of ``--blocks``
values (sapipe's are 64). The rounding is written out in PyTorch here (scale = max|v| / 127,
round half to even, clamp to ±127), so that the block size can vary; sapipe's own codec is
not used.

    python -m benchmarks int8_block_size [--seeds 3] [--blocks 256,128,64,32]

Prints the test R² (%) per seed: all 16 targets, and the ×1 targets alone.
"""

from __future__ import annotations

import _on_path  # noqa: F401  (benchmarks/ on sys.path)
import harness
import torch
import torch.nn.functional as F
from convergence_tasks import make_units_data, r_squared

# the units task's settings (convergence_tasks._units_task)
WORLD, LR, STEPS, BATCH = 4, 0.5, 300, 32


def rounded(v: torch.Tensor, block: int) -> torch.Tensor:
    """``v`` as int8 decodes it, one float32 scale per ``block`` values (the last zero-padded)."""
    pad = (-v.numel()) % block
    blocks = torch.cat([v, v.new_zeros(pad)]).view(-1, block)
    scale = (blocks.abs().amax(1, keepdim=True) / 127).clamp_min(torch.finfo(torch.float32).tiny)
    return (torch.round(blocks / scale).clamp(-127, 127) * scale).view(-1)[: v.numel()]


def shards(v: torch.Tensor, size: int) -> list:
    """``v`` cut into WORLD shards of ``size`` values, the last zero-padded."""
    padded = torch.cat([v, v.new_zeros(WORLD * size - v.numel())])
    return list(padded.view(WORLD, size))


def shard_size(n: int, block: int) -> int:
    """Values per shard: 1/W of the ``n`` values, rounded up to whole blocks (as sapipe's)."""
    return -(-n // (WORLD * block)) * block


def compressed_mean(grads, worker, server, block: int) -> torch.Tensor:
    """The mean of the ranks' ``grads`` after both roundings, residuals updated in place."""
    n = grads[0].numel()
    size = shard_size(n, block)
    total = torch.zeros(WORLD * size)
    for g, residual in zip(grads, worker):
        v = g + residual
        sent = torch.cat([rounded(s, block) for s in shards(v, size)])
        residual.copy_(v - sent[:n])
        total += sent
    out = []
    for s, residual in zip(total.view(WORLD, size), server):
        v = s + residual
        out.append(rounded(v, block))
        residual.copy_(v - out[-1])
    return torch.cat(out)[:n] / WORLD


def train(seed: int, block: int, data) -> tuple:
    """(mean test R² %, ×1 targets' R² %) after the task's steps; ``block`` 0: uncompressed."""
    torch.manual_seed(seed)
    model = torch.nn.Linear(32, 16)
    gens = [torch.Generator().manual_seed(1000 * seed + r) for r in range(WORLD)]
    n = sum(p.numel() for p in model.parameters())
    worker = [torch.zeros(n) for _ in range(WORLD)]
    server = [torch.zeros(shard_size(n, max(block, 1))) for _ in range(WORLD)]
    for _ in range(STEPS):
        grads = []
        for gen in gens:
            i = torch.randint(0, data["x_train"].shape[0], (BATCH,), generator=gen)
            model.zero_grad()
            F.mse_loss(model(data["x_train"][i]), data["y_train"][i]).backward()
            grads.append(torch.cat([p.grad.reshape(-1) for p in model.parameters()]))
        mean = (
            torch.stack(grads).mean(0)
            if block == 0
            else compressed_mean(grads, worker, server, block)
        )
        with torch.no_grad():
            offset = 0
            for p in model.parameters():
                p -= LR * mean[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
    with torch.no_grad():
        r2 = 100 * r_squared(model(data["x_test"]), data["y_test"])
    return r2.mean().item(), r2[3::4].mean().item()  # targets 3, 7, 11, 15 are in units of 1


def main() -> None:
    p = harness.Parser(__doc__, quick=dict(seeds=1, blocks="64"))
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--blocks", default="256,128,64,32", help="int8 block sizes to simulate")
    args = p.parse_args()
    torch.set_num_threads(1)
    data = make_units_data()
    print("| rounding | test R² % per seed | ×1 targets' R² % per seed |\n| --- | --- | --- |")
    for block in [0] + [int(b) for b in args.blocks.split(",")]:
        results = [train(seed, block, data) for seed in range(args.seeds)]
        label = "uncompressed" if block == 0 else f"int8 + error feedback, blocks of {block}"
        every = " ".join(f"{a:.2f}" for a, _ in results)
        ones = " ".join(f"{b:.2f}" for _, b in results)
        print(f"| {label} | {every} | {ones} |")


if __name__ == "__main__":
    main()
