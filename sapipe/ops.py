"""Elementwise kernels on flat buffers: delay compensation and the optimizer arithmetic.

Each function works on one contiguous slice of a bucket (a *segment*: parameters sharing
one param group). This module is the pure-PyTorch implementation; it follows the exact
operation sequence of ``torch.optim``'s single-tensor SGD/Adam so that synchronous layers
reproduce ``torch.optim`` (and hence DDP) to rounding. Fused C++/CUDA kernels, when built,
replace these functions one for one and are tested against them.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor


def backend() -> str:
    """Which kernel implementation runs: ``"torch"`` (this pure-PyTorch path)."""
    return "torch"


def delay_compensate(
    grad: Tensor, delta: Tensor, lam: float, form: str, lengths: Sequence[int], out: Tensor
) -> Tensor:
    """Write DC_λ(grad, delta) into ``out`` (which may alias ``grad``).

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
