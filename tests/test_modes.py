"""Every staleness mode on real Gloo ranks against the independent float64 reference.

Two ranks train ``TiedResidualNet`` (residual blocks, a tied embedding/head, registration
order != execution order) in float64 with sapipe; ``tests/reference.py`` simulates both
ranks of docs/design.md §3 with real ``torch.optim`` optimizers. After every configuration the
real weights x and each rank's held weights (x̃ under weight prediction) must agree to
~1e-10, so any deviation from the rules (wrong Δ, wrong slot, wrong LR of a deferred
update, state advancing at t=1, ...) fails.

The LR changes every step (LambdaLR on the sapipe optimizer), parameters are split into
two param groups interleaved across layers (weight decay on matrices only), and buckets
are tiny so each model spans several buckets.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from dist_utils import assert_close_dicts, run_ranks
from models import loss_fn_for, make_batches, make_model
from optimizers import GENERIC
from reference import run_reference

STEPS = 8
BASE_LR = {"sgd": 0.05, "adam": 0.01, "adamw": 0.01, "rmsprop": 0.01, "lion": 0.002}


def lr_factor(epoch: int) -> float:
    return 1.0 / (1.0 + 0.15 * epoch)


def make_optimizer(kind: str, params):
    params = list(params)
    decay = [p for p in params if p.ndim > 1]
    plain = [p for p in params if p.ndim <= 1]
    groups = [g for g in ({"params": decay}, {"params": plain, "weight_decay": 0.0}) if g["params"]]
    lr = BASE_LR[kind]
    if kind in GENERIC:  # the generic path: the optimizer's own step() per segment (design §3.10)
        return GENERIC[kind](groups, lr=lr)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=lr, momentum=0.9, nesterov=True, weight_decay=1e-2)
    if kind == "adam":
        return torch.optim.Adam(groups, lr=lr, betas=(0.8, 0.95), weight_decay=1e-2)
    return torch.optim.AdamW(groups, lr=lr, weight_decay=0.05)


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
    (2, "none", "outer", 1, 3, 0),
    (3, "dc", "outer", 1, 2, 0),
    (3, "wp1", "outer", 1, 2, 0),
    (M, "wp3", "outer", 1, 3, 0),
    (3, "none", "outer", 2, 0, 0),
    (M, "dc", "outer", 2, 1, 4),
    (4, "dc", "diagonal", 3, 0, 3),
]
DC_LAMBDA = 0.7


def _train(rank: int, world_size: int, kind: str, configs, options=None, device: str = "cpu"):
    """Train every configuration; ``options``: extra DistributedOptimizer arguments."""
    import sapipe

    results = []
    batches = make_batches("tied", STEPS, world_size, dtype=torch.float64)
    for k, mode, form, s, warmup, ramp in configs:
        # Rank 1 starts from different weights: construction must broadcast rank 0's.
        model = make_model("tied", seed=rank, dtype=torch.float64).to(device)
        opt = sapipe.DistributedOptimizer(
            make_optimizer(kind, model.parameters()),
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
            }
        )
        opt.close()
    return results


def train_and_read(model, opt, batches, rank: int, device: str = "cpu"):
    """Train on every step of ``batches`` with the LR changing each step; (real, held) weights."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    for step in batches:
        x, y = (v.to(device) for v in step[rank])
        opt.zero_grad()
        loss_fn_for("tied")(model(x), y).backward()
        opt.step()
        sched.step()
    opt.synchronize()
    held = {n: p.detach().clone() for n, p in model.named_parameters()}
    with opt.real_weights():
        real = {n: p.detach().clone() for n, p in model.named_parameters()}
    return real, held


@functools.cache
def _distributed(kind: str):
    return run_ranks(_train, world_size=2, args=(kind, CONFIGS), timeout=300)


def config_id(config) -> str:
    return "k{}-{}-{}-s{}-w{}-r{}".format(*config)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw", "rmsprop", "lion"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_mode_matches_reference(kind, config):
    per_rank = _distributed(kind)
    check_against_reference(kind, config, [per_rank[r][CONFIGS.index(config)] for r in range(2)])


@functools.cache
def _without_kernels(kind: str):
    """The ranks with ``SAPIPE_DISABLE_EXT=1``: the pure-PyTorch kernels (``ops.reference_*``),
    which also run wherever the compiled ones take no tensor (16-bit weights on the CPU)."""
    os.environ["SAPIPE_DISABLE_EXT"] = "1"  # read when the ranks import sapipe (dist_utils)
    try:
        return run_ranks(_train, world_size=2, args=(kind, CONFIGS), timeout=300)
    finally:
        del os.environ["SAPIPE_DISABLE_EXT"]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_the_pytorch_kernels_match_the_reference_too(kind, config):
    per_rank = _without_kernels(kind)
    assert not any(per_rank[r][0]["compiled_kernels"] for r in range(2)), (
        "the ranks did not see SAPIPE_DISABLE_EXT"
    )
    check_against_reference(kind, config, [per_rank[r][CONFIGS.index(config)] for r in range(2)])


def check_against_reference(kind: str, config, per_rank) -> None:
    """Every rank's results of ``config`` equal the float64 reference's (rtol 1e-9)."""
    k, mode, form, s, warmup, ramp = config
    batches = make_batches("tied", STEPS, len(per_rank), dtype=torch.float64)
    ref = run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        functools.partial(make_optimizer, kind),
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
