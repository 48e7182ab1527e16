"""``sapipe.ElasticAveraging`` (sapipe/elastic/averaging.py) on real Gloo ranks.

* every rank's model and the centre equal the independent float64 reference
  (support/elastic_reference.py) for SGD and AdamW, τ = 1 and 3, overlapped and
  synchronous, on 2 and 3 ranks: to 1e-9 with float64 models, 1e-5 with float32 ones;
  bf16 and fp16 compression against the reference with the casts applied; BatchNorm's
  buffers averaged or left local; GradScaler skipping one rank's overflowed step;
* the overlapped and synchronous forms give bit-identical trajectories, and the centre is
  bit-identical on every rank;
* with α = 1/n the centre after each sync is the plain all-reduce mean of the ranks'
  models, and every sync conserves Σ x_i + x̄;
* a checkpoint taken with a sum in flight resumes bit-exactly (through
  ``sapipe.save_checkpoint`` / ``load_checkpoint``), and on 3 ranks from the same centre;
* a job that never calls ``close()`` (with or without ``dist.destroy_process_group()``)
  exits 0;
* bad input is refused on every rank, naming it, within seconds.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch
from support import elastic_reference as ref
from support.dist_utils import free_port, run_ranks, same_state

from sapipe.elastic import ElasticAveraging

STEPS = 9
ALPHA = {2: 0.3, 3: 0.25}  # β = 0.6, 0.75


def _config(
    optimizer="adamw",
    period=3,
    overlap=True,
    compression=None,
    dtype="float64",
    average_buffers=True,
    scaler=False,
):
    return (optimizer, period, overlap, compression, dtype, average_buffers, scaler)


def _name(config, n) -> str:
    optimizer, period, overlap, compression, dtype, average_buffers, scaler = config
    parts = [optimizer, f"tau{period}", "overlap" if overlap else "sync", f"n{n}", dtype]
    parts += [compression] if compression else []
    parts += [] if average_buffers else ["local-buffers"]
    parts += ["gradscaler"] if scaler else []
    return "-".join(parts)


CONFIGS = (
    [
        _config(opt, period, overlap)
        for opt in ("sgd", "adamw")
        for period in (1, 3)
        for overlap in (True, False)
    ]
    + [
        _config(opt, 3, overlap, dtype="float32")
        for opt in ("sgd", "adamw")
        for overlap in (True, False)
    ]
    + [_config("adamw", 3, True, compression=c) for c in ("bf16", "fp16")]
    + [_config("sgd", 3, True, compression="bf16", dtype="float32")]
    + [_config("sgd", 3, True, average_buffers=False)]
    + [_config("sgd", 2, True, scaler=True)]
)
CASES = {_name(c, n): (c, n) for n in (2, 3) for c in CONFIGS}
SKIPPED = frozenset({(1, 2)})  # (rank, step) whose loss overflows under the GradScaler


def _train_all(rank, world_size, configs):
    """Every configuration in turn on these ranks: train STEPS steps, return each rank's model
    state and centre (and the centre seen inside centre_weights())."""

    out = {}
    for config in configs:
        optimizer, period, overlap, compression, dtype, average_buffers, scaler = config
        dt = getattr(torch, dtype)
        model = ref.make_net(seed=7 * rank, dtype=dt)  # rank 0's (seed 0) is broadcast
        opt = ElasticAveraging(
            ref.optimizer_factory(optimizer)(list(model.parameters())),
            model,
            period=period,
            alpha=ALPHA[world_size],
            overlap=overlap,
            compression=compression,
            average_buffers=average_buffers,
        )
        grad_scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10) if scaler else None
        for k, batches in enumerate(ref.make_data(STEPS, world_size, dtype=dt), start=1):
            x, y = batches[rank]
            opt.zero_grad()
            loss = ref.loss_fn(model(x), y)
            if grad_scaler is None:
                loss.backward()
                opt.step()
            else:
                if (rank, k) in SKIPPED:
                    loss = loss * float("inf")
                grad_scaler.scale(loss).backward()
                grad_scaler.step(opt)
                grad_scaler.update()
        with opt.centre_weights():
            held = {n: t.detach().clone() for n, t in model.state_dict().items()}
        out[_name(config, world_size)] = {
            "state": {n: t.detach().clone() for n, t in model.state_dict().items()},
            "centre": opt.centre_state_dict(),
            "held": held,
            "syncs": opt.syncs,
            "scale": grad_scaler.get_scale() if scaler else None,
        }
        opt.close()
    out["mean of the ranks"] = _mean_of_the_ranks(rank, world_size)
    return out


@pytest.fixture(scope="module")
def trained():
    """``trained[name][rank]``: a configuration's results, or ``_mean_of_the_ranks``'s under
    ``"mean of the ranks n<n>"``."""
    results = {}
    for n in (2, 3):
        for rank, per_rank in enumerate(run_ranks(_train_all, world_size=n, args=(CONFIGS,))):
            per_rank[f"mean of the ranks n{n}"] = per_rank.pop("mean of the ranks")
            for name, value in per_rank.items():
                results.setdefault(name, [None] * n)[rank] = value
    return results


def _configurations(trained):
    return {name: ranks for name, ranks in trained.items() if name in CASES}


@pytest.fixture(scope="module")
def references():
    cache = {}

    def get(name):
        if name not in cache:
            config, n = CASES[name]
            optimizer, period, _, compression, _, average_buffers, scaler = config
            cache[name] = ref.simulate(
                ref.make_data(STEPS, n, dtype=torch.float64),
                optimizer=optimizer,
                period=period,
                alpha=ALPHA[n],
                compression=compression,
                average_buffers=average_buffers,
                skip=SKIPPED if scaler else frozenset(),
            )
        return cache[name]

    return get


def _tolerance(name):
    if "float32" in name:
        # a bf16 cast of a float32 difference can round the other way than the float64
        # one's; the centre then moves by α·(one bf16 ulp of d), ~1e-6 of a weight here
        return (1e-4, 1e-5) if "bf16" in name else (1e-5, 1e-6)
    return (1e-9, 1e-12)


def _assert_close(actual, expected, rtol, atol, what):
    for key, value in expected.items():
        a, e = np.asarray(actual[key], dtype=np.float64), np.asarray(value, dtype=np.float64)
        err = np.max(np.abs(a - e) / (atol + rtol * np.abs(e)), initial=0.0)
        assert err <= 1, f"{what}: {key} differs by {np.max(np.abs(a - e)):.3e} (rtol={rtol})"


@pytest.mark.parametrize("name", sorted(CASES))
def test_matches_the_float64_reference(trained, references, name):
    expected = references(name)
    rtol, atol = _tolerance(name)
    for rank, result in enumerate(trained[name]):
        _assert_close(result["state"], expected["ranks"][rank], rtol, atol, f"rank {rank}")
        _assert_close(result["centre"], expected["centre"], rtol, atol, f"rank {rank} centre")
        period = CASES[name][0][1]
        assert result["syncs"] == STEPS // period


def test_compression_is_applied(trained, references):
    """The compressed runs follow the reference with the casts, and are further from the one
    without than their tolerance: the test above would see a cast left out."""
    for name in [n for n in CASES if "bf16" in n or "fp16" in n]:
        plain = name.replace("-bf16", "").replace("-fp16", "")
        assert plain in CASES, f"{name} has no uncompressed twin"
        got, uncompressed = trained[name][0]["centre"], references(plain)["centre"]
        rtol, atol = _tolerance(name)
        excess = max(
            np.max(np.abs(got[k] - uncompressed[k]) / (atol + rtol * np.abs(uncompressed[k])))
            for k in got
        )
        assert excess > 3, f"{name}: within {excess:.1f} tolerances of the uncompressed centre"


def test_overlap_changes_only_time(trained):
    """Waiting for each sum at the next sync point or at once: the same bits."""
    pairs = [(n, n.replace("-overlap-", "-sync-")) for n in CASES if "-overlap-" in n]
    pairs = [(a, b) for a, b in pairs if b in CASES]
    assert len(pairs) >= 8
    for overlapped, synchronous in pairs:
        for a, b in zip(trained[overlapped], trained[synchronous]):
            for what in ("state", "centre"):
                for key in a[what]:
                    assert np.array_equal(a[what][key], b[what][key]), (overlapped, what, key)


def test_the_centre_is_the_same_on_every_rank(trained):
    for name, ranks in _configurations(trained).items():
        for rank, result in enumerate(ranks[1:], start=1):
            for key, value in ranks[0]["centre"].items():
                assert np.array_equal(result["centre"][key], value), (name, rank, key)


def test_centre_weights_holds_the_centre_and_puts_the_rank_back(trained):
    for name, ranks in _configurations(trained).items():
        for result in ranks:
            for key, value in result["centre"].items():
                assert np.array_equal(result["held"][key], value), (name, key)
            # the rank's own integer buffer stays in place inside the block
            assert result["held"]["norm.num_batches_tracked"] == STEPS


def test_gradscaler_skips_only_the_overflowed_rank_and_keeps_the_ranks_in_step(trained):
    ranks = trained[_name(_config("sgd", 2, True, scaler=True), 2)]
    assert ranks[1]["scale"] < ranks[0]["scale"]  # rank 1 backed off, rank 0 did not
    assert [r["syncs"] for r in ranks] == [STEPS // 2] * 2


# ------------------------------------------------------------------ α = 1/n: the plain mean


def _mean_of_the_ranks(rank, world_size):
    """τ = 1, α = 1/n (β = 1), synchronous: after each sync the centre must be the plain
    all-reduce mean of the models the ranks held just before it."""
    import torch.distributed as dist

    model = ref.make_net(dtype=torch.float32)
    inner = ref.optimizer_factory("sgd")(list(model.parameters()))
    opt = ElasticAveraging(inner, model, period=1, alpha=1 / world_size, overlap=False)
    before = {}

    def snapshot(*_):  # after the local step, before the sync point
        before["x"] = torch.cat([t.detach().reshape(-1) for _, t in ref.averaged(model)])
        before["centre"] = torch.cat([c.reshape(-1) for c in opt.centre_state_dict().values()])

    inner.register_step_post_hook(snapshot)
    worst_mean = worst_mass = 0.0
    for batches in ref.make_data(6, world_size):
        x, y = batches[rank]
        opt.zero_grad()
        ref.loss_fn(model(x), y).backward()
        opt.step()
        mean = before["x"].clone()
        dist.all_reduce(mean)
        mean /= world_size
        centre = torch.cat([c.reshape(-1) for c in opt.centre_state_dict().values()])
        worst_mean = max(worst_mean, ((centre - mean).abs() / mean.abs().clamp_min(1e-3)).max())
        after = torch.cat([t.detach().reshape(-1) for _, t in ref.averaged(model)])
        mass = torch.stack([before["x"], after])
        dist.all_reduce(mass)  # Σ_i x_i before and after
        conserved = (mass[0] + before["centre"]) - (mass[1] + centre)
        worst_mass = max(worst_mass, conserved.abs().max().item())
    opt.close()
    return float(worst_mean), worst_mass


@pytest.mark.parametrize("world_size", [2, 3])
def test_alpha_one_over_n_makes_the_centre_the_all_reduce_mean(trained, world_size):
    for worst_mean, worst_mass in trained[f"mean of the ranks n{world_size}"]:
        assert worst_mean < 1e-5, worst_mean
        assert worst_mass < 1e-5, worst_mass


# ------------------------------------------------------------------ checkpoints


def _resume(rank, world_size, path):
    """10 steps at once, or 7, a checkpoint (a sum in flight: τ = 3), a fresh job, 3 more;
    uncompressed and bf16."""
    return {c: _resume_one(rank, path.replace(".pt", f"-{c}.pt"), c) for c in (None, "bf16")}


def _resume_one(rank, path, compression):
    import sapipe

    data = ref.make_data(10, 2)

    def build(seed):
        model = ref.make_net(seed=seed)
        opt = ElasticAveraging(
            torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
            model,
            period=3,
            alpha=0.3,
            compression=compression,
        )
        return model, opt

    def train(model, opt, steps):
        for batches in steps:
            x, y = batches[rank]
            opt.zero_grad()
            ref.loss_fn(model(x), y).backward()
            opt.step()

    def final(model, opt):
        return {
            "model": {n: t.detach().clone() for n, t in model.state_dict().items()},
            "centre": opt.centre_state_dict(),
            "optimizer": opt.optimizer.state_dict(),
        }

    model, opt = build(0)
    train(model, opt, data)
    straight = final(model, opt)
    opt.close()

    model, opt = build(0)
    train(model, opt, data[:7])
    sapipe.save_checkpoint(path, model, opt)
    opt.close()
    model, opt = build(5)  # other initial weights: the checkpoint must replace them
    sapipe.load_checkpoint(path, model, opt)
    assert opt.steps == 7 and opt.syncs == 2
    train(model, opt, data[7:])
    resumed = final(model, opt)
    opt.close()
    return same_state(straight, resumed), opt.syncs


def _resume_on_three(rank, world_size, path):
    """The 2-rank job's checkpoint of step 7 (uncompressed) resumed on 3 ranks, α = 0.25:
    rank 2 takes rank 0's file."""
    import warnings

    import sapipe

    model = ref.make_net(seed=5)
    opt = ElasticAveraging(
        torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1),
        model,
        period=3,
        alpha=0.25,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sapipe.load_checkpoint(path.replace(".pt", "-None.pt"), model, opt, rank=rank % 2)
    loaded = opt.centre_state_dict()
    for batches in ref.make_data(3, world_size):
        x, y = batches[rank]
        opt.zero_grad()
        ref.loss_fn(model(x), y).backward()
        opt.step()
    result = (loaded, opt.centre_state_dict(), opt.syncs, [str(w.message) for w in caught])
    opt.close()
    return result


def test_a_resumed_run_equals_an_uninterrupted_one_bit_for_bit(rank_checkpoint):
    for results in run_ranks(_resume, world_size=2, args=(rank_checkpoint,)):
        for compression, (same, syncs) in results.items():
            assert syncs == 3, compression
            assert same, f"compression={compression}: the resumed run differs"
    # the same checkpoint, resumed by a job of 3 ranks
    results = run_ranks(_resume_on_three, world_size=3, args=(rank_checkpoint,))
    for loaded, centre, syncs, warned in results:
        assert syncs == 3
        assert any("of 2 ranks on 3" in w for w in warned), warned
        for key, value in results[0][0].items():
            assert np.array_equal(loaded[key], value)  # every rank starts from the one centre
            assert np.array_equal(centre[key], results[0][1][key])


# ------------------------------------------------------------------ exit


EXIT_JOB = textwrap.dedent(
    """
    import datetime
    import sys
    import torch
    import torch.distributed as dist
    from sapipe.elastic import ElasticAveraging

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    opt = ElasticAveraging(
        torch.optim.SGD(model.parameters(), lr=0.1), model, period=3,
        compression=None if sys.argv[1] == "none" else sys.argv[1],
    )
    for _ in range(7):  # the sum of sync point 2 is still in flight at the end
        opt.zero_grad()
        model(torch.randn(8, 64)).square().mean().backward()
        opt.step()
    if sys.argv[2] == "destroy":
        dist.destroy_process_group()
    print("done", flush=True)  # no opt.close()
    """
)


def test_a_job_exits_cleanly_without_close(tmp_path):
    script = tmp_path / "job.py"
    script.write_text(EXIT_JOB)
    jobs = []
    for compression, end in (("none", "keep"), ("bf16", "destroy")):
        port = str(free_port())
        for rank in range(2):
            env = dict(
                os.environ,
                RANK=str(rank),
                WORLD_SIZE="2",
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
            )
            jobs.append(
                subprocess.Popen(
                    [sys.executable, str(script), compression, end],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    text=True,
                )
            )
    for job in jobs:
        out, err = job.communicate(timeout=120)
        assert job.returncode == 0, err[-3000:]
        assert "done" in out
        for bad in ("Traceback", "terminate called", "abandoned", "Warning"):
            assert bad not in err, err[-3000:]


# ------------------------------------------------------------------ bad input


BAD = {
    "period 0": ("ConfigurationError", "period must be an int >= 1; got 0"),
    "period 2.5": ("ConfigurationError", "period must be an int >= 1; got 2.5"),
    "alpha 0": ("ConfigurationError", "alpha must be a number in (0, 1); got 0"),
    "alpha 1": ("ConfigurationError", "alpha must be a number in (0, 1); got 1"),
    "alpha nan": ("ConfigurationError", "alpha must be a number in (0, 1); got nan"),
    "beta above 1": ("ConfigurationError", "beta = n*alpha = 1.2 > 1"),
    "int8": ("ConfigurationError", "cannot carry compression='int8'"),
    "an unknown compression": ("ConfigurationError", "cannot carry compression='zstd'"),
    "overlap not a bool": ("ConfigurationError", "overlap must be True or False"),
    "negative timeout": ("ConfigurationError", "timeout must be > 0 seconds"),
    "a DDP model": ("ConfigurationError", "not a DistributedDataParallel wrapper"),
    "a DistributedOptimizer inside": (
        "ConfigurationError",
        "ElasticAveraging cannot wrap a sapipe.DistributedOptimizer",
    ),
    "inside a DistributedOptimizer": (
        "UnsupportedOptimizerError",
        "sapipe.ElasticAveraging averages models, not gradients",
    ),
    "ranks disagree on alpha": (
        "ConfigurationError",
        "rank 1 has alpha=0.2 but rank 0 has alpha=0.3",
    ),
    "ranks disagree on period": (
        "ConfigurationError",
        "rank 1 has period=4 but rank 0 has period=3",
    ),
    "ranks disagree on compression": (
        "ConfigurationError",
        "rank 1 has compression='bf16' but rank 0 has compression=None",
    ),
    "one rank's argument is invalid": ("ConfigurationError", "rank 1 has period=0"),
    "a step after close()": ("UsageError", "ElasticAveraging.step() after close()"),
}


def _construct(rank, world_size, cases):
    import sapipe

    results = {}
    for case in cases:
        model = ref.make_net()
        inner = torch.optim.SGD(model.parameters(), lr=0.1)
        kwargs = {"period": 3, "alpha": 0.3}
        optimizer, wrapped = inner, model
        if case.startswith("period "):
            kwargs["period"] = float(case[7:]) if "." in case else int(case[7:])
        elif case.startswith("alpha "):
            kwargs["alpha"] = float(case[6:])
        elif case == "beta above 1":
            kwargs["alpha"] = 0.6
        elif case == "int8":
            kwargs["compression"] = "int8"
        elif case == "an unknown compression":
            kwargs["compression"] = "zstd"
        elif case == "overlap not a bool":
            kwargs["overlap"] = "yes"
        elif case == "negative timeout":
            kwargs["timeout"] = -5
        elif case == "a DDP model":
            wrapped = torch.nn.parallel.DistributedDataParallel(model)
        elif case == "a DistributedOptimizer inside":
            optimizer = sapipe.DistributedOptimizer(inner, model)
        elif case == "ranks disagree on alpha":
            kwargs["alpha"] = 0.3 if rank == 0 else 0.2
        elif case == "ranks disagree on period":
            kwargs["period"] = 3 if rank == 0 else 4
        elif case == "ranks disagree on compression":
            kwargs["compression"] = None if rank == 0 else "bf16"
        elif case == "one rank's argument is invalid":
            kwargs["period"] = 3 if rank == 0 else 0
        start = time.monotonic()
        try:
            if case == "a step after close()":
                elastic = ElasticAveraging(inner, model, **kwargs)
                elastic.close()
                elastic.close()  # idempotent
                elastic.step()
            elif case == "inside a DistributedOptimizer":
                elastic = ElasticAveraging(inner, model, **kwargs)
                try:
                    sapipe.DistributedOptimizer(elastic, model)
                finally:
                    elastic.close()
            else:
                ElasticAveraging(optimizer, wrapped, **kwargs).close()
            results[case] = ("no error", "", time.monotonic() - start)
        except sapipe.SapipeError as exc:
            results[case] = (type(exc).__name__, str(exc), time.monotonic() - start)
        finally:
            if isinstance(optimizer, sapipe.DistributedOptimizer):
                optimizer.close()
    return results


@pytest.fixture(scope="module")
def refusals():
    return run_ranks(_construct, world_size=2, args=(sorted(BAD),))


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_refused_on_every_rank(refusals, case):
    cls, text = BAD[case]
    for rank, results in enumerate(refusals):
        got, message, elapsed = results[case]
        assert got == cls, f"rank {rank}: expected {cls}, got {got}: {message}"
        assert text in message, f"rank {rank}: the message does not name the cause: {message}"
        assert message.startswith("sapipe: "), message
        assert elapsed < 20, f"rank {rank}: took {elapsed:.1f} s"
