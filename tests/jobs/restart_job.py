"""A fault-tolerant sapipe job for ``torchrun --max-restarts`` (used by
tests/system/test_restart.py).

    TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 \\
    torchrun --standalone --nproc_per_node=2 --max-restarts=1 tests/jobs/restart_job.py \\
        --ckpt 'DIR/ckpt-{step}-{rank}.pt' --out final.pt [--kill-step 7]

2 Gloo ranks train ``models.make_model("tied")`` with SGD + momentum + an LR schedule,
wrapped in ``sapipe.DistributedOptimizer(stale_layers=3, compensation="dc", timeout=10)``,
and checkpoint every ``--every`` steps with :class:`sapipe.Checkpointer`. On the first
attempt (``TORCHELASTIC_RESTART_COUNT == "0"``), rank 1 dies with ``os._exit(1)`` in step
``--kill-step`` (after backward, before ``step()``: stale-layer gradients are in flight).
The survivor gets :class:`sapipe.CommunicationError` (or is torn down by torchrun first);
torchrun restarts both ranks, which resume from the last checkpoint. Rank 0 writes the
final real weights to ``--out`` (``torch.save`` of a name -> tensor dict).

The Checkpointer keeps the last two checkpoints and, on (re)start, resumes from the
newest step that *every* rank has a checkpoint of: a rank can die after ``step()`` but
before its save while a peer completes that step's save.

``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: with torchrun's default shared rendezvous store
(torch >= 2.5) the restarted workers can read the previous attempt's Gloo/NCCL addresses
and fail to connect (pytorch/pytorch#135712); ``sapipe-launch --max-restarts=N`` sets it.

Each rank appends one line per attempt to ``<ckpt dir>/events.log``: the attempt, the
step it resumed from, and how it ended (``done`` / ``killed`` / ``CommunicationError``).
"""

from __future__ import annotations

import argparse
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from support.models import loss_fn_for, make_batches, make_model

import sapipe


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ckpt", required=True, help="checkpoint path with {step} and {rank}")
    ap.add_argument("--out", required=True, help="rank 0 writes the final weights here")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=3, help="checkpoint every N steps")
    ap.add_argument(
        "--kill-step",
        type=int,
        default=0,
        help="rank 1 dies in this step (1-based) on the first attempt; 0: never",
    )
    args = ap.parse_args()

    torch.set_num_threads(1)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank, world = dist.get_rank(), dist.get_world_size()
    log_path = os.path.join(os.path.dirname(os.path.abspath(args.ckpt)), "events.log")

    def log(what: str) -> None:
        with open(log_path, "a") as f:
            f.write(f"attempt={attempt} rank={rank} {what}\n")

    model = make_model("tied", seed=0)
    base = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=1e-3)
    opt = sapipe.DistributedOptimizer(
        base, model, stale_layers=3, compensation="dc", bucket_cap_mb=0.001, timeout=10
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.95**e)

    checkpoints = sapipe.Checkpointer(args.ckpt, model, opt, keep=2)
    start, extra = checkpoints.resume()
    if start:
        sched.load_state_dict(extra["scheduler"])
    log(f"start={start}")

    batches = make_batches("tied", args.steps, world)
    loss_fn = loss_fn_for("tied")
    try:
        for t in range(start + 1, args.steps + 1):  # t: 1-based step number
            x, y = batches[t - 1][rank]
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            if attempt == 0 and rank == 1 and t == args.kill_step:
                log(f"killed step={t}")
                os._exit(1)  # mid-step: gradients handed to sapipe, step() never called
            opt.step()
            sched.step()
            if t % args.every == 0:
                checkpoints.save(t, scheduler=sched.state_dict())
    except sapipe.CommunicationError as exc:
        log(f"CommunicationError step={t}: {str(exc).splitlines()[0]}")
        raise

    opt.synchronize()
    if rank == 0:
        with opt.real_weights():
            final = {n: p.detach().clone() for n, p in model.named_parameters()}
        torch.save(final, args.out)
    log("done")
    dist.barrier()  # nobody tears down while a peer still talks
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
