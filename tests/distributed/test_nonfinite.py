"""A NaN or inf in one rank's gradient without a GradScaler (``nonfinite_gradients=``,
docs/design.md §3.12).

As under DDP the average turns non-finite on every rank and the update applies it; sapipe
says so once, naming the iteration, the bucket and the rank(s). The model is the test MLP
(layers "0", "2", "4"), one layer per bucket: at k = 1 layer "0" is stale (bucket 2), layers
"4" and "2" are sync (buckets 0 and 1). Rank 1's gradient of one layer is made non-finite
in iteration INJECTED (a tensor hook, so only that layer's gradient, only on rank 1), in a
sync bucket or in the stale one, for every compensation, compression, both back-ends that
carry compressed sums, and ``expose_gradients`` True and False. Checked:

* the weights: identical, NaN and inf positions included, to the same job with
  ``nonfinite_gradients="ignore"`` (the training math is unchanged), non-finite on every rank,
  and at k = 0 equal to ``DistributedDataParallel`` after every step;
* the warnings: exactly one per rank, in the step() the design names (the next one for a sync
  gradient; the one that applies a stale gradient, or the next with ``p.grad`` not exposed),
  naming iteration INJECTED, the bucket and rank 1; none before, none after;
* ``"raise"``: every rank raises ``NonFiniteGradientError`` in the same step(), with the same
  message; ``"ignore"``: nothing, and the wire carries nothing more;
* under a GradScaler: nothing reported (the scaler skips the step); a clean run: nothing;
* bad values, and ranks that disagree, are refused with ``ConfigurationError``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from support.cuda import on_cuda
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.training import named_weights

STEPS = 7
INJECTED = 3  # rank 1's gradient of one layer is non-finite in this iteration
REPORT = "sapipe: the averaged gradient of "
LOSS = loss_fn_for("mlp")

# (stale_layers, compensation, staleness, compression, backend, expose_gradients, poison)
# k = 0: the sync bucket of layer "4" is poisoned; k = 1: the stale bucket of layer "0"
CASES = {
    "sync": (0, "none", 1, None, "torch", True, "nan"),
    "sync inf": (0, "none", 1, None, "torch", True, "inf"),
    "sync unexposed": (0, "none", 1, None, "torch", False, "nan"),
    "sync pushpull": (0, "none", 1, None, "pushpull", True, "inf"),
    "sync bf16": (0, "none", 1, "bf16", "torch", True, "nan"),
    "sync fp16 unexposed": (0, "none", 1, "fp16", "torch", False, "inf"),
    "sync int8": (0, "none", 1, "int8", "torch", True, "nan"),
    "sync int8 pushpull": (0, "none", 1, "int8", "pushpull", False, "inf"),
    "sync read on rank 0": (0, "none", 1, None, "torch", True, "nan"),
    "stale none": (1, "none", 1, None, "torch", True, "nan"),
    "stale none unexposed": (1, "none", 1, None, "torch", False, "inf"),
    "stale dc s=2": (1, "dc", 2, None, "torch", True, "nan"),
    "stale dc unexposed": (1, "dc", 1, None, "pushpull", False, "nan"),
    "stale wp1 fp16": (1, "wp1", 1, "fp16", "torch", True, "inf"),
    "stale wp1 unexposed": (1, "wp1", 1, None, "torch", False, "nan"),
    "stale wp2 bf16 pushpull": (1, "wp2", 1, "bf16", "pushpull", True, "nan"),
    "stale wp3 int8": (1, "wp3", 1, "int8", "torch", False, "inf"),
    "stale wp2 read on rank 0": (1, "wp2", 1, None, "torch", True, "inf"),
}
#: in these, rank 0 alone reads every p.grad before step() (a norm, logged): its sync gradients
#: are consumed in that step, rank 1's only at their next forward; the report must not differ
READS_ON_RANK_0 = "read on rank 0"


def reported_at(k: int, staleness: int, expose: bool, late: bool = False) -> int:
    """The step() whose check reports the gradient of INJECTED (docs/design.md §3.12): a sync
    gradient at the next one; a stale one at the step that applies it (INJECTED + s) if
    ``p.grad`` exposed it there, else at the one after. ``late`` (CUDA): one check later."""
    later = 1 if late else 0
    if k == 0:
        return INJECTED + 1 + later
    return INJECTED + staleness + (0 if expose else 1) + later


def _poison_hook(rank, kind, clock, poisoned=1):
    """Rank ``poisoned``'s gradient of the hooked parameter in iteration INJECTED: all NaN, or
    one inf."""

    def hook(grad):
        if rank != poisoned or clock["t"] != INJECTED:
            return grad
        if kind == "nan":
            return grad * float("nan")
        grad = grad.clone()
        grad[0, 0] = float("inf")
        return grad

    return hook


def _sapipe(model, k, mode, staleness, compression, backend, expose, nonfinite):
    import sapipe

    return sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model,
        stale_layers=k,
        compensation=mode,
        staleness=staleness,
        compression=compression,
        backend=backend,
        expose_gradients=expose,
        nonfinite_gradients=nonfinite,
        bucket_cap_mb=0.0001,
        timeout=60,
    )


def _read_late():
    """In this rank's process: read each total a check late on the CPU too, as on CUDA."""
    from sapipe.runtime.nonfinite import NonFiniteGradients

    start = NonFiniteGradients.start

    def late(self, device, next_check=None):
        start(self, device, next_check)
        self.deferred = True

    NonFiniteGradients.start = late


def _train(
    rank, world_size, case, nonfinite, poison=True, scaler=False, snapshots=False, device="cpu"
):
    """One job of ``case`` (the last rank's gradient poisoned): (per step, the reports it
    emitted), the final real weights, the poisoned layer's bucket as described, the wire's
    length of every bucket, with ``snapshots`` the weights after every step (sync updates
    applied), and on CUDA how many synchronising CUDA calls each step from the third made."""
    k, mode, staleness, compression, backend, expose, kind = CASES[case]
    model = make_model("mlp", seed=0).to(device)
    opt = _sapipe(model, k, mode, staleness, compression, backend, expose, nonfinite)
    grad_scaler = torch.amp.GradScaler(device, init_scale=2.0**10) if scaler else None
    clock = {"t": 0}
    layer = model[0] if k else model[4]
    if poison:
        layer.weight.register_hook(_poison_hook(rank, kind, clock, poisoned=world_size - 1))
    reports, raised, after, syncs = [], [], [], []
    for t, batch in enumerate(make_batches("mlp", STEPS, world_size), start=1):
        clock["t"] = t
        x, y = (v.to(device) for v in batch[rank])
        watch = device == "cuda" and t >= 3
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if watch:
                torch.cuda.set_sync_debug_mode("warn")
            opt.zero_grad()
            loss = LOSS(model(x), y)
            try:
                if grad_scaler is None:
                    loss.backward()
                    if READS_ON_RANK_0 in case and rank == 0:
                        [p.grad.norm() for p in model.parameters() if p.grad is not None]
                    opt.step()
                else:
                    grad_scaler.scale(loss).backward()
                    grad_scaler.step(opt)
                    grad_scaler.update()
            except Exception as exc:  # noqa: BLE001 - "raise": sent back to the test
                raised.append((t, type(exc).__name__, str(exc)))
                break
            finally:
                if watch:
                    torch.cuda.set_sync_debug_mode("default")
                    torch.cuda.synchronize()
        reports += [
            (t, str(w.message), w.category.__name__)
            for w in caught
            if str(w.message).startswith(REPORT)
        ]
        if watch:
            syncs.append((t, sum("synchroniz" in str(w.message) for w in caught)))
        if snapshots:
            opt.synchronize()
            with opt.real_weights():
                after.append(named_weights(model))
    opt.synchronize()
    with opt.real_weights():
        weights = named_weights(model)
    described = next(
        b.describe()
        for b in opt.buckets
        if any(layer.name == ("0" if k else "4") for layer in b.layers)
    )
    wires = [
        opt._runtime.pipeline.gradients(b).buffer.wire[0].numel() - b.numel - len(b.params)
        for b in opt.buckets
    ]
    opt.close()
    return {
        "reports": reports,
        "raised": raised,
        "weights": weights,
        "bucket": described,
        "wires": wires,
        "after": after,
        "syncs": syncs,
    }


def _ddp(rank, world_size, kind):
    """DDP with the same model, optimizer, data and poisoned gradient: its weights after every
    step."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model("mlp", seed=0)
    ddp = DDP(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    clock = {"t": 0}
    model[4].weight.register_hook(_poison_hook(rank, kind, clock))
    after = []
    for t, batch in enumerate(make_batches("mlp", STEPS, world_size), start=1):
        clock["t"] = t
        x, y = batch[rank]
        opt.zero_grad()
        LOSS(ddp(x), y).backward()
        opt.step()
        after.append(named_weights(model))
    return after


def _cases(rank, world_size, names, device="cpu", late=False):
    if late:
        _read_late()
    return {
        name: {
            setting: _train(rank, world_size, name, setting, device=device)
            for setting in ("warn", "ignore")
        }
        for name in names
    }


def _same(a: dict, b: dict) -> bool:
    """Bit-identical weights, NaN and inf where they are."""
    return set(a) == set(b) and all(np.array_equal(a[n], b[n], equal_nan=True) for n in a)


def _check_case(name, per_rank, late=False):
    k, _, staleness, _, _, expose, _ = CASES[name]
    step = reported_at(k, staleness, expose, late)
    world = len(per_rank)
    messages = set()
    for rank, runs in enumerate(per_rank):
        warned, ignored = runs["warn"], runs["ignore"]
        assert _same(warned["weights"], ignored["weights"]), (
            f"{name}, rank {rank}: the check changed the training"
        )
        poisoned = warned["weights"]["0.weight" if k else "4.weight"]
        assert not np.isfinite(poisoned).all(), (
            f"{name}, rank {rank}: the non-finite average was not applied"
        )
        assert ignored["reports"] == [], (
            f"{name}, rank {rank}: 'ignore' reported {ignored['reports']}"
        )
        assert ignored["wires"] == [0, 0, 0] and warned["wires"] == [1, 1, 1], (
            warned["wires"],
            ignored["wires"],
        )
        reports = warned["reports"]
        assert len(reports) == 1, f"{name}, rank {rank}: {len(reports)} reports, not one: {reports}"
        at, message, category = reports[0]
        assert (at, category) == (step, "RuntimeWarning"), (
            f"{name}, rank {rank}: reported in step {at}, not {step}"
        )
        expected = (
            f"{REPORT}{warned['bucket']} in iteration {INJECTED} holds NaN or inf: "
            f"the local gradient of rank {world - 1} (1 of {world} ranks) did."
        )
        assert message.startswith(expected), f"{name}, rank {rank}: {message}"
        # until it reports (which reads this rank's verdicts on the host, once), the check never
        # makes a step wait for the device
        before = [sum(n for t, n in run["syncs"] if t < step) for run in (warned, ignored)]
        assert before[0] == before[1], (
            f"{name}, rank {rank}: the check synchronised with the device: {before}"
        )
        messages.add(message)
    assert len(messages) == 1, f"{name}: the ranks' reports differ: {messages}"


SYNC = [name for name in CASES if name.startswith("sync")]
STALE = [name for name in CASES if name.startswith("stale")]


@pytest.mark.parametrize("names", [SYNC, STALE], ids=["sync_buckets", "stale_buckets"])
def test_one_report_per_rank_naming_the_rank_and_the_bucket_training_unchanged(names):
    out = run_ranks(_cases, world_size=2, args=(names,), timeout=400)
    for name in names:
        _check_case(name, [out[0][name], out[1][name]])


LATE = [
    "sync",
    "sync read on rank 0",
    "sync fp16 unexposed",
    "sync int8 pushpull",
    "stale none unexposed",
    "stale dc s=2",
    "stale wp1 fp16",
    "stale wp2 read on rank 0",
]


def test_a_check_late_as_on_cuda():
    """CUDA reads each total a check late (copied to the host meanwhile); the same logic on the
    CPU."""
    out = run_ranks(_cases, world_size=2, args=(LATE, "cpu", True), timeout=400)
    for name in LATE:
        _check_case(name, [out[0][name], out[1][name]], late=True)


def _with_ddp(rank, world_size, name):
    return {
        "sapipe": _train(rank, world_size, name, "warn", snapshots=True),
        "ddp": _ddp(rank, world_size, CASES[name][-1]),
    }


@pytest.mark.parametrize("name", ["sync", "sync inf", "sync unexposed"])
def test_non_finite_on_every_rank_as_ddp(name):
    for rank, out in enumerate(run_ranks(_with_ddp, world_size=2, args=(name,))):
        assert len(out["sapipe"]["reports"]) == 1, out["sapipe"]["reports"]
        for t, (mine, ddp) in enumerate(zip(out["sapipe"]["after"], out["ddp"]), start=1):
            for n in ddp:
                np.testing.assert_allclose(
                    mine[n],
                    ddp[n],
                    rtol=0,
                    atol=1e-6,
                    equal_nan=True,
                    err_msg=f"rank {rank}, step {t}, {n}",
                )
        poisoned = out["ddp"][INJECTED - 1][
            "4.weight"
        ]  # after the step that applied the poisoned average
        assert (
            not np.isfinite(poisoned).all()
            and np.isfinite(out["ddp"][INJECTED - 2]["4.weight"]).all()
        )


def _raising(rank, world_size, names):
    return {name: _train(rank, world_size, name, "raise") for name in names}


def test_raise_raises_on_every_rank_in_the_same_step():
    names = ["sync", "stale none unexposed", "stale wp1 fp16"]
    out = run_ranks(_raising, world_size=2, args=(names,), timeout=240)
    for name in names:
        k, _, staleness, _, _, expose, _ = CASES[name]
        raised = [out[rank][name]["raised"] for rank in range(2)]
        for rank, got in enumerate(raised):
            assert len(got) == 1, f"{name}, rank {rank}: {got}"
            step, kind, message = got[0]
            assert (step, kind) == (reported_at(k, staleness, expose), "NonFiniteGradientError"), (
                got
            )
            assert message.startswith(
                f"{REPORT}{out[rank][name]['bucket']} in iteration {INJECTED}"
            ), message
            assert "rank 1 (1 of 2 ranks)" in message and out[rank][name]["reports"] == []
        assert raised[0] == raised[1], f"{name}: the ranks raised differently: {raised}"


def _quiet(rank, world_size, names):
    """Each case clean (no poison), and poisoned under a GradScaler."""
    return {
        name: {
            "clean": _train(rank, world_size, name, "warn", poison=False),
            "scaled": _train(rank, world_size, name, "warn", scaler=True),
        }
        for name in names
    }


def test_nothing_reported_on_a_clean_run_or_under_a_grad_scaler():
    names = [
        "sync",
        "sync unexposed",
        "stale none",
        "stale dc unexposed",
        "stale wp1 fp16",
        "sync int8",
    ]
    out = run_ranks(_quiet, world_size=2, args=(names,), timeout=400)
    for rank in range(2):
        for name in names:
            clean, scaled = out[rank][name]["clean"], out[rank][name]["scaled"]
            assert clean["reports"] == [] and clean["raised"] == [], (
                name,
                clean["reports"],
                clean["raised"],
            )
            assert all(np.isfinite(w).all() for w in clean["weights"].values()), name
            assert scaled["reports"] == [] and scaled["raised"] == [], (
                name,
                scaled["reports"],
                scaled["raised"],
            )
            # the GradScaler skipped the poisoned step on every rank: nothing non-finite was applied
            assert all(np.isfinite(w).all() for w in scaled["weights"].values()), (
                f"{name}: rank {rank}"
            )


def _construct(rank, world_size, values):
    import sapipe

    got = {}
    for label, value in values.items():
        model = make_model("mlp", seed=0)
        mine = value[rank] if isinstance(value, tuple) else value
        try:
            sapipe.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                model,
                nonfinite_gradients=mine,
                timeout=20,
            ).close()
            got[label] = ("no error", "")
        except sapipe.SapipeError as exc:
            got[label] = (type(exc).__name__, str(exc))
    return got


def test_bad_values_and_disagreeing_ranks_are_refused():
    values = {
        "loud": "loud",
        "upper case": "WARN",
        "bool": True,
        "None": None,
        "ranks differ": ("warn", "raise"),
        "raise": "raise",
        "ignore": "ignore",
    }
    for rank, got in enumerate(run_ranks(_construct, world_size=2, args=(values,))):
        for label in ("loud", "upper case", "bool", "None"):
            kind, message = got[label]
            assert kind == "ConfigurationError", (label, got[label])
            assert message.startswith(
                "sapipe: nonfinite_gradients must be one of ['ignore', 'raise', 'warn']"
            ), message
        kind, message = got["ranks differ"]
        assert (
            kind == "ConfigurationError"
            and "nonfinite_gradients='raise' but rank 0 has nonfinite_gradients='warn'" in message
        ), (rank, got["ranks differ"])
        assert got["raise"] == ("no error", "") and got["ignore"] == ("no error", "")


# ------------------------------------------------------------------ the verdict itself


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16], ids=str
)
def test_the_verdict_sees_every_nan_and_inf_and_never_overflows(dtype):
    from sapipe.runtime.nonfinite import is_bad, judge

    def verdict(values):
        out = torch.full((), 7.0, dtype=dtype)
        kept = judge(values, out)
        assert out.item() in (0.0, 1.0) and is_bad(kept) == (out.item() == 1.0)
        return out.item()

    big = torch.finfo(dtype).max
    finite = [
        torch.tensor([big, big, -big, 0.0], dtype=dtype),
        torch.full((1000,), big, dtype=dtype),
        torch.zeros(0, dtype=dtype),
        torch.tensor([-big, -big / 4], dtype=dtype),
    ]
    assert verdict(finite) == 0.0, "finite values (whose sum overflows) judged non-finite"
    assert verdict([torch.zeros(0, dtype=dtype)]) == 0.0 and verdict([]) == 0.0
    for bad in (float("nan"), float("inf"), -float("inf")):
        for at in (0, 500, 999):
            values = torch.zeros(1000, dtype=dtype)
            values[at] = bad
            assert verdict([values]) == 1.0, (bad, at)
            assert verdict(finite + [values]) == 1.0 and verdict([values] + finite) == 1.0, (
                bad,
                at,
            )


# ------------------------------------------------------------------ CUDA (skipped without a GPU)

CUDA_CASES = [
    "sync",
    "sync read on rank 0",
    "sync int8 pushpull",
    "stale none",
    "stale dc unexposed",
    "stale wp1 fp16",
]


@on_cuda
def test_cuda_gloo_ranks_report_one_check_later():
    """Two Gloo ranks sharing the GPU: the counts travel to the host asynchronously and are read
    one check later, the same on every rank."""
    out = run_ranks(_cases, world_size=2, args=(CUDA_CASES, "cuda"), timeout=400)
    for name in CUDA_CASES:
        _check_case(name, [out[0][name], out[1][name]], late=True)


@on_cuda
def test_cuda_nccl_rank_reports_without_synchronising():
    """One NCCL rank (its own gradient poisoned): reported one check later, and the steps make no
    more synchronising CUDA calls with the check than without it."""
    names = ["sync", "stale wp1 fp16", "stale none unexposed"]
    out = run_ranks(_cases, world_size=1, args=(names, "cuda"), timeout=300, backend="nccl")
    for name in names:
        _check_case(name, [out[0][name]], late=True)
