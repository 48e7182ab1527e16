"""``compression=`` on ``backend="pushpull"`` and ``backend="horovod"`` (docs/design.md §5.9).

* pushpull, ``fp16`` / ``bf16`` (element-wise formats: how a bucket is cut does not change
  any value): bit-identical weights to ``backend="torch"`` with the same compression, with
  partitions small enough that the larger buckets are cut into several.
* pushpull, ``int8``: each partition is the unit that is sharded and scaled, so the float64
  reference ``compressed_mean`` with the same partitions (``chunks=``), rtol 1e-9, with and
  without error feedback, at k = 0 and k = 3 with compensation; the partitions matter
  (the reference without them is elsewhere) and so does the quantizer.
* pushpull + int8: a checkpoint carries the worker residual and every partition's server
  residual, and the resumed run is bit-identical.
* horovod: the same sums as ``backend="torch"`` bit for bit, for each format (skipped where
  ``horovod.torch`` does not import).
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from support import modes
from support.compressed import M, config_id, reference, train_one
from support.dist_utils import assert_close_dicts, horovod_missing, run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.training import named_weights, train_steps

# 314 bytes: 39 float64 values per partition, so the larger buckets are cut into several
PARTITION_MB = 0.0003
PER_PARTITION = int(PARTITION_MB * 1024 * 1024) // 8
PUSHPULL = {"backend": "pushpull", "partition_mb": PARTITION_MB}
# (compression, stale_layers, compensation, staleness, error_feedback)
SIXTEEN_BIT = [
    ("fp16", 3, "wp1", 1, None),
    ("bf16", 3, "dc", 1, True),
    ("fp16", M, "none", 2, True),
]
INT8 = [("int8", 0, "none", 1, None), ("int8", 3, "dc", 1, None), ("int8", 3, "wp1", 1, False)]


def _train(rank, world_size, runs):
    return [train_one(rank, world_size, config, options) for config, options in runs]


RUNS = (
    [(c, PUSHPULL) for c in SIXTEEN_BIT]
    + [(c, {}) for c in SIXTEEN_BIT]
    + [(c, PUSHPULL) for c in INT8]
)


@functools.cache
def _runs():
    return run_ranks(_train, world_size=2, args=(RUNS,), timeout=300)


def _result(config, options):
    return [run[RUNS.index((config, options))] for run in _runs()]


def _assert_identical(got: dict, expected: dict, what: str) -> None:
    for name, value in expected.items():
        assert np.array_equal(got[name], value), f"{what}: {name} differs"


@pytest.mark.parametrize("config", SIXTEEN_BIT, ids=config_id)
def test_pushpull_16_bit_equals_torch_bit_for_bit(config):
    pushpull, torch_backend = _result(config, PUSHPULL), _result(config, {})
    assert max(pushpull[0]["partitions"]) >= 3, "buckets should be cut into several partitions"
    assert len(pushpull[0]["partitions"]) >= 2, "the test should span several buckets"
    for rank in range(2):
        for view in ("real", "held"):
            _assert_identical(
                pushpull[rank][view], torch_backend[rank][view], f"rank {rank} {view}"
            )


def _chunks(buckets):
    """Each bucket's partitions as push-pull cuts it: PER_PARTITION values each, the last
    shorter."""
    sizes = [sum(n for _, n in layout) for layout in buckets]
    return [
        [(lo, min(lo + PER_PARTITION, size)) for lo in range(0, size, PER_PARTITION)]
        for size in sizes
    ]


def _largest_difference(a: dict, b: dict) -> float:
    return max((a[n] - b[n]).abs().max().item() for n in a)


@pytest.mark.parametrize("config", INT8, ids=config_id)
def test_pushpull_int8_matches_the_reference_per_partition(config):
    per_rank = _result(config, PUSHPULL)
    buckets = per_rank[0]["buckets"]
    chunks = _chunks(buckets)
    assert per_rank[0]["partitions"] == [len(c) for c in chunks]
    ref = reference(config, buckets, chunks=chunks)
    for rank, got in enumerate(per_rank):
        assert_close_dicts(
            got["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} real x"
        )
        assert_close_dicts(
            got["held"], ref.held[-1][rank], rtol=1e-9, atol=1e-11, what=f"rank {rank} held"
        )
    # both the partitions and the quantizer matter: the other rules are measurably elsewhere
    whole_buckets = _largest_difference(reference(config, buckets).real[-1], ref.real[-1])
    uncompressed = _largest_difference(
        reference(config, buckets, compressed=False).real[-1], ref.real[-1]
    )
    assert whole_buckets > 1e-7, (
        f"compressing per partition moved the weights by only {whole_buckets:.1e}"
    )
    assert uncompressed > 1e-7, f"compression changed the weights by only {uncompressed:.1e}"


# --------------------------------------------------------------------------- checkpoints

CHECKPOINT_STEPS, SPLIT = 8, 5


def _checkpoint_setup(seed):
    import sapipe

    model = make_model("tied", seed=seed, dtype=torch.float64)
    opt = sapipe.DistributedOptimizer(
        modes.OPTIMIZERS["adam"](model.parameters()),
        model,
        stale_layers=3,
        compensation="dc",
        bucket_cap_mb=0.0008,
        timeout=60,
        compression="int8",
        **PUSHPULL,
    )
    return model, opt


def _checkpoint_train(model, opt, rank, world_size, steps):
    batches = make_batches("tied", CHECKPOINT_STEPS, world_size, dtype=torch.float64)
    train_steps(model, opt, batches, rank, steps, loss_fn=loss_fn_for("tied"))


def _real(model, opt):
    opt.synchronize()
    with opt.real_weights():
        return named_weights(model)


def _resume(rank, world_size, path):
    """Uninterrupted, and saved after SPLIT steps then resumed by a fresh model and optimizer
    (other weights before loading): the real weights of both, and what the checkpoint held."""
    import sapipe

    model, opt = _checkpoint_setup(seed=0)
    _checkpoint_train(model, opt, rank, world_size, range(CHECKPOINT_STEPS))
    expected = _real(model, opt)
    opt.close()

    model, opt = _checkpoint_setup(seed=0)
    _checkpoint_train(model, opt, rank, world_size, range(SPLIT))
    sapipe.save_checkpoint(path, model, opt)
    opt.close()

    model, opt = _checkpoint_setup(seed=rank + 7)
    sapipe.load_checkpoint(path, model, opt)
    codecs = [
        bucket["codec"]
        for bucket in torch.load(path.format(rank=rank), weights_only=False)["optimizer"]["buckets"]
    ]
    _checkpoint_train(model, opt, rank, world_size, range(SPLIT, CHECKPOINT_STEPS))
    resumed = _real(model, opt)
    opt.close()
    held = {
        "partitions": [len(c["server_residuals"]) for c in codecs],
        "server residual": max(r.abs().max().item() for c in codecs for r in c["server_residuals"]),
        "residual": max(c["residual"].abs().max().item() for c in codecs),
    }
    return {"expected": expected, "resumed": resumed, "checkpoint": held}


def test_pushpull_int8_resumes_bit_identically(rank_checkpoint):
    per_rank = run_ranks(_resume, world_size=2, args=(rank_checkpoint,), timeout=180)
    for rank, out in enumerate(per_rank):
        held = out["checkpoint"]
        assert max(held["partitions"]) >= 3 and held["residual"] > 0, held
        _assert_identical(out["resumed"], out["expected"], f"rank {rank} real")
    # Partitions this small fit in rank 0's first int8 shard: rank 0 sums (and keeps the
    # residual of) all of them.
    assert per_rank[0]["checkpoint"]["server residual"] > 0, per_rank[0]["checkpoint"]


# --------------------------------------------------------------------------- horovod

HOROVOD = [("fp16", 3, "wp1", 1, None), ("bf16", 0, "none", 1, True), ("int8", 3, "dc", 1, None)]


def _on_horovod(rank, world_size):
    from sapipe.comm.horovod_backend import init_horovod_for_torch_job

    hvd = init_horovod_for_torch_job()
    try:
        return [
            [
                train_one(rank, world_size, config, options)
                for options in ({"backend": "horovod"}, {})
            ]
            for config in HOROVOD
        ]
    finally:
        hvd.shutdown()


@pytest.mark.skipif(bool(horovod_missing()), reason=horovod_missing() or "available")
def test_horovod_sums_equal_torch_bit_for_bit():
    for rank, runs in enumerate(run_ranks(_on_horovod, world_size=2, timeout=300)):
        for config, (horovod, torch_backend) in zip(HOROVOD, runs):
            for view in ("real", "held"):
                _assert_identical(
                    horovod[view], torch_backend[view], f"{config_id(config)} rank {rank} {view}"
                )
