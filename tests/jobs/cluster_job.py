"""A sapipe job for an emulated cluster (used by tests/system/test_emulated_cluster.py).

    sapipe-launch --emulate-cluster 2x2 --inter-node 200mbit tests/jobs/cluster_job.py OUT_DIR \\
        [--fail-node N] [--compression FORMAT]

Every rank trains ``models.make_model("tied")`` in float64 with AdamW wrapped in
``sapipe.DistributedOptimizer(stale_layers=3, compensation="wp1")`` on its share of the
batches (with ``compression=FORMAT`` when given), then writes its real and held weights, its
rank, node, address, its buckets' layout and how they were summed (two nodes of two:
hierarchically, by default) to ``OUT_DIR/rank<r>.pt``. With ``--fail-node N``, node N's
ranks exit with status 3 before training, to show that one failing node ends the whole job.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist
from support.models import loss_fn_for, make_batches, make_model

import sapipe

STEPS = 6
STALE_LAYERS, COMPENSATION, LR = 3, "wp1", 0.01


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--fail-node", type=int, default=-1)
    ap.add_argument("--compression", default=None)
    args = ap.parse_args()
    node = int(os.environ["GROUP_RANK"])
    if node == args.fail_node:
        sys.exit(3)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_model("tied", seed=rank, dtype=torch.float64)
    opt = sapipe.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=LR),
        model,
        stale_layers=STALE_LAYERS,
        compensation=COMPENSATION,
        timeout=60,
        compression=args.compression,
    )
    for step in make_batches("tied", STEPS, world, dtype=torch.float64):
        x, y = step[rank]
        opt.zero_grad()
        loss_fn_for("tied")(model(x), y).backward()
        opt.step()
    opt.synchronize()
    held = {n: p.detach().clone() for n, p in model.named_parameters()}
    with opt.real_weights():
        real = {n: p.detach().clone() for n, p in model.named_parameters()}
    names = {id(p): n for n, p in model.named_parameters()}
    buckets = [[(names[id(p)], p.numel()) for p in bucket.params] for bucket in opt.buckets]
    torch.save(
        {
            "rank": rank,
            "world": world,
            "node": node,
            "real": real,
            "held": held,
            "buckets": buckets,
            "address": os.environ.get("GLOO_SOCKET_IFNAME"),
            "sum": type(opt._pipeline.sync_comm).__name__,
        },
        os.path.join(args.out, f"rank{rank}.pt"),
    )
    opt.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
