"""``compression=``: compressed sums on real Gloo ranks (sapipe/compression/codec.py,
docs/design.md §5.9).

* Every format in every compensation mode against the float64 reference extended with the
  same quantizer (``reference.compressed_mean``): each rank's shards rounded once, summed in
  float64 in rank order, the sum rounded once more; with both error-feedback residuals where
  they are on (int8 by default; 16-bit with ``error_feedback=True``, int8 without one case).
  The configurations, their training and the comparison are ``support.compressed``, which
  the CUDA tests run too.
* At k = 0, ``"fp16"`` / ``"bf16"`` against DDP with torch's own ``fp16_compress_hook`` /
  ``bf16_compress_hook``: the averaged gradient of each step within the formats' rounding,
  while both differ from the uncompressed mean by more than that.
* fp16 / bf16 without error feedback run no encode on the worker (cast on intake).
* A checkpoint carries the int8 residuals: the resumed run is bit-identical.
* Bad input: an unknown format, or one the back-end cannot carry, is refused on every rank.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch
from support.compressed import CONFIGS, STEPS, check_against_reference, config_id, train
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.modes import OPTIMIZERS
from support.training import named_weights, train_steps


@functools.cache
def _runs():
    return run_ranks(train, world_size=2, args=(CONFIGS,), timeout=300)


@pytest.mark.parametrize("config", CONFIGS, ids=config_id)
def test_compressed_modes_match_the_reference_with_the_same_quantizer(config):
    check_against_reference(config, [run[CONFIGS.index(config)] for run in _runs()])


def _versus_ddp_hooks(rank, world_size):
    """Per step, the averaged gradient of sapipe (k = 0) and of DDP with torch's compress hook
    and without one, each on its own copy of the model (all start alike, take the same steps)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sapipe

    batches = make_batches("tied", STEPS, world_size)
    out = {}

    def bf16_hook(process_group, bucket):
        # torch's own hook; DDP refuses it by name unless NCCL runs it, though Gloo sums bf16
        return default_hooks.bf16_compress_hook(process_group, bucket)

    for kind, hook in (("fp16", default_hooks.fp16_compress_hook), ("bf16", bf16_hook)):
        hooked_model, exact_model, model = (
            make_model("tied"),
            make_model("tied"),
            make_model("tied"),
        )
        hooked, exact = DDP(hooked_model), DDP(exact_model)
        hooked.register_comm_hook(None, hook)
        opts = [torch.optim.AdamW(m.parameters(), lr=0.01) for m in (hooked_model, exact_model)]
        opt = sapipe.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01),
            model,
            compression=kind,
            bucket_cap_mb=0.001,
        )
        errors = []
        for t in range(STEPS):
            x, y = batches[t][rank]
            grads = []
            for net, params, o in (
                (hooked, hooked_model, opts[0]),
                (exact, exact_model, opts[1]),
                (model, model, opt),
            ):
                o.zero_grad()
                loss_fn_for("tied")(net(x), y).backward()
                grads.append(torch.cat([p.grad.reshape(-1) for p in params.parameters()]))
                o.step()
            scale = grads[1].abs().max().item()
            errors.append(
                {
                    "sapipe vs hook": (grads[2] - grads[0]).abs().max().item() / scale,
                    "hook vs exact": (grads[0] - grads[1]).abs().max().item() / scale,
                    "sapipe vs exact": (grads[2] - grads[1]).abs().max().item() / scale,
                }
            )
        weights = max(
            (a - b).abs().max().item()
            for a, b in zip(hooked_model.parameters(), model.parameters())
        )
        out[kind] = {"errors": errors, "weights vs hook": weights}
        opt.close()
    return out


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_16_bit_at_k0_equals_ddp_with_torchs_compress_hook(kind):
    """Each step's averaged gradient (relative to its largest element) is within two of the
    format's roundings of DDP + ``{kind}_compress_hook``'s, while both are farther than a
    tenth of one from the uncompressed mean; the weights after 6 AdamW steps stay together."""
    unit = {"fp16": 2.0**-11, "bf16": 2.0**-8}[kind]
    for rank, result in enumerate(run_ranks(_versus_ddp_hooks, world_size=2)):
        for step, errors in enumerate(result[kind]["errors"]):
            assert errors["sapipe vs hook"] <= 2 * unit, (rank, step, errors)
            assert errors["hook vs exact"] > unit / 10 and errors["sapipe vs exact"] > unit / 10, (
                rank,
                step,
                errors,
            )
        assert result[kind]["weights vs hook"] <= 50 * unit * 0.01, (
            rank,
            result[kind]["weights vs hook"],
        )


def test_the_link_model_for_compressed_sums():
    """Two collectives, the format's share of the bytes, plus the local work; never below
    what the compressed iterations were seen to take."""
    from sapipe.schedule.profiler import Profile, compressed

    profile = Profile(
        forward=[1.0],
        backward=[1.0],
        step_time=0.0,
        alpha=1e-4,
        beta=4e-9,
        beta_isolated=4e-9,
        beta_observed=1e-9,
    )
    model = compressed(profile, wire_ratio=0.26, codec_per_byte=1e-10)
    assert model.alpha == 2e-4 and model.beta == pytest.approx(4e-9 * 0.26 + 1e-10)
    assert compressed(profile, 0.26, 1e-10).beta_isolated == 4e-9
    slow_seen = Profile(
        forward=[1.0],
        backward=[1.0],
        step_time=0.0,
        alpha=1e-4,
        beta=4e-9,
        beta_isolated=4e-9,
        beta_observed=3e-9,
    )
    assert compressed(slow_seen, 0.26, 1e-10).beta == 3e-9
    # node first over 4 ranks per node: a rank compresses a quarter of each bucket, and the
    # profile keeps the codec's cost per byte compressed (a whole bucket's, for predictions)
    node_first = compressed(profile, 0.26, 1e-10, codec_share=0.25)
    assert node_first.beta == pytest.approx(4e-9 * 0.26 + 1e-10 / 4)
    assert (node_first.raw["codec_per_byte"], node_first.raw["codec_share"]) == (1e-10, 0.25)


def _auto_compressed(rank, world_size, backend):
    import sapipe

    model = make_model("tied", seed=rank)
    opt = sapipe.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        model,
        stale_layers="auto",
        compression="int8",
        profile_steps=3,
        tune_steps=0,
        backend=backend,
        partition_mb=0.01,
    )
    batches = make_batches("tied", 12, world_size)
    train_steps(model, opt, batches, rank, loss_fn=loss_fn_for("tied"))
    raw = opt.auto.profile.raw
    result = (opt.auto.decided, raw["wire_ratio"], raw["codec_per_byte"], opt.auto.profile.alpha)
    opt.close()
    return result


@pytest.mark.parametrize("backend", ["torch", "pushpull"])
def test_auto_models_the_compressed_link_alike_on_every_rank(backend):
    results = run_ranks(_auto_compressed, world_size=2, args=(backend,))
    assert results[0] == results[1]
    decided, wire_ratio, codec_per_byte, _ = results[0]
    assert (
        decided and 0.25 < wire_ratio < 0.5 and codec_per_byte > 0
    )  # a quarter, plus scales and (small model) padding


def _encodes_per_step(rank, world_size, configs):
    """For each (compression, compensation, error_feedback): how many times per step the
    worker ran stage 1's encode (the codec's kernels, counted at the module sapipe calls)."""
    import sapipe
    from sapipe.kernels import codec as codec_kernels

    calls = []
    real_encode = codec_kernels.encode

    def counted(*args, **kwargs):
        calls.append(1)
        return real_encode(*args, **kwargs)

    codec_kernels.encode = counted
    counts = []
    batches = make_batches("tied", STEPS, world_size)
    for compression, mode, feedback in configs:
        model = make_model("tied", seed=rank)
        opt = sapipe.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01),
            model,
            stale_layers=3,
            compensation=mode,
            compression=compression,
            error_feedback=feedback,
            bucket_cap_mb=0.001,
        )
        train_steps(model, opt, batches, rank, loss_fn=loss_fn_for("tied"))
        buckets = len(opt.buckets)
        opt.close()  # waits for every sum in flight: the last stale ones are never consumed
        counts.append((len(calls) / STEPS, buckets))
        calls.clear()
    return counts


def test_16_bit_without_error_feedback_encodes_on_intake():
    """fp16 and bf16 without error feedback reach the wire with no encode on the worker:
    backward cast them into the messages (docs/design.md §5.9), except the stale buckets whose
    mode keeps this rank's l_t at full precision (wp1); int8 and error feedback encode every
    bucket."""
    configs = [
        ("bf16", "none", None),
        ("fp16", "wp2", None),
        ("bf16", "wp1", None),
        ("bf16", "none", True),
        ("int8", "none", None),
    ]
    for rank_counts in run_ranks(_encodes_per_step, world_size=2, args=(configs,)):
        (bf16, buckets), (fp16, _), (wp1, _), (feedback, _), (int8, _) = rank_counts
        assert bf16 == 0 and fp16 == 0, rank_counts
        assert 0 < wp1 < buckets, rank_counts  # the stale buckets after warm-up only
        assert feedback == buckets and int8 == buckets, rank_counts


POISONED = 4  # rank 1's loss is inf in this iteration: its gradient is inf/NaN everywhere


def _residuals(codec):
    """A bucket codec's error-feedback residuals (a node-first codec keeps its shard's)."""
    codec = getattr(codec, "shard", codec)
    return [codec.residual, codec.server_residual]


def _with_a_poisoned_step(rank, world_size, node_first):
    """GradScaler over a compressed run whose rank 1 sends inf/NaN in iteration POISONED: the
    scale, whether the residuals stayed finite, and the final real weights, per configuration
    (``node_first``: ranks in pairs on 2 "nodes", summed node first)."""
    import os

    import sapipe

    if node_first:
        os.environ["GROUP_RANK"] = str(rank // 2)

    batches = make_batches("tied", STEPS + 2, world_size, dtype=torch.float64)
    out = []
    for compression, k, mode in (("int8", 0, "none"), ("int8", 3, "wp1"), ("fp16", 3, "dc")):
        model = make_model("tied", seed=rank, dtype=torch.float64)
        opt = sapipe.DistributedOptimizer(
            OPTIMIZERS["adamw"](model.parameters()),
            model,
            stale_layers=k,
            compensation=mode,
            bucket_cap_mb=0.0008,
            compression=compression,
            error_feedback=True,
            timeout=60,
        )
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=10**6)
        for t, step in enumerate(batches, start=1):
            x, y = step[rank]
            opt.zero_grad()
            loss = loss_fn_for("tied")(model(x), y)
            if rank == 1 and t == POISONED:
                loss = loss * float("inf")
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.synchronize()
        codecs = [opt._runtime.pipeline.gradients(b).buffer.codec for b in opt.buckets]
        finite = all(torch.isfinite(r).all().item() for c in codecs for r in _residuals(c))
        with opt.real_weights():
            real = named_weights(model)
        out.append(
            {
                "scale": scaler.get_scale(),
                "residuals finite": finite,
                "real": real,
                "sum": type(opt._pipeline.sync_comm).__name__,
            }
        )
        opt.close()
    return out


@pytest.mark.parametrize(
    "world_size,node_first", [(2, False), (4, True)], ids=["flat", "node-first"]
)
def test_a_step_gradscaler_skips_leaves_every_residual_finite(world_size, node_first):
    """The poisoned iteration travels as inf/NaN (an int8 block holding one as NaN), so
    GradScaler skips it on every rank and backs off once; no residual keeps a non-finite
    value, so the steps after it train on finite gradients and the ranks stay in agreement.
    Node first, the inf crosses the node's full-precision sum before it is compressed."""
    per_rank = run_ranks(_with_a_poisoned_step, world_size=world_size, args=(node_first,))
    for configs in zip(*per_rank):
        first = configs[0]
        assert first["sum"] == ("HierarchicalCompressedSum" if node_first else "CompressedSum")
        for other in configs:
            assert other["scale"] == 2.0**9, "every rank backs off once, and only once"
            assert other["residuals finite"]
            for name, value in first["real"].items():
                assert np.isfinite(value).all(), name
                assert np.array_equal(value, other["real"][name]), f"ranks disagree on {name}"


def _residuals_by_parameter(opt, model):
    """Each parameter's slice of its bucket's int8 worker residual, by name."""
    names = {id(p): n for n, p in model.named_parameters()}
    return {
        names[id(p)]: opt._runtime.pipeline.gradients(bucket)
        .buffer.codec.residual[offset : offset + p.numel()]
        .clone()
        for bucket in opt.buckets
        for p, offset in zip(bucket.params, bucket.offsets)
    }


def _relaid_out(rank, world_size):
    import sapipe

    model = make_model("tied", seed=0, dtype=torch.float64)
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
        model,
        stale_layers=3,
        compression="int8",
        bucket_cap_mb=0.0008,
        timeout=60,
    )
    batches = make_batches("tied", 4, world_size, dtype=torch.float64)
    train_steps(model, opt, batches, rank, loss_fn=loss_fn_for("tied"))
    opt.wait_for_communication()  # the worker thread's encode writes the residuals
    before = _residuals_by_parameter(opt, model)
    opt._runtime.relayout(5)  # noqa: SLF001 - what stale_layers="auto" does between its trials
    after = _residuals_by_parameter(opt, model)
    opt.close()
    return before, after


def test_error_feedback_residuals_move_with_their_parameters_when_buckets_are_laid_out_again():
    """``"auto"`` lays the buckets out again at each k it tries; what each parameter's
    rounding left behind must follow it into the new buckets, or error feedback loses it."""
    for before, after in run_ranks(_relaid_out, world_size=2):
        assert any(np.abs(value).max() > 0 for value in before.values()), "int8 leaves residuals"
        for name, value in before.items():
            assert np.array_equal(after[name], value), name
