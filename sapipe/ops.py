"""Elementwise kernels on flat buffers: delay compensation and the optimizer arithmetic.

Each function works on one contiguous slice of a bucket (a *segment*: parameters sharing
one param group). The ``reference_*`` functions are the pure-PyTorch implementation; they
follow the exact operation sequence of ``torch.optim``'s single-tensor SGD/Adam so that
synchronous layers reproduce ``torch.optim`` (and hence DDP) to rounding.

The public names (``delay_compensate``, ``sgd``, ``adam`` and the fused entry points
``compose_gradient``, ``dc_dots``, ``sgd_fused``, ``adam_fused``) dispatch per call on the
tensors' device: to the fused C++ kernels (``sapipe._C``: CPU, float32/float64) or CUDA
kernels (``sapipe._C_cuda``: float16/bfloat16/float32/float64) when built, else to the
reference. The reference also runs for anything the kernels do not take (non-contiguous
or mixed-device/dtype tensors, tensors that require grad while grad mode is on). A missing
extension is reported by one warning (sapipe/_ext.py); ``SAPIPE_DISABLE_EXT=1`` forces the
reference. Kernels and references are compared on random inputs in tests/test_kernels.py.

Fused entry points describe the gradient the update consumes as

    g~ = DC_lam(grad - prev_local / world_size, delta - delta_ref) + local / world_size

every term optional (``delta=None``: no delay compensation; ``delta_ref=None``: Delta is
``delta`` itself). That covers ``dc`` (DC_lam(g, x - x_old), fused with OPT) and ``wp3``
(DC_lam(g - l_prev/n, x_t - x_{t-1}) + l_t/n, fused with OPT_peek) in one call per segment.
The outer DC form needs per-tensor dot products first (a second pass over memory, done by
the kernel itself unless ``dots`` from :func:`dc_dots` is passed; with ``dots`` given, no
``delta`` is needed); the diagonal form is one pass.

An in-place update (``out=None``) can do more in the same pass, so that staleness
compensation costs no extra pass over the weights for it (DESIGN.md §5):

* ``hist``: x_t is written there too (a weight-history slot; may alias ``delta_ref``);
* ``peek=FusedPeek(out, grad, ...)``: x̃ = OPT_peek(x_t, g̃) from the just-updated weights
  and optimizer state, written to ``peek.out`` (weight prediction); g̃'s optional diagonal DC
  uses Δ = x_t − x_{t−1}, the step this very update takes (wp3, without a weight history);
* ``step_dots``: float64 [len(lengths)] receives <peek.grad − peek.prev_local/n, x_t − x_{t−1}>
  per tensor, the outer DC form's dot products for a peek done by a second call with
  ``dots=step_dots``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Tuple

import torch
from torch import Tensor

from . import _ext

_NO_DC, _DIAGONAL, _OUTER = 0, 1, 2
_FORMS = {"diagonal": _DIAGONAL, "outer": _OUTER}
# dtypes each compiled back end takes; anything else runs the reference
_EXT_DTYPES = {
    "cpu": (torch.float32, torch.float64),
    "cuda": (torch.float32, torch.float64, torch.float16, torch.bfloat16),
}


@dataclass(frozen=True)
class FusedPeek:
    """OPT_peek fused into an in-place update: ``out`` = OPT_peek(x_t, g̃) from the updated
    weights and state, g̃ = DC(grad − prev_local/n, x_t − x_{t−1}) + local/n.

    ``form``: None (no DC) or ``"diagonal"`` here; the outer form's coefficient needs every
    element's step first, so it runs as the update with ``step_dots`` then a plain peek call
    (:meth:`sapipe.optim_math.OptimizerRule.update_and_peek`). ``out=None``: no peek (the
    terms only feed ``step_dots``).
    """

    out: Optional[Tensor]
    grad: Tensor
    prev_local: Optional[Tensor] = None
    local: Optional[Tensor] = None
    form: Optional[str] = None
    lam: float = 0.0
    world_size: int = 1

    def tensors(self) -> Tuple[Optional[Tensor], ...]:
        return (self.out, self.grad, self.prev_local, self.local)


def backend(device=None) -> str:
    """Which kernel implementation runs: ``"cpu-ext"``, ``"cuda-ext"`` or ``"torch"``.

    With ``device`` (a ``torch.device`` or string) the answer is for tensors on that device;
    without, for the default device of training here (CUDA when available and its
    extension is built, else CPU).
    """
    if device is None:
        if _ext.cuda is not None and torch.cuda.is_available():
            return "cuda-ext"
        return "cpu-ext" if _ext.cpu is not None else "torch"
    kind = torch.device(device).type
    mod = {"cpu": _ext.cpu, "cuda": _ext.cuda}.get(kind)
    return f"{kind}-ext" if mod is not None else "torch"


def _module(*tensors: Optional[Tensor]):
    """The compiled module that takes these tensors (all alike and contiguous), or None."""
    t0 = tensors[0]
    assert t0 is not None
    if t0.dtype not in _EXT_DTYPES.get(t0.device.type, ()):
        return None
    mod = _ext.module_for(t0.device)
    if mod is None:
        return None
    grad_mode = torch.is_grad_enabled()
    for t in tensors:
        if t is None:
            continue
        if (
            t.device != t0.device
            or t.dtype != t0.dtype
            or t.numel() != t0.numel()
            or not t.is_contiguous()
            or (grad_mode and t.requires_grad)
        ):
            return None
    return mod


_OFFSETS: Dict[Tuple[Tuple[int, ...], torch.device], Tensor] = {}


def _offsets(lengths: Optional[Sequence[int]], like: Tensor) -> Tensor:
    """int64 tensor boundaries [0, l0, l0+l1, ..., N] on ``like``'s device (cached)."""
    if lengths is None:
        raise ValueError("the outer delay-compensation form needs the tensor lengths")
    key = (tuple(int(n) for n in lengths), like.device)
    cached = _OFFSETS.get(key)
    if cached is None:
        if any(n < 0 for n in key[0]):
            raise ValueError(f"negative tensor length in {list(key[0])}")
        if sum(key[0]) != like.numel():
            raise ValueError(
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


def _form_code(form: str) -> int:
    try:
        return _FORMS[form]
    except KeyError:
        raise ValueError(f"unknown delay-compensation form {form!r}") from None


def _spec(grad, delta, delta_ref, lam, form, lengths, dots, prev_local, local, world_size):
    """Positional GradSpec arguments of the compiled entry points."""
    if delta is None and not (dots is not None and form == "outer"):
        if delta_ref is not None:
            raise ValueError("delta_ref given without delta")
        code, offsets, dots = _NO_DC, None, None
    else:
        code = _form_code(form)
        offsets = _offsets(lengths, grad) if code == _OUTER else None
        if code != _OUTER:
            dots = None
    return (
        grad, prev_local, float(world_size), local, 1.0 / world_size, code,
        delta, delta_ref, float(lam), offsets, dots,
    )


def _dots_ok(dots: Optional[Tensor], like: Tensor) -> bool:
    return dots is None or (
        dots.dtype == torch.float64 and dots.device == like.device and dots.is_contiguous()
    )


def _extra_tensors(hist, peek) -> Tuple[Optional[Tensor], ...]:
    return (hist,) + (peek.tensors() if peek is not None else ())


def _extras(hist, peek, step_dots, lengths, like) -> Dict[str, object]:
    """Keyword arguments of the compiled sgd / adam for an update's extras (see module doc)."""
    if step_dots is not None and peek is None:
        raise ValueError("step_dots needs peek (its grad / prev_local terms)")
    if peek is not None and peek.form not in (None, "diagonal"):
        raise ValueError(f"a fused peek takes form None or 'diagonal', not {peek.form!r}")
    kw: Dict[str, object] = {"hist": hist}
    if peek is not None:
        kw.update(
            peek_out=peek.out, peek_grad=peek.grad, peek_prev_local=peek.prev_local,
            peek_n=float(peek.world_size), peek_local=peek.local, peek_inv_n=1.0 / peek.world_size,
            peek_form=_DIAGONAL if peek.form == "diagonal" else _NO_DC, peek_lam=float(peek.lam),
            peek_offsets=_offsets(lengths, like) if step_dots is not None else None,
            step_dots=step_dots,
        )
    return kw


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
    mod = _module(grad, delta, out)
    if mod is None:
        return reference_delay_compensate(grad, delta, lam, form, lengths, out)
    mod.compose(out, *_spec(grad, delta, None, lam, form, lengths, None, None, None, 1))
    return out


def sgd(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Optional[Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    first: bool,
    out: Optional[Tensor] = None,
) -> None:
    """One SGD step on a flat segment, as ``torch.optim.SGD`` does it.

    With ``out=None`` the update is applied: ``param`` and ``momentum_buffer`` change in
    place. With ``out`` given this is OPT_peek: the would-be weights are written to ``out``
    and neither ``param`` nor the momentum buffer is touched. ``first`` says the momentum
    buffer has never been written (torch initialises it with the first gradient).
    """
    sgd_fused(
        param, grad, momentum_buffer, lr=lr, momentum=momentum, dampening=dampening,
        nesterov=nesterov, weight_decay=weight_decay, maximize=maximize, first=first, out=out,
    )


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
    out: Optional[Tensor] = None,
) -> None:
    """One Adam (``decoupled=False``) or AdamW (``decoupled=True``) step on a flat segment.

    ``step`` is the 1-based count of this update (bias correction). ``out=None`` applies
    the update in place; with ``out`` it is OPT_peek (moments and weights untouched).
    """
    adam_fused(
        param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, decoupled=decoupled, maximize=maximize, out=out,
    )


def dc_dots(
    grad: Tensor,
    delta: Tensor,
    lengths: Sequence[int],
    *,
    delta_ref: Optional[Tensor] = None,
    prev_local: Optional[Tensor] = None,
    world_size: int = 1,
) -> Tensor:
    """Per-tensor dot products <grad − prev_local/n, delta − delta_ref> as float64 [len(lengths)].

    The first pass of the outer DC form; pass the result as ``dots=`` to the fused entry
    points to reuse it (e.g. for the real update and the peek of the same gradient).
    """
    mod = _module(grad, delta, delta_ref, prev_local)
    if mod is None:
        return reference_dc_dots(
            grad, delta, lengths, delta_ref=delta_ref, prev_local=prev_local, world_size=world_size
        )
    return mod.dc_dots(grad, prev_local, float(world_size), delta, delta_ref, _offsets(lengths, grad))


def compose_gradient(
    grad: Tensor,
    *,
    out: Tensor,
    delta: Optional[Tensor] = None,
    delta_ref: Optional[Tensor] = None,
    lam: float = 0.0,
    form: str = "outer",
    lengths: Optional[Sequence[int]] = None,
    dots: Optional[Tensor] = None,
    prev_local: Optional[Tensor] = None,
    local: Optional[Tensor] = None,
    world_size: int = 1,
) -> Tensor:
    """out = DC_λ(grad − prev_local/n, delta − delta_ref) + local/n (``out`` may alias inputs)."""
    mod = _module(grad, out, delta, delta_ref, prev_local, local)
    if mod is None or not _dots_ok(dots, grad):
        return reference_compose_gradient(
            grad, out=out, delta=delta, delta_ref=delta_ref, lam=lam, form=form, lengths=lengths,
            dots=dots, prev_local=prev_local, local=local, world_size=world_size,
        )
    mod.compose(
        out, *_spec(grad, delta, delta_ref, lam, form, lengths, dots, prev_local, local, world_size)
    )
    return out


def sgd_fused(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Optional[Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    first: bool,
    out: Optional[Tensor] = None,
    delta: Optional[Tensor] = None,
    delta_ref: Optional[Tensor] = None,
    lam: float = 0.0,
    form: str = "outer",
    lengths: Optional[Sequence[int]] = None,
    dots: Optional[Tensor] = None,
    prev_local: Optional[Tensor] = None,
    local: Optional[Tensor] = None,
    world_size: int = 1,
    hist: Optional[Tensor] = None,
    peek: Optional[FusedPeek] = None,
    step_dots: Optional[Tensor] = None,
) -> None:
    """:func:`sgd` on the composed gradient g̃ (see the module doc), in one kernel.

    ``out=None``: OPT (param and momentum buffer updated in place; ``delta`` may alias
    ``param``), with the optional extras ``hist``, ``peek``, ``step_dots`` (module doc).
    ``out`` given: OPT_peek into ``out``, no state touched.
    """
    buf = momentum_buffer if momentum != 0 else None
    mod = _module(param, grad, buf, out, delta, delta_ref, prev_local, local, *_extra_tensors(hist, peek))
    if mod is None or not _dots_ok(dots, grad) or not _dots_ok(step_dots, grad):
        return reference_sgd_fused(
            param, grad, momentum_buffer, lr=lr, momentum=momentum, dampening=dampening,
            nesterov=nesterov, weight_decay=weight_decay, maximize=maximize, first=first,
            out=out, delta=delta, delta_ref=delta_ref, lam=lam, form=form, lengths=lengths,
            dots=dots, prev_local=prev_local, local=local, world_size=world_size,
            hist=hist, peek=peek, step_dots=step_dots,
        )
    mod.sgd(
        param, buf, out, float(lr), float(momentum), float(1 - dampening), float(weight_decay),
        bool(nesterov), bool(maximize), bool(first),
        *_spec(grad, delta, delta_ref, lam, form, lengths, dots, prev_local, local, world_size),
        **_extras(hist, peek, step_dots, lengths, grad),
    )


def adam_fused(
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
    out: Optional[Tensor] = None,
    delta: Optional[Tensor] = None,
    delta_ref: Optional[Tensor] = None,
    lam: float = 0.0,
    form: str = "outer",
    lengths: Optional[Sequence[int]] = None,
    dots: Optional[Tensor] = None,
    prev_local: Optional[Tensor] = None,
    local: Optional[Tensor] = None,
    world_size: int = 1,
    hist: Optional[Tensor] = None,
    peek: Optional[FusedPeek] = None,
    step_dots: Optional[Tensor] = None,
) -> None:
    """:func:`adam` on the composed gradient g̃ (see the module doc), in one kernel.

    The extras ``hist``, ``peek`` (whose bias correction is that of ``step + 1``) and
    ``step_dots`` need ``out=None`` (module doc).
    """
    mod = _module(
        param, grad, exp_avg, exp_avg_sq, out, delta, delta_ref, prev_local, local, *_extra_tensors(hist, peek)
    )
    if mod is None or not _dots_ok(dots, grad) or not _dots_ok(step_dots, grad):
        return reference_adam_fused(
            param, grad, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2,
            eps=eps, weight_decay=weight_decay, decoupled=decoupled, maximize=maximize, out=out,
            delta=delta, delta_ref=delta_ref, lam=lam, form=form, lengths=lengths, dots=dots,
            prev_local=prev_local, local=local, world_size=world_size,
            hist=hist, peek=peek, step_dots=step_dots,
        )
    # the scalars exactly as the reference computes them (Python doubles)
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    peek_step_size = lr / (1 - beta1 ** (step + 1))
    peek_bc2_sqrt = (1 - beta2 ** (step + 1)) ** 0.5
    mod.adam(
        param, exp_avg, exp_avg_sq, out, float(-step_size), float(bias_correction2**0.5),
        float(1 - beta1), float(beta2), float(1 - beta2), float(eps), float(weight_decay),
        float(1 - lr * weight_decay), bool(decoupled), bool(maximize),
        *_spec(grad, delta, delta_ref, lam, form, lengths, dots, prev_local, local, world_size),
        **_extras(hist, peek, step_dots, lengths, grad),
        peek_neg_step_size=float(-peek_step_size), peek_bc2_sqrt=float(peek_bc2_sqrt),
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
        raise ValueError(f"unknown delay-compensation form {form!r}")
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
    momentum_buffer: Optional[Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    first: bool,
    out: Optional[Tensor] = None,
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
            buf = d_p.clone() if first else momentum_buffer.mul(momentum).add_(d_p, alpha=1 - dampening)
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
    out: Optional[Tensor] = None,
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


def reference_dc_dots(
    grad: Tensor,
    delta: Tensor,
    lengths: Sequence[int],
    *,
    delta_ref: Optional[Tensor] = None,
    prev_local: Optional[Tensor] = None,
    world_size: int = 1,
) -> Tensor:
    """Reference of :func:`dc_dots` (products and sums in float64)."""
    h = grad if prev_local is None else grad - prev_local / world_size
    d = delta if delta_ref is None else delta - delta_ref
    lens = torch.tensor(list(lengths), device=grad.device)
    if grad.numel() == 0:
        return torch.zeros(len(lens), dtype=torch.float64, device=grad.device)
    return torch.segment_reduce(h.double() * d.double(), "sum", lengths=lens)


def reference_compose_gradient(
    grad: Tensor,
    *,
    out: Tensor,
    delta: Optional[Tensor] = None,
    delta_ref: Optional[Tensor] = None,
    lam: float = 0.0,
    form: str = "outer",
    lengths: Optional[Sequence[int]] = None,
    dots: Optional[Tensor] = None,
    prev_local: Optional[Tensor] = None,
    local: Optional[Tensor] = None,
    world_size: int = 1,
) -> Tensor:
    """Reference of :func:`compose_gradient`: the op sequence of compensation.py's wp3 / dc."""
    if delta is None and delta_ref is not None:
        raise ValueError("delta_ref given without delta")
    h = grad if prev_local is None else grad - prev_local / world_size
    if form == "outer" and dots is not None:  # Δ entered only through the dots
        lens = torch.tensor(list(lengths), device=grad.device)
        coeff = dots.to(h.dtype).mul_(lam).repeat_interleave(lens, output_size=h.numel())
        torch.addcmul(h, h, coeff, out=out)
    elif delta is None:
        out.copy_(h)
    else:
        d = delta if delta_ref is None else delta - delta_ref
        reference_delay_compensate(h, d, lam, form, lengths, out=out)
    if local is not None:
        out.add_(local, alpha=1.0 / world_size)
    return out


def _composed(grad, out_like, delta, delta_ref, lam, form, lengths, dots, prev_local, local, n):
    if delta is None and delta_ref is None and prev_local is None and local is None and (
        dots is None or form != "outer"
    ):
        return grad
    return reference_compose_gradient(
        grad, out=torch.empty_like(out_like), delta=delta, delta_ref=delta_ref, lam=lam,
        form=form, lengths=lengths, dots=dots, prev_local=prev_local, local=local, world_size=n,
    )


def reference_sgd_fused(
    param: Tensor,
    grad: Tensor,
    momentum_buffer: Optional[Tensor],
    *,
    lr: float,
    momentum: float,
    dampening: float,
    nesterov: bool,
    weight_decay: float,
    maximize: bool,
    first: bool,
    out: Optional[Tensor] = None,
    delta: Optional[Tensor] = None,
    delta_ref: Optional[Tensor] = None,
    lam: float = 0.0,
    form: str = "outer",
    lengths: Optional[Sequence[int]] = None,
    dots: Optional[Tensor] = None,
    prev_local: Optional[Tensor] = None,
    local: Optional[Tensor] = None,
    world_size: int = 1,
    hist: Optional[Tensor] = None,
    peek: Optional[FusedPeek] = None,
    step_dots: Optional[Tensor] = None,
) -> None:
    """Reference of :func:`sgd_fused`: :func:`reference_compose_gradient`, then SGD, then
    the extras one after the other (:func:`reference_update_extras`)."""
    _check_extras(out, hist, peek, step_dots)
    before = param.clone() if _needs_step(peek, step_dots) else None
    g = _composed(grad, grad, delta, delta_ref, lam, form, lengths, dots, prev_local, local, world_size)
    reference_sgd(
        param, g, momentum_buffer, lr=lr, momentum=momentum, dampening=dampening,
        nesterov=nesterov, weight_decay=weight_decay, maximize=maximize, first=first, out=out,
    )

    def reference_peek(terms):  # the momentum buffer has started now (or is unused)
        reference_sgd_fused(
            param, peek.grad, momentum_buffer, lr=lr, momentum=momentum, dampening=dampening,
            nesterov=nesterov, weight_decay=weight_decay, maximize=maximize, first=False,
            out=peek.out, **terms,
        )

    reference_update_extras(param, before, hist, peek, step_dots, lengths, reference_peek)


def reference_adam_fused(
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
    out: Optional[Tensor] = None,
    delta: Optional[Tensor] = None,
    delta_ref: Optional[Tensor] = None,
    lam: float = 0.0,
    form: str = "outer",
    lengths: Optional[Sequence[int]] = None,
    dots: Optional[Tensor] = None,
    prev_local: Optional[Tensor] = None,
    local: Optional[Tensor] = None,
    world_size: int = 1,
    hist: Optional[Tensor] = None,
    peek: Optional[FusedPeek] = None,
    step_dots: Optional[Tensor] = None,
) -> None:
    """Reference of :func:`adam_fused`: :func:`reference_compose_gradient`, then Adam(W),
    then the extras one after the other (:func:`reference_update_extras`)."""
    _check_extras(out, hist, peek, step_dots)
    before = param.clone() if _needs_step(peek, step_dots) else None
    g = _composed(grad, grad, delta, delta_ref, lam, form, lengths, dots, prev_local, local, world_size)
    reference_adam(
        param, g, exp_avg, exp_avg_sq, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay, decoupled=decoupled, maximize=maximize, out=out,
    )

    def reference_peek(terms):  # the next step's bias correction
        reference_adam_fused(
            param, peek.grad, exp_avg, exp_avg_sq, step=step + 1, lr=lr, beta1=beta1,
            beta2=beta2, eps=eps, weight_decay=weight_decay, decoupled=decoupled,
            maximize=maximize, out=peek.out, **terms,
        )

    reference_update_extras(param, before, hist, peek, step_dots, lengths, reference_peek)


def _check_extras(out, hist, peek, step_dots) -> None:
    if out is not None and (hist is not None or peek is not None or step_dots is not None):
        raise ValueError("hist / peek / step_dots need an in-place update (out=None)")
    if step_dots is not None and peek is None:
        raise ValueError("step_dots needs peek (its grad / prev_local terms)")
    if peek is not None and peek.form not in (None, "diagonal"):
        raise ValueError(f"a fused peek takes form None or 'diagonal', not {peek.form!r}")


def _needs_step(peek: Optional[FusedPeek], step_dots: Optional[Tensor]) -> bool:
    """Whether the extras need x_{t−1} (the update's step x_t − x_{t−1})."""
    return step_dots is not None or (peek is not None and peek.out is not None and peek.form is not None)


def reference_update_extras(param, before, hist, peek, step_dots, lengths, reference_peek) -> None:
    """The extras of an in-place update, after it (``param`` = x_t, ``before`` = x_{t−1})."""
    if hist is not None:
        hist.copy_(param)
    if step_dots is not None:
        # Summed in the tensors' dtype, as reference_delay_compensate's outer form does (this
        # is the SAPIPE_DISABLE_EXT path: float64 temporaries of the whole segment would cost
        # more than the rest of the step); the kernels sum in float64.
        h = peek.grad if peek.prev_local is None else peek.grad - peek.prev_local / peek.world_size
        if param.numel() == 0:
            step_dots.zero_()
        else:
            lens = torch.tensor(list(lengths), device=param.device)
            step_dots.copy_(torch.segment_reduce(h * (param - before), "sum", lengths=lens))
    if peek is not None and peek.out is not None:
        dc = dict(delta=param, delta_ref=before, lam=peek.lam, form=peek.form) if peek.form else {}
        reference_peek(dict(
            prev_local=peek.prev_local, local=peek.local, world_size=peek.world_size, lengths=lengths, **dc
        ))
