"""``compensation="auto"`` (design §3.14) on real Gloo ranks against the float64 reference.

Two ranks train ``TiedResidualNet`` in float64, k = 3 (the stale layers in one bucket), with
the LR changing every step, for long enough that the probe decides and the choice then runs.
The reference (``support.reference.run_reference(compensation="auto")``) computes every
candidate's prediction with ``torch.optim`` and scores it by its own arithmetic. The scores
relative to ``none``'s, the candidate chosen, and the real and held weights at the end must
agree (rtol 1e-9). A checkpoint taken after the decision carries it into a new optimizer.
"""

from __future__ import annotations

import functools
import os

import pytest
import torch
from support.dist_utils import assert_close_dicts, run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.modes import BASE_LR, DC_LAMBDA, OPTIMIZERS, lr_factor, train_and_read
from support.reference import AUTO_CANDIDATES, run_reference

from sapipe.errors import ConfigurationError
from sapipe.optim.compensation import ChooseOnline

STEPS, K, PROBE = 10, 3, 4
#: (optimizer, candidates)
CASES = [("sgd", AUTO_CANDIDATES), ("adam", AUTO_CANDIDATES), ("sgd", ("none", "wp2"))]


def _job(rank: int, kind: str, policy: ChooseOnline):
    import sapipe

    model = make_model("tied", seed=rank, dtype=torch.float64)
    opt = sapipe.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()),
        model,
        stale_layers=K,
        compensation=policy,
        dc_lambda=DC_LAMBDA,
        timeout=60,
    )
    return model, opt


def _train(rank: int, world_size: int, cases, checkpoint_dir: str):
    import sapipe

    results = []
    batches = make_batches("tied", STEPS, world_size, dtype=torch.float64)
    for index, (kind, candidates) in enumerate(cases):
        policy = ChooseOnline(candidates=candidates, probe_steps=PROBE)
        model, opt = _job(rank, kind, policy)
        before = opt.compensation_choice
        real, held = train_and_read(model, opt, batches, rank)
        result = {"real": real, "held": held, "before": before, "after": opt.compensation_choice}
        if index == 0:  # the decision survives a checkpoint
            path = os.path.join(checkpoint_dir, f"rank{rank}.pt")
            sapipe.save_checkpoint(path, model, opt)
            opt.close()
            model, opt = _job(rank, kind, policy)
            sapipe.load_checkpoint(path, model, opt)
            result["resumed"] = opt.compensation_choice
        results.append(result)
        opt.close()
    return results


@functools.cache
def _distributed(checkpoint_dir: str):
    return run_ranks(_train, world_size=2, args=(CASES, checkpoint_dir), timeout=300)


@functools.cache
def _reference(kind: str, candidates: tuple[str, ...]):
    return run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        OPTIMIZERS[kind],
        make_batches("tied", STEPS, 2, dtype=torch.float64),
        loss_fn_for("tied"),
        stale_layers=K,
        compensation="auto",
        dc_lambda=DC_LAMBDA,
        lr_at=lambda it: BASE_LR[kind] * lr_factor(it - 1),
        probe_steps=PROBE,
        candidates=candidates,
    )


@pytest.fixture(scope="module")
def per_rank(tmp_path_factory):
    return _distributed(str(tmp_path_factory.mktemp("auto")))


@pytest.mark.parametrize("case", range(len(CASES)), ids=[f"{k}-{'-'.join(c)}" for k, c in CASES])
def test_the_choice_and_the_weights_match_the_reference(per_rank, case):
    kind, candidates = CASES[case]
    ref = _reference(kind, candidates)
    assert ref.auto_choice is not None
    assert len(set(ref.auto_scores.values())) == len(candidates), "scores should tell apart"
    for rank in range(2):
        got = per_rank[rank][case]
        assert not got["before"]["decided"] and got["before"]["buckets"] == {}
        after = got["after"]
        assert after["decided"] and after["probe_steps"] == PROBE
        (bucket,) = after["buckets"].values()  # k = 3: one stale bucket
        assert bucket["choice"] == ref.auto_choice
        baseline = ref.auto_scores["none"] if "none" in candidates else None
        for name in candidates:
            expected = ref.auto_scores[name] / baseline if baseline else float("nan")
            assert bucket["error_vs_none"][name] == pytest.approx(expected, rel=1e-9, nan_ok=True)
        assert_close_dicts(
            got["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} real x"
        )
        assert_close_dicts(
            got["held"], ref.held[-1][rank], rtol=1e-9, atol=1e-11, what=f"rank {rank} held"
        )


def test_a_checkpoint_carries_the_decision(per_rank):
    for rank in range(2):
        first = per_rank[rank][0]
        resumed = first["resumed"]
        assert resumed["decided"]
        assert {b: v["choice"] for b, v in resumed["buckets"].items()} == {
            b: v["choice"] for b, v in first["after"]["buckets"].items()
        }


@pytest.mark.parametrize(
    "arguments, message",
    [
        ({"candidates": ("none", "dc")}, "candidates"),
        ({"candidates": ()}, "candidates"),
        ({"candidates": ("wp1", "wp1")}, "candidates"),
        ({"probe_steps": 1}, "probe_steps"),
        ({"probe_steps": 2.5}, "probe_steps"),
    ],
)
def test_bad_settings_are_named(arguments, message):
    with pytest.raises(ConfigurationError, match=message):
        ChooseOnline(**arguments)


def test_the_policy_compares_as_a_name():
    assert ChooseOnline().describe() == "auto"
    assert ChooseOnline(candidates=("none", "wp3")).describe() != "auto"
    assert ChooseOnline().during_probe == "wp3"
    assert ChooseOnline(candidates=("wp2", "none")).during_probe == "none"
