"""Which update path an optimizer takes, and its state in and out (docs/design.md §3.10).

* In: a DDP job's optimizer state, loaded into the torch optimizer before wrapping or into
  sapipe after, continues exactly: DDP 5 steps, then sapipe (k = 0) 5 steps, equals DDP 10
  steps to 1e-6 (without the state it does not).
* Out: ``opt.torch_state_dict()`` after 5 sapipe steps is DDP's own state dict after 5, and
  DDP continues from it to DDP's 10 steps.
* State whose parameters are at different steps (stale layers' state) stays on the fused path,
  each parameter at its own step, and its checkpoint resumes in a fresh job.
"""

from __future__ import annotations

import copy

import pytest
import torch
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import GENERIC, GlobalStepRMSprop, GroupStepAdam, recipe
from support.training import named_weights, train_steps

import sapipe
from sapipe.optim.generic import rule_for

STEPS, SPLIT = 10, 5
OPTIMIZERS = {
    "adamw": recipe("adamw", lr=0.01, weight_decay=0.05),
    "sgd": recipe("sgd-momentum", lr=0.1, weight_decay=1e-3),
    "rmsprop": recipe("rmsprop"),  # GENERIC's
}


def _train(model, opt, forward, rank, steps):
    batches = make_batches("tied", STEPS, 2)
    train_steps(model, opt, batches, rank, steps, loss_fn=loss_fn_for("tied"), forward=forward)


def _distance(a, b):
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def _ddp(kind, rank, steps, weights=None, state=None):
    """A DDP job of ``steps`` from ``weights`` and optimizer ``state`` (fresh when None)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model("tied")
    if weights is not None:
        model.load_state_dict(weights)
    opt = OPTIMIZERS[kind](model.parameters())
    if state is not None:
        # torch.optim's loaded state may share its tensors
        opt.load_state_dict(copy.deepcopy(state))
    _train(model, opt, DDP(model), rank, steps)
    return model, opt


def _state_in(rank, world_size, kind, how):
    first, ddp_opt = _ddp(kind, rank, range(SPLIT))
    weights, state = copy.deepcopy(first.state_dict()), copy.deepcopy(ddp_opt.state_dict())
    reference, _ = _ddp(kind, rank, range(SPLIT, STEPS), weights, state)
    out = {}
    for variant in (how, "no state"):
        model = make_model("tied", seed=rank + 3)
        model.load_state_dict(weights)
        base = OPTIMIZERS[kind](model.parameters())
        if variant == "before wrapping":
            base.load_state_dict(copy.deepcopy(state))
        opt = sapipe.DistributedOptimizer(base, model, bucket_cap_mb=0.0004)
        if variant == "sapipe load_state_dict":
            opt.load_state_dict(copy.deepcopy(state))
        _train(model, opt, model, rank, range(SPLIT, STEPS))
        opt.synchronize()
        out[variant] = {"diff": _distance(model, reference), "path": opt.update_path}
        opt.close()
    return out


@pytest.mark.parametrize("how", ["before wrapping", "sapipe load_state_dict"])
@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_ddp_state_continues_exactly(kind, how):
    for rank, out in enumerate(run_ranks(_state_in, world_size=2, args=(kind, how))):
        assert out[how]["path"] == ("generic" if kind == "rmsprop" else "fused")
        assert out[how]["diff"] <= 1e-6, f"rank {rank}: max |sapipe - DDP| = {out[how]['diff']:.3e}"
        assert out["no state"]["diff"] > 1e-4, "restarting the optimizer's state must show"


def _state_out(rank, world_size, kind):
    ddp_first, ddp_opt = _ddp(kind, rank, range(SPLIT))
    reference, _ = _ddp(kind, rank, range(STEPS))
    model = make_model("tied", seed=rank)
    opt = sapipe.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()), model, bucket_cap_mb=0.0004
    )
    _train(model, opt, model, rank, range(SPLIT))
    exported = opt.torch_state_dict()
    ours, theirs = exported["state"], ddp_opt.state_dict()["state"]
    state_diff = max(
        (ours[i][key] - value).abs().max().item()
        if torch.is_tensor(value)
        else abs(ours[i][key] - value)
        for i in theirs
        for key, value in theirs[i].items()
    )
    continued, _ = _ddp(
        kind, rank, range(SPLIT, STEPS), copy.deepcopy(model.state_dict()), exported
    )
    return {
        "same keys": {i: sorted(s) for i, s in ours.items()}
        == {i: sorted(s) for i, s in theirs.items()},
        "groups": exported["param_groups"] == ddp_opt.state_dict()["param_groups"],
        "state diff": state_diff,
        "diff": _distance(continued, reference),
    }


@pytest.mark.parametrize("kind", sorted(OPTIMIZERS))
def test_torch_state_dict_continues_under_ddp(kind):
    for rank, out in enumerate(run_ranks(_state_out, world_size=2, args=(kind,))):
        assert out["same keys"] and out["groups"], out
        assert out["state diff"] <= 1e-6, (
            f"rank {rank}: state differs from DDP's by {out['state diff']:.3e}"
        )
        assert out["diff"] <= 1e-6, (
            f"rank {rank}: max |DDP from sapipe's state - DDP| = {out['diff']:.3e}"
        )


def _stale_state_round_trip(rank, world_size):
    """After k = 3 the stale layers' state is one step behind: loaded into a fresh AdamW it
    stays on the fused path, and continues as DDP does from the same state; a checkpoint of
    that job, loaded into a fresh one (whose optimizer holds no state), continues alike."""
    model = make_model("tied", seed=rank)
    opt = sapipe.DistributedOptimizer(
        OPTIMIZERS["adamw"](model.parameters()), model, stale_layers=3, bucket_cap_mb=0.0004
    )
    _train(model, opt, model, rank, range(SPLIT))
    exported = opt.torch_state_dict()
    with opt.real_weights():
        weights = copy.deepcopy(model.state_dict())
    opt.close()
    steps = sorted({int(s["step"]) for s in exported["state"].values()})
    reference, _ = _ddp("adamw", rank, range(SPLIT, STEPS), weights, exported)
    model = make_model("tied")
    model.load_state_dict(weights)
    opt = sapipe.DistributedOptimizer(
        OPTIMIZERS["adamw"](model.parameters()), model, bucket_cap_mb=0.0004
    )
    opt.load_state_dict(copy.deepcopy(exported))
    _train(model, opt, model, rank, range(SPLIT, SPLIT + 2))
    checkpoint = {"model": copy.deepcopy(model.state_dict()), "optimizer": opt.state_dict()}
    _train(model, opt, model, rank, range(SPLIT + 2, STEPS))
    opt.synchronize()
    path, diff = opt.update_path, _distance(model, reference)
    continued = named_weights(model)
    opt.close()
    model = make_model("tied", seed=rank + 7)
    model.load_state_dict(checkpoint["model"])
    opt = sapipe.DistributedOptimizer(
        OPTIMIZERS["adamw"](model.parameters()), model, bucket_cap_mb=0.0004
    )
    opt.load_state_dict(checkpoint["optimizer"])
    _train(model, opt, model, rank, range(SPLIT + 2, STEPS))
    opt.synchronize()
    resumed = max(
        (p.detach() - continued[n]).abs().max().item() for n, p in model.named_parameters()
    )
    return {"steps": steps, "path": path, "diff": diff, "resumed": resumed}


def test_state_at_different_steps_stays_fused_and_resumes():
    for rank, out in enumerate(run_ranks(_stale_state_round_trip, world_size=2)):
        assert out["steps"] == [SPLIT - 1, SPLIT], out  # stale layers: no update at pipeline step 1
        assert out["path"] == "fused"
        assert out["diff"] <= 1e-6, f"rank {rank}: max |sapipe - DDP| = {out['diff']:.3e}"
        assert out["resumed"] == 0.0, (
            f"rank {rank}: the resumed checkpoint moved by {out['resumed']:.3e}"
        )


def _group_state(rank, world_size, make=GroupStepAdam):
    model = make_model("tied")
    opt = sapipe.DistributedOptimizer(make(model.parameters(), lr=0.01), model, timeout=20)
    try:
        _train(model, opt, model, rank, range(2))
        opt.synchronize()
    except sapipe.UnsupportedOptimizerError as exc:
        return str(exc)
    return "no error"


def test_state_kept_in_param_groups_is_refused():
    for message in run_ranks(_group_state, world_size=2):
        assert (
            "GroupStepAdam" in message
            and "['group_step']" in message
            and "once per bucket" in message
        ), message


def test_state_kept_outside_any_parameter_is_refused():
    """A count kept in ``optimizer.state`` under a key that is no parameter would advance once
    per bucket segment, not once per step."""
    for message in run_ranks(_group_state, world_size=2, args=(GlobalStepRMSprop,)):
        assert (
            "GlobalStepRMSprop" in message and "['global_step'] in its state outside" in message
        ), message


def test_which_path():
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    assert rule_for(torch.optim.AdamW(params)).path == "fused"
    assert rule_for(torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True)).path == "fused"
    for optimizer in (
        torch.optim.Adam(params, amsgrad=True),
        torch.optim.Adafactor(params),
        torch.optim.ASGD(params),
        torch.optim.Rprop(params),
        GENERIC["sgd-subclass"](params),
    ):
        assert rule_for(optimizer).path == "generic", type(optimizer)
    partly = torch.optim.Adam(params, lr=0.1)
    params[0].grad = torch.ones_like(params[0])
    partly.step()  # state for one parameter only: each keeps its own counters
    assert rule_for(partly).path == "fused"
    horovod_like = type("SGD", (torch.optim.SGD,), {"__module__": "horovod.torch.optimizer"})
    for optimizer, text in (
        (torch.optim.LBFGS(params), "LBFGS"),
        (horovod_like(params, lr=0.1), "distributed"),
    ):
        with pytest.raises(sapipe.UnsupportedOptimizerError, match=text):
            rule_for(optimizer)


def test_adamw_decays_decoupled_where_torch_names_no_option():
    """torch < 2.7 has no ``decoupled_weight_decay`` in AdamW's groups (its class is the
    option); without the key the fused rule must still decay AdamW decoupled and Adam not."""
    params = [torch.nn.Parameter(torch.randn(3))]
    for optimizer, decoupled in (
        (torch.optim.AdamW(params, weight_decay=0.1), True),
        (torch.optim.Adam(params, weight_decay=0.1), False),
    ):
        group = {
            k: v for k, v in optimizer.param_groups[0].items() if k != "decoupled_weight_decay"
        }
        assert rule_for(optimizer).hyperparams(group)["decoupled"] is decoupled, type(optimizer)


def _loaded_into_the_torch_optimizer_after_wrapping(rank, world_size):
    model = make_model("tied")
    base = OPTIMIZERS["sgd"](model.parameters())
    opt = sapipe.DistributedOptimizer(base, model, timeout=20)
    base.load_state_dict(copy.deepcopy(base.state_dict()))  # torch replaces its param-group dicts
    try:
        _train(model, opt, model, rank, range(1))
    except sapipe.UsageError as exc:
        return str(exc)
    finally:
        opt.close()
    return "no error"


def test_state_loaded_into_the_torch_optimizer_after_wrapping_is_refused_at_step():
    """The new param-group dicts would leave sapipe (and schedulers built on the sapipe
    optimizer) with the old hyper-parameters, silently: step() says what to do instead."""
    for message in run_ranks(_loaded_into_the_torch_optimizer_after_wrapping, world_size=2):
        assert "param_groups were replaced after wrapping" in message, message
