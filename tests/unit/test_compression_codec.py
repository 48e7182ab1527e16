"""The compressed sum's arithmetic (sapipe/compression/codec.py), W ranks simulated in one process.

The bytes each simulated rank sends are handed to the others exactly as the all-to-all and
the all-gather would, so what is checked is the codec itself: how close the decoded mean is
to the exact one for each format, that every rank decodes the same bits, that flags are
summed exactly, and that error feedback keeps the running sum of int8 results from
drifting (without it, the error grows with every step).
"""

from __future__ import annotations

import pytest
import torch

from sapipe.compression.codec import BF16, INT8_BLOCK, BucketCodec, Compression, WireFormat, resolve

# largest |decoded - exact| / max|exact| one averaged step may show: two roundings of the format
BOUND = {"fp16": 2.0**-10, "bf16": 2.0**-7, "int8": 2.0 / 127}


def _codecs(kind, numel, nflags, world, dtype=torch.float32, error_feedback=None):
    compression = Compression.of(kind, error_feedback)
    return [
        BucketCodec(compression, numel, nflags, world, dtype, torch.device("cpu"))
        for _ in range(world)
    ]


def _sum(codecs, wires):
    """One compressed sum over the simulated ranks: every rank's decoded result (values
    averaged, flags summed)."""
    world = len(codecs)
    outgoing = [c.scatter_messages(w, 0).view(world, -1) for c, w in zip(codecs, wires)]
    for r, codec in enumerate(codecs):
        codec.inbox[0].view(world, -1).copy_(torch.stack([outgoing[i][r] for i in range(world)]))
    mine = [c.gather_message(0).clone() for c in codecs]
    results = []
    for codec, wire in zip(codecs, wires):
        codec.gathered[0].view(world, -1).copy_(torch.stack(mine))
        out = torch.empty_like(wire)
        codec.decode_mean(out, 0)
        results.append(out)
    return results


@pytest.mark.parametrize("kind", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("world", [2, 3, 8])
def test_the_mean_is_within_two_roundings_and_identical_on_every_rank(kind, world):
    numel, nflags = 3000, 11
    gen = torch.Generator().manual_seed(world)
    codecs = _codecs(kind, numel, nflags, world)
    for _ in range(3):
        grads = [torch.randn(numel, generator=gen) * 1e-3 for _ in range(world)]
        flags = [torch.randint(0, 2, (nflags,), generator=gen).float() for _ in range(world)]
        results = _sum(codecs, [torch.cat([g, f]) for g, f in zip(grads, flags)])
        exact = torch.stack(grads).sum(0) / world
        for result in results:
            assert torch.equal(result, results[0]), "ranks decoded different means"
        assert torch.equal(results[0][numel:], torch.stack(flags).sum(0)), (
            "flags must be summed exactly"
        )
        error = ((results[0][:numel] - exact).abs().max() / exact.abs().max()).item()
        assert 0 < error <= BOUND[kind], f"{kind}, W={world}: relative error {error:.2e}"


def test_the_16_bit_formats_survive_sums_beyond_fp16s_range():
    """Each rank's gradient fits fp16, their sum over 8 ranks does not: it travels as the mean."""
    world, numel = 8, 600
    grads = [torch.full((numel,), 30000.0) for _ in range(world)]
    result = _sum(_codecs("fp16", numel, 0, world), grads)[0]
    assert torch.isfinite(result).all() and torch.allclose(
        result, torch.full((numel,), 30000.0), rtol=2.0**-10
    )


def _drift(feedback: bool, steps: int = 60):
    """max |running sum of decoded means - running exact one| after each step (int8, W = 2)."""
    world, numel = 2, 4 * INT8_BLOCK
    gen = torch.Generator().manual_seed(0)
    codecs = _codecs("int8", numel, 0, world, error_feedback=feedback)
    base = [torch.randn(numel, generator=gen) for _ in range(world)]
    base[0][::7] *= 100  # outliers: large scales, so small values round to 0 without feedback
    running, exact, drift = torch.zeros(numel), torch.zeros(numel), []
    for _ in range(steps):
        grads = [b.clone() for b in base]
        running += _sum(codecs, grads)[0]
        exact += sum(grads) / world
        drift.append((running - exact).abs().max().item())
    return drift


def test_error_feedback_keeps_the_running_int8_sum_on_track():
    with_feedback, without = _drift(True), _drift(False)
    step_error = with_feedback[0]
    assert max(with_feedback) <= 4 * step_error, (
        "with error feedback the running error stays at one step's"
    )
    assert without[-1] >= 20 * step_error, "without it the same rounding repeats every step"
    assert without[-1] > 10 * max(with_feedback)


@pytest.mark.parametrize("kind", ["fp16", "int8"])
def test_a_restored_codec_sends_the_same_bytes(kind):
    world, numel = 2, 1000
    gen = torch.Generator().manual_seed(3)
    first, second = _codecs(kind, numel, 2, world), _codecs(kind, numel, 2, world)
    wires = [[torch.randn(numel + 2, generator=gen) for _ in range(world)] for _ in range(3)]
    for step in wires[:2]:
        _sum(first, [w.clone() for w in step])
    for source, target in zip(first, second):
        target.load_state_dict(source.state_dict())
    a, b = _sum(first, [w.clone() for w in wires[2]]), _sum(second, [w.clone() for w in wires[2]])
    assert torch.equal(a[0], b[0])
    assert all(torch.equal(x.outbox[0], y.outbox[0]) for x, y in zip(first, second))


def test_float64_gradients_stay_float64():
    world, numel = 2, 500
    grads = [torch.full((numel,), 1.0 + 2.0**-40, dtype=torch.float64) for _ in range(world)]
    result = _sum(_codecs("int8", numel, 0, world, torch.float64), grads)[0]
    assert result.dtype == torch.float64 and torch.allclose(
        result, torch.full((numel,), 1.0, dtype=torch.float64)
    )


def test_wire_bytes():
    """int8 moves a quarter of float32's bytes plus a float32 scale per 64 values, 16-bit half,
    as a ring all-reduce does."""
    numel, world = 1 << 20, 4
    ring_fp32 = 2 * (world - 1) / world * numel * 4
    assert WireFormat(resolve("fp16"), numel, 0, world).wire_bytes() / ring_fp32 == pytest.approx(
        0.5, rel=1e-3
    )
    assert WireFormat(resolve("int8"), numel, 0, world).wire_bytes() / ring_fp32 == pytest.approx(
        0.25 + 1 / 64, rel=1e-3
    )


def test_unknown_compression_is_refused_by_name():
    with pytest.raises(ValueError, match="'fp16', 'bf16', 'int8'.*'fp8'"):
        resolve("fp8")
    assert resolve(None) is None and resolve("bf16") == BF16() and resolve(BF16()) == BF16()


@pytest.mark.parametrize(
    "node_size,numel", [(3, 1), (4, 1), (4, 2), (4, 5), (8, 10), (3, 7), (4, 9)]
)
def test_node_first_shards_cover_small_buckets(node_size, numel):
    """A bucket cut into L node-first shards of ceil(numel / L) values: row j holds values
    [j·size, (j+1)·size) clipped to the bucket (shards past its end are empty), zeros
    after them, then every flag; unpacking the rows gives the bucket back."""
    from sapipe.compression.codec import NodeFirstCodec

    nflags = 3
    codec = NodeFirstCodec(
        Compression.of("int8"), numel, nflags, 2, node_size, torch.float64, torch.device("cpu")
    )
    wire = torch.arange(1.0, numel + nflags + 1, dtype=torch.float64)
    rows = torch.full((node_size * codec.row_numel,), float("nan"), dtype=torch.float64)
    codec.pack(wire, rows)
    size = -(-numel // node_size)
    for j, row in enumerate(rows.view(node_size, -1)):
        values = wire[min(j * size, numel) : min((j + 1) * size, numel)]
        expected = torch.cat(
            [values, torch.zeros(size - len(values), dtype=torch.float64), wire[numel:]]
        )
        assert torch.equal(row, expected), (j, row)
    back = torch.zeros_like(wire)
    codec.unpack(rows, back)
    assert torch.equal(back, wire)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("partition", [None, 37], ids=["bucket", "partitions"])
def test_gradients_written_on_intake_make_the_bytes_the_encode_makes(kind, dtype, partition):
    """fp16/bf16 without error feedback: backward's copy of each gradient straight into the
    outgoing messages (cast as it is copied; parameters spanning a shard's or a partition's
    end in pieces) leaves every message byte as stage 1's encode of the filled bucket, and
    the untouched padding zero. Sizes put shard and partition ends inside parameters."""
    from sapipe.compression.codec import PartitionedCodec, SpanningGradient, intake_views

    world, shapes = 3, [(7, 5), (13,), (4, 3, 2), (1,), (29,), (2,)]  # 104 values: shards padded
    params = [torch.empty(shape, dtype=dtype) for shape in shapes]
    offsets = [sum(p.numel() for p in params[:i]) for i in range(len(params))]
    numel, nflags = sum(p.numel() for p in params), 4
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(p.shape, generator=gen, dtype=dtype) * 300 for p in params]
    grads[1][3] = float("inf")  # beyond fp16's range as well as infinite
    grads[2] = torch.randn((2, 3, 4), generator=gen, dtype=dtype).transpose(0, 2)  # not contiguous
    wire = torch.cat([g.reshape(-1) for g in grads] + [torch.ones(nflags, dtype=dtype)])

    cpu = torch.device("cpu")
    plain = Compression.of(kind)

    def codec(compression=plain):
        if partition is None:
            return BucketCodec(compression, numel, nflags, world, dtype, cpu, slots=2)
        return PartitionedCodec(
            compression, numel, nflags, world, dtype, cpu, slots=2, per_partition=partition
        )

    encoded, on_intake = codec(), codec()
    assert on_intake.encodes_on_intake
    views = intake_views(on_intake, 1, offsets, params)
    assert any(isinstance(v, SpanningGradient) for v in views), "no parameter spans two messages"
    for view, grad in zip(views, grads):
        view.copy_(grad)
    for (lo, hi, want), (_, _, got) in zip(
        encoded.at(1).partitions(), on_intake.at(1, encoded=True).partitions()
    ):
        assert torch.equal(got.scatter_messages(wire[lo:hi]), want.scatter_messages(wire[lo:hi])), (
            lo,
            hi,
        )
    for other in (Compression.of(kind, error_feedback=True), Compression.of("int8")):
        # these must encode
        assert not codec(other).encodes_on_intake
