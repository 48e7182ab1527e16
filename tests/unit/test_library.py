"""The kernels as torch operators: ``torch.ops.sapipe`` (csrc/library.cpp), their CPU and CUDA
registrations and their fake implementations (sapipe/kernels/library.py).

* ``torch.library.opcheck`` on every operator, with the arguments ``sapipe.kernels.ops`` and
  ``sapipe.kernels.codec`` build: the schema's mutation marks against what the kernel really
  writes, the fake implementation against the real one, and the call traced through
  AOTAutograd (functionalised) against eager.
* ``torch.compile(fullgraph=True)`` of code calling the public entry points: one graph, no
  break, the same bits as eager.
* The dispatcher picks the kernel by device: a kernel per device type that was built, and
  none for the others.
"""

from __future__ import annotations

import pytest
import torch
from support.cuda import cuda_param

from sapipe.kernels import _ext, ops
from sapipe.kernels import codec as ck
from sapipe.kernels.gradient_spec import GradientSpec

pytestmark = pytest.mark.skipif(
    not _ext.has_kernels("cpu"), reason=f"sapipe._C not built ({_ext.errors.get('_C')})"
)

DEVICES = [
    "cpu",
    cuda_param("cuda", ok=torch.cuda.is_available() and _ext.has_kernels("cuda")),
]
N, LENGTHS = 200, [50, 120, 30]
SGD = ops.SGDHyperParams(
    lr=0.1, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=1e-2, maximize=False,
    first=False,
)  # fmt: skip
ADAM = ops.AdamHyperParams(
    step=3, lr=1e-2, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2, decoupled=True,
    maximize=False,
)  # fmt: skip


def _tensors(device, count, gen):
    return [torch.randn(N, generator=gen).to(device) for _ in range(count)]


def _update_cases(device):
    """(name, operator, arguments) of the updates ``ops`` issues, one per combination of
    extras: OPT in place with a weight-history write, OPT_peek into ``out``, OPT with a fused
    peek, OPT writing the step's dot products for the outer form's peek."""
    gen = torch.Generator().manual_seed(0)
    p, buf, g, x_old, hist, l_prev, l_now, out = _tensors(device, 8, gen)
    dc = GradientSpec(g, delta=p.clone(), delta_ref=x_old, lam=0.3, form="diagonal", hist=hist)
    outer = GradientSpec(g, delta=p.clone(), delta_ref=x_old, lam=0.3, lengths=LENGTHS)
    peek = GradientSpec(
        g, prev_local=l_prev, local=l_now, world_size=2, lam=0.3, form="diagonal",
        delta_is_step=True,
    )  # fmt: skip
    dots = torch.zeros(len(LENGTHS), dtype=torch.float64, device=device)
    peek_dots = GradientSpec(
        g, lam=0.3, lengths=LENGTHS, dots=dots, delta_is_step=True, world_size=2
    )
    sgd = torch.ops.sapipe.sgd.default
    adam = torch.ops.sapipe.adam.default
    m, v = buf.clone(), buf.abs().clone()

    def sgd_args(spec, peek_spec, target):
        return (p, buf, *ops._sgd_args(SGD), *ops._spec_args(spec), spec.hist,
                *ops._peek_args(peek_spec, g), target)  # fmt: skip

    def adam_args(spec, peek_spec, target):
        return (p, m, v, *ops._adam_args(ADAM), *ops._spec_args(spec), spec.hist,
                *ops._peek_args(peek_spec, g), target)  # fmt: skip

    return [
        ("sgd, dc with history", sgd, sgd_args(dc, None, None)),
        ("sgd, outer dc", sgd, sgd_args(outer, None, None)),
        ("sgd, peek into out", sgd, sgd_args(GradientSpec(g), None, out)),
        ("sgd, fused peek", sgd, sgd_args(GradientSpec(g), peek, out)),
        ("sgd, the step's dots", sgd, sgd_args(GradientSpec(g), peek_dots, None)),
        ("adam, dc with history", adam, adam_args(dc, None, None)),
        ("adam, fused peek", adam, adam_args(GradientSpec(g), peek, out)),
        ("compose, outer", torch.ops.sapipe.compose.default, (*ops._spec_args(outer), out)),
        (
            "compose, wp3",
            torch.ops.sapipe.compose.default,
            (
                *ops._spec_args(
                    GradientSpec(
                        g,
                        delta=p.clone(),
                        delta_ref=x_old,
                        prev_local=l_prev,
                        local=l_now,
                        world_size=2,
                        lam=0.3,
                        form="diagonal",
                    )
                ),
                out,
            ),
        ),  # fmt: skip
        (
            "dc_dots",
            torch.ops.sapipe.dc_dots.default,
            (g, l_prev, 2.0, p.clone(), x_old, ops._offsets(LENGTHS, g)),
        ),  # fmt: skip
    ]


def _codec_cases(device):
    """(name, operator, arguments) of the codec's stages: int8 with scales and error
    feedback, bf16 without."""
    gen = torch.Generator().manual_seed(1)
    rows, width = 2, 128
    src = torch.randn(rows * width - 7, generator=gen, dtype=torch.float64).to(device)
    residual = torch.randn(src.numel(), generator=gen, dtype=torch.float64).to(device) * 1e-3
    q = torch.zeros(rows, width, dtype=torch.int8, device=device)
    scales = torch.zeros(rows, width // ck.BLOCK, dtype=torch.float32, device=device)
    ck.reference_encode(src, None, q, scales, 1.0)
    h = src.new_zeros(rows, width, dtype=torch.bfloat16)
    ck.reference_encode(src, None, h, None, 2.0)
    row_q = torch.zeros(1, width, dtype=torch.int8, device=device)
    row_scales = torch.zeros(1, width // ck.BLOCK, dtype=torch.float32, device=device)
    server_residual = torch.zeros(width, dtype=torch.float64, device=device)
    encode = torch.ops.sapipe.codec_encode.default
    return [
        ("encode int8, error feedback", encode, (src, residual, q.clone(), scales.clone(), 1.0)),
        ("encode bf16", encode, (src, None, h.clone(), None, 2.0)),
        (
            "sum_encode int8",
            torch.ops.sapipe.codec_sum_encode.default,
            (q, scales, server_residual, row_q, row_scales, 1.0, torch.float64),
        ),  # fmt: skip
        (
            "decode int8",
            torch.ops.sapipe.codec_decode.default,
            (q, scales, torch.empty_like(src), 1.0),
        ),  # fmt: skip
        (
            "decode bf16",
            torch.ops.sapipe.codec_decode.default,
            (h, None, torch.empty_like(src), 2.0),
        ),  # fmt: skip
    ]


def _cases(device):
    return _update_cases(device) + _codec_cases(device)


CASE_NAMES = [name for name, _, _ in _cases("cpu")]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", CASE_NAMES)
def test_opcheck(device, case):
    """The schema marks every argument the kernel writes and no other; the fake
    implementation gives what the kernel gives; the traced, functionalised call equals eager."""
    name, op, args = next(c for c in _cases(device) if c[0] == case)
    torch.library.opcheck(op, args)


def _sgd_step(p, buf, g, x_old, hist, out):
    spec = GradientSpec(g, delta=p, delta_ref=x_old, lam=0.3, form="diagonal", hist=hist)
    ops.sgd_fused(p, buf, SGD, spec)
    peek = GradientSpec(g, lam=0.3, form="diagonal", delta_is_step=True)
    ops.adam_fused(p, buf, hist.abs(), ADAM, GradientSpec(g), peek=peek, out=out)
    return out * 2


def _codec_round_trip(src, residual, q, scales, out):
    ck.encode(src, residual, q, scales)
    ck.decode(q, scales, out)
    return out + 1


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_calls_have_no_graph_break(device):
    """Code calling the entry points compiles into one graph (``fullgraph=True``) holding the
    sapipe operators, and computes what eager computes, bit for bit."""
    gen = torch.Generator().manual_seed(2)

    def update_inputs():
        gen.manual_seed(2)
        p, buf, g, x_old, hist, out = _tensors(device, 6, gen)
        return [p, buf, g, x_old, hist, out]

    def codec_inputs():
        gen.manual_seed(3)
        src = torch.randn(300, generator=gen).to(device)
        residual = torch.zeros_like(src)
        q = torch.zeros(3, 128, dtype=torch.int8, device=device)
        scales = torch.zeros(3, 2, dtype=torch.float32, device=device)
        return [src, residual, q, scales, torch.empty_like(src)]

    for function, inputs in ((_sgd_step, update_inputs), (_codec_round_trip, codec_inputs)):
        seen: list[str] = []

        def backend(gm, example_inputs, seen=seen):
            seen.extend(str(node.target) for node in gm.graph.nodes)
            return gm.forward

        torch._dynamo.reset()
        eager, compiled = inputs(), inputs()
        expected = function(*eager)
        got = torch.compile(function, backend=backend, fullgraph=True)(*compiled)
        ours = [target for target in seen if target.startswith("sapipe.")]
        assert len(ours) == 2, seen
        assert torch.equal(got, expected)
        for a, b in zip(compiled, eager):
            assert torch.equal(a, b)


def test_the_dispatcher_picks_the_kernel_by_device():
    """Each operator has a kernel for every device type whose module was built (CPU always,
    here) and a fake one for tracing; on a device without a kernel the call fails loudly."""
    names = ["dc_dots", "compose", "sgd", "adam", "codec_encode", "codec_sum_encode"]
    names.append("codec_decode")
    for name in names:
        qualified = f"sapipe::{name}"
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CPU")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "Meta")
        has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key(qualified, "CUDA")
        assert has_cuda == _ext.has_kernels("cuda")
    assert ops.backend("cpu") == "cpu-ext"
    if not _ext.has_kernels("cuda"):
        assert ops.backend("cuda") == "torch"
