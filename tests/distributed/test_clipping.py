"""Gradient clipping and other edits of p.grad between backward and step (docs/design.md §3.11).

* k = 0 equals DDP + the same clip within 1e-6: ``clip_grad_norm_``, ``clip_grad_value_`` and
  ``opt.clip_grad_norm_``, with SGD and AdamW, with and without GradScaler (``unscale_`` first);
  the gradient norm a script logs from ``p.grad`` is DDP's.
* A nanoGPT-shaped loop (param groups, cosine LR set by hand, accumulation under ``no_sync``,
  GradScaler, unscale, clip) equals the same loop under DDP.
* k > 0 against the float64 reference: the step's gradient (sync g_t with stale g_{t-s}) is
  clipped as one vector, in every compensation mode and on the generic optimizer path.
* Edits other than clipping (a new tensor, ``None``) reach the update as under DDP; one
  sapipe cannot honour warns once; misuse raises.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import pytest
import torch
from support.dist_utils import assert_close_dicts, run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import recipe
from support.reference import clip_by_norm, clip_by_value, run_reference
from support.training import held_and_real, named_weights

import sapipe

STEPS = 6
MAX_NORM = 0.05  # below the models' gradient norms: clipping is active at every step
MAX_VALUE = 2e-3
OPTIMIZERS = {
    "sgd": recipe("sgd-momentum", lr=0.1, weight_decay=1e-3),
    "rmsprop": recipe("rmsprop-momentum", lr=0.01),
    "adamw": recipe("adamw", lr=0.01, weight_decay=0.1),
}


def _clip(how, model, opt):
    """The clip as a script writes it; returns the total norm it reports (None for by-value)."""
    if how == "norm":
        return torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    if how == "opt.norm":
        return opt.clip_grad_norm_(MAX_NORM)
    torch.nn.utils.clip_grad_value_(model.parameters(), MAX_VALUE)
    return None


def _grad_norm(model):
    return torch.nn.utils.get_total_norm(
        [p.grad for p in model.parameters() if p.grad is not None]
    ).item()


K0_CASES = [
    (opt, scaler, how)
    for opt in ("sgd", "adamw")
    for scaler in (False, True)
    for how in ("norm", "value", "opt.norm")
]


def _k0_against_ddp(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = make_batches("tied", STEPS, world_size)
    loss_fn = loss_fn_for("tied")
    results = []
    for kind, use_scaler, how in K0_CASES:
        ddp_model, model = make_model("tied"), make_model("tied")
        ddp = DDP(ddp_model)
        ddp_opt = OPTIMIZERS[kind](ddp_model.parameters())
        opt = sapipe.DistributedOptimizer(OPTIMIZERS[kind](model.parameters()), model)
        scalers = [
            torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, enabled=use_scaler)
            for _ in range(2)
        ]
        logged = []
        for t in range(STEPS):
            x, y = batches[t][rank]
            row = []
            for m, net, o, s in (
                (ddp_model, ddp, ddp_opt, scalers[0]),
                (model, model, opt, scalers[1]),
            ):
                o.zero_grad()
                s.scale(loss_fn(net(x), y)).backward()
                s.unscale_(o)
                row.append(_grad_norm(m))
                reported = _clip(how if m is model or how != "opt.norm" else "norm", m, o)
                row.append(None if reported is None else reported.item())
                s.step(o)
                s.update()
            logged.append(row)
        diff = max(
            (a - b).abs().max().item() for a, b in zip(ddp_model.parameters(), model.parameters())
        )
        results.append({"diff": diff, "logged": logged})
        opt.close()
    return results


@pytest.fixture(scope="module")
def k0_runs():
    return run_ranks(_k0_against_ddp, world_size=2)


@pytest.mark.parametrize(
    "index",
    range(len(K0_CASES)),
    ids=[f"{o}-{'scaler' if s else 'plain'}-{h}" for o, s, h in K0_CASES],
)
def test_clipping_at_k0_equals_ddp(k0_runs, index):
    for rank in range(2):
        result = k0_runs[rank][index]
        assert result["diff"] <= 1e-6, f"rank {rank}: |sapipe - DDP| = {result['diff']:.3e}"
        for ddp_norm, ddp_reported, norm, reported in result["logged"]:
            assert norm == pytest.approx(ddp_norm, rel=1e-6), "p.grad's norm is DDP's"
            if ddp_reported is not None:
                assert ddp_reported > MAX_NORM, (
                    "the clip must be active for the test to mean anything"
                )
                assert reported == pytest.approx(ddp_reported, rel=1e-6)


# ---------------------------------------------------------------- a nanoGPT-shaped loop

MICRO_STEPS = 3


def _nanogpt_optimizer(model):
    """nanoGPT's configure_optimizers: weight decay on matrices only, two param groups."""
    decay = [p for p in model.parameters() if p.dim() >= 2]
    no_decay = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=6e-3,
        betas=(0.9, 0.95),
    )


def _cosine_lr(it, warmup=2, total=STEPS, top=6e-3, bottom=6e-4):
    if it < warmup:
        return top * (it + 1) / (warmup + 1)
    ratio = (it - warmup) / (total - warmup)
    return bottom + 0.5 * (1.0 + math.cos(math.pi * ratio)) * (top - bottom)


def _nanogpt_loop(rank, world_size, use_sapipe):
    """The training loop of karpathy/nanoGPT's train.py, reduced to what touches the optimizer."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = make_batches("tied", STEPS * MICRO_STEPS, world_size)
    loss_fn = loss_fn_for("tied")
    raw_model = make_model("tied")
    optimizer = _nanogpt_optimizer(raw_model)
    if use_sapipe:
        model = raw_model
        optimizer = sapipe.DistributedOptimizer(optimizer, raw_model)
        no_sync = optimizer.no_sync
    else:
        model = DDP(raw_model)
        no_sync = model.no_sync
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12)
    norms = []
    for it in range(STEPS):
        for group in optimizer.param_groups:
            group["lr"] = _cosine_lr(it)
        for micro_step in range(MICRO_STEPS):
            x, y = batches[it * MICRO_STEPS + micro_step][rank]
            last = micro_step == MICRO_STEPS - 1
            with contextlib.nullcontext() if last else no_sync():
                loss = loss_fn(model(x), y) / MICRO_STEPS
                scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 0.3).item())
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
    return {
        "weights": named_weights(raw_model),
        "norms": norms,
    }


def test_nanogpt_style_loop_equals_ddp():
    ddp = run_ranks(_nanogpt_loop, world_size=2, args=(False,))
    ours = run_ranks(_nanogpt_loop, world_size=2, args=(True,))
    for rank in range(2):
        assert_close_dicts(
            ours[rank]["weights"], ddp[rank]["weights"], rtol=0, atol=1e-6, what=f"rank {rank}"
        )
        np.testing.assert_allclose(ours[rank]["norms"], ddp[rank]["norms"], rtol=1e-6)
        assert min(ddp[rank]["norms"]) > 0.3, (
            "the clip must be active for the test to mean anything"
        )


# ---------------------------------------------------------------- k > 0: the float64 reference

STALE_CASES = [  # (k, compensation, staleness, optimizer, clip, GradScaler)
    (3, "none", 1, "sgd", "norm", False),
    (2, "none", 2, "adamw", "norm", False),
    (7, "dc", 1, "adamw", "norm", False),
    (3, "wp1", 1, "sgd", "norm", True),
    (3, "wp2", 1, "adamw", "norm", False),
    (4, "wp3", 1, "sgd", "norm", False),
    (3, "dc", 1, "rmsprop", "norm", False),
    (3, "none", 1, "adamw", "value", False),
]


def _stale(rank, world_size):
    batches = make_batches("tied", STEPS, world_size, dtype=torch.float64)
    loss_fn = loss_fn_for("tied")
    results = []
    for k, mode, staleness, kind, how, use_scaler in STALE_CASES:
        model = make_model("tied", seed=rank, dtype=torch.float64)  # rank 0's weights are broadcast
        opt = sapipe.DistributedOptimizer(
            OPTIMIZERS[kind](model.parameters()),
            model,
            stale_layers=k,
            compensation=mode,
            staleness=staleness,
        )
        # a power-of-two scale that never changes unscales exactly
        scaler = torch.amp.GradScaler(
            "cpu", init_scale=2.0**10, growth_interval=10**6, enabled=use_scaler
        )
        for t in range(STEPS):
            x, y = batches[t][rank]
            opt.zero_grad()
            scaler.scale(loss_fn(model(x), y)).backward()
            scaler.unscale_(opt)
            _clip(how, model, opt)
            scaler.step(opt)
            scaler.update()
        held, real = held_and_real(model, opt)
        results.append({"real": real, "held": held})
        opt.close()
    return results


@pytest.fixture(scope="module")
def stale_runs():
    return run_ranks(_stale, world_size=2)


@pytest.mark.parametrize(
    "index",
    range(len(STALE_CASES)),
    ids=[f"k{k}-{m}-s{s}-{o}-{h}{'-scaler' if sc else ''}" for k, m, s, o, h, sc in STALE_CASES],
)
def test_clipping_at_k_above_0_follows_the_reference(stale_runs, index):
    k, mode, staleness, kind, how, _ = STALE_CASES[index]
    ref = run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        OPTIMIZERS[kind],
        make_batches("tied", STEPS, 2, dtype=torch.float64),
        loss_fn_for("tied"),
        stale_layers=k,
        compensation=mode,
        staleness=staleness,
        clip=clip_by_norm(MAX_NORM) if how == "norm" else clip_by_value(MAX_VALUE),
    )
    unclipped = run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        OPTIMIZERS[kind],
        make_batches("tied", STEPS, 2, dtype=torch.float64),
        loss_fn_for("tied"),
        stale_layers=k,
        compensation=mode,
        staleness=staleness,
    )
    gap = max((ref.real[-1][n] - unclipped.real[-1][n]).abs().max().item() for n in ref.real[-1])
    assert gap > 1e-4, "clipping must change the result for the test to mean anything"
    for rank in range(2):
        got = stale_runs[rank][index]
        assert_close_dicts(
            got["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} real"
        )
        assert_close_dicts(
            got["held"], ref.held[-1][rank], rtol=1e-9, atol=1e-11, what=f"rank {rank} held"
        )


# ---------------------------------------------------------------- other edits, and misuse


def _edits(rank, world_size):
    """A new tensor and None assigned to p.grad at k = 0, as under DDP; then the one edit
    sapipe cannot honour (a gradient for a stale parameter while the pipeline fills)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = make_batches("mlp", STEPS, world_size)
    loss_fn = loss_fn_for("mlp")
    ddp_model, model = make_model("mlp"), make_model("mlp")
    ddp = DDP(ddp_model)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=0.01)
    opt = sapipe.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model)
    for t in range(STEPS):
        x, y = batches[t][rank]
        for m, net, o in ((ddp_model, ddp, ddp_opt), (model, model, opt)):
            o.zero_grad(set_to_none=t % 2 == 0)
            loss_fn(net(x), y).backward()
            m[0].weight.grad = m[0].weight.grad * 0.5  # a new tensor
            if t == 2:
                m[-1].bias.grad = None  # this parameter sits this step out
            o.step()
    diff = max(
        (a - b).abs().max().item() for a, b in zip(ddp_model.parameters(), model.parameters())
    )
    opt.close()

    stale = make_model("mlp")
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(stale.parameters(), lr=0.1), stale, stale_layers=1
    )
    errors = []
    try:
        opt.clip_grad_norm_(1.0)
    except sapipe.UsageError as exc:
        errors.append(str(exc))
    x, y = batches[0][rank]
    loss_fn(stale(x), y).backward()
    first = stale[0].weight
    grad_after_backward = first.grad
    first.grad = torch.ones_like(first)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt.step()
    opt.close()
    closed = make_model("mlp")
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(closed.parameters(), lr=0.1), closed, expose_gradients=False
    )
    loss_fn(closed(x), y).backward()
    try:
        opt.clip_grad_norm_(1.0)
    except sapipe.UsageError as exc:
        errors.append(str(exc))
    opt.close()
    return {
        "diff": diff,
        "stale_grad_was_none": grad_after_backward is None,
        "warnings": [str(w.message) for w in caught],
        "errors": errors,
    }


def test_edits_of_p_grad_reach_the_update_or_warn_once():
    for rank, result in enumerate(run_ranks(_edits, world_size=2)):
        assert result["diff"] <= 1e-6, f"rank {rank}: |sapipe - DDP| = {result['diff']:.3e}"
        assert result["stale_grad_was_none"], (
            "a stale layer has no gradient to apply at the first step"
        )
        ignored = [w for w in result["warnings"] if "the gradient is ignored" in w]
        assert len(ignored) == 1, result["warnings"]
        before_backward, not_exposed = result["errors"]
        assert "between loss.backward() and step()" in before_backward
        assert "expose_gradients=True" in not_exposed


def _rewind(rank, world_size):
    """Load an earlier checkpoint into the live optimizer and replay: p.grad is exposed afresh."""
    import copy

    batches = make_batches("mlp", 4, world_size)
    loss_fn = loss_fn_for("mlp")
    model = make_model("mlp")
    opt = sapipe.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01), model, stale_layers=1
    )
    saved = None
    finals = []
    for attempt in range(2):
        for t in range(4) if attempt == 0 else range(2, 4):
            x, y = batches[t][rank]
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            opt.step()
            if attempt == 0 and t == 1:
                saved = (copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict()))
        with opt.real_weights():
            finals.append(named_weights(model))
        if attempt == 0:
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
    opt.close()
    return finals


def test_loading_an_earlier_checkpoint_exposes_afresh():
    for rank, (first, replayed) in enumerate(run_ranks(_rewind, world_size=2)):
        for name in first:
            assert torch.equal(torch.as_tensor(first[name]), torch.as_tensor(replayed[name])), (
                rank,
                name,
            )
