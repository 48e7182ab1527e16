"""stale_layers=0 is DistributedDataParallel: same weights to 1e-6 after 25 steps.

Each of 2 Gloo ranks trains two copies of ``TiedResidualNet`` (tied embedding/head,
residual blocks, registration order != forward order) in float32: one under
``torch.nn.parallel.DistributedDataParallel`` + the plain optimizer, one under sapipe.
The LR changes every step (LambdaLR), so a deferred update that used the wrong step's LR
would show.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import GENERIC, recipe

STEPS = 25
#: the fused path's optimizers by the tests' names; GENERIC's with their own hyper-parameters
OPTIMIZERS = {
    "sgd": recipe("sgd-momentum", lr=0.1, dampening=0.1, weight_decay=1e-3),
    "sgd-nesterov": recipe("sgd-nesterov", lr=0.1, weight_decay=1e-3),
    "adam": recipe("adam", lr=0.01, weight_decay=1e-3),
} | {kind: recipe(kind) for kind in GENERIC}


def _train(rank, world_size, kind, bucket_cap_mb, micro_batches=1):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sapipe

    batches = make_batches("tied", STEPS * micro_batches, world_size)
    loss_fn = loss_fn_for("tied")
    ddp_model = make_model("tied", seed=0)
    ddp = DDP(ddp_model)
    ddp_opt = OPTIMIZERS[kind](ddp_model.parameters())
    ddp_sched = torch.optim.lr_scheduler.LambdaLR(ddp_opt, lambda e: 0.97**e)

    model = make_model("tied", seed=rank)  # construction broadcasts rank 0's weights
    opt = sapipe.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()), model, bucket_cap_mb=bucket_cap_mb
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.97**e)
    assert opt.stale_layers == 0
    losses = []
    for t in range(STEPS):
        micro = [batches[t * micro_batches + j][rank] for j in range(micro_batches)]
        ddp_opt.zero_grad()
        for j, (x, y) in enumerate(micro):
            with ddp.no_sync() if j < micro_batches - 1 else contextlib.nullcontext():
                (loss_fn(ddp(x), y) / micro_batches).backward()
        ddp_opt.step()
        ddp_sched.step()

        opt.zero_grad()
        for j, (x, y) in enumerate(micro):
            with opt.no_sync() if j < micro_batches - 1 else contextlib.nullcontext():
                loss = loss_fn(model(x), y) / micro_batches
                loss.backward()
        opt.step()
        sched.step()
        losses.append(loss.item())
    opt.synchronize()
    diff = max(
        (a - b).abs().max().item() for a, b in zip(ddp_model.parameters(), model.parameters())
    )
    moved = max(
        (a - b).abs().max().item()
        for a, b in zip(make_model("tied").parameters(), model.parameters())
    )
    return {
        "diff": diff,
        "moved": moved,
        "losses": losses,
        "buckets": len(opt.buckets),
        "path": opt.update_path,
    }


@pytest.mark.parametrize("kind", ["sgd", "sgd-nesterov", "adam"])
@pytest.mark.parametrize("bucket_cap_mb", [25, 0.0004])
def test_sync_equals_ddp(kind, bucket_cap_mb):
    out = run_ranks(_train, world_size=2, args=(kind, bucket_cap_mb))
    for rank, r in enumerate(out):
        assert r["moved"] > 1e-2, "training must actually change the weights"
        assert r["diff"] <= 1e-6, f"rank {rank}: max |sapipe - DDP| = {r['diff']:.3e}"
    assert out[0]["buckets"] >= (2 if bucket_cap_mb < 1 else 1)
    assert np.isfinite(out[0]["losses"]).all()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_gradient_accumulation_equals_ddp_no_sync(kind):
    out = run_ranks(_train, world_size=2, args=(kind, 0.0004, 3))
    for rank, r in enumerate(out):
        assert r["moved"] > 1e-2
        assert r["diff"] <= 1e-6, f"rank {rank}: max |sapipe - DDP| = {r['diff']:.3e}"


@pytest.mark.parametrize("kind", sorted(GENERIC))
def test_generic_path_equals_ddp(kind):
    """Any other optimizer runs its own step() per bucket segment (docs/design.md §3.10): DDP's
    weights."""
    out = run_ranks(_train, world_size=2, args=(kind, 0.0004))
    for rank, r in enumerate(out):
        assert r["path"] == "generic"
        assert r["moved"] > 1e-2, "training must actually change the weights"
        assert r["diff"] <= 1e-6, f"rank {rank}: max |sapipe - DDP| = {r['diff']:.3e}"
    assert out[0]["buckets"] >= 2
