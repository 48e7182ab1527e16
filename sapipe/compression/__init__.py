"""Compression on the wire: formats, their error feedback, and each bucket's codec.

``compression=`` takes a :class:`Compression`: :class:`FP16`, :class:`BF16`, :class:`Int8`, or
a format of your own (a subclass that defines ``compress`` and ``decompress``); a registered
name (``"bf16"``) stands for one (:func:`register_compression`). docs/design.md §5.9.
"""

from sapipe.compression.codec import (
    BF16,
    COMPRESSIONS,
    FP16,
    Compression,
    Int8,
    register_compression,
)

__all__ = ["BF16", "COMPRESSIONS", "FP16", "Compression", "Int8", "register_compression"]
