"""Training scripts as people write them, converted from DDP to sapipe (2 Gloo ranks each).

* **torchvision-style** (``references/classification/train.py``): a small CNN with
  BatchNorm2d, synthetic images that differ in distribution per rank (so BatchNorm's
  statistics differ and ``broadcast_buffers`` matters), SGD(momentum, nesterov, weight decay
  but none on 1-D parameters) and a ``OneCycleLR`` stepped every iteration (it drives
  momentum as well as the LR), ``model.train()`` / ``model.eval()`` with an evaluation pass
  under ``torch.inference_mode()`` after each epoch, ``zero_grad()`` between forward and
  backward as train.py has it. A DDP job trains 2 epochs and writes train.py's checkpoint
  (``{"model", "optimizer", "lr_scheduler", "epoch"}``, rank 0, ``torch.save``). Then, from
  that file: (a) DDP resumes for 2 epochs; (b) sapipe at k = 0 does (optimizer wrapped, then
  the scheduler built on it, then train.py's resume code) and equals (a): weights,
  BatchNorm running statistics, evaluation outputs to 1e-6, the LR/momentum schedule
  exactly, ``opt.torch_state_dict()`` = DDP's ``opt.state_dict()``; (c) sapipe at k = 2
  resumes in float64 (state loaded into the torch optimizer, then wrapped) and equals an
  explicit float64 re-implementation of the stale rule to 1e-9.
* **custom optimizer**: SGD with decoupled weight decay and gradient centralisation, written
  as a user writes a ``torch.optim.Optimizer`` (per-parameter state with a Python-int step
  count that drives a per-parameter warm-up), ``zero_grad(set_to_none=...)``, an evaluation
  every few steps under ``torch.no_grad()``: k = 0 equals DDP with the same optimizer to
  1e-6 (set_to_none True and False); k = 2 with ``dc`` equals ``run_reference`` to 1e-9 in
  float64, evaluation losses included.
* **a subgroup**: 3 ranks, training over ``dist.new_group([0, 1])``; rank 2 takes no part.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from support.dist_utils import assert_close_dicts, run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.reference import run_reference

# ====================================================================== torchvision-style

STEPS_PER_EPOCH, FIRST_EPOCHS, EPOCHS = 4, 2, 4  # checkpoint after epoch 1; resume epochs 2, 3
MAX_LR = 0.2
STALE = 2


class SmallCNN(nn.Module):
    """ResNet-stem shaped: bias-free convolutions, each followed by BatchNorm2d; no Dropout."""

    def __init__(self, classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(16)
        self.fc = nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def small_cnn(seed: int) -> SmallCNN:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return SmallCNN()


def images(step: int, rank: int, dtype=torch.float32):
    """Rank ``rank``'s batch of iteration ``step`` (0-based over the whole run); ranks differ in
    distribution, so their BatchNorm statistics differ."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(6, 3, 8, 8, generator=g) * (1 + rank) + rank
    return x.to(dtype), torch.randint(0, 10, (6,), generator=g)


def eval_images(rank: int, dtype=torch.float32):
    return torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(77 + rank)).to(dtype)


criterion = nn.CrossEntropyLoss(label_smoothing=0.1)


def cnn_optimizer(params):
    """train.py's SGD; no weight decay on 1-D parameters (norm weights and biases)."""
    params = list(params)
    return torch.optim.SGD(
        [
            {"params": [p for p in params if p.ndim > 1]},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ],
        lr=MAX_LR,
        momentum=0.9,
        nesterov=True,
        weight_decay=1e-4,
    )


def cnn_scheduler(opt):
    return torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=MAX_LR, epochs=EPOCHS, steps_per_epoch=STEPS_PER_EPOCH
    )


def train_one_epoch(model, optimizer, lr_scheduler, epoch, rank, record, dtype=torch.float32):
    """train.py's loop (zero_grad between forward and backward), the scheduler stepped per
    iteration."""
    model.train()
    for i in range(STEPS_PER_EPOCH):
        image, target = images(epoch * STEPS_PER_EPOCH + i, rank, dtype)
        output = model(image)
        loss = criterion(output, target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        record["lr"].append([g["lr"] for g in optimizer.param_groups])
        record["momentum"].append([g["momentum"] for g in optimizer.param_groups])
        lr_scheduler.step()


def evaluate(model, rank, dtype=torch.float32):
    model.eval()
    with torch.inference_mode():
        return model(eval_images(rank, dtype)).clone()


def _named(module, buffers=True):
    out = {n: p.detach().clone() for n, p in module.named_parameters()}
    if buffers:
        out.update({"buffer " + n: b.clone() for n, b in module.named_buffers()})
    return out


def _resume(variant, rank, path):
    """train.py's resume code from ``path``, then epochs FIRST_EPOCHS..EPOCHS-1."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sapipe

    dtype = torch.float64 if variant == "sapipe k=2" else torch.float32
    checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    model = small_cnn(seed=rank + 7)
    net = model
    if variant == "ddp":
        net = DDP(model)
        optimizer = cnn_optimizer(model.parameters())
        lr_scheduler = cnn_scheduler(optimizer)
    elif (
        variant == "sapipe k=0"
    ):  # the two-line change: wrap, then the scheduler on the wrapped optimizer
        optimizer = sapipe.DistributedOptimizer(cnn_optimizer(model.parameters()), model)
        lr_scheduler = cnn_scheduler(optimizer)
    else:  # the optimizer's state goes in before wrapping; model in float64 against the reference
        model.to(dtype)
        optimizer = cnn_optimizer(model.parameters())
        lr_scheduler = cnn_scheduler(optimizer)
    model.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])  # sapipe k=0: a plain torch.optim state dict
    lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
    if variant == "sapipe k=2":
        optimizer = sapipe.DistributedOptimizer(
            optimizer,
            model,
            stale_layers=STALE,
            compensation="none",
            bucket_cap_mb=0.002,
            timeout=60,
        )
    record = {"lr": [], "momentum": [], "eval": []}
    for epoch in range(checkpoint["epoch"] + 1, EPOCHS):
        train_one_epoch(net, optimizer, lr_scheduler, epoch, rank, record, dtype)
        record["eval"].append(evaluate(net, rank, dtype))
    if variant == "ddp":
        record["state"] = optimizer.state_dict()
    else:
        record["state"] = optimizer.torch_state_dict()  # applies pending sync updates first
        record["path"] = optimizer.update_path
        record["layers"] = [layer.name for layer in optimizer.layers]
        with optimizer.real_weights():
            record["weights"] = _named(model)
        optimizer.close()
    record.setdefault("weights", _named(model))
    return record


def _torchvision_job(rank, world_size, directory):
    from torch.nn.parallel import DistributedDataParallel as DDP

    path = os.path.join(directory, "checkpoint.pth")
    model = small_cnn(seed=rank)  # DDP broadcasts rank 0's weights
    ddp = DDP(model)
    optimizer = cnn_optimizer(model.parameters())
    lr_scheduler = cnn_scheduler(optimizer)
    unused = {"lr": [], "momentum": []}
    for epoch in range(FIRST_EPOCHS):
        train_one_epoch(ddp, optimizer, lr_scheduler, epoch, rank, unused)
        evaluate(ddp, rank)
        checkpoint = {
            "model": ddp.module.state_dict(),
            "optimizer": optimizer.state_dict(),
            "lr_scheduler": lr_scheduler.state_dict(),
            "epoch": epoch,
        }
        if rank == 0:  # utils.save_on_master
            torch.save(checkpoint, path)
    dist.barrier()
    return {
        variant: _resume(variant, rank, path) for variant in ("ddp", "sapipe k=0", "sapipe k=2")
    }


@pytest.fixture(scope="module")
def torchvision_runs(tmp_path_factory):
    """(the directory holding the DDP job's checkpoint, every rank's results)"""
    directory = str(tmp_path_factory.mktemp("torchvision"))
    return directory, run_ranks(_torchvision_job, world_size=2, args=(directory,), timeout=240)


def _state_difference(ours, theirs):
    assert ours["param_groups"] == theirs["param_groups"], (
        ours["param_groups"],
        theirs["param_groups"],
    )
    assert sorted(ours["state"]) == sorted(theirs["state"])
    return max(
        abs(ours["state"][i]["momentum_buffer"] - s["momentum_buffer"]).max()
        for i, s in theirs["state"].items()
    )


def test_torchvision_resume_from_ddp_checkpoint_equals_ddp(torchvision_runs):
    for rank, out in enumerate(torchvision_runs[1]):
        ddp, ours = out["ddp"], out["sapipe k=0"]
        assert ours["path"] == "fused"
        assert ours["lr"] == ddp["lr"] and ours["momentum"] == ddp["momentum"], (
            "the schedule must be DDP's"
        )
        assert len({tuple(lr) for lr in ddp["lr"]}) == len(ddp["lr"]), (
            "OneCycleLR changes the LR every step"
        )
        assert_close_dicts(
            ours["weights"],
            ddp["weights"],
            rtol=0,
            atol=1e-6,
            what=f"rank {rank} sapipe k=0 vs DDP",
        )
        for e, (a, b) in enumerate(zip(ours["eval"], ddp["eval"])):
            assert abs(a - b).max() <= 1e-6, f"rank {rank}: evaluation {e} differs from DDP's"
        difference = _state_difference(ours["state"], ddp["state"])
        assert difference <= 1e-6, (
            f"rank {rank}: momentum buffers differ from DDP's by {difference:.3e}"
        )


def _stale_reimplementation(model, optimizer, lr_scheduler, stale, steps, world_size):
    """sapipe's rule for k stale layers, s = 1, ``none`` (docs/design.md §3.1-3.2), in float64:
    iteration t applies the ranks' mean gradient g_t to the sync parameters and g_{t-1} to the
    stale ones (none at the pipeline's first step: torch.optim skips a parameter whose grad is
    None), all in one ``optimizer.step()`` with the hyper-parameters in force at that step.
    run_reference cannot express this job: it builds its optimizers fresh (no state to resume
    from) and schedules the LR only (OneCycleLR also cycles momentum)."""
    params = dict(model.named_parameters())
    previous = None
    for step in steps:
        grads = {n: torch.zeros_like(p) for n, p in params.items()}
        for rank in range(world_size):
            model.zero_grad(set_to_none=True)
            image, target = images(step, rank, torch.float64)
            criterion(model(image), target).backward()
            for n, p in params.items():
                grads[n] += p.grad / world_size
        for n, p in params.items():
            p.grad = (previous[n] if previous is not None else None) if n in stale else grads[n]
        optimizer.step()
        lr_scheduler.step()
        previous = {n: grads[n] for n in stale}
    return {n: p.detach().clone() for n, p in params.items()}


def test_reimplementation_equals_run_reference():
    """The re-implementation above, from a fresh start with an LR-only schedule, is
    run_reference."""
    factor = functools.partial(pow, 0.9)  # factor(e) = 0.9**e
    stale = {"conv1.weight", "bn1.weight", "bn1.bias"}
    steps = range(6)
    model = small_cnn(seed=0).double()
    ref = run_reference(
        small_cnn(seed=0).double(),
        cnn_optimizer,
        [[images(t, r, torch.float64) for r in range(2)] for t in steps],
        criterion,
        stale_layers=STALE,
        lr_at=lambda it: MAX_LR * factor(it - 1),
    )
    assert ref.stale_names == stale
    optimizer = cnn_optimizer(model.parameters())
    ours = _stale_reimplementation(
        model, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, factor), stale, steps, 2
    )
    assert_close_dicts(
        ours, ref.real[-1], rtol=1e-12, atol=1e-14, what="re-implementation vs run_reference"
    )


def test_torchvision_resume_with_stale_layers_matches_float64_rule(torchvision_runs):
    directory, runs = torchvision_runs
    checkpoint = torch.load(
        os.path.join(directory, "checkpoint.pth"), map_location="cpu", weights_only=True
    )
    model = small_cnn(seed=0).double()
    model.load_state_dict(checkpoint["model"])
    optimizer = cnn_optimizer(model.parameters())
    lr_scheduler = cnn_scheduler(optimizer)
    optimizer.load_state_dict(checkpoint["optimizer"])
    lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
    stale = {n for n, _ in model.named_parameters() if n.split(".")[0] in ("conv1", "bn1")}
    expected = _stale_reimplementation(
        model,
        optimizer,
        lr_scheduler,
        stale,
        range(FIRST_EPOCHS * STEPS_PER_EPOCH, EPOCHS * STEPS_PER_EPOCH),
        2,
    )
    resumed = {n: checkpoint["model"][n].to(torch.float64).numpy() for n in stale}
    for rank, out in enumerate(runs):
        got = out["sapipe k=2"]
        assert got["layers"][:STALE] == ["conv1", "bn1"], got["layers"]
        assert got["lr"] == out["ddp"]["lr"] and got["momentum"] == out["ddp"]["momentum"], (
            "the scheduler drives it"
        )
        weights = {n: v for n, v in got["weights"].items() if not n.startswith("buffer ")}
        assert_close_dicts(
            weights, expected, rtol=1e-9, atol=1e-11, what=f"rank {rank} sapipe k=2 vs float64 rule"
        )
        moved = max(abs(weights[n] - resumed[n]).max() for n in stale)
        assert moved > 1e-3, "the stale layers must train after the resume"
        assert all(np.isfinite(e).all() for e in got["eval"])


# ====================================================================== custom optimizer


class CentralizedSGDW(torch.optim.Optimizer):
    """SGD with momentum, decoupled weight decay and gradient centralisation (Yong et al., 2020):
    a matrix's gradient has its mean over all but the first dimension removed. Per-parameter
    state; its Python-int step count drives a per-parameter LR warm-up."""

    def __init__(self, params, lr=0.05, momentum=0.9, weight_decay=1e-2, warmup=3):
        super().__init__(
            params, {"lr": lr, "momentum": momentum, "weight_decay": weight_decay, "warmup": warmup}
        )

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                if g.dim() > 1:
                    g = g - g.mean(dim=tuple(range(1, g.dim())), keepdim=True)
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["velocity"] = torch.zeros_like(p)
                state["step"] += 1
                lr = group["lr"] * min(1.0, state["step"] / group["warmup"])
                state["velocity"].mul_(group["momentum"]).add_(g)
                p.mul_(1 - lr * group["weight_decay"])
                p.add_(state["velocity"], alpha=-lr)
        return loss


CUSTOM_STEPS, EVAL_EVERY, DC_LAMBDA = 9, 3, 0.5


def custom_optimizer(params):
    params = list(params)
    return CentralizedSGDW(
        [
            {"params": [p for p in params if p.ndim > 1]},
            {"params": [p for p in params if p.ndim <= 1], "weight_decay": 0.0},
        ]
    )


def custom_factor(epoch: int) -> float:
    return 0.93**epoch


def _custom_loop(net, module, optimizer, batches, probe, rank, set_to_none):
    """A hand-written loop: zero_grad, loss, backward, step, scheduler; evaluation every few
    steps."""
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, custom_factor)
    evals = []
    for t in range(CUSTOM_STEPS):
        x, y = batches[t][rank]
        optimizer.zero_grad(set_to_none=set_to_none)
        loss = loss_fn_for("tied")(net(x), y)
        loss.backward()
        optimizer.step()
        scheduler.step()
        if (t + 1) % EVAL_EVERY == 0:
            module.eval()
            with torch.no_grad():
                evals.append(loss_fn_for("tied")(net(probe[0]), probe[1]).item())
            module.train()
    return evals


def _custom_job(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sapipe

    out = {}
    probe = make_batches("tied", 1, 1, seed=5)[0][0]
    batches = make_batches("tied", CUSTOM_STEPS, world_size)
    for set_to_none in (True, False):
        ddp_model = make_model("tied")
        ddp_evals = _custom_loop(
            DDP(ddp_model),
            ddp_model,
            custom_optimizer(ddp_model.parameters()),
            batches,
            probe,
            rank,
            set_to_none,
        )
        model = make_model("tied", seed=rank)
        opt = sapipe.DistributedOptimizer(
            custom_optimizer(model.parameters()), model, bucket_cap_mb=0.0004
        )
        evals = _custom_loop(model, model, opt, batches, probe, rank, set_to_none)
        opt.synchronize()
        out[set_to_none] = {
            "ddp": _named(ddp_model),
            "sapipe": _named(model),
            "ddp evals": ddp_evals,
            "evals": evals,
            "path": opt.update_path,
            "buckets": len(opt.buckets),
        }
        opt.close()
    batches = make_batches("tied", CUSTOM_STEPS, world_size, dtype=torch.float64)
    model = make_model("tied", seed=rank, dtype=torch.float64)
    opt = sapipe.DistributedOptimizer(
        custom_optimizer(model.parameters()),
        model,
        stale_layers=2,
        compensation="dc",
        dc_lambda=DC_LAMBDA,
        bucket_cap_mb=0.0004,
        timeout=60,
    )
    evals = _custom_loop(model, model, opt, batches, probe, rank, True)
    opt.synchronize()
    with opt.real_weights():
        out["dc"] = {"real": _named(model), "evals": evals}
    opt.close()
    return out


@functools.cache
def _custom_runs():
    return run_ranks(_custom_job, world_size=2, timeout=240)


def test_custom_optimizer_at_k0_equals_ddp():
    for rank, out in enumerate(_custom_runs()):
        for set_to_none in (True, False):
            r = out[set_to_none]
            assert r["path"] == "generic" and r["buckets"] >= 2
            what = f"rank {rank} set_to_none={set_to_none}"
            assert_close_dicts(
                r["sapipe"], r["ddp"], rtol=0, atol=1e-6, what=what + " sapipe vs DDP"
            )
            assert max(abs(a - b) for a, b in zip(r["evals"], r["ddp evals"])) <= 1e-6, (
                what + ": evaluations"
            )
            moved = max(
                abs(r["sapipe"][n] - v.numpy()).max() for n, v in _named(make_model("tied")).items()
            )
            assert moved > 1e-2, "training must change the weights"


def test_custom_optimizer_with_dc_matches_reference():
    batches = make_batches("tied", CUSTOM_STEPS, 2, dtype=torch.float64)
    ref = run_reference(
        make_model("tied", dtype=torch.float64),
        custom_optimizer,
        batches,
        loss_fn_for("tied"),
        stale_layers=2,
        compensation="dc",
        dc_lambda=DC_LAMBDA,
        lr_at=lambda it: 0.05 * custom_factor(it - 1),
    )
    probe = [
        v.to(torch.float64) if v.is_floating_point() else v
        for v in make_batches("tied", 1, 1, seed=5)[0][0]
    ]
    model = make_model("tied", dtype=torch.float64)
    expected_evals = []
    for t in range(EVAL_EVERY - 1, CUSTOM_STEPS, EVAL_EVERY):  # the real weights after step t + 1
        model.load_state_dict(ref.real[t], strict=False)
        with torch.no_grad():
            expected_evals.append(loss_fn_for("tied")(model(probe[0]), probe[1]).item())
    for rank, out in enumerate(_custom_runs()):
        assert_close_dicts(
            out["dc"]["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} dc real x"
        )
        for got, expected in zip(out["dc"]["evals"], expected_evals, strict=True):
            assert abs(got - expected) <= 1e-9 * abs(expected), (
                rank,
                out["dc"]["evals"],
                expected_evals,
            )


# The nanoGPT-style loop (accumulation under no_sync(), GradScaler, scaler.unscale_ +
# clip_grad_norm_, an LR set by hand each iteration) is tests/distributed/test_clipping.py::
# test_nanogpt_style_loop_equals_ddp.


# ====================================================================== a subgroup


def _subgroup_job(rank, world_size):
    """Ranks 0 and 1 train over a subgroup (DDP and sapipe alike); rank 2 is not in it."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sapipe

    group = dist.new_group([0, 1])  # collective over the world, as torch requires
    if rank == 2:
        return None
    batches = make_batches("tied", 6, 2)
    ddp_model = make_model("tied")
    ddp = DDP(ddp_model, process_group=group)
    ddp_opt = torch.optim.AdamW(ddp_model.parameters(), lr=0.01)
    model = make_model("tied", seed=rank)
    opt = sapipe.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        model,
        process_group=group,
        bucket_cap_mb=0.0004,
        timeout=60,
    )
    for t in range(6):
        x, y = batches[t][rank]
        for net, optimizer in ((ddp, ddp_opt), (model, opt)):
            optimizer.zero_grad()
            loss_fn_for("tied")(net(x), y).backward()
            optimizer.step()
    opt.synchronize()
    result = {
        "ddp": _named(ddp_model),
        "sapipe": _named(model),
        "world": (opt.rank, opt.world_size),
    }
    opt.close()
    return result


def test_training_over_a_subgroup_equals_ddp_over_it():
    out = run_ranks(_subgroup_job, world_size=3, timeout=180)
    assert out[2] is None
    for rank in (0, 1):
        assert out[rank]["world"] == (rank, 2)
        assert_close_dicts(
            out[rank]["sapipe"], out[rank]["ddp"], rtol=0, atol=1e-6, what=f"rank {rank} subgroup"
        )


def _scheduler_before_wrapping(rank, world_size):
    """A scheduler built on the torch optimizer, which is then wrapped (the README allows
    either order); the warnings torch's schedulers raised, per update path."""
    import warnings

    import sapipe

    batches = make_batches("mlp", 3, world_size)
    caught = {}
    for name, make in (
        ("fused", lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9)),
        ("generic", lambda p: torch.optim.RMSprop(p, lr=0.01)),
    ):
        model = make_model("mlp", seed=0)
        base = make(model.parameters())
        sched = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
        opt = sapipe.DistributedOptimizer(base, model, stale_layers=1)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            for step in batches:
                x, y = step[rank]
                opt.zero_grad()
                loss_fn_for("mlp")(model(x), y).backward()
                opt.step()
                sched.step()
        caught[name] = (
            [str(w.message) for w in seen if "lr_scheduler" in str(w.message)],
            opt.update_path,
            base.param_groups[0]["lr"],
        )
        opt.close()
    return caught


def test_a_scheduler_built_before_wrapping_sees_the_steps():
    """torch's schedulers warn "lr_scheduler.step() before optimizer.step()" unless the
    optimizer they were built on says its step ran: sapipe's step says so for it."""
    for caught in run_ranks(_scheduler_before_wrapping, world_size=2):
        for name, (messages, path, lr) in caught.items():
            assert path == name and messages == [], (name, messages)
            assert lr == pytest.approx((0.1 if name == "fused" else 0.01) * 0.5**3)
