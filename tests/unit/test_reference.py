"""Sanity checks of the independent reference (tests/support/reference.py) itself."""

import copy

import pytest
import torch
import torch.nn as nn
from support.models import MLP, TiedResidualNet, loss_fn_for, make_batches, make_model
from support.optimizers import make_optimizer
from support.reference import dc_correct, layer_order, opt_peek, run_reference

F64 = torch.float64


def sgd_full(p):
    return make_optimizer("sgd-nesterov", p, lr=0.1, weight_decay=1e-3)


def adam(p):
    return make_optimizer("adam", p, lr=1e-2, betas=(0.9, 0.99), weight_decay=1e-3)


def adamw(p):
    return make_optimizer("adamw", p, lr=1e-2, weight_decay=1e-2)


def plain_sgd(p, lr=0.1):
    return make_optimizer("sgd", p, lr=lr)


def grads_at(model, weights, batch, loss_fn):
    """Gradient (dict by canonical name) of the loss of ``batch`` at ``weights``."""
    m = copy.deepcopy(model).to(F64)
    params = dict(m.named_parameters())
    with torch.no_grad():
        for nm, p in params.items():
            p.copy_(weights[nm])
    x, y = batch
    x = x.to(F64) if x.is_floating_point() else x
    loss_fn(m(x), y.to(F64) if y.is_floating_point() else y).backward()
    return {nm: p.grad.detach().clone() for nm, p in params.items()}


def mean_grad(model, weights, step_batches, loss_fn):
    gs = [grads_at(model, weights, b, loss_fn) for b in step_batches]
    return {nm: sum(g[nm] for g in gs) / len(gs) for nm in gs[0]}


def init_weights(model):
    return {nm: p.detach().to(F64).clone() for nm, p in model.named_parameters()}


def assert_close(a, b, tol=1e-12):
    assert a.keys() == b.keys()
    for nm in a:
        torch.testing.assert_close(
            a[nm], b[nm], rtol=0, atol=tol, msg=lambda m, nm=nm: f"{nm}: {m}"
        )


# (a) k = 0 equals synchronous large-batch training -------------------------------------------
@pytest.mark.parametrize("name", ["tied", "mlp"])
@pytest.mark.parametrize("factory", [sgd_full, adam, adamw])
def test_k0_equals_sync(name, factory):
    model, loss_fn = make_model(name, seed=1), loss_fn_for(name)
    batches = make_batches(name, steps=5, world_size=3, seed=2)
    res = run_reference(model, factory, batches, loss_fn, stale_layers=0, compensation="dc")

    m = copy.deepcopy(model).to(F64)
    params = dict(m.named_parameters())
    opt = factory(list(params.values()))
    for t, step in enumerate(batches):
        g = mean_grad(model, init_weights(m), step, loss_fn)
        for nm, p in params.items():
            p.grad = g[nm]
        opt.step()
        assert_close(res.real[t], init_weights(m))
        for r in range(3):
            assert_close(res.held[t][r], res.real[t], 0)


# (b) k = m, none: hand-written 1-step-delayed SGD (momentum + weight decay, by hand) ----------
def test_full_stale_none_equals_delayed_sgd():
    name = "mlp"
    model, loss_fn = make_model(name, seed=3), loss_fn_for(name)
    batches = make_batches(name, steps=6, world_size=2, seed=4)
    lr, mu, wd = 0.05, 0.9, 1e-3
    res = run_reference(
        model,
        lambda p: torch.optim.SGD(p, lr=lr, momentum=mu, weight_decay=wd),
        batches,
        loss_fn,
        stale_layers=3,
        compensation="none",
    )
    assert res.stale_names == set(init_weights(model))

    x = init_weights(model)
    buf = {nm: torch.zeros_like(v) for nm, v in x.items()}
    g_prev = None
    for t, step in enumerate(batches, start=1):
        g = mean_grad(model, x, step, loss_fn)  # forward at current (real) weights
        if t >= 2:  # update with g_{t-1}
            for nm in x:
                d = g_prev[nm] + wd * x[nm]
                buf[nm] = mu * buf[nm] + d
                x[nm] = x[nm] - lr * buf[nm]
        g_prev = g
        assert_close(res.real[t - 1], x)
    assert_close(res.real[0], init_weights(model), 0)  # t = 1: no update


# (c) layer order follows execution; tied weight belongs to first executed owner --------------
def test_layer_order_tied():
    model = TiedResidualNet()
    reg = [nm for nm, m in model.named_modules() if list(m.parameters(recurse=False))]
    assert reg[0] == "head"  # registration order differs on purpose
    batches = make_batches("tied", steps=1, world_size=1)
    order, owned = layer_order(model, batches[0][0][0])
    assert order == [
        "embed",
        "block_a.norm",
        "block_a.fc1",
        "block_a.fc2",
        "block_b.fc1",
        "block_b.fc2",
        "head",
    ]
    # named_parameters lists the tied weight once, under its first registered name
    assert "head.weight" in dict(model.named_parameters())
    assert "embed.weight" not in dict(model.named_parameters())
    assert owned["embed"] == ["head.weight"]
    assert owned["head"] == ["head.bias"]
    res = run_reference(model, plain_sgd, batches, loss_fn_for("tied"), stale_layers=1)
    assert res.order == order
    assert res.stale_names == {"head.weight"}
    res = run_reference(model, plain_sgd, batches, loss_fn_for("tied"), stale_layers=2)
    assert res.stale_names == {"head.weight", "block_a.norm.weight", "block_a.norm.bias"}


# (d) wp2, n = 1, plain SGD: predictions by hand ---------------------------------------------
def test_wp2_by_hand():
    name = "mlp"
    model, loss_fn = make_model(name, seed=5), loss_fn_for(name)
    batches = make_batches(name, steps=4, world_size=1, seed=6)
    lr = 0.1
    res = run_reference(
        model, lambda p: plain_sgd(p, lr), batches, loss_fn, stale_layers=2, compensation="wp2"
    )
    S = {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert res.stale_names == S
    x0 = init_weights(model)
    l1 = grads_at(model, x0, batches[0][0], loss_fn)
    # t = 1: S not updated, N synchronous; wp2 predicts nothing: held = real
    x1 = {nm: (x0[nm] if nm in S else x0[nm] - lr * l1[nm]) for nm in x0}
    assert_close(res.real[0], x1)
    assert_close(res.held[0][0], x1)
    # t = 2: forward at x̃_2 = x_1; S updated with g_1; prediction x̃_3 = x_2 - lr*g_1
    l2 = grads_at(model, x1, batches[1][0], loss_fn)
    x2 = {nm: x1[nm] - lr * (l1[nm] if nm in S else l2[nm]) for nm in x0}
    assert_close(res.real[1], x2)
    held3 = {nm: (x2[nm] - lr * l1[nm] if nm in S else x2[nm]) for nm in x0}
    assert_close(res.held[1][0], held3)
    # t = 3: forward at x̃_3 (predicted S, real N)
    l3 = grads_at(model, held3, batches[2][0], loss_fn)
    x3 = {nm: x2[nm] - lr * (l2[nm] if nm in S else l3[nm]) for nm in x0}
    assert_close(res.real[2], x3)
    assert_close(res.held[2][0], {nm: (x3[nm] - lr * l2[nm] if nm in S else x3[nm]) for nm in x0})


# (e) dc with λ = 0 equals none; dc by hand on plain SGD -------------------------------------
@pytest.mark.parametrize("form", ["outer", "diagonal"])
def test_dc_lambda0_equals_none(form):
    model, loss_fn = make_model("tied", seed=7), loss_fn_for("tied")
    batches = make_batches("tied", steps=5, world_size=2, seed=8)
    a = run_reference(model, adam, batches, loss_fn, stale_layers=4, compensation="none")
    b = run_reference(
        model,
        adam,
        batches,
        loss_fn,
        stale_layers=4,
        compensation="dc",
        dc_lambda=0.0,
        dc_form=form,
    )
    c = run_reference(
        model,
        adam,
        batches,
        loss_fn,
        stale_layers=4,
        compensation="dc",
        dc_lambda=5.0,
        dc_form=form,
    )
    for t in range(5):
        assert_close(a.real[t], b.real[t], 0)
    assert any((a.real[-1][nm] - c.real[-1][nm]).abs().max() > 1e-9 for nm in a.stale_names)


@pytest.mark.parametrize("s", [1, 2])
@pytest.mark.parametrize("form", ["outer", "diagonal"])
def test_dc_by_hand(form, s):
    name = "mlp"
    model, loss_fn = make_model(name, seed=9), loss_fn_for(name)
    batches = make_batches(name, steps=6, world_size=2, seed=10)
    lr, lam = 0.1, 0.7
    res = run_reference(
        model,
        lambda p: plain_sgd(p, lr),
        batches,
        loss_fn,
        stale_layers=3,
        compensation="dc",
        dc_lambda=lam,
        dc_form=form,
        staleness=s,
    )
    xs = [init_weights(model)]  # xs[j] = x_j; x_j for j <= 0 is x_0
    gs = {}
    for t, step in enumerate(batches, start=1):
        x = xs[t - 1]
        gs[t] = mean_grad(model, x, step, loss_fn)
        if t <= s:
            new = dict(x)
        else:  # x_t = x_{t-1} - lr * DC(g_{t-s}, x_{t-1} - x_{t-1-s})
            back = xs[max(t - 1 - s, 0)]
            new = {}
            for nm in x:
                g, d = gs[t - s][nm], x[nm] - back[nm]
                gh = g + lam * (g * d).sum() * g if form == "outer" else g + lam * g * g * d
                new[nm] = x[nm] - lr * gh
        xs.append(new)
        assert_close(res.real[t - 1], new)


# staleness s > 1, PipeMare T1 lr ramp, warm-up: by hand on plain SGD -------------------------
def test_staleness2_ramp_warmup_by_hand():
    name = "mlp"
    model, loss_fn = make_model(name, seed=11), loss_fn_for(name)
    batches = make_batches(name, steps=7, world_size=2, seed=12)
    lr, s, K, W = 0.1, 2, 3, 2
    lr_at = lambda it: lr * (1.0 + 0.1 * it)  # noqa: E731
    res = run_reference(
        model,
        lambda p: plain_sgd(p, lr),
        batches,
        loss_fn,
        stale_layers=1,
        staleness=s,
        lr_ramp_steps=K,
        warmup_steps=W,
        lr_at=lr_at,
    )
    S = {"0.weight", "0.bias"}
    assert res.stale_names == S
    x = init_weights(model)
    G = {}
    for it, step in enumerate(batches, start=1):
        g = mean_grad(model, x, step, loss_fn)
        lr_it = lr_at(it)
        if it <= W:
            x = {nm: x[nm] - lr_it * g[nm] for nm in x}
        else:
            t = it - W
            G[t] = g
            lr_s = lr_it / s ** (1 - min(t / K, 1))
            x = {
                nm: (
                    x[nm] - lr_it * g[nm]
                    if nm not in S
                    else (x[nm] - lr_s * G[t - s][nm] if t > s else x[nm])
                )
                for nm in x
            }
        assert_close(res.real[it - 1], x)


# OPT_peek leaves the real optimizer untouched -------------------------------------------------
@pytest.mark.parametrize("factory", [sgd_full, adam, adamw])
def test_opt_peek_is_pure(factory):
    gen = torch.Generator().manual_seed(0)
    ps = [nn.Parameter(torch.randn(3, 4, generator=gen, dtype=F64)) for _ in range(2)]
    opt = factory(ps)
    for _ in range(2):
        for p in ps:
            p.grad = torch.randn(p.shape, generator=gen, dtype=F64)
        opt.step()
    before = copy.deepcopy(opt.state_dict())
    w_before = [p.detach().clone() for p in ps]
    gr = [torch.randn(p.shape, generator=gen, dtype=F64) for p in ps]
    peek = opt_peek(factory, opt, ps, gr)
    assert all(torch.equal(a, b) for a, b in zip(ps, w_before))
    after = opt.state_dict()
    for i in before["state"]:
        for k, v in before["state"][i].items():
            assert torch.equal(torch.as_tensor(v), torch.as_tensor(after["state"][i][k]))
    for p, g in zip(ps, gr):
        p.grad = g
    opt.step()
    for a, b in zip(peek, ps):
        assert torch.equal(a, b.detach())


def test_dc_correct_forms():
    g = torch.tensor([1.0, 2.0], dtype=F64)
    d = torch.tensor([3.0, -1.0], dtype=F64)
    assert torch.equal(dc_correct(g, d, 0.5, "outer"), g + 0.5 * 1.0 * g)
    assert torch.equal(
        dc_correct(g, d, 0.5, "diagonal"), g + 0.5 * torch.tensor([3.0, -4.0], dtype=F64)
    )


# (f) every mode on every optimizer runs and stays finite --------------------------------------
CASES = [("none", 1), ("dc", 1), ("wp1", 1), ("wp2", 1), ("wp3", 1), ("none", 2), ("dc", 3)]


@pytest.mark.parametrize("factory", [sgd_full, adam, adamw])
@pytest.mark.parametrize("mode,s", CASES)
def test_modes_finite(factory, mode, s):
    model, loss_fn = make_model("tied", seed=13), loss_fn_for("tied")
    batches = make_batches("tied", steps=6, world_size=2, seed=14)
    res = run_reference(
        model,
        factory,
        batches,
        loss_fn,
        stale_layers=3,
        compensation=mode,
        staleness=s,
        warmup_steps=1,
        lr_ramp_steps=2 if s > 1 else 0,
    )
    for snap in res.real + [h for hs in res.held for h in hs]:
        assert all(torch.isfinite(v).all() and v.dtype == F64 for v in snap.values())
    # N params held == real; non-WP: S held == real too
    for t in range(6):
        for r in range(2):
            for nm, v in res.held[t][r].items():
                if nm not in res.stale_names or not mode.startswith("wp"):
                    assert torch.equal(v, res.real[t][nm])
    if mode in ("wp1", "wp3"):  # per-rank predictions differ (own local gradient)
        nm = next(iter(res.stale_names))
        assert not torch.equal(res.held[-1][0][nm], res.held[-1][1][nm])


def test_bad_args():
    model = MLP()
    b = make_batches("mlp", 2, 1)
    with pytest.raises(ValueError):
        run_reference(model, plain_sgd, b, loss_fn_for("mlp"), stale_layers=4)
    with pytest.raises(ValueError):
        run_reference(
            model, plain_sgd, b, loss_fn_for("mlp"), stale_layers=1, compensation="wp1", staleness=2
        )


# wp1 / wp3, n = 2, plain SGD, all layers stale: per-rank predictions by hand ------------------
@pytest.mark.parametrize("mode", ["wp1", "wp3"])
def test_wp1_wp3_by_hand(mode):
    name, n = "mlp", 2
    model, loss_fn = make_model(name, seed=15), loss_fn_for(name)
    batches = make_batches(name, steps=4, world_size=n, seed=16)
    lr, lam = 0.1, 0.3
    res = run_reference(
        model,
        lambda p: plain_sgd(p, lr),
        batches,
        loss_fn,
        stale_layers=3,
        compensation=mode,
        dc_lambda=lam,
        dc_form="outer",
    )
    x_prev = x = init_weights(model)
    held = [x] * n
    g_prev = l_prev = None
    for t, step in enumerate(batches, start=1):
        local = [grads_at(model, held[r], step[r], loss_fn) for r in range(n)]
        g = {nm: sum(lr_[nm] for lr_ in local) / n for nm in x}
        if t >= 2:
            x_prev, x = x, {nm: x[nm] - lr * g_prev[nm] for nm in x}
        assert_close(res.real[t - 1], x)
        held = []
        for r in range(n):
            if mode == "wp1":
                gt = local[r]
            elif t == 1:
                gt = None
            else:
                gt = {
                    nm: dc_correct(g_prev[nm] - l_prev[r][nm] / n, x[nm] - x_prev[nm], lam, "outer")
                    + local[r][nm] / n
                    for nm in x
                }
            held.append(dict(x) if gt is None else {nm: x[nm] - lr * gt[nm] for nm in x})
            assert_close(res.held[t - 1][r], held[r])
        g_prev, l_prev = g, local
