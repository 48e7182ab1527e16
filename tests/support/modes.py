"""Every staleness mode, trained on real ranks and held to the float64 reference.

The configurations of ``tests/distributed/test_modes.py``, shared with the tests that run
them elsewhere (other back-ends, compressed sums, CUDA): ``train`` runs on each rank (through
``dist_utils.run_ranks``), ``check_against_reference`` compares its results with
``reference.run_reference`` (rtol 1e-9).

The model is ``TiedResidualNet`` in float64; the LR changes every step (LambdaLR on the
sapipe optimizer); parameters are split into two param groups interleaved across layers
(weight decay on matrices only); buckets are tiny so the model spans several.
"""

from __future__ import annotations

import torch

from support.dist_utils import assert_close_dicts
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import recipe
from support.reference import run_reference
from support.training import held_and_real, train_steps

STEPS = 8
BASE_LR = {"sgd": 0.05, "adam": 0.01, "adamw": 0.01, "rmsprop": 0.01, "lion": 0.002}
#: the optimizers by the tests' names; rmsprop and lion take the generic path (design §3.10)
OPTIMIZERS = {
    "sgd": recipe("sgd-nesterov", lr=BASE_LR["sgd"], weight_decay=1e-2, decay_matrices_only=True),
    "adam": recipe(
        "adam",
        lr=BASE_LR["adam"],
        betas=(0.8, 0.95),
        weight_decay=1e-2,
        decay_matrices_only=True,
    ),
    "adamw": recipe("adamw", lr=BASE_LR["adamw"], weight_decay=0.05, decay_matrices_only=True),
    "rmsprop": recipe("rmsprop", lr=BASE_LR["rmsprop"], decay_matrices_only=True),
    "lion": recipe("lion", lr=BASE_LR["lion"], decay_matrices_only=True),
}


def lr_factor(epoch: int) -> float:
    return 1.0 / (1.0 + 0.15 * epoch)


# (stale_layers, compensation, dc_form, staleness, warmup, lr_ramp) — the tied model has m = 7.
M = 7
CONFIGS = [
    (0, "none", "outer", 1, 0, 0),
    (1, "none", "outer", 1, 0, 0),
    (3, "none", "outer", 1, 0, 0),
    (M, "none", "outer", 1, 0, 0),  # Pipe-SGD
    (3, "dc", "outer", 1, 0, 0),
    (3, "dc", "diagonal", 1, 0, 0),
    (M, "dc", "outer", 1, 0, 0),
    (3, "wp1", "outer", 1, 0, 0),
    (3, "wp2", "outer", 1, 0, 0),
    (3, "wp3", "outer", 1, 0, 0),
    (M, "wp3", "diagonal", 1, 0, 0),
    (3, "t2", "outer", 1, 0, 0),
    (M, "t2", "outer", 2, 2, 0),
    (2, "none", "outer", 1, 3, 0),
    (3, "dc", "outer", 1, 2, 0),
    (3, "wp1", "outer", 1, 2, 0),
    (M, "wp3", "outer", 1, 3, 0),
    (3, "none", "outer", 2, 0, 0),
    (M, "dc", "outer", 2, 1, 4),
    (4, "dc", "diagonal", 3, 0, 3),
]
DC_LAMBDA = 0.7


def config_id(config) -> str:
    return "k{}-{}-{}-s{}-w{}-r{}".format(*config)


def train(rank: int, world_size: int, kind: str, configs, options=None, device: str = "cpu"):
    """Train every configuration; ``options``: extra DistributedOptimizer arguments."""
    import sapipe

    results = []
    batches = make_batches("tied", STEPS, world_size, dtype=torch.float64)
    for k, mode, form, s, warmup, ramp in configs:
        # Rank 1 starts from different weights: construction must broadcast rank 0's.
        model = make_model("tied", seed=rank, dtype=torch.float64).to(device)
        opt = sapipe.DistributedOptimizer(
            OPTIMIZERS[kind](model.parameters()),
            model,
            stale_layers=k,
            compensation=mode,
            dc_lambda=DC_LAMBDA,
            dc_form=form,
            staleness=s,
            warmup_steps=warmup,
            lr_ramp_steps=ramp,
            bucket_cap_mb=0.0008,
            timeout=60,
            **(options or {}),
        )
        real, held = train_and_read(model, opt, batches, rank, device)
        results.append(
            {
                "real": real,
                "held": held,
                "buckets": len(opt.buckets),
                "compiled_kernels": sapipe.kernels._ext.cpu is not None,
                "intake": type(opt._pipeline.intake).__name__,
            }
        )
        opt.close()
    return results


def train_and_read(model, opt, batches, rank: int, device: str = "cpu"):
    """Train on every step of ``batches`` with the LR changing each step; (real, held) weights."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    train_steps(
        model, opt, batches, rank, loss_fn=loss_fn_for("tied"), scheduler=sched, device=device
    )
    opt.synchronize()
    held, real = held_and_real(model, opt)
    return real, held


def check_against_reference(kind: str, config, per_rank) -> None:
    """Every rank's results of ``config`` equal the float64 reference's (rtol 1e-9)."""
    k, mode, form, s, warmup, ramp = config
    batches = make_batches("tied", STEPS, len(per_rank), dtype=torch.float64)
    ref = run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        OPTIMIZERS[kind],
        batches,
        loss_fn_for("tied"),
        stale_layers=k,
        compensation=mode,
        dc_lambda=DC_LAMBDA,
        dc_form=form,
        staleness=s,
        warmup_steps=warmup,
        lr_ramp_steps=ramp,
        lr_at=lambda it: BASE_LR[kind] * lr_factor(it - 1),
    )
    assert per_rank[0]["buckets"] >= 2, "the test should span several buckets"
    for rank, got in enumerate(per_rank):
        assert_close_dicts(
            got["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} real x"
        )
        assert_close_dicts(
            got["held"], ref.held[-1][rank], rtol=1e-9, atol=1e-11, what=f"rank {rank} held"
        )
