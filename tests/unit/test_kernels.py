"""Fused kernels (csrc/, via sapipe.kernels.ops) against their pure-PyTorch references.

Every public kernel entry point of sapipe.kernels.ops is run on random inputs of awkward sizes
(0, 1, not a multiple of any vector width, larger than one tile / parallel grain / reduction
chunk) and compared with the matching ``ops.reference_*`` function: outputs are poisoned (NaN)
first so an element the kernel fails to write shows up, in-place calls compare weights and
optimizer state, peek calls check that weights and state are untouched. While a kernel test
runs, the reference functions inside sapipe.kernels.ops are replaced by stubs that raise, so a
silent fallback to the pure-PyTorch path cannot pass for a kernel.

CPU tests need the C++ extension (``pip install --no-build-isolation -e .``); CUDA tests need
a GPU and the CUDA extension and skip cleanly otherwise. The nvcc test compiles the CUDA
sources wherever nvcc exists, GPU or not. No timings here (see benchmarks/kernels.py).
"""

from __future__ import annotations

import itertools
import os
import random
import shutil
import subprocess
import sys
import sysconfig
import warnings

import pytest
import torch
from support import paths
from support.cuda import cuda_param, on_cuda

from sapipe.kernels import _ext, ops
from sapipe.kernels.gradient_spec import GradientSpec

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64

# the references, captured before any test stubs them out inside sapipe.kernels.ops
REF = {
    name: getattr(ops, name)
    for name in (
        "reference_delay_compensate",
        "reference_dc_dots",
        "reference_compose_gradient",
        "reference_sgd",
        "reference_adam",
        "reference_sgd_fused",
        "reference_adam_fused",
    )
}

CASES = [("cpu", F32), ("cpu", F64)] + [cuda_param("cuda", dt) for dt in (F32, F64, F16, BF16)]
# 0, 1, odd sizes around the vector widths, > one CPU tile (512), > one parallel grain and
# one dot-product chunk (32768 on CPU) and > one CUDA dot tile (16384)
BIG = 70001
SIZES = [0, 1, 3, 17, 1000, BIG]


def thin(grid, n, keep=3):
    """The full option grid for small sizes, a spread of it for the big one (time)."""
    return grid if n < BIG else grid[:: max(1, len(grid) // keep)]


def _require(device):
    if device == "cpu" and not _ext.has_kernels("cpu"):
        pytest.skip(f"CPU extension not built: {_ext.errors.get('_C')}")
    if device == "cuda" and not _ext.has_kernels("cuda"):
        pytest.skip(f"CUDA extension not built: {_ext.errors.get('_C_cuda')}")


@pytest.fixture
def no_fallback(monkeypatch):
    """Make every pure-PyTorch fallback inside sapipe.kernels.ops raise."""

    def stub(name):
        def guarded(*args, **kwargs):
            caller = sys._getframe(1).f_code.co_name
            if caller.startswith("reference_") or caller == "_composed":  # reference internals
                return REF[name](*args, **kwargs)
            raise AssertionError(f"sapipe.kernels.ops fell back to {name} instead of the kernel")

        return guarded

    for name in REF:
        monkeypatch.setattr(ops, name, stub(name))


def tol(dtype):
    return {
        F64: dict(rtol=1e-12, atol=1e-12),
        F32: dict(rtol=1e-6, atol=1e-6),
        F16: dict(rtol=4e-3, atol=4e-3),
        BF16: dict(rtol=3e-2, atol=3e-2),
    }[dtype]


def ref_dtype(dtype):
    """The reference runs in float32 for 16-bit kernels (which compute in float32)."""
    return F32 if dtype in (F16, BF16) else dtype


def close(actual, expected, dtype, what):
    kw = tol(dtype)
    if actual.is_cuda and dtype == F32:
        # On CPU the kernels repeat the reference's float32 operations one by one (same bits
        # up to 1e-6). On CUDA they cannot: nvcc contracts a*b+c into one FMA, and torch's
        # own CUDA division by a scalar multiplies by its reciprocal, so kernel and reference
        # differ by float32 rounding -- a few ulps of the tensor's largest value. The CUDA
        # float64 cases instantiate the same kernel templates and hold their arithmetic to
        # 1e-12, so a wrong term cannot hide in this tolerance.
        scale = float(expected.abs().max()) if expected.numel() else 1.0
        kw = dict(rtol=1e-5, atol=1e-5 * max(1.0, scale))
    torch.testing.assert_close(
        actual.to(expected.dtype), expected, **kw, equal_nan=False, msg=lambda m: f"{what}: {m}"
    )


def rand(n, device, dtype, gen, positive=False):
    x = torch.randn(n, generator=gen, dtype=F64)
    if positive:
        x = x.abs() + 0.05
    return x.to(dtype).to(device)


def poisoned(n, device, dtype):
    return torch.full((n,), float("nan"), device=device, dtype=dtype)


def up(t):
    """The reference's copy of an input (float32 for 16-bit inputs)."""
    return None if t is None else t.to(ref_dtype(t.dtype)).clone()


def partitions(n, seed=0):
    """Tensor-length lists covering n elements, with empty tensors."""
    rng = random.Random(seed + n)
    parts = [[n], [0, n, 0]]
    if n >= 2:
        cuts = sorted(rng.sample(range(1, n), k=min(6, n - 1)))
        bounds = [0] + cuts + [n]
        lens = [b - a for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
        lens.insert(rng.randrange(len(lens) + 1), 0)
        lens.insert(rng.randrange(len(lens) + 1), 0)
        parts.append(lens)
    if 0 < n <= 17:
        parts.append([1] * n)
    if n > 40000:  # tensor boundaries just around the CPU chunk / CUDA tile boundaries
        parts.append([16383, 2, 16382, 1, 32768, 0, n - 65536])
    return parts


# ---------------------------------------------------------------------------------------
# build / load / dispatch
# ---------------------------------------------------------------------------------------


def test_cpu_extension_loaded():
    if os.environ.get("SAPIPE_DISABLE_EXT", "") not in ("", "0") or os.environ.get(
        "SAPIPE_NO_EXT", ""
    ) not in ("", "0"):
        pytest.skip("extension disabled by the environment")
    assert _ext.cpu is not None, (
        f"sapipe._C did not load ({_ext.errors.get('_C')}); build it with "
        "`pip install --no-build-isolation -e .`"
    )
    assert ops.backend("cpu") == "cpu-ext"
    assert _ext.cpu.openmp, "the CPU extension was built without OpenMP"


def test_backend_names():
    assert ops.backend() in ("cpu-ext", "cuda-ext", "torch")
    assert ops.backend("cpu") == ("cpu-ext" if _ext.has_kernels("cpu") else "torch")
    assert ops.backend("cuda") == ("cuda-ext" if _ext.has_kernels("cuda") else "torch")
    assert ops.backend(torch.device("meta")) == "torch"


def test_one_warning_when_extension_missing(monkeypatch):
    monkeypatch.setattr(_ext, "_HAS_KERNELS", {"cpu": False, "cuda": False})
    monkeypatch.setattr(_ext, "DISABLED", False)
    monkeypatch.setattr(_ext, "_warned", {})
    gen = torch.Generator().manual_seed(0)
    p, g, b = (rand(33, "cpu", F32, gen) for _ in range(3))
    p2, b2 = p.clone(), b.clone()
    kw = dict(
        lr=0.1,
        momentum=0.9,
        dampening=0.0,
        nesterov=True,
        weight_decay=1e-2,
        maximize=False,
        first=False,
    )
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            ops.sgd(p, g, b, **kw)
            ops.delay_compensate(g, p, 0.1, "diagonal", [33], out=torch.empty(33))
    ours = [w for w in caught if "sapipe" in str(w.message)]
    assert len(ours) == 1, [str(w.message) for w in ours]
    assert ops.backend("cpu") == "torch"
    for _ in range(3):
        REF["reference_sgd"](p2, g, b2, **kw)
    assert torch.equal(p, p2) and torch.equal(b, b2)


def test_unsupported_inputs_fall_back_to_reference():
    """Non-contiguous / mixed-dtype / CPU-half tensors still get the reference result."""
    gen = torch.Generator().manual_seed(1)
    g = rand(64, "cpu", F32, gen)
    d = rand(64, "cpu", F32, gen)
    strided = torch.full((64, 2), float("nan"))[:, 0]
    ops.delay_compensate(g, d, 0.5, "diagonal", [64], out=strided)
    expected = REF["reference_delay_compensate"](g, d, 0.5, "diagonal", [64], out=torch.empty(64))
    assert torch.equal(strided, expected)
    gh, dh = g.half(), d.half()
    outh = ops.delay_compensate(gh, dh, 0.5, "outer", [60, 4], out=torch.empty(64, dtype=F16))
    refh = REF["reference_delay_compensate"](
        gh, dh, 0.5, "outer", [60, 4], out=torch.empty(64, dtype=F16)
    )
    assert torch.equal(outh, refh)


def test_bad_arguments_raise():
    g = torch.zeros(10)
    with pytest.raises(ValueError):
        ops.delay_compensate(g, g, 0.1, "bogus", [10], out=torch.empty(10))
    with pytest.raises((ValueError, RuntimeError)):
        ops.delay_compensate(g, g, 0.1, "outer", [4, 5], out=torch.empty(10))


# ---------------------------------------------------------------------------------------
# delay compensation, dots, gradient composition
# ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n", SIZES)
def test_delay_compensate_diagonal(device, dtype, n, no_fallback):
    _require(device)
    gen = torch.Generator().manual_seed(n)
    g, d = rand(n, device, dtype, gen), rand(n, device, dtype, gen)
    expected = REF["reference_delay_compensate"](up(g), up(d), 0.5, "diagonal", [n], out=up(g))
    out = poisoned(n, device, dtype)
    assert ops.delay_compensate(g, d, 0.5, "diagonal", [n], out=out) is out
    close(out, expected, dtype, "diagonal DC")
    # out aliasing grad
    g2 = g.clone()
    ops.delay_compensate(g2, d, 0.5, "diagonal", [n], out=g2)
    close(g2, expected, dtype, "diagonal DC in place")


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n", SIZES)
def test_delay_compensate_outer(device, dtype, n, no_fallback):
    _require(device)
    gen = torch.Generator().manual_seed(100 + n)
    g, d = rand(n, device, dtype, gen), rand(n, device, dtype, gen)
    for lengths in partitions(n):
        lam = 0.5
        # exact comparison: the reference given the (float64) per-tensor dots
        dots = REF["reference_dc_dots"](GradientSpec(up(g), delta=up(d), lengths=lengths))
        expected = REF["reference_compose_gradient"](
            GradientSpec(up(g), delta=up(d), lam=lam, form="outer", lengths=lengths, dots=dots),
            up(g),
        )
        out = poisoned(n, device, dtype)
        ops.delay_compensate(g, d, lam, "outer", lengths, out=out)
        close(out, expected, dtype, f"outer DC, lengths {lengths}")
        g2 = g.clone()
        ops.delay_compensate(g2, d, lam, "outer", lengths, out=g2)
        close(g2, expected, dtype, f"outer DC in place, lengths {lengths}")
        if dtype == F64:
            # the reference's own (segment_reduce) dots agree in float64
            plain = REF["reference_delay_compensate"](g, d, lam, "outer", lengths, out=g.clone())
            close(out, plain, dtype, "outer DC vs reference_delay_compensate")
        elif dtype == F32:  # float32-summed reference dots: looser
            plain = REF["reference_delay_compensate"](g, d, lam, "outer", lengths, out=g.clone())
            scale = float(plain.abs().max()) if n else 1.0
            torch.testing.assert_close(out, plain, rtol=1e-5, atol=1e-5 * scale)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n", SIZES)
def test_dc_dots(device, dtype, n, no_fallback):
    _require(device)
    gen = torch.Generator().manual_seed(200 + n)
    g, d, r, p = (rand(n, device, dtype, gen) for _ in range(4))
    for lengths, (use_ref, use_prev) in itertools.product(
        partitions(n), itertools.product((False, True), repeat=2)
    ):
        kw = dict(
            delta_ref=r if use_ref else None, prev_local=p if use_prev else None, world_size=3
        )
        got = ops.dc_dots(GradientSpec(g, delta=d, lengths=lengths, **kw))
        assert got.dtype == F64 and got.shape == (len(lengths),)
        # reference on the same h = g - p/n and D = d - r, rounded as the kernel rounds them
        # (to the dtype; float32 for the 16-bit dtypes, which the kernels compute in). They
        # are formed on the CPU, whose division is the kernels' IEEE one (torch's CUDA
        # division by a scalar multiplies by the reciprocal instead: another rounding).
        gc, pc, dc, rc = (up(t).cpu() for t in (g, p, d, r))
        h = (gc - pc / 3 if use_prev else gc).to(device=device, dtype=F64)
        dd = (dc - rc if use_ref else dc).to(device=device, dtype=F64)
        expected = REF["reference_dc_dots"](GradientSpec(h, delta=dd, lengths=lengths))
        bound = REF["reference_dc_dots"](GradientSpec(h.abs(), delta=dd.abs(), lengths=lengths))
        err = (got - expected).abs()
        assert bool((err <= 1e-13 * bound + 1e-300).all()), (lengths, use_ref, use_prev, err.max())
        empty = torch.tensor([x == 0 for x in lengths], device=device)
        assert bool((got[empty] == 0).all())


def _threads(n):
    class Ctx:
        def __enter__(self):
            self.old = torch.get_num_threads()
            torch.set_num_threads(n)

        def __exit__(self, *exc):
            torch.set_num_threads(self.old)

    return Ctx()


def test_dots_do_not_depend_on_thread_count(no_fallback):
    _require("cpu")
    gen = torch.Generator().manual_seed(7)
    n = 300001
    g, d = rand(n, "cpu", F32, gen), rand(n, "cpu", F32, gen)
    lengths = [100000, 0, 150001, 50000]
    spec = GradientSpec(g, delta=d, lam=0.5, lengths=lengths)
    with _threads(1):
        one = ops.dc_dots(spec)
        out1 = ops.compose_gradient(spec, torch.empty(n))
    with _threads(max(2, torch.get_num_threads())):
        many = ops.dc_dots(spec)
        out2 = ops.compose_gradient(spec, torch.empty(n))
    assert torch.equal(one, many)
    assert torch.equal(out1, out2)


SPECS = [  # (name, uses delta, delta_ref, prev_local, local, form)
    ("plain", False, False, False, False, None),
    ("local only", False, False, True, True, None),
    ("dc diagonal", True, False, False, False, "diagonal"),
    ("dc outer", True, False, False, False, "outer"),
    ("dc outer, delta - ref", True, True, False, False, "outer"),
    ("dc diagonal, delta - ref", True, True, False, False, "diagonal"),
    ("wp3 outer", True, True, True, True, "outer"),
    ("wp3 diagonal", True, True, True, True, "diagonal"),
    ("wp3 outer, prev only", True, False, True, False, "outer"),
]


def _spec_inputs(spec, n, device, dtype, gen, lengths, world_size=3, lam=0.5):
    _, use_delta, use_ref, use_prev, use_local, form = spec
    kw = dict(world_size=world_size)
    if use_delta:
        kw.update(delta=rand(n, device, dtype, gen), lam=lam, form=form, lengths=lengths)
        if use_ref:
            kw["delta_ref"] = rand(n, device, dtype, gen)
    if use_prev:
        kw["prev_local"] = rand(n, device, dtype, gen)
    if use_local:
        kw["local"] = rand(n, device, dtype, gen)
    return kw


def _ref_kw(grad, kw):
    """The reference's copy of a spec, with the float64 dots of the outer form made explicit.

    The kernels accumulate the dots in double; the float32 reference sums in float32. Handing
    the reference the exact dots makes the comparison tight (dots are tested on their own).
    """
    r = {k: (up(v) if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    if r.get("form") == "outer" and "delta" in r:
        r["dots"] = REF["reference_dc_dots"](GradientSpec(up(grad), **r))
    return r


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n", SIZES)
def test_compose_gradient(device, dtype, n, no_fallback):
    _require(device)
    gen = torch.Generator().manual_seed(300 + n)
    g = rand(n, device, dtype, gen)
    for spec, lengths in itertools.product(SPECS, partitions(n)[-2:]):
        kw = _spec_inputs(spec, n, device, dtype, gen, lengths)
        r = _ref_kw(g, kw)
        expected = REF["reference_compose_gradient"](
            GradientSpec(up(g), **r), poisoned(n, device, ref_dtype(dtype))
        )
        out = poisoned(n, device, dtype)
        assert ops.compose_gradient(GradientSpec(g, **kw), out) is out
        close(out, expected, dtype, f"compose {spec[0]} lengths {lengths}")
        # out aliasing grad, and caller-supplied dots
        g2 = g.clone()
        ops.compose_gradient(GradientSpec(g2, **kw), g2)
        close(g2, expected, dtype, f"compose {spec[0]} in place")
        if kw.get("form") == "outer":
            dots = ops.dc_dots(GradientSpec(g, **kw))
            out3 = poisoned(n, device, dtype)
            ops.compose_gradient(GradientSpec(g, dots=dots, **kw), out3)
            assert torch.equal(out3, out)


# ---------------------------------------------------------------------------------------
# SGD / Adam / AdamW, plain and fused
# ---------------------------------------------------------------------------------------

SGD_GRID = [
    dict(momentum=m, nesterov=nest, dampening=damp, weight_decay=wd, maximize=mx, first=first)
    for m, nest, damp, wd, mx, first in itertools.product(
        (0.0, 0.9), (False, True), (0.0, 0.25), (0.0, 1e-2), (False, True), (False, True)
    )
    if not (nest and (m == 0 or damp != 0))  # torch.optim's own constraint on Nesterov
    and not (m == 0 and (damp != 0 or first))
]
ADAM_GRID = [
    dict(weight_decay=wd, decoupled=dec, maximize=mx, step=step, beta1=b1)
    for wd, dec, mx, step, b1 in itertools.product(
        (0.0, 1e-2), (False, True), (False, True), (1, 7), (0.9, 0.3)
    )
]


def _check_sgd(device, dtype, n, hp, spec_kw, gen, peek, fused):
    p, g, b = (rand(n, device, dtype, gen) for _ in range(3))
    rp, rg, rb = up(p), up(g), up(b)
    p0, b0 = p.clone(), b.clone()
    out = poisoned(n, device, dtype) if peek else None
    rout = poisoned(n, device, ref_dtype(dtype)) if peek else None
    if fused:
        r = _ref_kw(g, spec_kw)
        REF["reference_sgd_fused"](
            rp, rb, ops.SGDHyperParams(lr=0.1, **hp), GradientSpec(rg, **r), out=rout
        )
        ops.sgd_fused(p, b, ops.SGDHyperParams(lr=0.1, **hp), GradientSpec(g, **spec_kw), out=out)
    else:
        REF["reference_sgd"](rp, rg, rb, lr=0.1, out=rout, **hp)
        ops.sgd(p, g, b, lr=0.1, out=out, **hp)
    what = f"sgd {hp} peek={peek} fused={fused}"
    if peek:
        close(out, rout, dtype, what + " out")
        assert torch.equal(p, p0) and torch.equal(b, b0), what + ": peek touched state"
    else:
        close(p, rp, dtype, what + " param")
        if hp["momentum"] != 0:
            close(b, rb, dtype, what + " momentum buffer")
        else:
            assert torch.equal(b, b0)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n", SIZES)
def test_sgd(device, dtype, n, no_fallback):
    _require(device)
    gen = torch.Generator().manual_seed(400 + n)
    for hp, peek in itertools.product(thin(SGD_GRID, n, 6), (False, True)):
        _check_sgd(device, dtype, n, hp, {}, gen, peek, fused=False)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n", [0, 1, 17, 1000, BIG])
def test_sgd_fused(device, dtype, n, no_fallback):
    _require(device)
    gen = torch.Generator().manual_seed(500 + n)
    lengths = partitions(n)[-1]
    grid = thin([hp for hp in SGD_GRID if hp["maximize"] == hp["first"]], n, 2)
    for spec, hp, peek in itertools.product(SPECS, grid, (False, True)):
        kw = _spec_inputs(spec, n, device, dtype, gen, lengths)
        _check_sgd(device, dtype, n, hp, kw, gen, peek, fused=True)


def _check_adam(device, dtype, n, hp, spec_kw, gen, peek, fused):
    p, g, m = (rand(n, device, dtype, gen) for _ in range(3))
    v = rand(n, device, dtype, gen, positive=True)
    rp, rg, rm, rv = up(p), up(g), up(m), up(v)
    p0, m0, v0 = p.clone(), m.clone(), v.clone()
    out = poisoned(n, device, dtype) if peek else None
    rout = poisoned(n, device, ref_dtype(dtype)) if peek else None
    common = dict(lr=1e-2, beta2=0.999, eps=1e-8, out=None)
    hp = dict(hp)
    if fused:
        r = _ref_kw(g, spec_kw)
        ahp = ops.AdamHyperParams(lr=1e-2, beta2=0.999, eps=1e-8, **hp)
        REF["reference_adam_fused"](rp, rm, rv, ahp, GradientSpec(rg, **r), out=rout)
        ops.adam_fused(p, m, v, ahp, GradientSpec(g, **spec_kw), out=out)
    else:
        REF["reference_adam"](rp, rg, rm, rv, **{**common, "out": rout}, **hp)
        ops.adam(p, g, m, v, **{**common, "out": out}, **hp)
    what = f"adam {hp} peek={peek} fused={fused}"
    if peek:
        close(out, rout, dtype, what + " out")
        assert torch.equal(p, p0) and torch.equal(m, m0) and torch.equal(v, v0), what
    else:
        close(p, rp, dtype, what + " param")
        close(m, rm, dtype, what + " exp_avg")
        close(v, rv, dtype, what + " exp_avg_sq")


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n", SIZES)
def test_adam(device, dtype, n, no_fallback):
    _require(device)
    gen = torch.Generator().manual_seed(600 + n)
    for hp, peek in itertools.product(thin(ADAM_GRID, n, 6), (False, True)):
        _check_adam(device, dtype, n, hp, {}, gen, peek, fused=False)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n", [0, 1, 17, 1000, BIG])
def test_adam_fused(device, dtype, n, no_fallback):
    _require(device)
    gen = torch.Generator().manual_seed(700 + n)
    lengths = partitions(n)[-1]
    grid = [hp for hp in ADAM_GRID if hp["maximize"] == (hp["step"] == 7) and hp["beta1"] == 0.9]
    grid = thin(grid, n, 2)
    for spec, hp, peek in itertools.product(SPECS, grid, (False, True)):
        kw = _spec_inputs(spec, n, device, dtype, gen, lengths)
        _check_adam(device, dtype, n, hp, kw, gen, peek, fused=True)


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_fused_dc_update_with_delta_aliasing_param(device, dtype, rule, no_fallback):
    """SAPipe-DC in one call: Δ = param − x_old read from the very param being updated."""
    _require(device)
    gen = torch.Generator().manual_seed(800)
    n, lengths = 4099, [1000, 0, 3000, 99]
    p, g, s1, x_old = (rand(n, device, dtype, gen) for _ in range(4))
    s2 = rand(n, device, dtype, gen, positive=True)
    rp, rs1, rs2 = up(p), up(s1), up(s2)
    dc = dict(lam=0.5, form="outer", lengths=lengths)
    dots = REF["reference_dc_dots"](
        GradientSpec(up(g), delta=rp, delta_ref=up(x_old), lengths=lengths)
    )
    rspec = GradientSpec(up(g), delta=rp, delta_ref=up(x_old), dots=dots, **dc)
    spec = GradientSpec(g, delta=p, delta_ref=x_old, **dc)
    if rule == "sgd":
        hp = dict(
            lr=0.1,
            momentum=0.9,
            dampening=0.0,
            nesterov=True,
            weight_decay=1e-2,
            maximize=False,
            first=False,
        )
        REF["reference_sgd_fused"](rp, rs1, ops.SGDHyperParams(**hp), rspec)
        ops.sgd_fused(p, s1, ops.SGDHyperParams(**hp), spec)
    else:
        hp = dict(
            step=3,
            lr=1e-2,
            beta1=0.9,
            beta2=0.999,
            eps=1e-8,
            weight_decay=1e-2,
            decoupled=True,
            maximize=False,
        )
        REF["reference_adam_fused"](rp, rs1, rs2, ops.AdamHyperParams(**hp), rspec)
        ops.adam_fused(p, s1, s2, ops.AdamHyperParams(**hp), spec)
        close(s2, rs2, dtype, "exp_avg_sq")
    close(p, rp, dtype, "param")
    close(s1, rs1, dtype, "state")


# The extras of an in-place update (ops module doc): the history write, the fused peek and
# the step's dot products. Each case: (name, builds the extras from the tensors at hand).
# Expected values come from the plain references run one after the other: the update, then
# hist = x_t, dots = reference_dc_dots(g~, x_t, x_{t-1}), then OPT_peek(x_t, g~) with
# Δ = x_t − x_{t-1} given explicitly — not from the references' own extras code.
EXTRA_CASES = [
    "hist",
    "hist_aliasing_delta_ref",
    "peek_wp1",
    "peek_wp2",
    "peek_wp3_diagonal",
    "dots_wp3_outer",
    "all",
]


def _extras_case(case, t, world_size, lengths):
    """(update terms, hist, peek GradientSpec or None, its out or None, wants step dots) for
    ``case``; ``t`` holds the tensors (kernel or reference copies alike)."""
    upd, hist, peek, out, dots = {}, None, None, None, False
    n = world_size
    if case == "hist":
        hist = t["hist"]
    elif case == "hist_aliasing_delta_ref":  # SAPipe-DC: x_t written over the x_old it reads
        upd = dict(delta=t["p"], delta_ref=t["x_old"], lam=0.5, form="diagonal")
        hist = t["x_old"]
    elif case == "peek_wp1":
        peek, out = GradientSpec(t["local"], world_size=n), t["out"]
    elif case == "peek_wp2":
        peek, out = GradientSpec(t["g"], world_size=n), t["out"]
    elif case == "peek_wp3_diagonal":
        peek = GradientSpec(
            t["g"],
            prev_local=t["prev"],
            local=t["local"],
            form="diagonal",
            lam=0.7,
            world_size=n,
            delta_is_step=True,
            lengths=lengths,
        )
        out = t["out"]
    elif case == "dots_wp3_outer":
        peek = GradientSpec(
            t["g"],
            prev_local=t["prev"],
            local=t["local"],
            form="outer",
            lam=0.7,
            world_size=n,
            delta_is_step=True,
            lengths=lengths,
        )
        dots = True
    elif case == "all":
        hist = t["hist"]
        peek = GradientSpec(
            t["g"],
            prev_local=t["prev"],
            local=t["local"],
            form="diagonal",
            lam=0.3,
            world_size=n,
            delta_is_step=True,
            lengths=lengths,
        )
        out = t["out"]
        dots = True
    return upd, hist, peek, out, dots


@pytest.mark.parametrize("device,dtype", CASES)
@pytest.mark.parametrize("n", [0, 1, 17, 1000, BIG])
@pytest.mark.parametrize("rule", ["sgd", "adam"])
def test_update_extras(device, dtype, n, rule, no_fallback):
    _require(device)
    gen = torch.Generator().manual_seed(850 + n)
    lengths = partitions(n)[-1]
    world_size = 3
    if rule == "sgd":
        hps = [
            dict(
                lr=0.1,
                momentum=0.9,
                dampening=0.25,
                nesterov=False,
                weight_decay=1e-2,
                maximize=False,
                first=True,
            ),
            dict(
                lr=0.1,
                momentum=0.9,
                dampening=0.0,
                nesterov=True,
                weight_decay=0.0,
                maximize=True,
                first=False,
            ),
            dict(
                lr=0.1,
                momentum=0.0,
                dampening=0.0,
                nesterov=False,
                weight_decay=1e-2,
                maximize=False,
                first=False,
            ),
        ]
    else:
        hps = [
            dict(
                step=1,
                lr=1e-2,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=1e-2,
                decoupled=True,
                maximize=False,
            ),
            dict(
                step=6,
                lr=1e-2,
                beta1=0.3,
                beta2=0.99,
                eps=1e-8,
                weight_decay=1e-2,
                decoupled=False,
                maximize=True,
            ),
        ]
    for case, hp in itertools.product(EXTRA_CASES, hps):
        what = f"{rule} {case} {hp}"
        k = {
            name: rand(n, device, dtype, gen) for name in ("p", "g", "s1", "x_old", "prev", "local")
        }
        k["s2"] = rand(n, device, dtype, gen, positive=True)
        k["hist"], k["out"] = poisoned(n, device, dtype), poisoned(n, device, dtype)
        r = {name: up(v) for name, v in k.items()}
        upd, hist, peek, pout, want_dots = _extras_case(case, k, world_size, lengths)
        step_dots = (
            torch.full((len(lengths),), float("nan"), dtype=F64, device=device)
            if want_dots
            else None
        )
        if want_dots:
            peek = peek.with_dots(step_dots)
        # kernel
        state = (k["s1"],) if rule == "sgd" else (k["s1"], k["s2"])
        fused = ops.sgd_fused if rule == "sgd" else ops.adam_fused
        Hyper = ops.SGDHyperParams if rule == "sgd" else ops.AdamHyperParams
        fused(
            k["p"],
            *state,
            Hyper(**hp),
            GradientSpec(k["g"], lengths=lengths, hist=hist, **upd),
            peek=peek,
            out=pout,
        )
        # plain references, one after the other
        rupd, _, rpeek, _, _ = _extras_case(case, r, world_size, lengths)
        rstate = (r["s1"],) if rule == "sgd" else (r["s1"], r["s2"])
        rfused = REF["reference_sgd_fused"] if rule == "sgd" else REF["reference_adam_fused"]
        before = r["p"].clone()
        rfused(r["p"], *rstate, Hyper(**hp), GradientSpec(r["g"], lengths=lengths, **rupd))
        close(k["p"], r["p"], dtype, what + " param")
        for a, b in zip(state, rstate, strict=True):
            if rule == "adam" or hp["momentum"] != 0:
                close(a, b, dtype, what + " state")
        if hist is not None:
            assert torch.equal(hist, k["p"]), what + " hist"
        if want_dots:
            # over the step the kernel took and stored, x_t - x_{t-1}: for 16-bit weights the
            # reference's float32 x_t is not that (the step is far below one 16-bit ulp of x)
            expected = REF["reference_dc_dots"](
                GradientSpec(
                    rpeek.grad,
                    delta=up(k["p"]),
                    delta_ref=before,
                    prev_local=rpeek.prev_local,
                    world_size=world_size,
                    lengths=lengths,
                )
            )
            close(step_dots, expected, F64 if dtype == F64 else F32, what + " step_dots")
            if device == "cpu":  # bit for bit the separate dots pass
                separate = ops.dc_dots(
                    GradientSpec(
                        peek.grad,
                        delta=k["p"],
                        delta_ref=before.to(dtype),
                        prev_local=peek.prev_local,
                        world_size=world_size,
                        lengths=lengths,
                    )
                )
                assert torch.equal(step_dots, separate), what + " step_dots vs dc_dots"
        if pout is not None:
            dc = (
                dict(delta=r["p"], delta_ref=before, lam=rpeek.lam, form="diagonal")
                if rpeek.delta_is_step
                else {}
            )
            rout = poisoned(n, device, ref_dtype(dtype))
            peek_hp = dict(hp, first=False) if rule == "sgd" else dict(hp, step=hp["step"] + 1)
            rfused(
                r["p"],
                *rstate,
                Hyper(**peek_hp),
                GradientSpec(
                    rpeek.grad,
                    prev_local=rpeek.prev_local,
                    local=rpeek.local,
                    world_size=world_size,
                    lengths=lengths,
                    **dc,
                ),
                out=rout,
            )
            close(pout, rout, dtype, what + " peek out")


def test_update_extras_reference_path_matches_kernel(no_fallback):
    """ops.reference_*_fused with extras (the SAPIPE_DISABLE_EXT path) = the CPU kernel."""
    _require("cpu")
    gen = torch.Generator().manual_seed(870)
    n, lengths = 5003, [1000, 0, 4000, 3]
    # "sgd first": the momentum buffer is seeded by this update, and the peek after it must not
    # seed it again
    for name, case in itertools.product(["sgd", "sgd first", "adam"], EXTRA_CASES):
        rule = name.split()[0]
        k = {name: rand(n, "cpu", F64, gen) for name in ("p", "g", "s1", "x_old", "prev", "local")}
        k["s2"] = rand(n, "cpu", F64, gen, positive=True)
        k["hist"], k["out"] = poisoned(n, "cpu", F64), poisoned(n, "cpu", F64)
        r = {name: v.clone() for name, v in k.items()}
        hp = (
            dict(
                lr=0.1,
                momentum=0.9,
                dampening=0.0,
                nesterov=True,
                weight_decay=1e-2,
                maximize=False,
                first=name == "sgd first",
            )
            if rule == "sgd"
            else dict(
                step=3,
                lr=1e-2,
                beta1=0.9,
                beta2=0.999,
                eps=1e-8,
                weight_decay=1e-2,
                decoupled=True,
                maximize=False,
            )
        )
        results = []
        for t, fn in (
            (k, ops.sgd_fused if rule == "sgd" else ops.adam_fused),
            (r, REF["reference_sgd_fused"] if rule == "sgd" else REF["reference_adam_fused"]),
        ):
            upd, hist, peek, pout, want = _extras_case(case, t, 2, lengths)
            dots = torch.full((len(lengths),), float("nan"), dtype=F64) if want else None
            state = (t["s1"],) if rule == "sgd" else (t["s1"], t["s2"])
            Hyper = ops.SGDHyperParams if rule == "sgd" else ops.AdamHyperParams
            fn(
                t["p"],
                *state,
                Hyper(**hp),
                GradientSpec(t["g"], lengths=lengths, hist=hist, **upd),
                peek=peek.with_dots(dots) if want else peek,
                out=pout,
            )
            results.append(
                [t["p"], *state]
                + ([hist] if hist is not None else [])
                + ([pout] if pout is not None else [])
                + ([dots] if dots is not None else [])
            )
        for a, b in zip(*results, strict=True):
            close(a, b, F64, f"{name} {case}")


def test_update_extras_bad_arguments(no_fallback):
    _require("cpu")
    p, g, b, out, x_old = (torch.rand(10) for _ in range(5))
    hp = ops.SGDHyperParams(
        lr=0.1,
        momentum=0.9,
        dampening=0.0,
        nesterov=False,
        weight_decay=0.0,
        maximize=False,
        first=False,
    )
    dots = torch.zeros(1, dtype=F64)
    step = dict(delta_is_step=True, lengths=[10])
    bad = [  # (update spec, peek, out)
        (GradientSpec(g), GradientSpec(g), None),  # a peek with neither out nor dots
        (GradientSpec(g), GradientSpec(g, dots=dots, lengths=[10]), None),  # dots of no step
        (GradientSpec(g, hist=torch.zeros(10)), None, out),  # extras with a peek call
        (GradientSpec(g), GradientSpec(g, form="outer", **step), out),  # fused outer peek
        (GradientSpec(g), GradientSpec(g, delta=p, lam=0.1), out),  # a peek's explicit delta
        (GradientSpec(g, **step), None, None),  # the update's own step as its Δ
        (
            GradientSpec(g, delta=p, delta_ref=x_old, lengths=[10]),  # step dots, outer update
            GradientSpec(g, dots=dots, **step),
            None,
        ),
    ]
    for spec, peek, o in bad:
        with pytest.raises((ValueError, RuntimeError)):
            ops.sgd_fused(p, b, hp, spec, peek=peek, out=o)
    with pytest.raises(ValueError):
        GradientSpec(g, delta_ref=x_old)  # delta_ref without delta


@pytest.mark.parametrize("compression", [None, "bf16"])
@pytest.mark.parametrize("mode", ["wp1", "wp3"])
def test_local_gradient_copy_paths_agree(mode, compression, monkeypatch):
    """The engine keeps l_t (wp1, wp3) by writing backward's gradients into both ``local`` and
    the communication slot (large parameters; compressed as bf16, the outgoing messages), or
    into ``local`` and copying it at launch (small ones; then encoded): both paths train
    bit-identically (one process, Gloo group of 1)."""
    import socket

    import torch.distributed as dist

    import sapipe
    from sapipe.runtime import pipeline as engine

    if dist.is_initialized():
        pytest.skip("a default process group already exists in this process")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        results = []
        for threshold in (0, 10**9):  # always mirror / never mirror
            monkeypatch.setattr(engine, "MIRROR_LOCAL_MIN_MEAN_NUMEL", threshold)
            torch.manual_seed(0)
            model = torch.nn.Sequential(
                torch.nn.Linear(7, 33), torch.nn.Tanh(), torch.nn.Linear(33, 3)
            )
            opt = sapipe.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                model,
                stale_layers=2,
                compensation=mode,
                dc_form="outer",
                compression=compression,
            )
            gen = torch.Generator().manual_seed(1)
            for _ in range(5):
                opt.zero_grad()
                model(torch.randn(4, 7, generator=gen)).square().sum().backward()
                opt.step()
            with opt.real_weights():
                results.append(
                    [p.detach().clone() for p in model.parameters()]
                    + [
                        g.local.clone()
                        for g in map(opt._runtime.pipeline.gradients, opt.buckets)
                        if g.local is not None
                    ]
                )
            opt.close()
        assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    finally:
        dist.destroy_process_group()


def test_step_dots_do_not_depend_on_thread_count(no_fallback):
    _require("cpu")
    gen = torch.Generator().manual_seed(880)
    n, lengths = 200003, [70000, 1, 0, 130002]
    results = []
    previous = torch.get_num_threads()
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            gen.manual_seed(881)
            p, g, b, prev = (rand(n, "cpu", F32, gen) for _ in range(4))
            dots = torch.empty(len(lengths), dtype=F64)
            hp = ops.SGDHyperParams(
                lr=0.1,
                momentum=0.9,
                dampening=0.0,
                nesterov=False,
                weight_decay=0.0,
                maximize=False,
                first=False,
            )
            peek = GradientSpec(
                g, prev_local=prev, world_size=2, delta_is_step=True, lengths=lengths, dots=dots
            )
            ops.sgd_fused(p, b, hp, GradientSpec(g, lengths=lengths), peek=peek)
            results.append(dots)
    finally:
        torch.set_num_threads(previous)
    assert all(torch.equal(results[0], d) for d in results[1:])


@pytest.mark.parametrize(
    "device",
    ["cpu", cuda_param("cuda")],
)
@pytest.mark.parametrize("name", ["sgd", "nesterov", "adam", "adamw"])
def test_kernels_follow_torch_optim(device, name, no_fallback):
    """Several steps of the kernels on a flat tensor track torch.optim to 1e-6 (float32)."""
    _require(device)
    gen = torch.Generator().manual_seed(900)
    n = 1031
    x = torch.nn.Parameter(rand(n, device, F32, gen))
    flat = x.detach().clone()
    if name in ("sgd", "nesterov"):
        hp = dict(
            lr=0.05,
            momentum=0.9,
            dampening=0.0 if name == "nesterov" else 0.1,
            nesterov=name == "nesterov",
            weight_decay=1e-3,
            maximize=False,
        )
        opt = torch.optim.SGD([x], **hp)
        buf = torch.zeros_like(flat)
    else:
        hp = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=1e-2)
        opt = (torch.optim.AdamW if name == "adamw" else torch.optim.Adam)([x], foreach=False, **hp)
        m, v = torch.zeros_like(flat), torch.zeros_like(flat)
    for step in range(1, 6):
        grad = rand(n, device, F32, gen)
        x.grad = grad.clone()
        opt.step()
        if name in ("sgd", "nesterov"):
            ops.sgd(flat, grad, buf, first=step == 1, **hp)
        else:
            ops.adam(
                flat,
                grad,
                m,
                v,
                step=step,
                lr=hp["lr"],
                beta1=0.9,
                beta2=0.99,
                eps=1e-8,
                weight_decay=hp["weight_decay"],
                decoupled=name == "adamw",
                maximize=False,
            )
        torch.testing.assert_close(flat, x.detach(), rtol=1e-6, atol=1e-6)


def test_cpu_isa_variants_agree_bitwise(no_fallback):
    """The AVX2 and baseline builds of the CPU tile kernels give identical bits."""
    _require("cpu")
    previous = _ext.cpu.cpu_isa()
    if not _ext.cpu.set_cpu_isa("avx2"):
        pytest.skip("this CPU has no AVX2")
    gen = torch.Generator().manual_seed(11)
    n, lengths = 20011, [5000, 0, 15000, 11]
    results = {}
    try:
        for isa in ("base", "avx2"):
            assert _ext.cpu.set_cpu_isa(isa) and _ext.cpu.cpu_isa() == isa
            gen.manual_seed(11)
            for dtype in (F32, F64):
                p, g, b, m, x_old, prev, local = (rand(n, "cpu", dtype, gen) for _ in range(7))
                v = rand(n, "cpu", dtype, gen, positive=True)
                wp3 = dict(
                    delta=p,
                    delta_ref=x_old,
                    lam=0.3,
                    lengths=lengths,
                    prev_local=prev,
                    local=local,
                    world_size=3,
                )
                outs = [
                    ops.dc_dots(
                        GradientSpec(
                            g,
                            delta=p,
                            delta_ref=x_old,
                            prev_local=prev,
                            world_size=3,
                            lengths=lengths,
                        )
                    ),
                    ops.dc_dots(GradientSpec(g, delta=p, lengths=lengths)),
                ]
                for form in ("outer", "diagonal"):
                    spec = GradientSpec(g, form=form, **wp3)
                    outs.append(ops.compose_gradient(spec, torch.empty(n, dtype=dtype)))
                    out = torch.empty(n, dtype=dtype)
                    ops.sgd_fused(
                        p,
                        b,
                        ops.SGDHyperParams(
                            lr=0.1,
                            momentum=0.9,
                            dampening=0.1,
                            nesterov=False,
                            weight_decay=1e-2,
                            maximize=False,
                            first=False,
                        ),
                        spec,
                        out=out,
                    )
                    outs.append(out)
                    out = torch.empty(n, dtype=dtype)
                    ops.adam_fused(
                        p,
                        m,
                        v,
                        ops.AdamHyperParams(
                            step=3,
                            lr=1e-2,
                            beta1=0.9,
                            beta2=0.99,
                            eps=1e-8,
                            weight_decay=1e-2,
                            decoupled=form == "outer",
                            maximize=False,
                        ),
                        spec,
                        out=out,
                    )
                    outs.append(out)
                ops.sgd(
                    p,
                    g,
                    b,
                    lr=0.1,
                    momentum=0.9,
                    dampening=0.0,
                    nesterov=True,
                    weight_decay=1e-2,
                    maximize=True,
                    first=False,
                )
                ops.adam(
                    p,
                    g,
                    m,
                    v,
                    step=2,
                    lr=1e-2,
                    beta1=0.9,
                    beta2=0.99,
                    eps=1e-8,
                    weight_decay=1e-2,
                    decoupled=False,
                    maximize=False,
                )
                results[(isa, dtype)] = outs + [p, b, m, v]
    finally:
        _ext.cpu.set_cpu_isa(previous)
    for dtype in (F32, F64):
        for a, b in zip(results[("base", dtype)], results[("avx2", dtype)], strict=True):
            assert torch.equal(a, b)


def test_in_place_kernels_bump_version_counters(no_fallback):
    _require("cpu")
    p, g, b, m, v = (torch.rand(100) for _ in range(5))
    before = (p._version, b._version)
    ops.sgd(
        p,
        g,
        b,
        lr=0.1,
        momentum=0.9,
        dampening=0.0,
        nesterov=False,
        weight_decay=0.0,
        maximize=False,
        first=False,
    )
    assert p._version > before[0] and b._version > before[1]
    before = (p._version, m._version, v._version)
    ops.adam(
        p,
        g,
        m,
        v,
        step=1,
        lr=0.1,
        beta1=0.9,
        beta2=0.99,
        eps=1e-8,
        weight_decay=0.0,
        decoupled=False,
        maximize=False,
    )
    assert p._version > before[0] and m._version > before[1] and v._version > before[2]


# ---------------------------------------------------------------------------------------
# nvcc: the CUDA sources compile (no GPU needed)
# ---------------------------------------------------------------------------------------

CSRC = str(paths.CSRC)
CSRC_INCLUDES = [
    f"-I{os.path.join(CSRC, d)}" for d in ("", "cpu", "codec", "cuda")
]  # as setup.py's

STANDALONE = r"""
#include "codec.cuh"
#include "kernels.cuh"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
namespace sc = sapipe_cuda;
#define INST(T)                                                                               \
  template cudaError_t sc::launch_dots<T>(const sc::GradSrc<T>&, int64_t, double*, double*,    \
                                          cudaStream_t);                                      \
  template cudaError_t sc::launch_compose<T>(const sc::GradSrc<T>&, int64_t, T*, int,          \
                                             cudaStream_t);                                   \
  template cudaError_t sc::launch_sgd<T>(const sc::GradSrc<T>&, int64_t, T*, T*, T*,           \
                                         const sc::SgdParams&, const sc::StepExtras<T>&,      \
                                         double*, double*, int, cudaStream_t);                \
  template cudaError_t sc::launch_adam<T>(const sc::GradSrc<T>&, int64_t, T*, T*, T*, T*,     \
                                          const sc::AdamParams&, const sc::StepExtras<T>&,    \
                                          double*, double*, int, cudaStream_t);
INST(float)
INST(double)
INST(__half)
INST(__nv_bfloat16)
namespace cc = sapipe_codec;
#define CODEC(T)                                                                              \
  template cudaError_t cc::launch_encode<T>(int, const T*, T*, int64_t, const cc::Rows&, T,     \
                                            int, cudaStream_t);                               \
  template cudaError_t cc::launch_sum_encode<T>(int, const cc::Rows&, T*, const cc::Rows&, T,   \
                                                int, cudaStream_t);                           \
  template cudaError_t cc::launch_decode<T>(int, const cc::Rows&, T*, int64_t, T, int,          \
                                            cudaStream_t);
CODEC(float)
CODEC(double)
"""


@on_cuda(ok=shutil.which("nvcc") is not None, reason="nvcc not found")
@pytest.mark.slow
def test_nvcc_compiles_cuda_sources(tmp_path):
    """csrc/cuda/kernels.cuh (all four dtypes) and csrc/codec/codec.cuh standalone,
    csrc/cuda/cuda_ops.cu and csrc/codec/cuda_codec.cu against torch's headers, and the CUDA
    module's operator registrations with the host compiler, run side by side.

    A CPU-only torch wheel ships c10/cuda headers but not the build-generated
    c10/cuda/impl/cuda_cmake_macros.h; a one-line stand-in is supplied for it then.
    """
    from torch.utils import cpp_extension

    nvcc = shutil.which("nvcc")
    (tmp_path / "standalone.cu").write_text(STANDALONE)
    arch = ["-gencode=arch=compute_80,code=sm_80"]
    torch_inc = cpp_extension.include_paths()
    stub = tmp_path / "stub"
    torch_root = torch_inc[0]
    if not os.path.exists(os.path.join(torch_root, "c10", "cuda", "impl", "cuda_cmake_macros.h")):
        (stub / "c10" / "cuda" / "impl").mkdir(parents=True)
        (stub / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h").write_text("#pragma once\n")
    incs = [f"-I{p}" for p in torch_inc] + [f"-I{stub}", *CSRC_INCLUDES]
    torch_defs = [
        "-D__CUDA_NO_HALF_OPERATORS__",
        "-D__CUDA_NO_HALF_CONVERSIONS__",
        "-D__CUDA_NO_BFLOAT16_CONVERSIONS__",
        "-D__CUDA_NO_HALF2_OPERATORS__",
        "--expt-relaxed-constexpr",
    ]
    cxx = os.environ.get("CXX", "c++")
    jobs = {
        "kernels.cuh standalone": [
            nvcc,
            "-c",
            "-std=c++17",
            "-O3",
            *arch,
            *CSRC_INCLUDES,
            str(tmp_path / "standalone.cu"),
            "-o",
            str(tmp_path / "k.o"),
        ],
        "cuda_ops.cu with torch headers": [
            nvcc,
            "-c",
            "-std=c++20",
            "-O3",
            *arch,
            *torch_defs,
            *incs,
            os.path.join(CSRC, "cuda", "cuda_ops.cu"),
            "-o",
            str(tmp_path / "cuda_ops.o"),
        ],
        "cuda_codec.cu with torch headers": [
            nvcc,
            "-c",
            "-std=c++20",
            "-O3",
            *arch,
            *torch_defs,
            *incs,
            os.path.join(CSRC, "codec", "cuda_codec.cu"),
            "-o",
            str(tmp_path / "cuda_codec.o"),
        ],
        "cuda_library.cpp (host)": [
            cxx,
            "-fsyntax-only",
            "-std=c++20",
            *incs,
            f"-I{sysconfig.get_paths()['include']}",
            "-DTORCH_EXTENSION_NAME=_C_cuda",
            os.path.join(CSRC, "cuda", "cuda_library.cpp"),
        ],
    }
    procs = {
        name: subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for name, cmd in jobs.items()
    }
    failures = {}
    for name, proc in procs.items():
        out, _ = proc.communicate(timeout=600)
        if proc.returncode != 0:
            failures[name] = out[-3000:]
    assert not failures, "\n\n".join(f"{k}:\n{v}" for k, v in failures.items())
    assert (tmp_path / "k.o").stat().st_size > 0
    assert (tmp_path / "cuda_ops.o").stat().st_size > 0
    assert (tmp_path / "cuda_codec.o").stat().st_size > 0
