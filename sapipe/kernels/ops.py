"""Elementwise kernels on flat buffers: delay compensation and the optimizer arithmetic.

Each function works on one contiguous slice of a bucket (a *segment*: parameters sharing
one param group). The ``reference_*`` functions are the pure-PyTorch implementation; they
follow the exact operation sequence of ``torch.optim``'s single-tensor SGD/Adam so that
synchronous layers reproduce ``torch.optim`` (and hence DDP) to rounding.

The public names (``delay_compensate``, ``sgd``, ``adam`` and the fused entry points
``compose_gradient``, ``dc_dots``, ``sgd_fused``, ``adam_fused``) call the
``torch.ops.sapipe`` operators (csrc/library.cpp), whose kernel the dispatcher picks by the
tensors' device: fused C++ (registered by ``sapipe._C``: CPU, float32/float64) or CUDA
(``sapipe._C_cuda``: float16/bfloat16/float32/float64), when built; else they run the
reference. The reference also runs for anything the kernels do not take (non-contiguous
or mixed-device/dtype tensors, tensors that require grad while grad mode is on). A missing
extension is reported by one warning (sapipe/kernels/_ext.py); ``SAPIPE_DISABLE_EXT=1`` forces the
reference. Kernels and references are compared on random inputs in tests/unit/test_kernels.py.

Fused entry points take the gradient the update consumes as a
:class:`~sapipe.kernels.gradient_spec.GradientSpec`

    g~ = DC_lam(grad - prev_local / world_size, delta - delta_ref) + local / world_size

every term optional. That covers ``dc`` (DC_lam(g, x - x_old), fused with OPT) and ``wp3``
(DC_lam(g - l_prev/n, x_t - x_{t-1}) + l_t/n, fused with OPT_peek) in one call per segment.
The outer DC form needs per-tensor dot products first (a second pass over memory, done by
the kernel itself unless the spec's ``dots`` from :func:`dc_dots` are given; with ``dots``
given, no ``delta`` is needed); the diagonal form is one pass. The optimizer's numbers come
as :class:`SGDHyperParams` / :class:`AdamHyperParams`.

An in-place update (``out=None``) can do more in the same pass, so that staleness
compensation costs no extra pass over the weights for it (docs/design.md §5):

* ``spec.hist``: x_t is written there too (a weight-history slot; may alias ``delta_ref``);
* ``peek``, a second GradientSpec g̃ whose Δ is x_t − x_{t−1}, the step this very update
  takes (``delta_is_step``; or no DC): x̃ = OPT_peek(x_t, g̃) from the just-updated weights
  and optimizer state, written to ``out`` (weight prediction; wp3 without a weight history).
  The fused peek takes the diagonal form; the outer form's coefficient needs every element's
  step first, so then the update writes the per-tensor dot products
  <peek.grad − peek.prev_local/n, x_t − x_{t−1}> into ``peek.dots`` (float64, one per
  tensor) and a second call, given those dots, peeks.

Whether the extras go together is checked once, by :func:`_check_update`, for the kernels
and the reference alike; the operators check only what their kernels dereference. The
operators have fake implementations (sapipe/kernels/library.py), so ``torch.compile`` traces
a call to them without a graph break.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from sapipe.errors import ConfigurationError
from sapipe.kernels import _ext
from sapipe.kernels.gradient_spec import GradientSpec

_NO_DC, _DIAGONAL, _OUTER = 0, 1, 2
_FORMS = {"diagonal": _DIAGONAL, "outer": _OUTER}
# dtypes each compiled back end takes; anything else runs the reference
_EXT_DTYPES = {
    "cpu": (torch.float32, torch.float64),
    "cuda": (torch.float32, torch.float64, torch.float16, torch.bfloat16),
}


@dataclass(frozen=True)
class SGDHyperParams:
    """One ``torch.optim.SGD`` step's numbers (its param group's), plus ``first``: the momentum
    buffer has never been written (torch seeds it with the first gradient)."""

    lr: float
    momentum: float
    dampening: float
    nesterov: bool
    weight_decay: float
    maximize: bool
    first: bool

    def after_update(self) -> SGDHyperParams:
        """The numbers of OPT_peek from the weights and state this step produces."""
        return dataclasses.replace(self, first=False)


@dataclass(frozen=True)
class AdamHyperParams:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) step's numbers; ``step`` is
    the 1-based count of this update (bias correction)."""

    step: int
    lr: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    decoupled: bool
    maximize: bool

    def after_update(self) -> AdamHyperParams:
        """The numbers of OPT_peek from the weights and state this step produces."""
        return dataclasses.replace(self, step=self.step + 1)


def backend(device=None) -> str:
    """Which kernel implementation runs: ``"cpu-ext"``, ``"cuda-ext"`` or ``"torch"``.

    With ``device`` (a ``torch.device`` or string) the answer is for tensors on that device;
    without, for the default device of training here (CUDA when available and its
    extension is built, else CPU).
    """
    if device is None:
        if _ext.has_kernels("cuda") and torch.cuda.is_available():
            return "cuda-ext"
        return "cpu-ext" if _ext.has_kernels("cpu") else "torch"
    kind = torch.device(device).type
    return f"{kind}-ext" if _ext.has_kernels(kind) else "torch"


def kernel_unavailable(device, dtype: torch.dtype) -> str | None:
    """Why tensors of ``dtype`` on ``device`` would run the pure-PyTorch path (None: compiled)."""
    kind = torch.device(device).type
    name = _ext.MODULE_OF_DEVICE.get(kind)
    if name is None:
        return f"no compiled kernels for {kind} tensors"
    if not _ext.has_kernels(kind):
        return f"sapipe.{name} is not built ({_ext.errors.get(name, 'not built')})"
    if dtype not in _EXT_DTYPES[kind]:
        return f"sapipe.{name} does not take {dtype}"
    return None


def _compiled(*tensors: Tensor | None) -> bool:
    """Whether the compiled operators take these tensors (all alike and contiguous).

    Called once per segment per update, so it compares devices by their flags and index
    rather than building a ``torch.device`` per tensor.
    """
    t0 = tensors[0]
    assert t0 is not None
    device = t0.device
    if t0.dtype not in _EXT_DTYPES.get(device.type, ()) or not _ext.compiled_for(device):
        return False
    dtype, numel, on_cpu, index = t0.dtype, t0.numel(), t0.is_cpu, t0.get_device()
    grad_mode = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if not (
            t.is_contiguous()
            and t.dtype == dtype
            and t.numel() == numel
            and (t.is_cpu if on_cpu else (t.is_cuda and t.get_device() == index))
        ):
            return False
        if grad_mode and t.requires_grad:
            return False
    return True


_OFFSETS: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def _offsets(lengths: Sequence[int] | None, like: Tensor) -> Tensor:
    """int64 tensor boundaries [0, l0, l0+l1, ..., N] on ``like``'s device (cached)."""
    if lengths is None:
        raise ConfigurationError("the outer delay-compensation form needs the tensor lengths")
    key = (tuple(int(n) for n in lengths), like.device)
    cached = _OFFSETS.get(key)
    if cached is None:
        if any(n < 0 for n in key[0]):
            raise ConfigurationError(f"negative tensor length in {list(key[0])}")
        if sum(key[0]) != like.numel():
            raise ConfigurationError(
                f"tensor lengths sum to {sum(key[0])}, the segment has {like.numel()} elements"
            )
        bounds = [0]
        for n in key[0]:
            bounds.append(bounds[-1] + n)
        cached = torch.tensor(bounds, dtype=torch.int64).to(like.device)
        if len(_OFFSETS) >= 1024:
            _OFFSETS.clear()
        _OFFSETS[key] = cached
    return cached


def _dots_ok(dots: Tensor | None, like: Tensor) -> bool:
    return dots is None or (
        dots.dtype == torch.float64 and dots.device == like.device and dots.is_contiguous()
    )


def _check_update(spec: GradientSpec, peek: GradientSpec | None, out: Tensor | None) -> None:
    """The one check that an update's extras go together (module doc), for kernel and reference.

    ``peek=None``: OPT in place (``out=None``) or OPT_peek into ``out`` (no history write).
    """
    if spec.delta_is_step:
        raise ConfigurationError("only a peek's Δ can be the update's own step (delta_is_step)")
    if peek is None:
        if out is not None and spec.hist is not None:
            raise ConfigurationError("hist needs an in-place update (out=None, or a peek)")
        return
    if peek.delta is not None or peek.hist is not None:
        raise ConfigurationError(
            "a fused peek's Δ is the update's own step and it writes no history; "
            "for an explicit delta, update, then peek"
        )
    if peek.dots is not None and not peek.delta_is_step:
        raise ConfigurationError("a peek's dots are those of the update's step: set delta_is_step")
    if out is not None and peek.delta_is_step and peek.form == "outer":
        raise ConfigurationError(
            "the outer form's peek needs every element's step first: the update "
            "fills peek.dots, then a second call peeks given them"
        )
    if out is None and peek.dots is None:
        raise ConfigurationError("a peek needs out (x̃) or dots (the step's dot products)")
    if peek.dots is not None and spec.compensates and spec.form == "outer":
        raise ConfigurationError(
            "the step's dot products with an outer-form update are not supported"
        )


def _spec_args(spec: GradientSpec) -> tuple:
    """``spec`` as the operators' flat spec arguments (csrc/library.cpp's SPEC): the one place
    they are built."""
    code = _FORMS[spec.form] if spec.compensates else _NO_DC
    dots = spec.dots if code == _OUTER else None
    offsets = _offsets(spec.lengths, spec.grad) if code == _OUTER else None
    return (
        spec.grad,
        spec.prev_local,
        float(spec.world_size),
        spec.local,
        1.0 / spec.world_size,
        code,
        spec.delta,
        spec.delta_ref,
        float(spec.lam),
        offsets,
        dots,
    )


_NO_PEEK = (None, None, 1.0, None, 1.0, _NO_DC, 0.0, None, None)


def _peek_args(peek: GradientSpec | None, like: Tensor) -> tuple:
    """A fused peek as the operators' peek arguments (csrc/library.cpp's PEEK, then peek_dots):
    its Δ is the update's step, so it has no delta; the step's dot products it asks for are
    written by the update."""
    if peek is None:
        return _NO_PEEK
    code = _FORMS[peek.form] if peek.compensates else _NO_DC
    offsets = _offsets(peek.lengths, like) if peek.dots is not None else None
    return (
        peek.grad,
        peek.prev_local,
        float(peek.world_size),
        peek.local,
        1.0 / peek.world_size,
        code,
        float(peek.lam),
        offsets,
        peek.dots,
    )


def _updates_compiled(
    spec: GradientSpec, peek: GradientSpec | None, out: Tensor | None, *state
) -> bool:
    """Whether an update (after :func:`_check_update`) runs the compiled operator."""
    _check_update(spec, peek, out)
    peek_tensors = peek.flat_tensors() if peek is not None else ()
    if not _compiled(*spec.flat_tensors(), out, *state, *peek_tensors):
        return False
    if not _dots_ok(spec.dots, spec.grad):
        return False
    return peek is None or _dots_ok(peek.dots, spec.grad)


def _sgd_args(hp: SGDHyperParams) -> tuple:
    """The kernel's scalars (``damp1`` = 1 − dampening, as the reference computes it)."""
    return (
        float(hp.lr),
        float(hp.momentum),
        float(1 - hp.dampening),
        float(hp.weight_decay),
        bool(hp.nesterov),
        bool(hp.maximize),
        bool(hp.first),
    )


def _adam_args(hp: AdamHyperParams) -> tuple:
    """The kernel's scalars, exactly as the reference computes them (Python doubles); the
    fused peek's bias correction is that of ``step + 1``."""
    lr, beta1, beta2, step = hp.lr, hp.beta1, hp.beta2, hp.step
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    peek_step_size = lr / (1 - beta1 ** (step + 1))
    peek_bc2_sqrt = (1 - beta2 ** (step + 1)) ** 0.5
    return (
        float(-step_size),
        float(bias_correction2**0.5),
        float(1 - beta1),
        float(beta2),
        float(1 - beta2),
        float(hp.eps),
        float(hp.weight_decay),
        float(1 - lr * hp.weight_decay),
        bool(hp.decoupled),
        bool(hp.maximize),
        float(-peek_step_size),
        float(peek_bc2_sqrt),
    )


# ---------------------------------------------------------------------------------------
# Public entry points (dispatching)
# ---------------------------------------------------------------------------------------


def delay_compensate(
    grad: Tensor, delta: Tensor, lam: float, form: str, lengths: Sequence[int], out: Tensor
) -> Tensor:
    """Write DC_λ(grad, delta) into ``out`` (which may alias ``grad``).

    ``outer``: g + λ·(g·Δ)·g with g·Δ the dot product over each parameter tensor, whose
    sizes along the flat buffer are ``lengths``. ``diagonal``: g + λ·g⊙g⊙Δ (DC-ASGD).
    """
    return compose_gradient(
        GradientSpec(grad, delta=delta, lam=lam, form=form, lengths=lengths), out
    )


def sgd(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | None,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    first: bool,
    out: Tensor | None = None,
) -> None:
    """One SGD step on a flat segment, as ``torch.optim.SGD`` does it.

    With ``out=None`` the update is applied: ``param`` and ``momentum_buffer`` change in
    place. With ``out`` given this is OPT_peek: the would-be weights are written to ``out``
    and neither ``param`` nor the momentum buffer is touched. ``first`` says the momentum
    buffer has never been written (torch initialises it with the first gradient).
    """
    hp = SGDHyperParams(lr, momentum, dampening, nesterov, weight_decay, maximize, first)
    sgd_fused(param, momentum_buffer, hp, GradientSpec(grad), out=out)


def adam(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    out: Tensor | None = None,
) -> None:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) step on a flat segment.

    ``step`` is the 1-based count of this update (bias correction). ``out=None`` applies
    the update in place; with ``out`` it is OPT_peek (moments and weights untouched).
    """
    hp = AdamHyperParams(step, lr, beta1, beta2, eps, weight_decay, decoupled, maximize)
    adam_fused(param, exp_avg, exp_avg_sq, hp, GradientSpec(grad), out=out)


def dc_dots(spec: GradientSpec) -> Tensor:
    """Per-tensor dot products <grad − prev_local/n, delta − delta_ref> of ``spec`` (its
    ``lengths``) as float64 [len(lengths)], whatever its form.

    The first pass of the outer DC form; give the result as a spec's ``dots`` to reuse it
    (e.g. for the real update and the peek of the same gradient).
    """
    if spec.delta is None:
        raise ConfigurationError("dc_dots needs delta")
    if not _compiled(*spec.flat_tensors()):
        return reference_dc_dots(spec)
    offsets = _offsets(spec.lengths, spec.grad)
    return torch.ops.sapipe.dc_dots.default(
        spec.grad, spec.prev_local, float(spec.world_size), spec.delta, spec.delta_ref, offsets
    )


def compose_gradient(spec: GradientSpec, out: Tensor) -> Tensor:
    """out = DC_λ(grad − prev_local/n, delta − delta_ref) + local/n (``out`` may alias inputs)."""
    _check_update(spec, None, out)
    if not _compiled(*spec.flat_tensors(), out) or not _dots_ok(spec.dots, spec.grad):
        return reference_compose_gradient(spec, out)
    torch.ops.sapipe.compose.default(*_spec_args(spec), out)
    return out


def sgd_fused(
    param: Tensor,
    momentum_buffer: Tensor | None,
    hp: SGDHyperParams,
    spec: GradientSpec,
    *,
    peek: GradientSpec | None = None,
    out: Tensor | None = None,
) -> None:
    """:func:`sgd` on the composed gradient g̃ of ``spec``, in one kernel.

    ``out=None``: OPT (param and momentum buffer updated in place; ``spec.delta`` may alias
    ``param``; x_t also into ``spec.hist``). ``out`` without ``peek``: OPT_peek into ``out``,
    no state touched. With ``peek``: OPT, then OPT_peek(x_t, peek) into ``out`` and / or the
    step's dot products into ``peek.dots`` (module doc).
    """
    buf = momentum_buffer if hp.momentum != 0 else None
    if not _updates_compiled(spec, peek, out, param, buf):
        return reference_sgd_fused(param, momentum_buffer, hp, spec, peek=peek, out=out)
    torch.ops.sapipe.sgd.default(
        param,
        buf,
        *_sgd_args(hp),
        *_spec_args(spec),
        spec.hist,
        *_peek_args(peek, spec.grad),
        out,
    )


def adam_fused(
    param: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    hp: AdamHyperParams,
    spec: GradientSpec,
    *,
    peek: GradientSpec | None = None,
    out: Tensor | None = None,
) -> None:
    """:func:`adam` on the composed gradient g̃ of ``spec``, in one kernel; ``out`` and
    ``peek`` as for :func:`sgd_fused` (the peek's bias correction is that of ``step + 1``)."""
    if not _updates_compiled(spec, peek, out, param, exp_avg, exp_avg_sq):
        return reference_adam_fused(param, exp_avg, exp_avg_sq, hp, spec, peek=peek, out=out)
    torch.ops.sapipe.adam.default(
        param,
        exp_avg,
        exp_avg_sq,
        *_adam_args(hp),
        *_spec_args(spec),
        spec.hist,
        *_peek_args(peek, spec.grad),
        out,
    )


# ---------------------------------------------------------------------------------------
# Pure-PyTorch reference implementations
# ---------------------------------------------------------------------------------------


def reference_delay_compensate(
    grad: Tensor, delta: Tensor, lam: float, form: str, lengths: Sequence[int], out: Tensor
) -> Tensor:
    """Reference of :func:`delay_compensate`: write DC_λ(grad, delta) into ``out``.

    ``outer``: g + λ·(g·Δ)·g with g·Δ the dot product over each parameter tensor, whose
    sizes along the flat buffer are ``lengths``. ``diagonal``: g + λ·g⊙g⊙Δ (DC-ASGD).
    """
    if form == "diagonal":
        # out = g + lam * g * g * delta, evaluated without aliasing hazards.
        scale = grad * delta
        scale.mul_(grad).mul_(lam)
        return torch.add(grad, scale, out=out)
    if form != "outer":
        raise ConfigurationError(f"unknown delay-compensation form {form!r}")
    if grad.numel() == 0:
        return out
    dots = torch.segment_reduce(
        grad * delta, "sum", lengths=torch.tensor(list(lengths), device=grad.device)
    )
    coeff = dots.mul_(lam).repeat_interleave(
        torch.tensor(list(lengths), device=grad.device), output_size=grad.numel()
    )
    # out = g * (1 + lam * <g, delta>_tensor)
    return torch.addcmul(grad, grad, coeff, out=out)


def reference_sgd(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Tensor | None,
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    first: bool,
    out: Tensor | None = None,
) -> None:
    """Reference of :func:`sgd` (torch.optim.SGD's single-tensor step)."""
    d_p = grad.neg() if maximize else grad
    if weight_decay != 0:
        d_p = d_p.add(param, alpha=weight_decay)
    if momentum != 0:
        assert momentum_buffer is not None
        if out is None:
            buf = momentum_buffer
            if first:
                buf.copy_(d_p)
            else:
                buf.mul_(momentum).add_(d_p, alpha=1 - dampening)
        else:
            buf = (
                d_p.clone()
                if first
                else momentum_buffer.mul(momentum).add_(d_p, alpha=1 - dampening)
            )
        d_p = d_p.add(buf, alpha=momentum) if nesterov else buf
    if out is None:
        param.add_(d_p, alpha=-lr)
    else:
        torch.add(param, d_p, alpha=-lr, out=out)


def reference_adam(
    param: Tensor,
    grad: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
    decoupled: bool,
    maximize: bool,
    out: Tensor | None = None,
) -> None:
    """Reference of :func:`adam` (torch.optim.Adam(W)'s single-tensor step)."""
    g = grad.neg() if maximize else grad
    peek = out is not None
    if peek:
        base = param.clone()
    else:
        base = param
    if weight_decay != 0:
        if decoupled:
            base.mul_(1 - lr * weight_decay)
        else:
            g = g.add(param, alpha=weight_decay)
    if peek:
        m = exp_avg.lerp(g, 1 - beta1)
        v = exp_avg_sq.mul(beta2).addcmul_(g, g, value=1 - beta2)
    else:
        m = exp_avg.lerp_(g, 1 - beta1)
        v = exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    denom = (v.sqrt() / bias_correction2**0.5).add_(eps)
    base.addcdiv_(m, denom, value=-step_size)
    if peek:
        out.copy_(base)


def reference_dc_dots(spec: GradientSpec) -> Tensor:
    """Reference of :func:`dc_dots` (products and sums in float64)."""
    grad = spec.grad
    h = grad if spec.prev_local is None else grad - spec.prev_local / spec.world_size
    d = spec.delta if spec.delta_ref is None else spec.delta - spec.delta_ref
    lens = torch.tensor(list(spec.lengths), device=grad.device)
    if grad.numel() == 0:
        return torch.zeros(len(lens), dtype=torch.float64, device=grad.device)
    return torch.segment_reduce(h.double() * d.double(), "sum", lengths=lens)


def reference_compose_gradient(spec: GradientSpec, out: Tensor) -> Tensor:
    """Reference of :func:`compose_gradient`: the op sequence of compensation.py's wp3 / dc."""
    grad, n = spec.grad, spec.world_size
    h = grad if spec.prev_local is None else grad - spec.prev_local / n
    if spec.form == "outer" and spec.dots is not None:  # Δ entered only through the dots
        lens = torch.tensor(list(spec.lengths), device=grad.device)
        coeff = (
            spec.dots.to(h.dtype, copy=True)
            .mul_(spec.lam)
            .repeat_interleave(lens, output_size=h.numel())
        )
        torch.addcmul(h, h, coeff, out=out)
    elif spec.delta is None:
        out.copy_(h)
    else:
        d = spec.delta if spec.delta_ref is None else spec.delta - spec.delta_ref
        reference_delay_compensate(h, d, spec.lam, spec.form, spec.lengths, out=out)
    if spec.local is not None:
        out.add_(spec.local, alpha=1.0 / n)
    return out


def _composed(spec: GradientSpec) -> Tensor:
    """g̃ of ``spec`` as a tensor: ``grad`` itself when there is nothing to compose."""
    if spec.prev_local is None and spec.local is None and not spec.compensates:
        return spec.grad
    return reference_compose_gradient(spec, torch.empty_like(spec.grad))


def reference_sgd_fused(
    param: Tensor,
    momentum_buffer: Tensor | None,
    hp: SGDHyperParams,
    spec: GradientSpec,
    *,
    peek: GradientSpec | None = None,
    out: Tensor | None = None,
) -> None:
    """Reference of :func:`sgd_fused` (:func:`reference_update` with :func:`reference_sgd`)."""
    reference_update(reference_sgd, param, (momentum_buffer,), hp, spec, peek, out)


def reference_adam_fused(
    param: Tensor,
    exp_avg: Tensor,
    exp_avg_sq: Tensor,
    hp: AdamHyperParams,
    spec: GradientSpec,
    *,
    peek: GradientSpec | None = None,
    out: Tensor | None = None,
) -> None:
    """Reference of :func:`adam_fused` (:func:`reference_update` with :func:`reference_adam`)."""
    reference_update(reference_adam, param, (exp_avg, exp_avg_sq), hp, spec, peek, out)


def reference_update(
    rule: Callable[..., None],
    param: Tensor,
    state: tuple[Tensor | None, ...],
    hp: SGDHyperParams | AdamHyperParams,
    spec: GradientSpec,
    peek: GradientSpec | None,
    out: Tensor | None,
) -> None:
    """A fused update done one operation after the other: :func:`reference_compose_gradient`,
    then ``rule`` (:func:`reference_sgd` / :func:`reference_adam`, with ``state`` its buffers
    and ``hp`` its numbers), then the extras: the history write, the step's dot products and
    OPT_peek(x_t, peek) with Δ = x_t − x_{t−1} given explicitly."""
    needs_step = peek is not None and (
        peek.dots is not None or (out is not None and peek.delta_is_step)
    )
    before = param.clone() if needs_step else None
    rule(param, _composed(spec), *state, **vars(hp), out=out if peek is None else None)
    if peek is None and out is not None:
        return  # OPT_peek: no extras
    if spec.hist is not None:
        spec.hist.copy_(param)
    if peek is None:
        return
    if peek.dots is not None:
        # Summed in the tensors' dtype, as reference_delay_compensate's outer form does (this
        # is the SAPIPE_DISABLE_EXT path: float64 temporaries of the whole segment would cost
        # more than the rest of the step); the kernels sum in float64.
        h = peek.grad if peek.prev_local is None else peek.grad - peek.prev_local / peek.world_size
        if param.numel() == 0:
            peek.dots.zero_()
        else:
            lens = torch.tensor(list(peek.lengths), device=param.device)
            peek.dots.copy_(torch.segment_reduce(h * (param - before), "sum", lengths=lens))
    if out is not None:
        step = dict(delta=param, delta_ref=before) if peek.delta_is_step else {}
        explicit = peek.replace(delta_is_step=False, dots=None, **step)
        reference_update(rule, param, state, hp.after_update(), explicit, None, out)
