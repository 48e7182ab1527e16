"""The private torch behaviour sapipe relies on, where no public API serves; each test fails
loudly if a torch release changes it (the code that relies on it names this file).

* ``GradScaler._check_inf_per_device(opt)`` and ``GradScaler._per_optimizer_states``: an
  optimizer that handles scaling itself (``_step_supports_amp_scaling``) must leave its verdict
  where ``GradScaler.update()`` reads it (sapipe/runtime/updates.py);
* ``optimizer._opt_called``: what an LR scheduler checks to tell that the optimizer stepped
  (sapipe/optimizer.py);
* ``Tensor._version``: bumped by every in-place change (sapipe/runtime/pipeline.py).
"""

from __future__ import annotations

import warnings

import torch


def _scaled_step(found_inf: bool):
    param = torch.nn.Parameter(torch.ones(3))
    opt = torch.optim.SGD([param], lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=4.0)
    scaler.scale(param.sum()).backward()  # as a script does: the scale exists from here on
    if found_inf:
        param.grad.fill_(float("inf"))
    found = scaler._check_inf_per_device(opt)
    state = scaler._per_optimizer_states[id(opt)]
    return scaler, state, found


def test_gradscaler_records_its_per_device_verdict_where_update_reads_it():
    for found_inf in (False, True):
        scaler, state, found = _scaled_step(found_inf)
        assert set(found) == {torch.device("cpu")}
        assert float(found[torch.device("cpu")]) == float(found_inf)
        assert state["found_inf_per_device"] is found  # the dict update() sums
        assert state["stage"].name in ("READY", "UNSCALED")
        scaler.update()
        assert scaler.get_scale() == (2.0 if found_inf else 4.0)  # backed off on inf only


def test_an_lr_scheduler_reads_opt_called():
    param = torch.nn.Parameter(torch.ones(3))
    for called in (False, True):
        opt = torch.optim.SGD([param], lr=0.1)
        sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1)
        if called:
            opt._opt_called = True  # what sapipe's step() sets on the wrapped optimizer
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            sched.step()
        order = [w for w in caught if "optimizer.step()" in str(w.message)]
        assert bool(order) == (not called), [str(w.message) for w in caught]


def test_version_counts_in_place_changes():
    grad = torch.ones(4)
    version = grad._version
    grad.mul_(2.0)
    assert grad._version > version
    version = grad._version
    _ = grad * 2.0  # out of place: unchanged
    assert grad._version == version
