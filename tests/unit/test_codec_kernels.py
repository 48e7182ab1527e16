"""The codec kernels (csrc/codec/cpu_codec*.{h,cpp}, csrc/codec/codec.cuh) against their
pure-PyTorch reference (sapipe/kernels/codec.py), bit for bit, and the reference against
torch's own conversions.

* The 16-bit conversions: every fp16 / bf16 bit pattern decoded, and float32 values spread
  over every exponent (round-half ties included) encoded, against ``Tensor.to``.
* Each stage (encode, sum_encode, decode) for fp16 / bf16 / int8, float32 / float64, with and
  without a residual, rows that end inside a block, a bucket shorter than its rows, and
  non-finite values: the same bits from kernel and reference, on every CPU instruction set
  this host has, and on CUDA where there is one.
* Non-finite values: an int8 block holding one decodes to NaN everywhere, and residuals keep
  their value wherever the decoded value is not finite.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support.codec import KINDS, messages
from support.cuda import cuda_param
from support.paths import job_env

from sapipe.kernels import _ext
from sapipe.kernels import codec as ck

CUDA_OK = torch.cuda.is_available() and _ext.has_kernels("cuda")
DEVICES = ["cpu", cuda_param("cuda", ok=CUDA_OK)]


@pytest.fixture(autouse=True)
def _kernels_required():
    if not _ext.has_kernels("cpu"):
        pytest.skip(f"sapipe._C not built with the codec ({_ext.errors.get('_C')})")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where the other has NaN (payloads aside)."""
    if a.dtype.is_floating_point:
        nan = torch.isnan(a)
        return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])
    return torch.equal(a, b)


def _data(n: int, dtype, device, seed: int, nonfinite: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=gen, dtype=torch.float64)
    x *= torch.exp(torch.randn(n, generator=gen, dtype=torch.float64) * 3)  # many magnitudes
    x[::97] = 0.0
    if n >= 2 * ck.BLOCK:
        # a block below float32's normal range (what error feedback leaves of zeros)
        x[ck.BLOCK : 2 * ck.BLOCK] *= 1e-40
    if nonfinite and n > 600:
        x[5], x[300], x[n - 2] = float("nan"), float("inf"), float("-inf")
    return x.to(dtype).to(device)


# ------------------------------------------------------------------- torch's conversions


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_every_16_bit_pattern_decodes_as_torch_decodes_it(kind):
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    values = bits.view(KINDS[kind]).view(1, -1)
    for dtype in (torch.float32, torch.float64):
        expected = values.reshape(-1).to(dtype) * 3
        for fn in (ck.decode, ck.reference_decode):
            out = torch.empty(values.numel(), dtype=dtype)
            fn(values, None, out, 3.0)
            assert _same(out, expected), (fn.__name__, dtype)


@pytest.mark.parametrize("kind", ["fp16", "bf16"])
def test_encoding_rounds_as_torchs_conversion(kind):
    """Every float32 exponent, random mantissas, exact ties and their neighbours, specials."""
    gen = torch.Generator().manual_seed(1)
    exponents = torch.arange(-149, 128, dtype=torch.float64)
    x = (torch.rand(277, 400, generator=gen, dtype=torch.float64) + 1) * torch.pow(2.0, exponents)[
        :, None
    ]
    x = x.to(torch.float32).reshape(-1)
    x = torch.cat([x, -x])
    mantissa_bits = 10 if kind == "fp16" else 7
    ties = torch.randint(-(2**15), 2**15, (20000,), generator=gen, dtype=torch.int32).to(
        torch.int16
    )
    ties = ties.view(KINDS[kind]).to(torch.float32)
    ties = ties[torch.isfinite(ties)].double()
    ulp = torch.where(
        ties == 0,
        torch.ones_like(ties),
        torch.pow(2.0, torch.floor(torch.log2(ties.abs().clamp_min(1e-40))) - mantissa_bits),
    )
    near = [
        ties + ulp / 2,
        ties - ulp / 2,
        ties + ulp / 2 * (1 + 2**-20),
        ties + ulp / 2 * (1 - 2**-20),
    ]
    specials = torch.tensor(
        [
            0.0,
            -0.0,
            float("inf"),
            float("-inf"),
            float("nan"),
            65504,
            65519.99,
            65520,
            2.0**-24,
            2.0**-25,
            3 * 2.0**-26,
            2.0**-14,
            2.0**-14 - 2.0**-25,
            3.4e38,
        ]
    )
    src = torch.cat([x, *(t.to(torch.float32) for t in near), specials.float()])
    for fn in (ck.encode, ck.reference_encode):
        _, values, _ = messages(kind, 1, src.numel(), "cpu")
        fn(src, None, values, None, 1.0)
        assert _same(values.reshape(-1).float(), src.to(KINDS[kind]).float()), fn.__name__


# ------------------------------------------------------------------- kernel vs reference


CASES = [  # (rows, width, n): n < rows * width leaves padding; widths off the block size, and
    # int8 rows of whole blocks that end inside the CPU kernels' 256-value tiles
    (1, 256, 256),
    (2, 512, 1000),
    (3, 768, 2304),
    (4, 300, 1111),
    (8, 1024, 8000),
    (2, 256, 17),
    (3, 192, 500),
    (2, 320, 639),
    (5, 64, 200),
]


def _isas():
    """The instruction sets this CPU runs the codec with."""
    previous = _ext.cpu.cpu_isa()
    found = ["base"] + [name for name in _ext.CPU_ISAS[1:] if _ext.cpu.set_cpu_isa(name)]
    _ext.cpu.set_cpu_isa(previous)
    return found


@pytest.fixture(params=["base", "avx2", "avx512"])
def isa(request):
    if request.param not in _isas():
        pytest.skip(f"this CPU has no {request.param}")
    previous = _ext.cpu.cpu_isa()
    _ext.cpu.set_cpu_isa(request.param)
    yield request.param
    _ext.cpu.set_cpu_isa(previous)


def _both(device, run):
    """``run(fn_table)`` with the kernels and with the reference; both results."""
    kernels = {"encode": ck.encode, "sum_encode": ck.sum_encode, "decode": ck.decode}
    reference = {
        "encode": ck.reference_encode,
        "sum_encode": ck.reference_sum_encode,
        "decode": ck.reference_decode,
    }
    return run(kernels), run(reference)


def _assert_same_messages(got, want, where, kind: str, every_byte: bool) -> None:
    """``got`` and ``want``: (message buffer, values, scales, residual or None, ...) from the
    kernels and the reference."""
    if every_byte:  # the untouched gaps between fields included
        assert torch.equal(got[0], want[0]), (where, "message bytes")
    assert _same(got[1].float(), want[1].float()), (where, "values")  # NaN payloads aside
    if kind == "int8":
        assert _same(got[2], want[2]), (where, "scales")
    if got[3] is not None:
        assert _same(got[3], want[3]), (where, "residual")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_encode_matches_the_reference(device, dtype, kind, feedback, nonfinite, isa):
    for rows, width, n in CASES:
        if kind == "int8" and width % ck.BLOCK:
            continue
        src = _data(n, dtype, device, seed=rows * 7 + n, nonfinite=nonfinite)
        start = _data(n, dtype, device, seed=n) * 1e-3 if feedback else None

        def run(fn, rows=rows, width=width, src=src, start=start):
            buffer, values, scales = messages(kind, rows, width, device)
            residual = start.clone() if feedback else None
            fn["encode"](src, residual, values, scales, 1.0 if kind == "int8" else 2.0)
            return buffer, values, scales, residual

        got, want = _both(device, run)
        _assert_same_messages(got, want, (rows, width, n), kind, every_byte=not nonfinite)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("kind", ["fp16", "bf16", "int8"])
@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("nonfinite", [False, True])
def test_sum_encode_and_decode_match_the_reference(device, dtype, kind, feedback, nonfinite, isa):
    for rows, width, n in CASES:
        if kind == "int8" and width % ck.BLOCK:
            continue
        _, received, received_scales = messages(kind, rows, width, device)
        sent = _data(rows * width, dtype, device, seed=n, nonfinite=nonfinite)  # int8: NaN blocks
        ck.reference_encode(sent, None, received, received_scales, 1.0)
        start = _data(width, dtype, device, seed=rows) * 1e-3 if feedback else None

        def run(
            fn,
            rows=rows,
            width=width,
            n=n,
            start=start,
            received=received,
            received_scales=received_scales,
        ):
            buffer, values, scales = messages(kind, 1, width, device)
            residual = start.clone() if feedback else None
            fn["sum_encode"](received, received_scales, residual, values, scales, rows, dtype)
            out = torch.full((n,), 7.0, dtype=dtype, device=device)
            fn["decode"](received, received_scales, out, rows)
            return buffer, values, scales, residual, out

        got, want = _both(device, run)
        _assert_same_messages(
            got, want, (rows, width, n, "the sum"), kind, every_byte=not nonfinite
        )
        assert _same(got[4], want[4]), (rows, width, n, "decoded")


# ------------------------------------------------------------------- tiny and non-finite values


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fn", [ck.encode, ck.reference_encode])
def test_an_int8_block_below_float32s_normal_range_travels_as_zeros(fn, dtype):
    """Error feedback resends a zero gradient's rest, ever smaller, until its scale would be
    subnormal (1 / s overflows): such a block is sent as zeros and keeps all of v as residual."""
    src = torch.zeros(2 * ck.BLOCK, dtype=dtype)
    src[: ck.BLOCK] = torch.linspace(-1, 1, ck.BLOCK, dtype=dtype) * 1e-39
    residual = torch.zeros_like(src)
    residual[ck.BLOCK :] = 3e-41
    _, values, scales = messages("int8", 1, src.numel(), "cpu")
    fn(src, residual, values, scales, 1.0)
    assert torch.equal(scales, torch.zeros_like(scales)) and torch.equal(
        values, torch.zeros_like(values)
    )
    assert torch.equal(residual[: ck.BLOCK], src[: ck.BLOCK]) and torch.equal(
        residual[ck.BLOCK :], torch.full((ck.BLOCK,), 3e-41, dtype=dtype)
    )
    out = torch.full_like(src, 7.0)
    ck.decode(values, scales, out, 1.0)
    assert torch.equal(out, torch.zeros_like(out))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("fn", [ck.encode, ck.reference_encode])
def test_int8_rounds_ties_to_even(fn, dtype):
    """max|v| = 127 gives the scale 1 exactly, so the halves are ties: they round to the even
    neighbour (docs/design.md §5.9), not away from zero."""
    src = torch.zeros(ck.BLOCK, dtype=dtype)
    src[:8] = torch.tensor([127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5], dtype=dtype)
    _, values, scales = messages("int8", 1, src.numel(), "cpu")
    fn(src, None, values, scales, 1.0)
    assert scales.tolist() == [[1.0]]
    assert values[0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]


@pytest.mark.parametrize("fn", [ck.encode, ck.reference_encode])
def test_a_nonfinite_int8_block_decodes_to_nan_and_keeps_its_residual(fn):
    src = torch.ones(3 * ck.BLOCK)
    src[ck.BLOCK + 3] = float("inf")
    residual = torch.full_like(src, 0.25)
    _, values, scales = messages("int8", 1, src.numel(), "cpu")
    fn(src, residual, values, scales, 1.0)
    out = torch.empty_like(src)
    ck.decode(values, scales, out, 1.0)
    middle = slice(ck.BLOCK, 2 * ck.BLOCK)
    assert (
        torch.isnan(out[middle]).all()
        and torch.isfinite(out[: ck.BLOCK]).all()
        and torch.isfinite(out[2 * ck.BLOCK :]).all()
    )
    assert torch.equal(residual[middle], torch.full((ck.BLOCK,), 0.25)), (
        "a skipped block keeps its residual"
    )
    assert torch.allclose(out[: ck.BLOCK], torch.full((ck.BLOCK,), 1.25)), "v = src + residual"
    assert residual[: ck.BLOCK].abs().max() < 1.25 / 127


@pytest.mark.parametrize("fn", [ck.encode, ck.reference_encode])
def test_a_16_bit_overflow_travels_as_inf_and_keeps_its_residual(fn):
    src = torch.tensor([1.0, 70000.0, -1e6, float("nan"), 3.0])
    residual = torch.full_like(src, 1e-4)
    _, values, _ = messages("fp16", 1, src.numel(), "cpu")
    fn(src, residual, values, None, 1.0)
    decoded = values.reshape(-1).float()
    assert decoded[1] == float("inf") and decoded[2] == float("-inf") and torch.isnan(decoded[3])
    assert torch.equal(residual[1:4], torch.full((3,), 1e-4)), (
        "non-finite values keep their residual"
    )
    assert residual[0] != 1e-4 and residual[4] != 1e-4


BAD_CALLS = """
import torch
from support.codec import messages
import sapipe.kernels
src = torch.randn(512)
_, values, scales = messages("int8", 2, 256, "cpu")
_, values16, _ = messages("fp16", 2, 256, "cpu")
calls = [
    ("scales", lambda: torch.ops.sapipe.codec_encode(src, None, values, None, 1.0)),
    (
        "cannot hold",
        lambda: torch.ops.sapipe.codec_encode(torch.randn(600), None, values, scales, 1.0),
    ),
    ("residual", lambda: torch.ops.sapipe.codec_encode(src, torch.zeros(10), values, scales, 1.0)),
    (
        "int8, float16 or bfloat16",
        lambda: torch.ops.sapipe.codec_encode(src, None, torch.zeros(2, 256), scales, 1.0),
    ),
    (
        "float32 or float64",
        lambda: torch.ops.sapipe.codec_decode(
            values16, None, torch.zeros(512, dtype=torch.float16), 1.0
        ),
    ),
]
for expected, call in calls:
    try:
        call()
        print("no error:", expected)
    except RuntimeError as exc:
        wrong = "wrong message: " + str(exc).splitlines()[0]
        print("raised" if expected in str(exc) else wrong, flush=True)
"""


def test_bad_arguments_raise_clearly():
    """Each wrong argument raises a RuntimeError naming it. Run in a child interpreter: on a
    GPU machine's torch (2.11.0+cu130) an error raised inside sapipe._C crashed the
    interpreter (SIGSEGV) while the extension's checks streamed numbers into a stream of
    their own (csrc/check.h says more); a crash must fail this test, not end the run."""
    child = subprocess.run(
        [sys.executable, "-c", BAD_CALLS],
        capture_output=True,
        text=True,
        timeout=120,
        env=job_env(),  # tests/ on its path: the child imports support.codec
    )
    assert child.returncode == 0, (
        f"the child interpreter died (rc {child.returncode}): {child.stderr[-2000:]}"
    )
    assert child.stdout.split("\n")[:-1] == ["raised"] * 5, child.stdout


@pytest.mark.parametrize("cap", ["base", "avx2"])
def test_the_environment_caps_the_instruction_set(cap):
    """SAPIPE_CPU_ISA=base|avx2 caps the run-time choice (the best the CPU has otherwise)."""
    if cap not in _isas():
        pytest.skip(f"this CPU has no {cap}")
    code = "from sapipe.kernels import _ext; print(_ext.cpu.cpu_isa())"
    env = dict(os.environ, SAPIPE_CPU_ISA=cap)
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == cap, out.stderr[-2000:]
    best = subprocess.run(
        [sys.executable, "-c", code],
        env={k: v for k, v in os.environ.items() if k != "SAPIPE_CPU_ISA"},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert best.stdout.strip() == _isas()[-1], best.stderr[-2000:]


def test_an_unknown_instruction_set_cap_warns():
    code = "import warnings; warnings.simplefilter('error'); from sapipe.kernels import _ext"
    env = dict(os.environ, SAPIPE_CPU_ISA="AVX2")
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120
    )
    assert (
        out.returncode != 0
        and "SAPIPE_CPU_ISA='AVX2' is not one of base, avx2, avx512" in out.stderr
    ), out.stderr
