"""torch.amp.GradScaler in every mode: unscaling, skipped steps, agreement across ranks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.dist_utils import assert_close_dicts, run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import recipe
from support.reference import run_reference
from support.training import held_and_real

import sapipe

STEPS = 8
POISONED = 4  # rank 1's loss is inf in this iteration: GradScaler must skip it everywhere


def _loss(model, x, y, rank, t, poison):
    loss = loss_fn_for("tied")(model(x), y)
    if poison and rank == 1 and t == POISONED:
        loss = loss * float("inf")
    return loss


def _with_ddp(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = make_batches("tied", STEPS, world_size)
    ddp_model = make_model("tied")
    ddp = DDP(ddp_model)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    ddp_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    model = make_model("tied")
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), model
    )
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**12, growth_interval=2)
    scales = []
    for t in range(1, STEPS + 1):
        x, y = batches[t - 1][rank]
        for m, o, s in ((ddp, ddp_opt, ddp_scaler), (model, opt, scaler)):
            o.zero_grad()
            s.scale(_loss(m, x, y, rank, t, poison=True)).backward()
            s.step(o)
            s.update()
        scales.append((ddp_scaler.get_scale(), scaler.get_scale()))
    opt.synchronize()
    diff = max(
        (a - b).abs().max().item() for a, b in zip(ddp_model.parameters(), model.parameters())
    )
    return {"diff": diff, "scales": scales}


def test_sync_with_grad_scaler_equals_ddp_including_skipped_steps():
    out = run_ranks(_with_ddp, world_size=2)
    for rank, r in enumerate(out):
        assert r["diff"] <= 1e-6, f"rank {rank}: |sapipe - DDP| = {r['diff']:.3e}"
        assert all(a == b for a, b in r["scales"]), r["scales"]
    ddp_scales = [a for a, _ in out[0]["scales"]]
    assert ddp_scales[POISONED - 1] < ddp_scales[POISONED - 2], (
        "the poisoned step must have been skipped"
    )


MODES = [(3, "none"), (7, "dc"), (3, "wp1"), (3, "wp2"), (4, "wp3"), (7, "wp1"), (7, "wp3")]


_optimizer = recipe("sgd-momentum", lr=0.05, weight_decay=1e-3)


def _scaled(rank, world_size, poison, expose=True, growth_interval=10**6):
    results = []
    batches = make_batches("tied", STEPS, world_size, dtype=torch.float64)
    for k, mode in MODES:
        model = make_model("tied", seed=rank, dtype=torch.float64)
        opt = sapipe.DistributedOptimizer(
            _optimizer(model.parameters()),
            model,
            stale_layers=k,
            compensation=mode,
            expose_gradients=expose,
        )
        # Power-of-two scales unscale exactly, also where they change (growth_interval=2).
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=growth_interval)
        # the weights the next forward runs on (predicted ones included)
        finite_after, around_poison = [], {}
        for t in range(1, STEPS + 1):
            x, y = batches[t - 1][rank]
            opt.zero_grad()
            scaler.scale(_loss(model, x, y, rank, t, poison)).backward()
            scaler.step(opt)
            scaler.update()
            finite_after.append(all(bool(p.isfinite().all()) for p in model.parameters()))
            if t in (POISONED - 1, POISONED):
                around_poison[t] = held_and_real(model, opt)
        opt.synchronize()
        held, real = held_and_real(model, opt)
        results.append(
            {
                "real": real,
                "held": held,
                "scale": scaler.get_scale(),
                "finite_after": finite_after,
                "around_poison": around_poison,
            }
        )
    return results


@pytest.fixture(scope="module")
def scaled_runs():
    return run_ranks(_scaled, world_size=2, args=(False,))


def _assert_reference(runs, index):
    k, mode = MODES[index]
    ref = run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        _optimizer,
        make_batches("tied", STEPS, 2, dtype=torch.float64),
        loss_fn_for("tied"),
        stale_layers=k,
        compensation=mode,
    )
    for rank in range(2):
        got = runs[rank][index]
        assert_close_dicts(
            got["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} real"
        )
        assert_close_dicts(
            got["held"], ref.held[-1][rank], rtol=1e-9, atol=1e-11, what=f"rank {rank} held"
        )


@pytest.mark.parametrize("index", range(len(MODES)), ids=[f"k{k}-{m}" for k, m in MODES])
def test_scaled_gradients_are_unscaled_exactly(scaled_runs, index):
    _assert_reference(scaled_runs, index)


@pytest.mark.parametrize("expose", [True, False], ids=["exposed", "rank-local p.grad"])
def test_a_changing_scale_unscales_each_gradient_with_its_own(expose):
    """The scale doubles every 2 steps: a stale g_{t-s} summed at S_{t-s} is applied at S_t's
    step (exposed: rescaled by S_t / S_{t-s}; rank-local: unscaled by its own iteration's)."""
    runs = run_ranks(_scaled, world_size=2, args=(False, expose, 2))
    assert runs[0][0]["scale"] == 2.0 ** (10 + STEPS // 2)
    for index in range(len(MODES)):
        _assert_reference(runs, index)


def test_skipped_step_keeps_ranks_in_agreement():
    out = run_ranks(_scaled, world_size=2, args=(True,))
    for index, (k, mode) in enumerate(MODES):
        a, b = out[0][index], out[1][index]
        assert a["scale"] == b["scale"] == 2.0**9, f"{mode}: both ranks back off once"
        assert all(a["finite_after"]) and all(b["finite_after"]), (
            f"k={k} {mode}: a forward ran on non-finite weights"
        )
        for name, value in a["real"].items():
            assert np.isfinite(value).all(), f"{mode}: {name} not finite"
            assert np.array_equal(value, b["real"][name]), f"{mode}: ranks disagree on real {name}"
        # sync layers see the overflow at once: nothing of the step is applied or predicted
        if k < 7:
            for rank, run in enumerate((a, b)):
                (_, real_before), (held, real) = (
                    run["around_poison"][POISONED - 1],
                    run["around_poison"][POISONED],
                )
                for name in real:
                    assert np.array_equal(real[name], real_before[name]), (
                        mode,
                        rank,
                        name,
                        "x_t = x_{t-1}",
                    )
                    assert np.array_equal(held[name], real[name]), (
                        mode,
                        rank,
                        name,
                        "no prediction: x_t held",
                    )


def _scaler_without_itself(rank, world_size):
    """torch's announced GradScaler protocol, driven by a real scaler: ``step()`` offered
    without its ``grad_scaler`` parameter, so the scaler sets ``grad_scale`` / ``found_inf``
    on the optimizer instead of passing itself."""
    model = make_model("tied")
    opt = sapipe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
    opt.step = lambda closure=None: type(opt).step(opt, closure)
    scaler = torch.amp.GradScaler("cpu")
    x, y = make_batches("tied", 1, world_size)[0][rank]
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(_loss(model, x, y, rank, 1, poison=False)).backward()
    try:
        scaler.step(opt)
    except sapipe.UsageError as exc:
        unchanged = all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        return {"error": str(exc), "unchanged": unchanged}
    return {"error": None}


def test_a_scaler_that_does_not_pass_itself_is_refused():
    for r in run_ranks(_scaler_without_itself, world_size=2):
        assert r["error"] is not None, "scaled gradients were stepped as if unscaled"
        assert "grad_scaler" in r["error"] and "found_inf" in r["error"], r["error"]
        assert r["unchanged"], "the refused step changed the weights"
