"""``optimizer.step(closure)`` as ``torch.optim`` defines it (and Lightning calls it): the
closure runs forward and backward, the step follows, and the loss comes back.

A loop whose closure zeroes the gradients, runs forward and backward and clips must train
exactly as the same loop written without a closure: bit-identical weights at k = 0 and at
k > 0 with a compensation that reads this rank's own gradient (wp1), on 2 Gloo ranks.
"""

from __future__ import annotations

import pytest
import torch
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import recipe
from support.training import held_and_real

STEPS = 6
MAX_NORM = 0.05  # below the model's gradient norm: the clip acts at every step


def _train(rank, world_size, k, compensation, use_closure):
    import sapipe

    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(
        recipe("adamw", lr=0.01, weight_decay=0.1)(model.parameters()),
        model,
        stale_layers=k,
        compensation=compensation,
        bucket_cap_mb=0.0008,
    )
    loss_fn = loss_fn_for("tied")
    losses = []
    for x, y in (batch[rank] for batch in make_batches("tied", STEPS, world_size)):

        def closure(x=x, y=y):
            opt.zero_grad()
            loss = loss_fn(model(x), y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            return loss

        if use_closure:
            loss = opt.step(closure)
        else:
            loss = closure()
            opt.step()
        losses.append(loss.item())
    held, real = held_and_real(model, opt)
    opt.close()
    return {"held": held, "real": real, "losses": losses}


@pytest.mark.parametrize("k,compensation", [(0, "none"), (2, "wp1")])
def test_a_closure_trains_as_the_loop_without_one(k, compensation):
    plain = run_ranks(_train, world_size=2, args=(k, compensation, False))
    closed = run_ranks(_train, world_size=2, args=(k, compensation, True))
    for rank, (a, b) in enumerate(zip(plain, closed)):
        assert a["losses"] == b["losses"], f"rank {rank}: the closure's losses differ"
        for what in ("held", "real"):
            for name, value in a[what].items():
                assert (value == b[what][name]).all(), f"rank {rank}: {what} {name} differs"


def _closure_raises(rank, world_size):
    import sapipe

    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)

    def closure():
        raise RuntimeError("the user's closure failed")

    try:
        opt.step(closure)
    except RuntimeError as exc:
        message = str(exc)
    opt.close()
    return message


def test_an_exception_in_the_closure_reaches_the_caller():
    for message in run_ranks(_closure_raises, world_size=2):
        assert message == "the user's closure failed"


def _backward_twice(rank, world_size):
    import sapipe

    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    loss_fn = loss_fn_for("tied")
    (x, y) = make_batches("tied", 1, world_size)[0][rank]

    def closure():
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward(retain_graph=True)
        loss.backward()  # a second gradient for every parameter before the step
        return loss

    try:
        opt.step(closure)
    except sapipe.UsageError as exc:
        return str(exc)
    finally:
        opt.close()
    return None


def test_a_closure_that_calls_backward_twice_is_refused_on_every_rank():
    for message in run_ranks(_backward_twice, world_size=2):
        assert message is not None and "second gradient before step()" in message, message
        assert "no_sync" in message
