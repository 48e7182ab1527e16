"""sapipe with Hugging Face Accelerate: Accelerate's own loop, DDP replaced by sapipe.

Run on 2 ranks (CPU ranks use Gloo; on GPUs drop nothing, Accelerate picks NCCL):

    torchrun --standalone --nproc_per_node=2 examples/accelerate_train.py
    accelerate launch --num_processes 2 examples/accelerate_train.py --stale-layers 2

The one change from an Accelerate script is ``sapipe.integrations.accelerate.prepare`` in
place of ``accelerator.prepare(model, optimizer)``; the loop (``accumulate``, ``backward``,
``clip_grad_norm_``, the scheduler) is Accelerate's. Data: a synthetic regression task
(random inputs, targets from a fixed random teacher network), so nothing is downloaded.
``--checkpoint DIR`` saves the state at the end with ``accelerator.save_state`` and, when DIR
holds one already, resumes from it first (then trains ``--steps`` more). The main process
prints the loss every ``--log-every`` steps and, at the end, the evaluation loss on the real
weights.
"""

from __future__ import annotations

import argparse
import os

import torch
from accelerate import Accelerator
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from sapipe.integrations.accelerate import prepare

DIM, HIDDEN = 32, 64


def make_model() -> nn.Module:
    return nn.Sequential(
        nn.Linear(DIM, HIDDEN),
        nn.LayerNorm(HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, 1),
    )


def make_data(samples: int, seed: int) -> TensorDataset:
    """Inputs drawn with ``seed``; targets from one fixed teacher (the same for every seed)."""
    teacher = torch.randn(DIM, 1, generator=torch.Generator().manual_seed(0))
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, DIM, generator=generator)
    noise = 0.1 * torch.randn(samples, 1, generator=generator)
    return TensorDataset(x, torch.tanh(x @ teacher) + noise)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50, help="optimizer steps")
    parser.add_argument("--stale-layers", default="2", help="k, or 'auto'")
    parser.add_argument("--compensation", default="dc", help="none, dc, wp1, wp2, wp3")
    parser.add_argument("--accumulate", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank and micro-batch")
    parser.add_argument("--max-norm", type=float, default=1.0, help="gradient clipping bound")
    parser.add_argument("--mixed-precision", default="no", help="no, bf16, fp16")
    parser.add_argument("--checkpoint", help="save the state here at the end (resume if there)")
    parser.add_argument("--log-every", type=int, default=10)
    args = parser.parse_args()
    stale_layers = args.stale_layers if args.stale_layers == "auto" else int(args.stale_layers)

    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),
        gradient_accumulation_steps=args.accumulate,
        mixed_precision=args.mixed_precision,
    )
    torch.manual_seed(0)  # the same initial weights on every rank (sapipe broadcasts rank 0's)
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=args.steps)
    model, optimizer = prepare(
        accelerator, model, optimizer, stale_layers=stale_layers, compensation=args.compensation
    )
    samples = args.steps * args.accumulate * args.batch_size * accelerator.num_processes
    loader = DataLoader(make_data(samples, seed=1), batch_size=args.batch_size, shuffle=True)
    loader, scheduler = accelerator.prepare(loader, scheduler)
    if args.checkpoint and os.path.isdir(args.checkpoint):
        accelerator.load_state(args.checkpoint)
        accelerator.print(f"resumed from {args.checkpoint}")

    loss_fn = nn.MSELoss()
    model.train()
    for micro_step, (x, y) in enumerate(loader, start=1):
        with accelerator.accumulate(model):
            loss = loss_fn(model(x), y)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), args.max_norm)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        step = micro_step // args.accumulate
        if accelerator.sync_gradients and step % args.log_every == 0:
            accelerator.print(f"step {step}: loss {loss.item():.4f}")

    if args.checkpoint:
        accelerator.save_state(args.checkpoint)
        accelerator.wait_for_everyone()  # save_state ends without a barrier
    x, y = make_data(256, seed=2).tensors
    model.eval()
    with optimizer.real_weights(), torch.no_grad():  # not weight prediction's predicted ones
        evaluation = loss_fn(model(x.to(accelerator.device)), y.to(accelerator.device)).item()
    optimizer.sapipe.finish()  # the model keeps the real weights; sapipe's groups are freed
    accelerator.print(
        f"done: {args.steps} steps, stale_layers={optimizer.sapipe.stale_layers}, "
        f"compensation={args.compensation}, eval loss {evaluation:.4f}"
    )


if __name__ == "__main__":
    main()
