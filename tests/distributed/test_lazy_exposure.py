"""``p.grad`` read or not (docs/design.md §3.11, sapipe/runtime/exposure.py).

A synchronous layer's exposed gradient is waited for only when something reads ``p.grad``:

* a script that never reads it keeps the deferred timeline — its sync updates are applied at
  the next forward, so right after ``step()`` the weights still lack them — and still ends
  where DDP does;
* a script that reads ``p.grad`` before ``step()`` has those updates applied in ``step()``:
  the weights right after it are DDP's;
* ``p.grad`` read after ``step()`` (logging), or zeroed in place by
  ``zero_grad(set_to_none=False)`` while the update is still deferred, shows and applies
  DDP's averaged gradient: the read applies the deferred update first.
"""

from __future__ import annotations

import pytest
import torch
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model

import sapipe

STEPS = 4
SCRIPTS = ("untouched", "read-before-step", "read-after-step", "zero-in-place")


def _max_diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a.parameters(), b.parameters()))


def _grad_norms(model):
    return [p.grad.norm().item() for p in model.parameters() if p.grad is not None]


def _script(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = make_batches("mlp", STEPS, world_size)
    loss_fn = loss_fn_for("mlp")
    out = {}
    for script in SCRIPTS:
        ddp_model, model = make_model("mlp"), make_model("mlp")
        ddp, ddp_opt = DDP(ddp_model), torch.optim.AdamW(ddp_model.parameters(), lr=0.01)
        opt = sapipe.DistributedOptimizer(  # a bucket per layer
            torch.optim.AdamW(model.parameters(), lr=0.01), model, bucket_cap_mb=0.0001
        )
        after_step, logged = [], []
        for t in range(STEPS):
            x, y = batches[t][rank]
            for net, o in ((ddp, ddp_opt), (model, opt)):
                o.zero_grad(set_to_none=script != "zero-in-place")
                loss_fn(net(x), y).backward()
                if script == "read-before-step":
                    _grad_norms(net.module if net is ddp else net)
                o.step()
                if script == "read-after-step":
                    logged.append(_grad_norms(net.module if net is ddp else net))
            after_step.append(_max_diff(ddp_model, model))
        opt.synchronize()
        out[script] = {
            "after_step": after_step,
            "final": _max_diff(ddp_model, model),
            "logged": logged,
        }
        opt.close()
    return out


@pytest.fixture(scope="module")
def runs():
    return run_ranks(_script, world_size=2)


@pytest.mark.parametrize("script", SCRIPTS)
def test_each_script_ends_where_ddp_does(runs, script):
    for rank, result in enumerate(runs):
        assert result[script]["final"] <= 1e-6, (
            f"rank {rank}: |sapipe - DDP| = {result[script]['final']:.3e}"
        )


def test_unread_gradients_leave_the_sync_updates_to_the_next_forward(runs):
    """Right after step(), the weights lack the deferred updates (they differ from DDP's)."""
    for rank, result in enumerate(runs):
        assert min(result["untouched"]["after_step"]) > 1e-4, (
            rank,
            result["untouched"]["after_step"],
        )


def test_read_gradients_are_applied_in_step(runs):
    for rank, result in enumerate(runs):
        assert max(result["read-before-step"]["after_step"]) <= 1e-6, (
            rank,
            result["read-before-step"],
        )


def test_gradients_read_after_step_are_ddps(runs):
    for rank, result in enumerate(runs):
        logged = result["read-after-step"]["logged"]
        for ddp_norms, norms in zip(logged[0::2], logged[1::2]):
            assert norms == pytest.approx(ddp_norms, rel=1e-6), (rank, ddp_norms, norms)


def _auto_timeline(rank, world_size):
    """Which timeline ``"auto"`` models: a script that reads p.grad on one rank only (rank 0
    logs a norm) and one that reads none."""
    batches = make_batches("mlp", 12, world_size)
    loss_fn = loss_fn_for("mlp")
    modelled = {}
    for reader in ("rank 0", "none"):
        model = make_model("mlp")
        opt = sapipe.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.01),
            model,
            stale_layers="auto",
            profile_steps=3,
            tune_steps=0,
        )
        for x, y in (step[rank] for step in batches):
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            if reader == "rank 0" and rank == 0:
                _grad_norms(model)
            opt.step()
        modelled[reader] = (opt.auto.decided, opt.auto.sync_at_step)
        opt.close()
    return modelled


def test_auto_models_the_timeline_the_script_is_on_agreed_over_ranks():
    for rank, modelled in enumerate(run_ranks(_auto_timeline, world_size=2)):
        assert modelled == {"rank 0": (True, True), "none": (True, False)}, (rank, modelled)
