"""Elastic restarts: a job resumes a checkpoint written by a job of another world size
(``torchrun --nnodes MIN:MAX``), from the real weights and the optimizer state.

A 3-rank job at k = 2 with wp1 saves at step 6 and goes on to restart its own pipeline there
(what a resized resume promises: the averaged stale gradients in flight applied as plain
updates, the real weights in the model). A 2-rank job resuming that checkpoint must hold
exactly those weights, warn, and train on; a 3-rank job resuming the 2-rank job's checkpoint
(its rank 2 from rank 0's file) likewise.
"""

from __future__ import annotations

import warnings

import torch
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import recipe
from support.training import named_weights

SAVED_AT = 6
MORE = 3


def _job(rank, world_size, path, resume, save_at, optimizer_first=False):
    """Resume ``path`` if ``resume``, train to ``save_at`` and save there; then restart the
    pipeline at that step (the resized resume's promise) and report the weights.
    ``optimizer_first``: resume by hand, the optimizer's state loaded before the model's
    weights (a script's order that must work too)."""
    import sapipe

    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(
        recipe("adamw", lr=0.01, weight_decay=0.1)(model.parameters()),
        model,
        stale_layers=2,
        compensation="wp1",
        bucket_cap_mb=0.0008,
    )
    checkpoints = sapipe.Checkpointer(path, model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if resume and optimizer_first:
            state = torch.load(checkpoints.file(SAVED_AT), weights_only=False)
            opt.load_state_dict(state["optimizer"])
            model.load_state_dict(state["model"])
            start = SAVED_AT
        else:
            start, _ = checkpoints.resume() if resume else (0, {})
    opt.synchronize()  # as before reading the weights after any step()
    resumed = named_weights(model)
    batches = make_batches("tied", save_at, world_size)
    losses = []
    for t in range(start, save_at):
        x, y = batches[t][rank]
        opt.zero_grad()
        loss = loss_fn_for("tied")(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    checkpoints.save(save_at)
    hyperparams = [opt._updater.rule.hyperparams(g) for g in opt.param_groups]
    opt._runtime.restart(opt.stale_layers, save_at, hyperparams)  # the promise, for the next job
    restarted = named_weights(model)
    opt.close()
    return {
        "start": start,
        "warnings": [str(w.message) for w in caught if "sapipe" in str(w.message)],
        "resumed": resumed,
        "restarted": restarted,
        "losses": losses,
    }


def test_a_job_resumes_on_fewer_ranks_and_on_more(tmp_path):
    path = str(tmp_path / "ckpt-{rank}-{step}.pt")
    three = run_ranks(_job, world_size=3, args=(path, False, SAVED_AT))
    two = run_ranks(_job, world_size=2, args=(path, True, SAVED_AT + MORE))
    by_hand = run_ranks(_job, world_size=2, args=(path, True, SAVED_AT, True))  # re-saves step 6
    for rank, result in enumerate(two + by_hand):
        assert result["start"] == SAVED_AT
        assert any("of 3 ranks on 2" in w for w in result["warnings"]), result["warnings"]
        for name, value in three[0]["restarted"].items():
            assert (result["resumed"][name] == value).all(), f"rank {rank}: {name} resumed wrong"
        assert all(torch.isfinite(torch.tensor(result["losses"])))
    again = run_ranks(_job, world_size=3, args=(path, True, SAVED_AT + 2 * MORE))
    for rank, result in enumerate(again):
        assert result["start"] == SAVED_AT + MORE, f"rank {rank} resumed step {result['start']}"
        assert any("of 2 ranks on 3" in w for w in result["warnings"]), result["warnings"]
        for name, value in two[0]["restarted"].items():
            assert (result["resumed"][name] == value).all(), f"rank {rank}: {name} resumed wrong"


def _same_world(rank, world_size, path):
    import sapipe

    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    state = torch.load(sapipe.checkpoint._path(path, opt, rank=0), weights_only=False)
    try:
        opt.load_state_dict(state["optimizer"])
    except sapipe.ConfigurationError as exc:
        return str(exc)
    finally:
        opt.close()
    return None


def test_a_rank_given_another_ranks_checkpoint_of_the_same_world_is_refused(tmp_path):
    path = str(tmp_path / "ckpt-{rank}.pt")

    run_ranks(_save, world_size=2, args=(path,))
    messages = run_ranks(_same_world, world_size=2, args=(path,))
    assert messages[0] is None
    assert "rank 1 was given rank 0's checkpoint" in messages[1]


def _save(rank, world_size, path):
    import sapipe

    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)
    x, y = make_batches("tied", 1, world_size)[0][rank]
    loss_fn_for("tied")(model(x), y).backward()
    opt.step()
    sapipe.save_checkpoint(path, model, opt)
    opt.close()
