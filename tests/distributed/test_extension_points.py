"""Extension points, each driven through the public API as a user would: a compression format of
one's own (``sapipe.compression.Compression``), a compensation of one's own
(``sapipe.optim.compensation.Compensation``) and a communication back-end of one's own
(``sapipe.comm.register_backend``). Each is first written to do what a built-in does, and must
then train bit for bit as the built-in (so every hook is really used, and nothing of the
built-in's leaks in); then one that no built-in is, held to what it must do.
"""

from __future__ import annotations

import pytest
import torch
from support.dist_utils import run_ranks

STEPS = 6


def _user_classes():
    """The user's classes, made in the rank that uses them (they subclass sapipe's)."""
    from sapipe.comm.torch_backend import AllReduce
    from sapipe.compression import Compression
    from sapipe.kernels.gradient_spec import GradientSpec
    from sapipe.optim.compensation import Compensation

    class BF16ByCasts(Compression):
        """bfloat16 values compressed with torch's own casts: the built-in bf16, by a user."""

        name = "bf16-by-casts"
        value_dtype = torch.bfloat16
        calls = 0

        def compress(self, rows):
            type(self).calls += 1
            return rows.to(torch.float32).to(torch.bfloat16), None

        def decompress(self, values, scales, dtype):
            return values.to(dtype)

    class Float8(Compression):
        """A format no built-in is: float8 (e4m3) values, one float32 scale per 32 values
        (max|v| / 448, e4m3's largest)."""

        name = "float8-e4m3"
        value_dtype = torch.float8_e4m3fn
        block = 32

        def compress(self, rows):
            blocks = rows.reshape(rows.shape[0], -1, self.block)
            scale = (blocks.abs().amax(dim=2) / 448).to(torch.float32)
            safe = torch.where(scale > 0, scale, torch.ones_like(scale)).to(rows.dtype)
            values = (blocks / safe.unsqueeze(2)).to(torch.float8_e4m3fn)
            return values.reshape(rows.shape), scale

        def decompress(self, values, scales, dtype):
            blocks = values.to(dtype).reshape(values.shape[0], -1, self.block)
            return (blocks * scales.to(dtype).unsqueeze(2)).reshape(values.shape)

    class SynchronisedPrediction(Compensation):
        """wp2 as a user writes it: predict with the latest averaged gradient."""

        name = "predict-synchronised"
        predicts = True
        max_staleness = 1
        calls = 0

        def prediction_gradient(self, step):
            type(self).calls += 1
            return None if step.g is None else GradientSpec.plain(step.g)

    class CompensatedPrediction(Compensation):
        """A compensation no built-in mode is: predict with g_{t-1} delay-compensated by the
        update just taken, DC_λ(g_{t-1}, x_t − x_{t-1})."""

        name = "predict-compensated"
        predicts = True
        max_staleness = 1

        def __init__(self, lam):
            self.lam = lam

        def prediction_gradient(self, step):
            if step.g is None:
                return None
            return GradientSpec(step.g, delta_is_step=True, lam=self.lam, form=step.form)

    class CountingAllReduce(AllReduce):
        """The default all-reduce, counting the buckets it carries."""

        starts = 0

        def start(self, tensor, what, priority=0, *, values=None):
            type(self).starts += 1
            return super().start(tensor, what, priority, values=values)

    return BF16ByCasts, Float8, SynchronisedPrediction, CompensatedPrediction, CountingAllReduce


def _train(rank, options, stale_layers=2):
    """Train a small model; its real and held weights, and the loss history."""
    import sapipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 32),
        torch.nn.Tanh(),
        torch.nn.Linear(32, 8),
    )
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        model,
        stale_layers=stale_layers,
        bucket_cap_mb=0.002,
        **options,
    )
    gen = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        opt.zero_grad()
        model(torch.randn(4, 16, generator=gen)).pow(2).mean().backward()
        opt.step()
    opt.synchronize()
    held = [p.detach().clone() for p in model.parameters()]
    with opt.real_weights():
        real = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return {"held": held, "real": real}


def _codecs(rank, world_size):
    bf16, float8, *_ = _user_classes()
    out = {}
    for feedback in (False, True):
        out[f"built-in {feedback}"] = _train(
            rank, {"compression": "bf16", "error_feedback": feedback}
        )
        out[f"user {feedback}"] = _train(rank, {"compression": bf16(error_feedback=feedback)})
    out["user calls"] = bf16.calls
    out["float8"] = _train(rank, {"compression": float8(error_feedback=True)})
    out["uncompressed"] = _train(rank, {})
    return out


def test_a_compression_of_ones_own_trains_as_the_built_in_it_rewrites():
    """A bf16 written with torch's casts equals the built-in bf16 (fused kernels, and values cast
    on intake) bit for bit, with and without error feedback; a float8 format no built-in is
    trains close to uncompressed (two roundings of 3 mantissa bits a step, error feedback on)."""
    for out in run_ranks(_codecs, world_size=2, timeout=240):
        assert out["user calls"] > 0
        for feedback in (False, True):
            for a, b in zip(out[f"built-in {feedback}"]["held"], out[f"user {feedback}"]["held"]):
                assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), (
                    f"error feedback {feedback}"
                )
        for a, b in zip(out["float8"]["real"], out["uncompressed"]["real"]):
            a, b = torch.as_tensor(a), torch.as_tensor(b)
            assert not torch.equal(a, b)  # it did compress
            torch.testing.assert_close(a, b, rtol=0.05, atol=0.02)


def _compensations(rank, world_size):
    _, _, mine, compensated, _ = _user_classes()
    return {
        "wp2": _train(rank, {"compensation": "wp2"}),
        "mine": _train(rank, {"compensation": mine()}),
        "calls": mine.calls,
        "lam 0": _train(rank, {"compensation": compensated(0.0)}),
        "lam 5": _train(rank, {"compensation": compensated(5.0)}),
    }


def test_a_compensation_of_ones_own_drives_the_prediction():
    """wp2 written by a user equals the built-in wp2 (real and predicted weights, bit for bit);
    a prediction delay-compensated by the step just taken equals wp2 at λ = 0 and differs
    from it at λ > 0."""
    for out in run_ranks(_compensations, world_size=2, timeout=240):
        assert out["calls"] > 0
        for kind in ("held", "real"):
            for a, b in zip(out["wp2"][kind], out["mine"][kind]):
                assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), kind
            for a, b in zip(out["wp2"][kind], out["lam 0"][kind]):
                assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), kind
        assert any(
            not torch.equal(torch.as_tensor(a), torch.as_tensor(b))
            for a, b in zip(out["wp2"]["held"], out["lam 5"]["held"])
        )


def _backends(rank, world_size):
    from sapipe import comm

    *_, counting = _user_classes()
    if "counting" not in comm.BACKENDS:
        comm.register_backend(
            "counting",
            lambda r: counting(
                comm.new_group_like(r.process_group, r.timeout), r.name, r.timeout, r.tracer
            ),
        )
    return {
        "torch": _train(rank, {}),
        "counting": _train(rank, {"backend": "counting"}),
        "starts": counting.starts,
    }


def test_a_backend_of_ones_own_carries_every_bucket():
    """A registered back-end (the default all-reduce, counting) trains bit for bit as
    ``backend="torch"``, and carried every bucket: 3 buckets a step, sync and stale."""
    for out in run_ranks(_backends, world_size=2, timeout=240):
        assert out["starts"] == 3 * STEPS
        for a, b in zip(out["torch"]["held"], out["counting"]["held"]):
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))


def test_registries_refuse_what_they_cannot_take():
    from sapipe import comm
    from sapipe.compression import Compression, register_compression
    from sapipe.errors import ConfigurationError
    from sapipe.optim.compensation import Compensation, register_compensation

    class Nameless(Compression):
        pass

    with pytest.raises(ConfigurationError, match="must set a name"):
        Nameless()
    with pytest.raises(ConfigurationError, match="registered already"):
        register_compression(type("Other", (Compression,), {"name": "int8"}))
    with pytest.raises(ConfigurationError, match="registered already"):
        register_compensation(type("Other", (Compensation,), {"name": "dc"}))
    with pytest.raises(ConfigurationError, match="not a new name"):
        comm.register_backend("torch", lambda request: None)
