"""DDP's semantics where training scripts rely on them (docs/design.md §3.9).

* **Unused parameters.** ``BranchNet`` routes each batch by a code in its last input column:
  ``sometimes`` runs on every rank at some iterations only (so it is unused everywhere at the
  others, its first iteration included), ``mine`` runs on rank 0 only (unused on one rank:
  averaged with rank 1's zeros; it also makes the ranks' first forwards differ, so the
  layer order must be rank 0's), ``never`` never runs. Against
  ``DistributedDataParallel(find_unused_parameters=True)`` at k = 0 (float32, 1e-6; also
  with a gradient accumulated inside ``no_sync()`` only, which DDP counts as used) and
  against the float64 reference (tests/support/reference.py, same rule) at k > 0 for every mode;
  a checkpoint taken with skipped gradients in flight resumes bit-identically.
* **broadcast_buffers.** A BatchNorm model with different data per rank, evaluation
  forwards under ``no_grad`` and ``no_sync()`` micro-batches in between (DDP broadcasts
  before a forward only when the previous one ran with gradients outside ``no_sync()``):
  parameters, every rank's buffers and the evaluation outputs equal DDP's, for
  ``broadcast_buffers`` True and False.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from support.dist_utils import assert_close_dicts, run_ranks
from support.optimizers import recipe
from support.reference import run_reference
from support.training import held_and_real, named_weights, train_steps

STEPS = 12


def route(t: int, rank: int) -> int:
    """Bit 0: ``sometimes`` runs (every rank, iterations 1, 4, 7, ...); bit 1: ``mine`` runs
    (rank 0)."""
    return (1 if t % 3 == 1 else 0) | (2 if rank == 0 else 0)


class BranchNet(nn.Module):
    """Features x[:, :-1]; x[0, -1] is the route (registration order != execution order)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 8)
        self.sometimes = nn.Linear(8, 8)
        self.mine = nn.Linear(8, 8)
        self.never = nn.Linear(8, 8)
        self.out = nn.Linear(8, 3)

    def forward(self, x):
        code = int(x[0, -1].item())
        h = torch.tanh(self.inp(x[:, :-1]))
        if code & 1:
            h = h + torch.tanh(self.sometimes(h))
        if code & 2:
            h = h + torch.tanh(self.mine(h))
        return self.out(h)


def branch_net(seed: int, dtype=torch.float32) -> BranchNet:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return BranchNet().to(dtype)


def branch_batches(steps: int, world_size: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    batches = []
    for t in range(steps):
        per_rank = []
        for r in range(world_size):
            x = torch.randn(4, 6, generator=g, dtype=torch.float64)
            x = torch.cat([x, torch.full((4, 1), float(route(t, r)), dtype=torch.float64)], dim=1)
            per_rank.append(
                (x.to(dtype), torch.randn(4, 3, generator=g, dtype=torch.float64).to(dtype))
            )
        batches.append(per_rank)
    return batches


BASE_LR = {"sgd": 0.05, "adam": 0.01, "adamw": 0.01, "rmsprop": 0.01}
#: two param groups each (weight decay on matrices only)
OPTIMIZERS = {
    # dampening: a momentum buffer seeded at the wrong step would show
    "sgd": recipe(
        "sgd-momentum",
        lr=BASE_LR["sgd"],
        dampening=0.1,
        weight_decay=1e-2,
        decay_matrices_only=True,
    ),
    "adam": recipe(
        "adam",
        lr=BASE_LR["adam"],
        betas=(0.8, 0.95),
        weight_decay=1e-2,
        decay_matrices_only=True,
    ),
    # the generic path: the optimizer's own step() over the used parameters
    "rmsprop": recipe(
        "rmsprop-momentum", lr=BASE_LR["rmsprop"], weight_decay=1e-2, decay_matrices_only=True
    ),
    "adamw": recipe("adamw", lr=BASE_LR["adamw"], weight_decay=0.05, decay_matrices_only=True),
}


def lr_factor(epoch: int) -> float:
    return 1.0 / (1.0 + 0.15 * epoch)


# ------------------------------------------------------------------ unused parameters vs DDP


def _micro_batches(x, y, t, accumulate):
    """One batch, or (accumulate, every 2nd iteration) two micro-batches where only the first
    runs ``sometimes``: a gradient accumulated inside no_sync() that DDP counts as used."""
    if not accumulate or t % 2 == 0:
        return [(x, y)]
    second = x.clone()
    second[:, -1] = float(int(x[0, -1].item()) & ~1)
    return [(x, y), (second, y)]


def _train_vs_ddp(rank, world_size, kind, bucket_cap_mb, accumulate=False, compression=None):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sapipe

    batches = branch_batches(STEPS, world_size)
    ddp_model = branch_net(seed=0)
    ddp = DDP(ddp_model, find_unused_parameters=True)
    if compression is not None:
        # torch's own hook (DDP's check for NCCL bypassed: Gloo sums bf16 too)
        hook = getattr(default_hooks, f"{compression}_compress_hook")
        ddp.register_comm_hook(None, lambda group, bucket: hook(group, bucket))
    ddp_opt = OPTIMIZERS[kind](ddp_model.parameters())
    ddp_sched = torch.optim.lr_scheduler.LambdaLR(ddp_opt, lr_factor)
    model = branch_net(seed=rank)  # construction broadcasts rank 0's weights
    opt = sapipe.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()),
        model,
        bucket_cap_mb=bucket_cap_mb,
        compression=compression,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
    for t in range(STEPS):
        micro = _micro_batches(*batches[t][rank], t, accumulate)
        for net, optimizer, scheduler in ((ddp, ddp_opt, ddp_sched), (model, opt, sched)):
            optimizer.zero_grad()
            for j, (x, y) in enumerate(micro):
                no_sync = net.no_sync if net is ddp else optimizer.no_sync
                with no_sync() if j < len(micro) - 1 else contextlib.nullcontext():
                    (F.mse_loss(net(x), y) / len(micro)).backward()
            optimizer.step()
            scheduler.step()
    opt.synchronize()
    return {
        "ddp": named_weights(ddp_model),
        "sapipe": named_weights(model),
        "initial": named_weights(branch_net(seed=0)),
        "buckets": len(opt.buckets),
    }


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw", "rmsprop"])
@pytest.mark.parametrize("bucket_cap_mb", [25, 0.0004])
def test_unused_parameters_equal_ddp(kind, bucket_cap_mb):
    out = run_ranks(_train_vs_ddp, world_size=2, args=(kind, bucket_cap_mb))
    assert out[0]["buckets"] == (1 if bucket_cap_mb > 1 else 4)
    for rank, r in enumerate(out):
        assert_close_dicts(
            r["sapipe"], r["ddp"], rtol=0, atol=1e-6, what=f"rank {rank} {kind} sapipe vs DDP"
        )
        for name in ("never.weight", "never.bias"):  # untouched, to the bit, as under DDP
            assert (r["sapipe"][name] == r["initial"][name]).all(), f"rank {rank}: {name} moved"
            assert (r["ddp"][name] == r["initial"][name]).all()
        for name in ("sometimes.weight", "mine.weight"):
            assert abs(r["sapipe"][name] - r["initial"][name]).max() > 1e-3, f"{name} must train"


@pytest.mark.parametrize("compression", ["fp16", "bf16"])
def test_unused_and_accumulated_gradients_compressed_equal_ddp_with_torchs_compress_hook(
    compression,
):
    """Gradients backward writes straight into the compressed messages: a parameter no rank
    used goes as zeros, one accumulated inside no_sync() (whose hook does not fire) as its
    gradient, as DDP with find_unused_parameters and the same format's compress hook sends
    them (two ranks: the same roundings, but for fp16's subnormals: DDP's hook halves each
    rank's fp16 gradient before the sum, sapipe halves the sum, and a halved subnormal loses
    its last bit)."""
    atol = {"fp16": 1e-5, "bf16": 1e-6}[compression]
    for rank, r in enumerate(
        run_ranks(_train_vs_ddp, world_size=2, args=("adamw", 0.0004, True, compression))
    ):
        assert_close_dicts(
            r["sapipe"],
            r["ddp"],
            rtol=0,
            atol=atol,
            what=f"rank {rank} {compression} vs DDP's hook",
        )
        for name in ("never.weight", "never.bias"):
            assert (r["sapipe"][name] == r["initial"][name]).all(), f"rank {rank}: {name} moved"


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_gradient_accumulated_in_no_sync_counts_as_used_as_in_ddp(kind):
    for rank, r in enumerate(run_ranks(_train_vs_ddp, world_size=2, args=(kind, 0.0004, True))):
        assert_close_dicts(
            r["sapipe"], r["ddp"], rtol=0, atol=1e-6, what=f"rank {rank} {kind} no_sync vs DDP"
        )


# ------------------------------------------------------------------ k > 0 vs the float64 reference

# (stale_layers, compensation, staleness, warmup); rank 0's layer order: inp, mine, out, then
# the layers its first forward did not run: sometimes, never (m = 5)
CONFIGS = [
    (2, "none", 1, 0),
    (5, "none", 1, 0),
    (3, "none", 2, 1),
    (5, "dc", 1, 0),
    (3, "dc", 2, 2),
    (2, "wp1", 1, 0),
    (5, "wp1", 1, 2),
    (5, "wp2", 1, 0),
    (5, "wp3", 1, 1),
]


def _train_stale(rank, world_size, kind, configs):
    import sapipe

    batches = branch_batches(STEPS, world_size, torch.float64)
    results = []
    for k, mode, s, warmup in configs:
        model = branch_net(seed=rank, dtype=torch.float64)
        opt = sapipe.DistributedOptimizer(
            OPTIMIZERS[kind](model.parameters()),
            model,
            stale_layers=k,
            compensation=mode,
            staleness=s,
            warmup_steps=warmup,
            dc_lambda=0.7,
            bucket_cap_mb=0.0006,
            timeout=60,
        )
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_factor)
        train_steps(model, opt, batches, rank, loss_fn=F.mse_loss, scheduler=sched)
        opt.synchronize()
        held, real = held_and_real(model, opt)
        results.append({"real": real, "held": held, "order": [layer.name for layer in opt.layers]})
        opt.close()
    return results


@functools.cache
def _stale_runs(kind: str):
    return run_ranks(_train_stale, world_size=2, args=(kind, CONFIGS), timeout=300)


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
@pytest.mark.parametrize("config", CONFIGS, ids=lambda c: "k{}-{}-s{}-w{}".format(*c))
def test_unused_parameters_stale_match_reference(kind, config):
    k, mode, s, warmup = config
    per_rank = [r[CONFIGS.index(config)] for r in _stale_runs(kind)]
    ref = run_reference(
        branch_net(seed=0, dtype=torch.float64),
        OPTIMIZERS[kind],
        branch_batches(STEPS, 2, torch.float64),
        F.mse_loss,
        stale_layers=k,
        compensation=mode,
        staleness=s,
        warmup_steps=warmup,
        dc_lambda=0.7,
        lr_at=lambda it: BASE_LR[kind] * lr_factor(it - 1),
    )
    initial = named_weights(branch_net(seed=0, dtype=torch.float64))
    for rank, got in enumerate(per_rank):
        assert got["order"] == ref.order == ["inp", "mine", "out", "sometimes", "never"]
        assert_close_dicts(
            got["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} real x"
        )
        assert_close_dicts(
            got["held"], ref.held[-1][rank], rtol=1e-9, atol=1e-11, what=f"rank {rank} held"
        )
        assert (got["real"]["never.weight"] == initial["never.weight"]).all()


# ------------------------------------------------------------------ broadcast_buffers vs DDP


class NormNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(6, 10)
        self.bn = nn.BatchNorm1d(10)
        self.fc2 = nn.Linear(10, 3)

    def forward(self, x):
        return self.fc2(torch.tanh(self.bn(self.fc1(x))))


def _train_buffers(rank, world_size, broadcast):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sapipe

    g = torch.Generator().manual_seed(1)
    data = [
        [
            (torch.randn(8, 6, generator=g) * (1 + r) + r, torch.randn(8, 3, generator=g))
            for r in range(world_size)
        ]
        for _ in range(STEPS + 1)
    ]
    probe = torch.randn(5, 6, generator=g)

    def build(seed):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return NormNet()

    ddp_model = build(0)
    ddp = DDP(ddp_model, broadcast_buffers=broadcast)
    ddp_opt = torch.optim.SGD(ddp_model.parameters(), lr=0.05, momentum=0.9)
    model = build(rank)
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model,
        broadcast_buffers=broadcast,
    )
    evals = {"ddp": [], "sapipe": []}
    for t in range(STEPS):
        micro = [data[t][rank], data[t + 1][rank]] if t % 4 == 3 else [data[t][rank]]
        for key, net, module, optimizer in (
            ("ddp", ddp, ddp_model, ddp_opt),
            ("sapipe", model, model, opt),
        ):
            optimizer.zero_grad()
            for j, (x, y) in enumerate(micro):
                no_sync = net.no_sync if key == "ddp" else optimizer.no_sync
                with no_sync() if j < len(micro) - 1 else contextlib.nullcontext():
                    (F.mse_loss(net(x), y) / len(micro)).backward()
            optimizer.step()
            if t % 3 == 2:  # evaluation: running statistics are used
                module.eval()
                with torch.no_grad():
                    evals[key].append(net(probe).clone())
                    evals[key].append(net(probe).clone())
                module.train()
    opt.synchronize()
    return {
        "ddp": dict(
            named_weights(ddp_model),
            **{"buf." + n: b.clone() for n, b in ddp_model.named_buffers()},
        ),
        "sapipe": dict(
            named_weights(model), **{"buf." + n: b.clone() for n, b in model.named_buffers()}
        ),
        "evals": {key: torch.stack(v) for key, v in evals.items()},
    }


@pytest.mark.parametrize("broadcast", [True, False])
def test_broadcast_buffers_equals_ddp(broadcast):
    out = run_ranks(_train_buffers, world_size=2, args=(broadcast,))
    for rank, r in enumerate(out):
        assert_close_dicts(
            r["sapipe"],
            r["ddp"],
            rtol=0,
            atol=1e-6,
            what=f"rank {rank} broadcast_buffers={broadcast}",
        )
        assert abs(r["evals"]["sapipe"] - r["evals"]["ddp"]).max() <= 1e-6, (
            f"rank {rank}: evaluation outputs differ"
        )
    # every rank evaluates with rank 0's running statistics exactly when they are broadcast
    evals_differ = abs(out[0]["evals"]["sapipe"] - out[1]["evals"]["sapipe"]).max()
    assert (evals_differ == 0) if broadcast else (evals_differ > 1e-3)


def _replaced_buffer(rank, world_size):
    import sapipe

    torch.manual_seed(0)
    model = NormNet()
    opt = sapipe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), model)
    # after construction each rank replaces the tensor (not its values) of a buffer, and adds
    # one to a module that had none: the replacement is what rank 0 sends
    model.bn.running_mean = torch.full((10,), 10.0 + rank)
    model.fc1.register_buffer("seen", torch.full((2,), float(rank)))
    torch.manual_seed(1)  # the same batch on both ranks: their running means then move alike
    opt.zero_grad()
    F.mse_loss(model(torch.randn(8, 6)), torch.zeros(8, 3)).backward()
    opt.step()
    opt.close()
    return {"running_mean": model.bn.running_mean.clone(), "seen": model.fc1.seen.clone()}


def test_a_replaced_buffer_is_the_one_broadcast():
    """The buffers are read from their modules before each broadcast (docs/design.md §3.9):
    a buffer a module replaced after construction reaches the other ranks as rank 0's; the
    modules are the model's at construction, whose own buffer tables are read each time."""
    out = run_ranks(_replaced_buffer, world_size=2)
    # rank 0's 10.0 reached rank 1 before the forward; the same batch then moved both alike
    # (rank 1 keeping its own 11.0 would leave it 0.9 above rank 0)
    assert (out[0]["running_mean"] == out[1]["running_mean"]).all(), [
        r["running_mean"] for r in out
    ]
    for rank, r in enumerate(out):
        assert (r["seen"] == 0.0).all(), (
            f"rank {rank}: a buffer added to a module's table was not broadcast"
        )


# ----------------------------------------------------------------- checkpoints keep what §3.9 needs

RESUME_CASES = [("adamw", 3, "dc", 2, 1), ("adamw", 5, "wp1", 1, 0), ("sgd", 0, "none", 1, 0)]


def _resume(rank, world_size, cases):
    """Uninterrupted vs state_dict() after 6 steps into a fresh optimizer: flags still in flight,
    per-parameter step counts."""
    import copy

    import sapipe

    batches = branch_batches(STEPS, world_size)

    def setup(kind, k, mode, s, warmup):
        model = branch_net(seed=0)
        opt = sapipe.DistributedOptimizer(
            OPTIMIZERS[kind](model.parameters()),
            model,
            stale_layers=k,
            compensation=mode,
            staleness=s,
            warmup_steps=warmup,
            bucket_cap_mb=0.0004,
        )
        return model, opt

    def train(model, opt, steps):
        train_steps(model, opt, batches, rank, steps, loss_fn=F.mse_loss)

    def weights(model, opt):
        held = named_weights(model)
        opt.synchronize()
        with opt.real_weights():
            return {"held": held, "real": named_weights(model)}

    out = []
    for case in cases:
        model, opt = setup(*case)
        train(model, opt, range(STEPS))
        whole = weights(model, opt)
        opt.close()
        model, opt = setup(*case)
        train(model, opt, range(6))
        saved = copy.deepcopy({"model": model.state_dict(), "opt": opt.state_dict()})
        opt.close()
        model, opt = setup(*case)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["opt"])
        train(model, opt, range(6, STEPS))
        out.append({"whole": whole, "resumed": weights(model, opt)})
        opt.close()
    return out


def test_resume_keeps_unused_flags_and_step_counts():
    for rank, per_case in enumerate(run_ranks(_resume, world_size=2, args=(RESUME_CASES,))):
        for case, r in zip(RESUME_CASES, per_case):
            for which in ("held", "real"):
                assert_close_dicts(
                    r["resumed"][which],
                    r["whole"][which],
                    rtol=0,
                    atol=0,
                    what=f"rank {rank} {case} {which}",
                )
