"""Compressed sums in every compensation mode, trained on real ranks and held to the float64
reference extended with the same quantizer (``reference.compressed_mean``).

The configurations of ``tests/distributed/test_compression.py``, shared with the tests that
run them on other back-ends (push-pull's partitions) and on CUDA: ``train`` runs on each rank
(through ``dist_utils.run_ranks``), ``check_against_reference`` compares its results.
"""

from __future__ import annotations

import torch

from support import modes
from support.dist_utils import assert_close_dicts
from support.models import loss_fn_for, make_batches, make_model
from support.reference import compressed_mean, run_reference
from support.training import bucket_layouts

STEPS = 6
M = modes.M
CONFIGS = [  # (compression, stale_layers, compensation, staleness, error_feedback)
    ("fp16", 0, "none", 1, None),
    ("fp16", 3, "dc", 1, None),
    ("fp16", 3, "wp1", 1, None),
    ("fp16", M, "none", 1, None),
    ("bf16", 0, "none", 1, None),
    ("bf16", 3, "wp2", 1, None),
    ("bf16", 3, "wp3", 1, None),
    ("bf16", 3, "dc", 1, True),
    ("fp16", M, "none", 2, True),
    ("int8", 0, "none", 1, None),
    ("int8", 3, "none", 1, None),
    ("int8", 3, "dc", 1, None),
    ("int8", 3, "wp1", 1, None),
    ("int8", 3, "wp3", 1, None),
    ("int8", M, "none", 2, None),
    ("int8", 3, "wp1", 1, False),
    ("bf16", M, "none", 2, None),  # three slots of messages cast into on intake
]


def config_id(config) -> str:
    return "{}-k{}-{}-s{}-ef{}".format(*config)


def train_one(rank, world_size, config, options=None, device="cpu"):
    """One configuration trained on this rank (AdamW, the LR changing every step; ``options``:
    extra DistributedOptimizer arguments): real and held weights, the bucket layout and each
    bucket's number of partitions."""
    import sapipe

    compression, k, mode, s, feedback = config
    model = make_model("tied", seed=rank, dtype=torch.float64).to(device)
    opt = sapipe.DistributedOptimizer(
        modes.OPTIMIZERS["adamw"](model.parameters()),
        model,
        stale_layers=k,
        compensation=mode,
        dc_lambda=modes.DC_LAMBDA,
        staleness=s,
        bucket_cap_mb=0.0008,
        compression=compression,
        error_feedback=feedback,
        timeout=60,
        **(options or {}),
    )
    real, held = modes.train_and_read(
        model, opt, make_batches("tied", STEPS, world_size, dtype=torch.float64), rank, device
    )
    out = {
        "real": real,
        "held": held,
        "buckets": bucket_layouts(opt, model),
        "partitions": [
            len(getattr(opt._runtime.pipeline.gradients(b).buffer.codec, "parts", [None]))
            for b in opt.buckets
        ],
    }
    opt.close()
    return out


def train(rank, world_size, configs, device="cpu"):
    """``train_one`` of every configuration."""
    return [train_one(rank, world_size, config, device=device) for config in configs]


def reference(config, buckets, *, chunks=None, compressed=True, world=2):
    """The float64 reference of ``config``: its sums compressed as sapipe's are over
    ``buckets`` (cut into ``chunks``, push-pull's partitions, when given), or exact."""
    compression, k, mode, s, feedback = config
    return run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        modes.OPTIMIZERS["adamw"],
        make_batches("tied", STEPS, world, dtype=torch.float64),
        loss_fn_for("tied"),
        stale_layers=k,
        compensation=mode,
        dc_lambda=modes.DC_LAMBDA,
        staleness=s,
        lr_at=lambda it: modes.BASE_LR["adamw"] * modes.lr_factor(it - 1),
        reduce=compressed_mean(compression, buckets, error_feedback=feedback, chunks=chunks)
        if compressed
        else None,
    )


def check_against_reference(config, per_rank) -> None:
    """Every rank's real and held weights equal the float64 reference with the same quantizer
    (rtol 1e-9), which the quantizer moved measurably away from the uncompressed rule."""
    assert len(per_rank[0]["buckets"]) >= 2, "the test should span several buckets"
    world = len(per_rank)
    ref = reference(config, per_rank[0]["buckets"], world=world)
    for rank, got in enumerate(per_rank):
        assert_close_dicts(
            got["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} real x"
        )
        assert_close_dicts(
            got["held"], ref.held[-1][rank], rtol=1e-9, atol=1e-11, what=f"rank {rank} held"
        )
    # the quantizer matters: the uncompressed rule is measurably elsewhere
    plain = reference(config, per_rank[0]["buckets"], compressed=False, world=world).real[-1]
    moved = max((plain[n] - ref.real[-1][n]).abs().max().item() for n in plain)
    assert moved > 1e-7, f"compression changed the weights by only {moved:.1e}"
