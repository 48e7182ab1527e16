"""Every staleness mode on real Gloo ranks against the independent float64 reference.

Two ranks train ``TiedResidualNet`` (residual blocks, a tied embedding/head, registration
order != execution order) in float64 with sapipe; ``tests/support/reference.py`` simulates both
ranks of docs/design.md §3 with real ``torch.optim`` optimizers. After every configuration the
real weights x and each rank's held weights (x̃ under weight prediction) must agree to
~1e-10, so any deviation from the rules (wrong Δ, wrong slot, wrong LR of a deferred
update, state advancing at t=1, ...) fails.

The LR changes every step (LambdaLR on the sapipe optimizer), parameters are split into
two param groups interleaved across layers (weight decay on matrices only), and buckets
are tiny so each model spans several buckets. The configurations, the training on each
rank and the comparison are ``support.modes``: other back-ends and CUDA run them too.
"""

from __future__ import annotations

import functools
import os

import pytest
from support.dist_utils import run_ranks
from support.modes import CONFIGS, check_against_reference, config_id, train


@functools.cache
def _distributed(kind: str):
    return run_ranks(train, world_size=2, args=(kind, CONFIGS), timeout=300)


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw", "rmsprop", "lion"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_mode_matches_reference(kind, config):
    per_rank = _distributed(kind)
    # gradients taken by the C++ hooks where the kernels are built (sapipe.runtime.intake)
    built = per_rank[0][0]["compiled_kernels"]
    assert per_rank[0][0]["intake"] == ("GradientIntake" if built else "PythonIntake")
    check_against_reference(kind, config, [per_rank[r][CONFIGS.index(config)] for r in range(2)])


@functools.cache
def _without_kernels(kind: str):
    """The ranks with ``SAPIPE_DISABLE_EXT=1``: the pure-PyTorch kernels (``ops.reference_*``),
    which also run wherever the compiled ones take no tensor (16-bit weights on the CPU)."""
    os.environ["SAPIPE_DISABLE_EXT"] = "1"  # read when the ranks import sapipe (dist_utils)
    try:
        return run_ranks(train, world_size=2, args=(kind, CONFIGS), timeout=300)
    finally:
        del os.environ["SAPIPE_DISABLE_EXT"]


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_the_pytorch_kernels_match_the_reference_too(kind, config):
    per_rank = _without_kernels(kind)
    assert not any(per_rank[r][0]["compiled_kernels"] for r in range(2)), (
        "the ranks did not see SAPIPE_DISABLE_EXT"
    )
    assert per_rank[0][0]["intake"] == "PythonIntake"
    check_against_reference(kind, config, [per_rank[r][CONFIGS.index(config)] for r in range(2)])
