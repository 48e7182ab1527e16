"""Checkpoint mid-training, resume in fresh processes: bit-identical to never stopping."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.dist_utils import run_ranks, same_state
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import recipe
from support.training import named_weights, train_steps

import sapipe

STEPS, SPLIT = 10, 6
OPTIMIZERS = {
    "sgd": recipe("sgd-nesterov", lr=0.05, weight_decay=1e-3),
    "adam": recipe("adam", lr=0.01),
    "rmsprop": recipe("rmsprop"),  # GENERIC's
}
# (optimizer, stale_layers, compensation, staleness, warmup)
CASES = [
    ("sgd", 3, "none", 1, 0),
    ("sgd", 7, "dc", 2, 1),
    ("adam", 3, "wp1", 1, 2),
    ("adam", 4, "wp3", 1, 0),
    ("sgd", 0, "none", 1, 0),
    ("rmsprop", 7, "dc", 2, 1),  # the generic path: the optimizer's own state[p] in the checkpoint
    ("rmsprop", 4, "wp3", 1, 0),
    ("adam", 3, "dc", 1, 0, "int8"),  # the error-feedback residuals in the checkpoint
    ("sgd", 7, "none", 2, 1, "int8"),
    ("adam", 0, "none", 1, 0, "bf16"),
    # stale buckets whose gradients backward casts into the messages
    ("sgd", 4, "wp2", 1, 0, "fp16"),
    ("adam", 4, "t2", 2, 1),  # T2's velocity in the checkpoint
]
INT8_CASE = 7


def _case_id(case) -> str:
    return "{}-k{}-{}-s{}-w{}".format(*case) + (f"-{case[5]}" if len(case) > 5 else "")


def _setup(kind, k, mode, s, warmup, compression=None, *, seed, error_feedback=None):
    model = make_model("tied", seed=seed)
    opt = sapipe.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()),
        model,
        stale_layers=k,
        compensation=mode,
        staleness=s,
        warmup_steps=warmup,
        bucket_cap_mb=0.001,
        timeout=60,
        compression=compression,
        error_feedback=error_feedback,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.9**e)
    return model, opt, sched


def _train(model, opt, sched, rank, world_size, steps):
    batches = make_batches("tied", STEPS, world_size)
    train_steps(model, opt, batches, rank, steps, loss_fn=loss_fn_for("tied"), scheduler=sched)


def _weights(model, opt):
    held = named_weights(model)
    opt.synchronize()
    synced = named_weights(model)
    with opt.real_weights():
        real = named_weights(model)
    return {"held": held, "synced": synced, "real": real}


def _uninterrupted(rank, world_size, cases):
    results = []
    for case in cases:
        model, opt, sched = _setup(*case, seed=0)
        _train(model, opt, sched, rank, world_size, range(STEPS))
        results.append(_weights(model, opt))
    return results


def _first_half(rank, world_size, cases, paths):
    files = []
    for case, path in zip(cases, paths):
        model, opt, sched = _setup(*case, seed=0)
        _train(model, opt, sched, rank, world_size, range(SPLIT))
        files.append(sapipe.save_checkpoint(path, model, opt, scheduler=sched.state_dict()))
    return files


def _second_half(rank, world_size, cases, paths):
    results = []
    for case, path in zip(cases, paths):
        model, opt, sched = _setup(*case, seed=rank + 7)  # fresh, different weights before loading
        extra = sapipe.load_checkpoint(path, model, opt)
        sched.load_state_dict(extra["scheduler"])
        _train(model, opt, sched, rank, world_size, range(SPLIT, STEPS))
        results.append(_weights(model, opt))
    return results


@pytest.fixture(scope="module")
def resumed_runs(tmp_path_factory):
    """Each phase is one 2-rank job looping over every case (process start-up is the cost)."""
    tmp = tmp_path_factory.mktemp("checkpoints")
    paths = [str(tmp / f"case{i}-{{rank}}.pt") for i in range(len(CASES))]
    expected = run_ranks(_uninterrupted, world_size=2, args=(CASES,))
    files = run_ranks(_first_half, world_size=2, args=(CASES, paths))
    resumed = run_ranks(_second_half, world_size=2, args=(CASES, paths))
    return expected, files, resumed, tmp


@pytest.mark.parametrize("index", range(len(CASES)), ids=[_case_id(c) for c in CASES])
def test_resume_is_bit_identical(resumed_runs, index):
    expected, files, resumed, tmp = resumed_runs
    assert files[0][index] == str(tmp / f"case{index}-0.pt")
    for rank in range(2):
        for view in ("held", "synced", "real"):
            for name, value in expected[rank][index][view].items():
                got = resumed[rank][index][view][name]
                assert np.array_equal(got, value), f"rank {rank} {view} {name} differs"


def _other_world(rank, world_size, path):
    model, opt, sched = _setup("sgd", 3, "none", 1, 0, seed=0)
    try:
        sapipe.load_checkpoint(path, model, opt)
    except sapipe.ConfigurationError as exc:
        return str(exc)
    return "loaded"


def _other_config(rank, world_size, path):
    model, opt, sched = _setup("sgd", 4, "dc", 1, 0, seed=0)
    try:
        sapipe.load_checkpoint(path, model, opt)
    except sapipe.ConfigurationError as exc:
        return str(exc)
    return "loaded"


def _older_int8(rank, world_size, path):
    model, opt, sched = _setup(*CASES[INT8_CASE], seed=0)
    try:
        sapipe.load_checkpoint(path, model, opt)
    except sapipe.ConfigurationError as exc:
        return str(exc)
    return "loaded"


def test_checkpoint_of_another_int8_block_is_refused(resumed_runs, tmp_path):
    """A checkpoint written by a sapipe whose int8 blocks differ (its server residuals cover
    other shards) is refused by name, not resumed with misplaced residuals."""
    written = resumed_runs[3]
    for rank in range(2):
        state = torch.load(written / f"case{INT8_CASE}-{rank}.pt", weights_only=False)
        state["optimizer"]["settings"]["int8_block"] = "256"
        torch.save(state, tmp_path / f"older-{rank}.pt")
    messages = run_ranks(_older_int8, world_size=2, args=(str(tmp_path / "older-{rank}.pt"),))
    assert all(
        "this job has int8_block=64 but the checkpoint has int8_block=256" in m for m in messages
    ), messages


BF16_CASE = 9
SPELLED_OUT = [
    (INT8_CASE, True),
    (BF16_CASE, False),
]  # each format's default error feedback, written out


def _second_half_spelled_out(rank, world_size, paths):
    results = []
    for (index, feedback), path in zip(SPELLED_OUT * 2, paths):
        model, opt, sched = _setup(*CASES[index], seed=rank + 7, error_feedback=feedback)
        sched.load_state_dict(sapipe.load_checkpoint(path, model, opt)["scheduler"])
        _train(model, opt, sched, rank, world_size, range(SPLIT, STEPS))
        results.append(_weights(model, opt))
    return results


def test_the_default_error_feedback_written_out_resumes_the_same(resumed_runs, tmp_path):
    """error_feedback=None means on for int8 and off for 16 bits: a job that writes that value
    out continues a checkpoint of the default bit-identically, as does one written before
    checkpoints recorded the value (their settings say None)."""
    expected, _, _, written = resumed_runs
    paths = []
    for index, _ in SPELLED_OUT:
        paths.append(str(written / f"case{index}-{{rank}}.pt"))
    for index, _ in SPELLED_OUT:  # as written before: the setting as given
        for rank in range(2):
            state = torch.load(written / f"case{index}-{rank}.pt", weights_only=False)
            state["optimizer"]["settings"]["error_feedback"] = "None"
            torch.save(state, tmp_path / f"older{index}-{rank}.pt")
        paths.append(str(tmp_path / f"older{index}-{{rank}}.pt"))
    resumed = run_ranks(_second_half_spelled_out, world_size=2, args=(paths,))
    for rank in range(2):
        for run, (index, _) in enumerate(SPELLED_OUT * 2):
            for name, value in expected[rank][index]["real"].items():
                assert np.array_equal(resumed[rank][run]["real"][name], value), (
                    rank,
                    CASES[index],
                    run,
                    name,
                )


def _other_groups(rank, world_size, path):
    """CASES[0]'s checkpoint (one param group) into the same job whose SGD has two groups."""
    model = make_model("tied", seed=0)
    params = list(model.parameters())
    base = torch.optim.SGD(
        [{"params": params[:2]}, {"params": params[2:], "lr": 0.01}],
        lr=0.05,
        momentum=0.9,
        nesterov=True,
        weight_decay=1e-3,
    )
    opt = sapipe.DistributedOptimizer(base, model, stale_layers=3, bucket_cap_mb=0.001, timeout=60)
    _train(
        model,
        opt,
        torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 1.0),
        rank,
        world_size,
        range(1),
    )
    before = opt.state_dict()
    try:
        opt.load_state_dict(torch.load(path.format(rank=rank), weights_only=False)["optimizer"])
        message = "loaded"
    except sapipe.ConfigurationError as exc:
        message = str(exc)
    return message, same_state(opt.state_dict(), before)


def test_a_checkpoint_of_other_param_groups_is_refused_before_anything_changes(resumed_runs):
    path = str(resumed_runs[3] / "case0-{rank}.pt")
    for message, unchanged in run_ranks(_other_groups, world_size=2, args=(path,)):
        assert "splits into other param groups" in message, message
        assert unchanged


def test_mismatched_checkpoint_is_refused(resumed_runs):
    tmp = resumed_runs[3]
    path = str(tmp / "case0-{rank}.pt")  # written with CASES[0] = sgd, k=3, none
    messages = run_ranks(_other_config, world_size=2, args=(path,))
    assert all("stale_layers" in m and "compensation" in m for m in messages), messages
    # A 1-rank job resumes rank 0's file of the 2-rank job: an elastic restart
    # (tests/distributed/test_elastic.py holds what it does).
    message = run_ranks(_other_world, world_size=1, args=(str(tmp / "case0-0.pt"),))[0]
    assert message == "loaded", message


def _checkpointer(rank, world_size, directory):
    """Save steps 1..4 (keep 2); rank 1 then loses step 4. Resume must pick step 3 on both."""
    model, opt, sched = _setup("sgd", 3, "dc", 1, 0, seed=0)
    ckpt = sapipe.Checkpointer(directory + "/s{step}-{rank}.pt", model, opt, keep=2)
    batches = make_batches("tied", STEPS, world_size)
    saved = {}
    for t in range(1, 5):
        x, y = batches[t - 1][rank]
        opt.zero_grad()
        loss_fn_for("tied")(model(x), y).backward()
        opt.step()
        ckpt.save(t, marker=t * 10 + rank)
        saved[t] = named_weights(model)
    kept = ckpt.steps()
    if rank == 1:
        import os

        os.remove(ckpt.file(4))  # died between step 4's step() and its save
    model2, opt2, _ = _setup("sgd", 3, "dc", 1, 0, seed=1)
    start, extra = sapipe.Checkpointer(directory + "/s{step}-{rank}.pt", model2, opt2).resume()
    restored = named_weights(model2)
    same = all(torch.equal(restored[n], saved[start][n]) for n in restored)
    return {"kept": kept, "start": start, "extra": extra, "same": same}


def test_checkpointer_keeps_two_and_resumes_from_the_newest_common_step(tmp_path):
    out = run_ranks(_checkpointer, world_size=2, args=(str(tmp_path),))
    for rank in range(2):
        assert list(out[rank]["kept"]) == [3, 4], out[rank]
        assert out[rank]["start"] == 3, out[rank]
        assert out[rank]["extra"] == {"marker": 30 + rank}, out[rank]
        assert out[rank]["same"], f"rank {rank} did not restore step 3's weights"


# (stale_layers, compensation, expose_gradients): GradScaler's per-iteration verdicts and scales
# travel in the checkpoint (rank-local p.grad unscales each stale gradient with its own iteration's)
AMP_CASES = [(3, "none", True), (3, "wp1", True), (3, "none", False), (3, "wp1", False)]
AMP_POISONED = SPLIT  # rank 1's loss is inf in the last iteration before the checkpoint


def _amp_setup(seed, k, mode, expose):
    model = make_model("tied", seed=seed, dtype=torch.float64)
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model,
        stale_layers=k,
        compensation=mode,
        expose_gradients=expose,
        timeout=60,
    )
    return model, opt, torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def _amp_train(model, opt, scaler, rank, world_size, steps):
    batches = make_batches("tied", STEPS, world_size, dtype=torch.float64)
    for t in steps:
        x, y = batches[t][rank]
        opt.zero_grad()
        loss = loss_fn_for("tied")(model(x), y)
        poisoned = rank == 1 and t + 1 == AMP_POISONED
        scaler.scale(loss * float("inf") if poisoned else loss).backward()
        scaler.step(opt)
        scaler.update()


def _amp_resumed(rank, world_size, directory):
    out = []
    for index, case in enumerate(AMP_CASES):
        model, opt, scaler = _amp_setup(0, *case)
        _amp_train(model, opt, scaler, rank, world_size, range(STEPS))
        expected = _weights(model, opt)
        opt.close()
        path = f"{directory}/amp{index}-{{rank}}.pt"
        model, opt, scaler = _amp_setup(0, *case)
        _amp_train(model, opt, scaler, rank, world_size, range(SPLIT))
        sapipe.save_checkpoint(path, model, opt, scaler=scaler.state_dict())
        opt.close()
        model, opt, scaler = _amp_setup(rank + 7, *case)
        scaler.load_state_dict(sapipe.load_checkpoint(path, model, opt)["scaler"])
        _amp_train(model, opt, scaler, rank, world_size, range(SPLIT, STEPS))
        out.append((expected, _weights(model, opt)))
        opt.close()
    return out


def test_a_checkpoint_under_a_grad_scaler_resumes_bit_identically(tmp_path):
    """The scale changes every 2 steps and the step before the checkpoint overflowed on rank 1."""
    for rank, runs in enumerate(run_ranks(_amp_resumed, world_size=2, args=(str(tmp_path),))):
        for case, (expected, resumed) in zip(AMP_CASES, runs):
            for view, weights in expected.items():
                for name, value in weights.items():
                    assert np.isfinite(value).all() and np.array_equal(
                        resumed[view][name], value
                    ), (rank, case, view, name)
