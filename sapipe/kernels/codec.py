"""The compression codec's three local stages, on message rows (sapipe.compression.codec).

A compressed bucket travels as rows ("messages") of ``S`` values each: 16-bit values
(``float16`` / ``bfloat16``) or ``int8`` values with one float32 scale per block of
:data:`BLOCK` values. Every function takes a message's fields as views into its byte
buffer: ``values`` [R, S] and, for int8, ``scales`` [R, S / BLOCK], rows contiguous.

* :func:`encode`: rows <- ``src`` (+ ``residual``), compressed; the tail zero-padded.
* :func:`sum_encode`: one row <- the received rows decoded and added in row (rank) order in
  ``dtype``, (+ ``residual``), compressed.
* :func:`decode`: ``out`` <- the rows decoded, row after row.

The rounding, which every implementation follows op for op (csrc/codec/codec.h):

* 16-bit: h = (v / divide) rounded to float32, then to 16 bits (nearest even); it decodes as
  h · multiply (``divide`` / ``multiply`` apply to the 16-bit formats only).
* int8, per block: s = float32(max|v| / 127); q = round-half-even(v · (1 / s)) clamped to
  ±127; it decodes as q · s. A block whose s is below float32's normal range (all zeros, or
  the ever smaller rest that error feedback resends of a gradient that stays zero) travels
  as s = 0, q = 0, since 1 / s would overflow.
* Error feedback (``residual`` given): v includes the residual, and the residual becomes
  v − decoded(v) · divide wherever that decoded value is finite; elsewhere (an overflow, a
  NaN or inf gradient) it keeps its value, so that a step GradScaler skips does not leave a
  non-finite residual behind for every later step. An int8 block holding a non-finite value
  travels as scale NaN and q = 0: all of it decodes to NaN; so does one whose scale is beyond
  float32's range (float64 gradients).

Each call runs the ``torch.ops.sapipe.codec_*`` operator, whose kernel the dispatcher picks
by device (``sapipe._C`` registers the CPU one, ``sapipe._C_cuda`` the CUDA one; float32/float64
gradients), and otherwise the ``reference_*`` function, in pure PyTorch.
``tests/unit/test_codec_kernels.py`` holds the two to the same bits.
"""

from __future__ import annotations

import torch
from torch import Tensor

from sapipe.kernels import _ext

BLOCK = 64  # int8 values per scale (csrc/codec/codec.h kCodecBlock)
_KERNEL_DTYPES = (torch.float32, torch.float64)


def _compiled(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the compiled operators take gradients of ``dtype`` on ``device``."""
    return dtype in _KERNEL_DTYPES and _ext.compiled_for(device)


def encode(
    src: Tensor,
    residual: Tensor | None,
    values: Tensor,
    scales: Tensor | None,
    divide: float = 1.0,
) -> None:
    """``values`` (and ``scales``) <- ``src`` (+ ``residual``) compressed; ``residual`` updated."""
    if _compiled(src.device, src.dtype):
        torch.ops.sapipe.codec_encode.default(src, residual, values, scales, float(divide))
    else:
        reference_encode(src, residual, values, scales, divide)


def sum_encode(
    values: Tensor,
    scales: Tensor | None,
    residual: Tensor | None,
    out_values: Tensor,
    out_scales: Tensor | None,
    divide: float,
    dtype: torch.dtype,
) -> None:
    """``out_values`` [1, S] <- the sum of the received rows (+ ``residual``) compressed."""
    if _compiled(values.device, dtype):
        torch.ops.sapipe.codec_sum_encode.default(
            values, scales, residual, out_values, out_scales, float(divide), dtype
        )
    else:
        reference_sum_encode(values, scales, residual, out_values, out_scales, divide, dtype)


def decode(values: Tensor, scales: Tensor | None, out: Tensor, multiply: float = 1.0) -> None:
    """``out`` <- the rows decoded, row j filling ``out[j*S : (j+1)*S]``."""
    if _compiled(out.device, out.dtype):
        torch.ops.sapipe.codec_decode.default(values, scales, out, float(multiply))
    else:
        reference_decode(values, scales, out, multiply)


# ---------------------------------------------------------------------------- the reference


def _is_int8(values: Tensor) -> bool:
    return values.dtype == torch.int8


def _divided(t: Tensor, by: float) -> Tensor:
    """t / by, correctly rounded as the kernels divide. On CUDA torch divides by a Python
    number as t · (1 / by), one rounding more (max|v| / 127 came out one ulp off); by a
    tensor on the device it divides."""
    return t / (torch.full((), by, dtype=t.dtype, device=t.device) if t.is_cuda else by)


def _compress_rows(v: Tensor, values: Tensor, scales: Tensor | None, divide: float) -> Tensor:
    """``v`` [R, S] compressed into ``values`` / ``scales``; returns what they decode to, times
    ``divide`` (16-bit), in ``v``'s dtype."""
    if not _is_int8(values):
        h = _divided(v, divide).to(torch.float32).to(values.dtype)
        values.copy_(h)
        return h.to(v.dtype) * divide
    rows = v.shape[0]
    blocks = v.reshape(rows, -1, BLOCK)
    scale = _divided(blocks.abs().amax(dim=2), 127).to(torch.float32)
    bad = ~torch.isfinite(blocks).all(dim=2) | ~torch.isfinite(scale)
    tiny = scale < torch.finfo(torch.float32).tiny
    scale = scale.masked_fill(bad, float("nan")).masked_fill(tiny, 0.0)
    inverse = 1 / torch.where(scale > 0, scale, torch.ones_like(scale)).to(v.dtype)
    q = (
        torch.round(blocks * inverse.unsqueeze(2))
        .clamp_(-127, 127)
        .masked_fill_((bad | tiny).unsqueeze(2), 0)
    )
    values.copy_(q.reshape(rows, -1))
    scales.copy_(scale)
    return (q * scale.to(v.dtype).unsqueeze(2)).reshape(rows, -1)


def _feed_back(residual: Tensor, v: Tensor, decoded: Tensor) -> None:
    """residual <- v − decoded where decoded is finite (elsewhere it keeps its value)."""
    residual.copy_(torch.where(torch.isfinite(decoded), v - decoded, residual))


def _decoded_rows(values: Tensor, scales: Tensor | None, dtype: torch.dtype) -> Tensor:
    """Every row decoded, in ``dtype`` (16-bit values not yet multiplied)."""
    if not _is_int8(values):
        return values.to(dtype)
    rows, width = values.shape
    q = values.to(dtype).reshape(rows, -1, BLOCK)
    return (q * scales.to(dtype).unsqueeze(2)).reshape(rows, width)


def reference_encode(
    src: Tensor,
    residual: Tensor | None,
    values: Tensor,
    scales: Tensor | None,
    divide: float = 1.0,
) -> None:
    rows, width = values.shape
    n = src.numel()
    v = torch.zeros(rows * width, dtype=src.dtype, device=src.device)
    v[:n] = src if residual is None else src + residual
    decoded = _compress_rows(v.view(rows, width), values, scales, divide).reshape(-1)
    if residual is not None:
        _feed_back(residual, v[:n], decoded[:n])


def reference_sum_encode(
    values: Tensor,
    scales: Tensor | None,
    residual: Tensor | None,
    out_values: Tensor,
    out_scales: Tensor | None,
    divide: float,
    dtype: torch.dtype,
) -> None:
    rows = _decoded_rows(values, scales, dtype)
    v = rows[0].clone()
    for row in rows[1:]:
        v += row
    if residual is not None:
        v = v + residual
    decoded = _compress_rows(v.view(1, -1), out_values, out_scales, divide).view(-1)
    if residual is not None:
        _feed_back(residual, v, decoded)


def reference_decode(
    values: Tensor, scales: Tensor | None, out: Tensor, multiply: float = 1.0
) -> None:
    decoded = _decoded_rows(values, scales, out.dtype).reshape(-1)[: out.numel()]
    out.copy_(decoded if _is_int8(values) else decoded * multiply)


__all__ = [
    "BLOCK",
    "encode",
    "sum_encode",
    "decode",
    "reference_encode",
    "reference_sum_encode",
    "reference_decode",
]
