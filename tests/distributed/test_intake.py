"""Backward's gradients into the buckets (sapipe/runtime/intake.py,
csrc/runtime/gradient_intake.cpp).

Where sapipe's kernels are built, C++ hooks on the parameters' AccumulateGrad nodes take every
gradient: Python's per-gradient path (``GradientPipeline.take``) never runs in a plain
training step, at any k and with a compensation that keeps this rank's own gradient; it runs
for every gradient where the step needs per-gradient work (tracing records each gradient) and
in the pure-Python intake (``SAPIPE_DISABLE_EXT=1``). Each way, the weights equal DDP's at
k = 0 within 1e-6. After ``close()`` the hooks are gone: a backward hands sapipe nothing.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model

import sapipe

STEPS = 4
CASES = (  # (stale layers, compensation, trace)
    (0, "none", False),
    (2, "none", False),
    (2, "wp1", False),
    (0, "none", True),
)


def _counting(take, taken: list[int]):
    """``GradientPipeline.take`` recording each call's iteration in ``taken``."""

    def counted(param, iteration):
        taken.append(iteration)
        return take(param, iteration)

    return counted


def _train(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    batches = make_batches("mlp", STEPS, world_size)
    loss_fn = loss_fn_for("mlp")
    out = []
    for k, compensation, trace in CASES:
        model = make_model("mlp")
        opt = sapipe.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            model,
            stale_layers=k,
            compensation=compensation,
            trace=trace or None,
            bucket_cap_mb=0.0001,  # a bucket per layer
        )
        ddp_model = make_model("mlp")
        ddp = DDP(ddp_model)
        ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
        pipeline = opt._pipeline
        taken: list[int] = []
        pipeline.take = _counting(pipeline.take, taken)
        for t in range(STEPS):
            x, y = batches[t][rank]
            for net, o in ((model, opt), (ddp, ddp_opt)):
                o.zero_grad()
                loss_fn(net(x), y).backward()
                o.step()
        opt.synchronize()
        diff = max(
            (a - b).abs().max().item() for a, b in zip(model.parameters(), ddp_model.parameters())
        )
        opt.close()
        del pipeline.take
        before = len(taken)
        loss_fn(model(batches[0][rank][0]), batches[0][rank][1]).backward()  # after close()
        out.append(
            {
                "intake": type(pipeline.intake).__name__,
                "taken": before,
                "taken_after_close": len(taken) - before,
                "params": sum(1 for p in model.parameters() if p.requires_grad),
                "buckets": len(pipeline.buckets),
                "diff": diff,
            }
        )
    return out


@functools.cache
def _results(python_intake: bool):
    if not python_intake:
        return run_ranks(_train, world_size=2, timeout=120)
    os.environ["SAPIPE_DISABLE_EXT"] = "1"  # read when the ranks import sapipe
    try:
        return run_ranks(_train, world_size=2, timeout=120)
    finally:
        del os.environ["SAPIPE_DISABLE_EXT"]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"k{c[0]}-{c[1]}{'-trace' if c[2] else ''}")
@pytest.mark.parametrize("python_intake", [False, True], ids=["built", "python"])
def test_gradients_go_through_python_only_where_needed(case, python_intake):
    if not python_intake and sapipe.kernels._ext.cpu is None:
        pytest.skip("sapipe's kernels are not built")
    k, _, trace = case
    for per_rank in _results(python_intake):
        r = per_rank[CASES.index(case)]
        assert r["intake"] == ("PythonIntake" if python_intake else "GradientIntake")
        assert r["buckets"] > 2, "the case needs several buckets"
        every = r["params"] * STEPS
        assert r["taken"] == (every if python_intake or trace else 0), r
        assert r["taken_after_close"] == 0, "a hook outlived close()"
        if k == 0:
            assert r["diff"] < 1e-6, r
        else:
            assert r["diff"] > 1e-6, "stale layers must change the trajectory"


def _copies(rank, world_size):
    from torch.utils._python_dispatch import TorchDispatchMode

    class CountCopies(TorchDispatchMode):
        """Every ``aten::copy_`` the backward runs (the intake's hooks included)."""

        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.aten.copy_.default:
                self.count += 1
            return func(*args, **(kwargs or {}))

    batches = make_batches("mlp", STEPS, world_size)
    loss_fn = loss_fn_for("mlp")
    out = {}
    for k in (0, 2):
        for set_to_none in (True, False):
            model = make_model("mlp")
            opt = sapipe.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
                model,
                stale_layers=k,
                bucket_cap_mb=0.0001,
            )
            for t in range(STEPS):
                x, y = batches[t][rank]
                opt.zero_grad(set_to_none=set_to_none)
                loss = loss_fn(model(x), y)
                if t < STEPS - 1:
                    loss.backward()
                else:
                    with CountCopies() as counted:
                        loss.backward()
                    copies = counted.count
                opt.step()
            opt.synchronize()
            out[(k, set_to_none)] = {
                "copies": copies,
                "params": sum(1 for _ in model.parameters()),
                "weights": [p.detach().clone() for p in model.parameters()],
            }
            opt.close()
    return out


@pytest.mark.skipif(sapipe.kernels._ext.cpu is None, reason="sapipe's kernels are not built")
def test_a_gradient_accumulated_into_its_slot_is_not_copied():
    """``zero_grad(set_to_none=False)`` leaves ``p.grad`` as the exposed view of the slot the next
    iteration fills (a sync bucket's only slot; a stale bucket's slot of g_{t-s}, which is
    iteration t+1's): autograd accumulates into it in place and the intake copies nothing, as
    DDP's ``gradient_as_bucket_view``. A fresh ``p.grad`` (``set_to_none=True``) is copied once.
    Both train to the same weights, bit for bit."""
    for per_rank in run_ranks(_copies, world_size=2, timeout=120):
        for k in (0, 2):
            fresh, kept = per_rank[(k, True)], per_rank[(k, False)]
            assert fresh["copies"] == fresh["params"], fresh["copies"]
            assert kept["copies"] == 0, (k, kept["copies"])
            for a, b in zip(fresh["weights"], kept["weights"]):
                assert (a == b).all(), k
