"""The compressed messages' layout, for the codec kernels' tests (and the child interpreter
one of them runs)."""

from __future__ import annotations

import torch

KINDS = {"fp16": torch.float16, "bf16": torch.bfloat16, "int8": torch.int8}


def messages(kind: str, rows: int, width: int, device, pad_bytes: int = 12):
    """A byte buffer of ``rows`` messages, each a header of scales (int8) and ``width`` values
    behind ``pad_bytes`` of something else, as the wire lays them out; its views."""
    from sapipe.kernels import codec as ck

    value_bytes = 1 if kind == "int8" else 2
    blocks = width // ck.BLOCK if kind == "int8" else 0
    header = pad_bytes + 4 * blocks
    row_bytes = -(-(header + value_bytes * width) // 4) * 4
    buffer = torch.full((rows * row_bytes,), 0xAB, dtype=torch.uint8, device=device)
    grid = buffer.view(rows, row_bytes)
    scales = grid[:, pad_bytes:header].view(torch.float32) if kind == "int8" else None
    values = grid[:, header : header + value_bytes * width].view(KINDS[kind])
    return buffer, values, scales
