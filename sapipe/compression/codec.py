"""Gradient compression on the wire: ``fp16``, ``bf16``, and ``int8`` with error feedback.

A compressed bucket is summed in two collectives, each carrying compressed bytes, with the
sum itself taken in the gradient's own dtype (float32 or float64), never in 16 or 8 bits:

1. **Scatter** (an all-to-all): rank r splits its bucket into W equal shards and sends
   shard j, compressed, to rank j. Rank j decodes the W messages it receives and adds
   them up, in rank order, in the gradient's dtype.
2. **Gather** (an all-gather): rank j compresses its summed shard and every rank receives
   every shard; each decodes all W of them into the bucket, as the mean over ranks.

Every rank decodes the same gathered bytes, so all hold the identical mean. The division
by W rides on what the formats do anyway (16-bit: the sum travels as its mean; int8: the
gathered scales are divided, W per block), so no pass over the bucket is spent on it. Each element
is rounded twice (once as a rank's gradient, once as the sum), whatever W is: a 16-bit
ring all-reduce rounds W − 1 partial sums, and its error grows with the job. The link
carries 2 (W − 1) / W of the compressed bucket each way, as a ring all-reduce does of
the uncompressed one.

Formats (docs/design.md §5.9):

* ``fp16`` / ``bf16``: each value cast to the 16-bit type (round to nearest even). The
  sum is sent as its mean (sum / W), which keeps it in fp16's range wherever each rank's
  gradient was, and decodes as that mean.
* ``int8``: blocks of :data:`INT8_BLOCK` values share one float32 scale s = max|v| / 127;
  a value travels as q = round(v · (1/s)) in [−127, 127] (the reciprocal, not a division:
  the kernels and their reference round alike) and arrives as q · s (a sum: as q · (s / W),
  its mean).

Without error feedback, ``fp16`` and ``bf16`` round each value alone, as torch's cast does:
backward's hook then copies each gradient straight into the outgoing messages, cast as it
goes (:attr:`BucketCodec.encodes_on_intake`, :func:`intake_views`), and stage 1 only adds
the flags, sparing the bucket's float32 copy and the encode's pass over it.

**Error feedback** (on by default for int8, ``error_feedback=`` turns it on or off for any
format) keeps what rounding dropped: rank r sends v = g + e and keeps e ← v − decoded(v)
for its next gradient of the bucket (the worker residual); the rank that sums a shard does
the same for the sum it sends (the server residual). Both are part of a bucket's
checkpoint, so a resumed run sends the same bytes. A value that decodes to inf or NaN
(GradScaler's overflow steps) keeps its residual: :mod:`sapipe.kernels.codec` has the exact
rounding rules, and the kernels that carry them out.

Each message also carries the rank's flags for the shard (whether it used each parameter,
sapipe.runtime.unused, and whether its gradient held NaN or inf, sapipe.runtime.nonfinite) as
float32 in its header: they are summed exactly.

**Units.** :class:`BucketCodec` compresses a bucket as one unit (``backend="torch"`` and
``"horovod"``). :class:`PartitionedCodec` compresses it partition by partition, the unit
``backend="pushpull"`` sums one at a time in priority order (BytePS compresses each
partition it pushes): every partition is a :class:`BucketCodec` of its own, its shards
taken within the partition. :func:`make_codec` picks one. A back-end is handed a slot's
codec and asks it for its :meth:`~SlotCodec.partitions`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Union

import torch
from torch import Tensor

from sapipe.errors import ConfigurationError
from sapipe.kernels import codec as codec_kernels

INT8_BLOCK = codec_kernels.BLOCK  # values per int8 scale: 1/16 byte of scale per value


class Compression:
    """How bucket gradients travel: a wire format, and whether it keeps error feedback.

    ``compression=`` takes one of these (``sapipe.compression.BF16()``,
    ``Int8(error_feedback=False)``)
    or a registered name (``"bf16"``; :func:`register_compression`). A format of your own is a
    subclass that names itself (``name``), says how a value travels (``value_dtype``, and
    ``block`` > 0 where ``block`` values share one float32 scale), and defines two pure
    functions on rows of values: :meth:`compress` and :meth:`decompress`. sapipe does the rest
    as for its own formats: the messages and their headers, the all-to-all and all-gather, the
    sum in the gradient's dtype, the mean, error feedback, checkpoints. The built-in formats
    override the three stages (:meth:`encode`, :meth:`sum_encode`, :meth:`decode`) with fused
    kernels; a subclass may too. Every rank must give an equal compression (the same class,
    ``name`` and settings).
    """

    #: the format's name: in checkpoints and in the comparison of the ranks' settings
    name: ClassVar[str] = ""
    #: the dtype of one value on the wire (1 or 2 bytes for the built-in formats)
    value_dtype: ClassVar[torch.dtype] = torch.float16
    #: values that share one float32 scale (0: no scales)
    block: ClassVar[int] = 0
    #: error feedback when ``error_feedback=None``
    default_error_feedback: ClassVar[bool] = False

    def __init__(self, error_feedback: bool | None = None):
        if error_feedback is not None and not isinstance(error_feedback, bool):
            raise ConfigurationError(
                f"error_feedback must be None, True or False; got {error_feedback!r}"
            )
        if not type(self).name:
            raise ConfigurationError(
                f"{type(self).__qualname__} must set a name (its class attribute)"
            )
        self.error_feedback = (
            self.default_error_feedback if error_feedback is None else error_feedback
        )

    @classmethod
    def of(
        cls, compression: str | Compression | None, error_feedback: bool | None = None
    ) -> Compression | None:
        """:func:`resolve`: a registered name (or an object, or None) as the compression it stands
        for."""
        return resolve(compression, error_feedback)

    # ---------------------------------------------------------------- the format

    def compress(self, rows: Tensor) -> tuple[Tensor, Tensor | None]:
        """``rows`` [R, S] (the gradient's dtype; S a multiple of ``block``) as the wire carries
        them: values [R, S] of ``value_dtype``, and scales [R, S / block] (float32) or None."""
        raise NotImplementedError(f"{type(self).__qualname__} must define compress()")

    def decompress(self, values: Tensor, scales: Tensor | None, dtype: torch.dtype) -> Tensor:
        """What :meth:`compress`'s ``values`` and ``scales`` stand for, as [R, S] in ``dtype``."""
        raise NotImplementedError(f"{type(self).__qualname__} must define decompress()")

    @property
    def mean_in_scales(self) -> bool:
        """Whether the sum is averaged by dividing its scales (one division per block, int8's
        way) instead of being sent as its mean."""
        return False

    @property
    def casts_on_intake(self) -> bool:
        """Whether compressing a value is torch's cast to ``value_dtype``, value by value, so
        that backward may write gradients straight into the messages (docs/design.md §5.9)."""
        return False

    def wire_constants(self) -> dict[str, int]:
        """Fixed constants of the format that ranks, and a checkpoint and the job resuming it,
        must share although no setting names them (int8's block size)."""
        return {}

    # ---------------------------------------------------------------- the three stages

    def encode(
        self,
        src: Tensor,
        residual: Tensor | None,
        values: Tensor,
        scales: Tensor | None,
        divide: float = 1.0,
    ) -> None:
        """Stage 1: ``values`` (and ``scales``), rows of S, <- ``src`` (+ ``residual``) / ``divide``
        compressed, zero-padded; ``residual`` <- what rounding dropped where it decodes finite."""
        rows, width = values.shape
        v = torch.zeros(rows * width, dtype=src.dtype, device=src.device)
        v[: src.numel()] = src if residual is None else src + residual
        decoded = self._compress_into(v.view(rows, width), values, scales, divide).reshape(-1)
        if residual is not None:
            _feed_back(residual, v[: src.numel()], decoded[: src.numel()])

    def sum_encode(
        self,
        values: Tensor,
        scales: Tensor | None,
        residual: Tensor | None,
        out_values: Tensor,
        out_scales: Tensor | None,
        divide: float,
        dtype: torch.dtype,
    ) -> None:
        """Stage 2: the received rows decoded and added in rank order in ``dtype`` (+
        ``residual``), divided by ``divide`` and compressed into one row."""
        rows = self.decompress(values, scales, dtype)
        v = rows[0].clone()
        for row in rows[1:]:
            v += row
        if residual is not None:
            v = v + residual
        decoded = self._compress_into(v.view(1, -1), out_values, out_scales, divide).view(-1)
        if residual is not None:
            _feed_back(residual, v, decoded)

    def decode(
        self, values: Tensor, scales: Tensor | None, out: Tensor, multiply: float = 1.0
    ) -> None:
        """Stage 3: ``out`` <- the rows decoded, row after row, times ``multiply``."""
        decoded = self.decompress(values, scales, out.dtype).reshape(-1)[: out.numel()]
        out.copy_(decoded if multiply == 1.0 else decoded * multiply)

    def _compress_into(
        self, v: Tensor, values: Tensor, scales: Tensor | None, divide: float
    ) -> Tensor:
        """``v`` / ``divide`` compressed into ``values`` / ``scales``; what they decode to, times
        ``divide``."""
        q, s = self.compress(v if divide == 1.0 else v / divide)
        values.copy_(q)
        if scales is not None and s is not None:
            scales.copy_(s)
        decoded = self.decompress(values, scales, v.dtype)
        return decoded if divide == 1.0 else decoded * divide

    # ---------------------------------------------------------------- identity

    def describe(self) -> str:
        """What ranks and checkpoints compare: the name, and error feedback if not the default."""
        if self.error_feedback == self.default_error_feedback:
            return self.name
        return f"{self.name} ({'with' if self.error_feedback else 'without'} error feedback)"

    __str__ = describe

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}(error_feedback={self.error_feedback})"

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def __hash__(self) -> int:
        return hash((type(self), self.name, self.error_feedback))


class _Kernels(Compression):
    """The built-in formats: the three stages run sapipe's fused codec kernels
    (:mod:`sapipe.kernels.codec`), the same bits as :meth:`Compression.compress` would give."""

    def encode(self, src, residual, values, scales, divide=1.0):
        codec_kernels.encode(src, residual, values, scales, divide)

    def sum_encode(self, values, scales, residual, out_values, out_scales, divide, dtype):
        codec_kernels.sum_encode(values, scales, residual, out_values, out_scales, divide, dtype)

    def decode(self, values, scales, out, multiply=1.0):
        codec_kernels.decode(values, scales, out, multiply)

    def compress(self, rows):
        values = torch.empty(rows.shape, dtype=self.value_dtype, device=rows.device)
        scales = (
            torch.empty(rows.shape[0], rows.shape[1] // self.block, device=rows.device)
            if self.block
            else None
        )
        codec_kernels.reference_encode(rows.reshape(-1), None, values, scales)
        return values, scales

    def decompress(self, values, scales, dtype):
        out = torch.empty(values.numel(), dtype=dtype, device=values.device)
        codec_kernels.reference_decode(values, scales, out)
        return out.view(values.shape)


class FP16(_Kernels):
    """float16 values (round to nearest even); the sum travels as its mean, in range wherever
    each rank's gradient was. Error feedback off by default."""

    name = "fp16"
    value_dtype = torch.float16

    @property
    def casts_on_intake(self) -> bool:
        return not self.error_feedback


class BF16(FP16):
    """bfloat16 values (round to nearest even): float32's range, 8 bits of mantissa."""

    name = "bf16"
    value_dtype = torch.bfloat16


class Int8(_Kernels):
    """int8 values, one float32 scale per block of :data:`INT8_BLOCK` (max|v| / 127), with
    error feedback by default."""

    name = "int8"
    value_dtype = torch.int8
    block = INT8_BLOCK
    default_error_feedback = True

    @property
    def mean_in_scales(self) -> bool:
        return True

    def wire_constants(self) -> dict[str, int]:
        return {"int8_block": INT8_BLOCK}


#: names ``compression=`` accepts, and the format each stands for (:func:`register_compression`)
COMPRESSIONS: dict[str, type[Compression]] = {"fp16": FP16, "bf16": BF16, "int8": Int8}


def register_compression(cls: type[Compression]) -> type[Compression]:
    """Let ``compression=cls.name`` stand for ``cls()`` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Compression) and cls.name):
        raise ConfigurationError(
            f"register_compression takes a named Compression subclass; got {cls!r}"
        )
    if COMPRESSIONS.get(cls.name, cls) is not cls:
        raise ConfigurationError(
            f"compression {cls.name!r} is registered already ({COMPRESSIONS[cls.name]})"
        )
    COMPRESSIONS[cls.name] = cls
    return cls


def resolve(
    compression: str | Compression | None, error_feedback: bool | None = None
) -> Compression | None:
    """The compression the settings ask for (None: the gradients travel as they are): a
    :class:`Compression` as given, or the one a registered name stands for, with
    ``error_feedback`` (which a given object carries itself)."""
    if compression is None or isinstance(compression, Compression):
        if compression is not None and error_feedback is not None:
            raise ConfigurationError(
                f"error_feedback= goes with a compression name; {compression!r} carries its own "
                f"(give error_feedback to {type(compression).__qualname__}(...))"
            )
        return compression
    if not isinstance(compression, str) or compression not in COMPRESSIONS:
        raise ConfigurationError(
            "compression must be None, a sapipe.compression.Compression or one of "
            f"{', '.join(map(repr, COMPRESSIONS))}; got {compression!r}"
        )
    return COMPRESSIONS[compression](error_feedback)


def _feed_back(residual: Tensor, v: Tensor, decoded: Tensor) -> None:
    """residual <- v − decoded where decoded is finite (elsewhere it keeps its value)."""
    residual.copy_(torch.where(torch.isfinite(decoded), v - decoded, residual))


@dataclass(frozen=True)
class WireFormat:
    """The bytes one bucket of ``numel`` values and ``nflags`` flags takes on the wire,
    compressed by ``compression`` over ``world`` ranks: W messages of ``message_bytes`` each way."""

    compression: Compression
    numel: int
    nflags: int
    world: int

    @property
    def shard(self) -> int:
        """Values per shard (the bucket padded with zeros to W equal shards of whole blocks)."""
        per_rank = math.ceil(self.numel / self.world)
        block = self.compression.block
        return math.ceil(per_rank / block) * block if block else per_rank

    @property
    def flag_shard(self) -> int:
        return math.ceil(self.nflags / self.world)

    @property
    def blocks(self) -> int:
        block = self.compression.block
        return self.shard // block if block else 0

    @property
    def header_floats(self) -> int:
        return self.flag_shard + self.blocks

    @property
    def value_bytes(self) -> int:
        return torch.empty((), dtype=self.compression.value_dtype).element_size()

    @property
    def message_bytes(self) -> int:
        raw = 4 * self.header_floats + self.value_bytes * self.shard
        return math.ceil(raw / 4) * 4  # each message starts 4-byte aligned

    def wire_bytes(self) -> int:
        """Bytes each rank sends (and receives) for one bucket: 2 (W − 1) messages."""
        return 2 * (self.world - 1) * self.message_bytes


class Messages:
    """Views of messages in one byte buffer: flags, scales (int8: else None) and values per
    message, one row per message."""

    def __init__(self, fmt: WireFormat, buffer: Tensor):
        rows = buffer.view(-1, fmt.message_bytes)
        header = rows[:, : 4 * fmt.header_floats].view(torch.float32)
        self.flags = header[:, : fmt.flag_shard]
        self.scales = header[:, fmt.flag_shard :] if fmt.compression.block else None
        body = rows[:, 4 * fmt.header_floats : 4 * fmt.header_floats + fmt.value_bytes * fmt.shard]
        self.values = body.view(fmt.compression.value_dtype)


class BucketCodec:
    """One bucket's compressed sum: its wire format, scratch bytes and error feedback.

    The scatter/gather buffers are kept for the bucket's life: a collective may still hold
    them after its wait returns, and freeing a tensor on a communication thread during
    interpreter shutdown is what the exit handler guards against (sapipe.runtime.shutdown).
    ``slots``: how many of the bucket's sums may be in flight at once (its staleness slots).
    ``residual``: with error feedback, the worker residual to keep (a partition's slice of
    its bucket's, :class:`PartitionedCodec`); by default one of its own.
    ``ranks_per_message``: how many ranks' gradients each message sums (a node's, when sums
    go node first: :class:`NodeFirstCodec`); the sum still arrives as the mean over all of them.
    The arithmetic is sapipe.kernels.codec' (compiled kernels where built).
    """

    def __init__(
        self,
        compression: Compression,
        numel: int,
        nflags: int,
        world: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 1,
        *,
        residual: Tensor | None = None,
        ranks_per_message: int = 1,
    ):
        self.compression = compression
        self.format = fmt = WireFormat(compression, numel, nflags, world)
        self.dtype = dtype
        self.ranks_per_message = ranks_per_message
        size = world * fmt.message_bytes
        self.outbox = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.inbox = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.gathered = [torch.zeros(size, dtype=torch.uint8, device=device) for _ in range(slots)]
        self.own = [
            torch.zeros(fmt.message_bytes, dtype=torch.uint8, device=device) for _ in range(slots)
        ]
        flags = torch.zeros(world * fmt.flag_shard, dtype=torch.float32, device=device)
        self._flags_in, self._flags_rows = flags[: fmt.nflags], flags.view(world, fmt.flag_shard)
        # the views each stage reads and writes, made once: a sum runs on the worker thread,
        # where every Python-level tensor op holds the GIL the training thread launches with
        self._outbox_views = [Messages(fmt, b) for b in self.outbox]
        self._inbox_views = [Messages(fmt, b) for b in self.inbox]
        self._gathered_views = [Messages(fmt, b) for b in self.gathered]
        self._own_views = [Messages(fmt, b) for b in self.own]
        feedback = compression.error_feedback
        #: e of this rank's gradients (one per bucket value), and of the sums of its own shard it
        #: sent
        if feedback and residual is None:
            residual = torch.zeros(numel, dtype=dtype, device=device)
        self.residual = residual if feedback else None
        self.server_residual = (
            torch.zeros(fmt.shard, dtype=dtype, device=device) if feedback else None
        )

    # ---------------------------------------------------------------- the two stages

    def scatter_messages(self, wire: Tensor, slot: int, encoded: bool = False) -> Tensor:
        """Stage 1's outgoing bytes: ``wire`` (values then flags) as W messages, one per shard.
        ``encoded``: backward already wrote the values into the messages (:meth:`intake_pieces`),
        so only the flags are added."""
        numel = self.format.numel
        self._flags_in.copy_(wire[numel:])
        out = self._outbox_views[slot]
        out.flags.copy_(self._flags_rows)
        if not encoded:
            # 16-bit: a node's sum travels as its mean over the node's ranks, in range as one rank's
            # is
            self.compression.encode(
                wire[:numel], self.residual, out.values, out.scales, divide=self.ranks_per_message
            )
        return self.outbox[slot]

    @property
    def encodes_on_intake(self) -> bool:
        """Whether backward's gradients can go straight into the outgoing messages, cast as they
        are copied, instead of into the bucket for stage 1 to encode: fp16 and bf16 without
        error feedback, each rank's own gradient (not a node's sum to divide). Each value is then
        rounded alone, as torch's cast rounds it, bit for bit the encode's (docs/design.md §5.9)."""
        return self.compression.casts_on_intake and self.ranks_per_message == 1

    def intake_values(self, slot: int) -> list[Tensor]:
        """Slot ``slot``'s outgoing values as backward wrote them (:attr:`encodes_on_intake`
        formats; zeros past the bucket's end): what this rank sends of its gradient."""
        return [self._outbox_views[slot].values]

    def intake_pieces(self, slot: int, start: int, numel: int) -> list[tuple[int, int, Tensor]]:
        """Where bucket values [start, start + numel) lie in slot ``slot``'s outgoing messages
        (:attr:`encodes_on_intake` formats): (lo, hi, view) per message they reach, values
        [start + lo, start + hi) going to ``view``."""
        shard, values = self.format.shard, self._outbox_views[slot].values
        pieces = []
        at = start
        while at < start + numel:
            row, column = divmod(at, shard)
            take = min(start + numel - at, shard - column)
            pieces.append((at - start, at - start + take, values[row, column : column + take]))
            at += take
        return pieces

    def gather_message(self, slot: int) -> Tensor:
        """Stage 2's outgoing bytes: the W messages received for this rank's shard, summed in
        the gradient's dtype (in rank order) and compressed again as one message (16-bit: as
        the mean, which stays in fp16's range wherever each rank's values were)."""
        received, message = self._inbox_views[slot], self._own_views[slot]
        self.compression.sum_encode(
            received.values,
            received.scales,
            self.server_residual,
            message.values,
            message.scales,
            self.format.world,
            self.dtype,
        )
        torch.sum(received.flags, dim=0, out=message.flags[0])  # counts of ranks: exact in float32
        return self.own[slot]

    def decode_mean(self, wire: Tensor, slot: int) -> None:
        """The gathered shards, decoded into ``wire``: the values' mean over ranks, then the
        flags' sum (how many ranks used each parameter). The gathered bytes are spent: int8's
        scales are divided in place."""
        fmt = self.format
        gathered = self._gathered_views[slot]
        if self.compression.mean_in_scales:  # the sum travelled: one division per block, no pass
            assert gathered.scales is not None, "a format that averages in its scales has scales"
            gathered.scales.div_(fmt.world * self.ranks_per_message)
        self.compression.decode(
            gathered.values, gathered.scales, wire[: fmt.numel]
        )  # else the mean
        wire[fmt.numel :].copy_(gathered.flags.reshape(-1)[: fmt.nflags])

    def at(self, slot: int, encoded: bool = False) -> SlotCodec:
        """This codec bound to staleness slot ``slot``'s scratch bytes, for one sum
        (``encoded``: its values were written into the messages on intake)."""
        return SlotCodec(self, slot, encoded)

    # ---------------------------------------------------------------- checkpoints

    def state_dict(self) -> dict[str, Tensor | None]:
        return {"residual": _clone(self.residual), "server_residual": _clone(self.server_residual)}

    def check_state_dict(self, state: dict[str, Tensor | None]) -> None:
        """ConfigurationError where ``state``'s residuals cover other values (they went node
        first)."""
        _check_node_size(state, 1)

    def load_state_dict(self, state: dict[str, Tensor | None]) -> None:
        self.check_state_dict(state)
        for name in ("residual", "server_residual"):
            mine, saved = getattr(self, name), state.get(name)
            if mine is not None and saved is not None:
                # a residual saved over the zero-padded shards holds zeros past the bucket's end
                mine.copy_(saved[: mine.numel()])


@dataclass(frozen=True)
class SlotCodec:
    """What a back-end is handed with a bucket's slot: the three steps of its compressed sum."""

    codec: BucketCodec
    slot: int
    encoded: bool = False  # backward wrote the values into the messages already (intake_pieces)

    @property
    def format(self) -> WireFormat:
        return self.codec.format

    def scatter_messages(self, wire: Tensor) -> Tensor:
        return self.codec.scatter_messages(wire, self.slot, self.encoded)

    def inbox(self) -> Tensor:
        return self.codec.inbox[self.slot]

    def gather_message(self) -> Tensor:
        return self.codec.gather_message(self.slot)

    def gathered(self) -> Tensor:
        return self.codec.gathered[self.slot]

    def decode_mean(self, wire: Tensor) -> None:
        self.codec.decode_mean(wire, self.slot)

    def partitions(self) -> list[tuple[int, int, SlotCodec]]:
        """The units summed one by one: [start, end) of the wire and the unit's codec (one: all of
        it)."""
        fmt = self.format
        return [(0, fmt.numel + fmt.nflags, self)]


class SpanningGradient:
    """Where a parameter's gradient goes when it spans several outgoing messages (a shard's or a
    partition's end falls inside it): its pieces, each cast-copied into its message. Quacks
    like the tensor view a parameter within one message gets (``copy_``, ``zero_``)."""

    def __init__(self, pieces: list[tuple[int, int, Tensor]]):
        self.pieces = pieces

    def copy_(self, grad: Tensor) -> None:
        flat = grad.reshape(-1)
        for lo, hi, view in self.pieces:
            view.copy_(flat[lo:hi])

    def zero_(self) -> None:
        for _, _, view in self.pieces:
            view.zero_()


def intake_views(
    codec: BucketCodec | PartitionedCodec, slot: int, offsets: list[int], params: list[Tensor]
) -> list[object]:
    """Each parameter's place in ``slot``'s outgoing messages of a codec that
    ``encodes_on_intake``, for backward to copy its gradient into (cast to the wire's 16 bits):
    a view shaped like the parameter, or a :class:`SpanningGradient`."""
    views: list[object] = []
    for offset, param in zip(offsets, params):
        pieces = codec.intake_pieces(slot, offset, param.numel())
        views.append(
            pieces[0][2].view(param.shape) if len(pieces) == 1 else SpanningGradient(pieces)
        )
    return views


def partition_bounds(numel: int, per_partition: int) -> list[tuple[int, int]]:
    """[start, end) of each partition of ``numel`` values, ``per_partition`` values each (the
    last may be shorter)."""
    if per_partition <= 0:
        raise ConfigurationError(f"a partition must hold at least one value; got {per_partition}")
    return [(lo, min(lo + per_partition, numel)) for lo in range(0, numel, per_partition)]


@dataclass(frozen=True)
class PartitionedFormat:
    """The wire formats of a bucket's partitions, each compressed and summed on its own."""

    parts: tuple[WireFormat, ...]

    @property
    def world(self) -> int:
        return self.parts[0].world

    @property
    def numel(self) -> int:
        return sum(fmt.numel for fmt in self.parts)

    def wire_bytes(self) -> int:
        """Bytes each rank sends (and receives) for the whole bucket: every partition's."""
        return sum(fmt.wire_bytes() for fmt in self.parts)


class PartitionedCodec:
    """One bucket compressed partition by partition (``backend="pushpull"``).

    Partition i holds values [start, end) of the bucket (``per_partition`` values each, the
    last possibly fewer) and is a :class:`BucketCodec` of its own: its wire format (shards
    within the partition, int8 shards padded to whole blocks), scratch bytes per slot and
    server residual. The worker residual is one tensor over the whole bucket, each partition
    keeping its slice, so it moves with each parameter when buckets are laid out again, as a
    :class:`BucketCodec`'s does. The flags travel with the last partition: the wire holds them
    right after its values.
    """

    def __init__(
        self,
        compression: Compression,
        numel: int,
        nflags: int,
        world: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 1,
        *,
        per_partition: int,
    ):
        self.compression = compression
        self.dtype = dtype
        bounds = partition_bounds(numel, per_partition) or [
            (0, 0)
        ]  # an empty bucket's flags still travel
        #: this rank's residual of every bucket value (None without error feedback)
        self.residual = (
            torch.zeros(numel, dtype=dtype, device=device) if compression.error_feedback else None
        )
        last = len(bounds) - 1
        self.parts = [
            BucketCodec(
                compression,
                hi - lo,
                nflags if i == last else 0,
                world,
                dtype,
                device,
                slots,
                residual=None if self.residual is None else self.residual[lo:hi],
            )
            for i, (lo, hi) in enumerate(bounds)
        ]
        #: [start, end) of each partition in the wire (values, then the flags with the last)
        self.wire_bounds = bounds[:last] + [(bounds[last][0], numel + nflags)]
        self.format = PartitionedFormat(tuple(part.format for part in self.parts))

    @property
    def server_residuals(self) -> list[Tensor | None]:
        """Each partition's residual of the sum of its shard this rank sent."""
        return [part.server_residual for part in self.parts]

    def at(self, slot: int, encoded: bool = False) -> PartitionedSlot:
        """This codec bound to staleness slot ``slot``'s scratch bytes, for one sum
        (``encoded``: its values were written into the messages on intake)."""
        return PartitionedSlot(self, slot, encoded)

    @property
    def encodes_on_intake(self) -> bool:
        """As :attr:`BucketCodec.encodes_on_intake` (every partition has the same format)."""
        return self.parts[0].encodes_on_intake

    def intake_values(self, slot: int) -> list[Tensor]:
        """As :meth:`BucketCodec.intake_values`, every partition's."""
        return [values for part in self.parts for values in part.intake_values(slot)]

    def intake_pieces(self, slot: int, start: int, numel: int) -> list[tuple[int, int, Tensor]]:
        """As :meth:`BucketCodec.intake_pieces`, across the partitions the values reach."""
        pieces = []
        for (lo, _), part in zip(self.wire_bounds, self.parts):
            first, end = (
                max(start, lo),
                min(start + numel, lo + part.format.numel),
            )  # values, not flags
            if first < end:
                pieces += [
                    (first - start + a, first - start + b, view)
                    for a, b, view in part.intake_pieces(slot, first - lo, end - first)
                ]
        return pieces

    def state_dict(self) -> dict[str, Any]:
        return {
            "residual": _clone(self.residual),
            "server_residuals": [_clone(r) for r in self.server_residuals],
        }

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """ConfigurationError where ``state``'s residuals cover other values: sums that went node
        first, or another number of partitions."""
        _check_node_size(state, 1)
        saved = state.get("server_residuals") or []
        if len(saved) != len(self.parts):
            raise ConfigurationError(
                f"the checkpoint holds {len(saved)} partitions of this bucket, "
                f"this layout {len(self.parts)}"
            )

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        if self.residual is not None and state.get("residual") is not None:
            self.residual.copy_(state["residual"])
        for part, residual in zip(self.parts, state["server_residuals"]):
            part.load_state_dict({"server_residual": residual})


@dataclass(frozen=True)
class PartitionedSlot:
    """What ``backend="pushpull"`` is handed with a bucket's slot: each partition's codec."""

    codec: PartitionedCodec
    slot: int
    encoded: bool = False  # backward wrote the values into the messages already (intake_pieces)

    def partitions(self) -> list[tuple[int, int, SlotCodec]]:
        """[start, end) of each partition in the wire, and its codec bound to this slot."""
        return [
            (lo, hi, part.at(self.slot, self.encoded))
            for (lo, hi), part in zip(self.codec.wire_bounds, self.codec.parts)
        ]


class NodeFirstCodec:
    """One bucket's compressed sum node first (``hierarchical=``, sapipe.comm.hierarchical).

    The bucket's values are cut into L shards of ceil(numel / L) values (L ranks per node;
    zero-padded where they reach past the bucket's end, :meth:`shard_bounds`), each
    followed by all the bucket's flags. Inside the node the shards are summed at full
    precision; local rank j then compresses the node's sum of shard j and sums it across
    the N nodes with the ranks of local index j, as a :class:`BucketCodec` of one shard
    over N ranks, whose messages each carry a node's sum of L gradients. Across nodes each
    NIC carries the compressed bytes of one bucket, not of L.

    Error feedback keeps this rank's residuals of its shard only (the residual of what it
    sent, and of the sum it sent). A shard's bounds move when ``"auto"`` lays the buckets out
    again, so both are dropped then (one step's rounding of the shard); ``residual`` (one
    per bucket value) is None.
    """

    residual = None
    encodes_on_intake = False  # the node's sum is taken at full precision first

    def __init__(
        self,
        compression: Compression,
        numel: int,
        nflags: int,
        nodes: int,
        node_size: int,
        dtype: torch.dtype,
        device: torch.device,
        slots: int = 1,
    ):
        self.compression = compression
        self.numel, self.nflags, self.node_size = numel, nflags, node_size
        self.shard_numel = math.ceil(numel / node_size)
        self.shard = BucketCodec(
            compression,
            self.shard_numel,
            nflags,
            nodes,
            dtype,
            device,
            slots,
            ranks_per_message=node_size,
        )

    @property
    def format(self) -> WireFormat:
        """What crosses between nodes: one shard's compressed sum over the N nodes."""
        return self.shard.format

    @property
    def row_numel(self) -> int:
        """Values of one shard as it is summed inside the node: its values, then the flags."""
        return self.shard_numel + self.nflags

    def shard_bounds(self) -> list[tuple[int, int]]:
        """[start, end) of each of the L shards within the bucket's values. Shard j starts at
        j · ceil(numel / L); past the bucket's end it is empty (a bucket of 5 values over 4
        ranks per node: shards of 2, 2, 1 and 0 values), and the rest of its row is zeros."""
        size = self.shard_numel
        return [
            (min(j * size, self.numel), min((j + 1) * size, self.numel))
            for j in range(self.node_size)
        ]

    def pack(self, wire: Tensor, rows: Tensor) -> None:
        """``wire`` (values, then flags) into ``rows``, L rows of :attr:`row_numel`: row j
        holds shard j of the values (zero past the bucket's end), then every flag."""
        size, rows = self.shard_numel, rows.view(self.node_size, self.row_numel)
        for j, (lo, hi) in enumerate(self.shard_bounds()):
            rows[j, : hi - lo].copy_(wire[lo:hi])
            rows[j, hi - lo : size].zero_()
        rows[:, size:].copy_(wire[self.numel :].expand(self.node_size, self.nflags))

    def unpack(self, rows: Tensor, wire: Tensor) -> None:
        """The summed ``rows`` back into ``wire``: each shard's values, and the flags (alike in
        every row)."""
        size, rows = self.shard_numel, rows.view(self.node_size, self.row_numel)
        for j, (lo, hi) in enumerate(self.shard_bounds()):
            wire[lo:hi].copy_(rows[j, : hi - lo])
        wire[self.numel :].copy_(rows[0, size:])

    def at(self, slot: int, encoded: bool = False) -> NodeFirstSlot:
        """This codec bound to staleness slot ``slot``'s scratch bytes, for one sum (never
        ``encoded`` on intake: :attr:`encodes_on_intake` is False)."""
        assert not encoded, "a node-first sum encodes its shard of the node's sum"
        return NodeFirstSlot(self, slot)

    def state_dict(self) -> dict[str, Any]:
        return {"node_size": self.node_size, **self.shard.state_dict()}

    def check_state_dict(self, state: dict[str, Any]) -> None:
        """ConfigurationError unless ``state``'s sums went node first over as many ranks per node
        (the same buckets, checked before, then give the same shards)."""
        _check_node_size(state, self.node_size)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state_dict(state)
        self.shard.load_state_dict({k: v for k, v in state.items() if k != "node_size"})


@dataclass(frozen=True)
class NodeFirstSlot:
    """What the node-first back-end is handed with a bucket's slot (:class:`NodeFirstCodec`)."""

    codec: NodeFirstCodec
    slot: int

    def partitions(self) -> list[tuple[int, int, SlotCodec]]:
        """The one unit this rank compresses: its shard of the node's sum, as one row of
        :meth:`NodeFirstCodec.pack` holds it, and that shard's codec bound to this slot."""
        return [(0, self.codec.row_numel, self.codec.shard.at(self.slot))]


def _check_node_size(state: dict, node_size: int) -> None:
    """ConfigurationError unless the checkpointed codec's sums went node first over the same
    number of ranks per node (1: flat), so its residuals cover the same values; a codec
    without error feedback saved none, and resumes either way."""
    saved = state.get("node_size", 1)
    residuals = [
        state.get("residual"),
        state.get("server_residual"),
        *(state.get("server_residuals") or []),
    ]
    if saved != node_size and any(r is not None for r in residuals):

        def how(n):
            return "flat" if n == 1 else f"node first over {n} ranks per node"

        raise ConfigurationError(
            f"the checkpoint's compressed sums went {how(saved)}, this job's go "
            f"{how(node_size)}: their error-feedback residuals cover other values"
        )


#: a bucket's codec, and what a back-end is handed with a slot of it (see ``partitions()``)
Codec = Union[BucketCodec, PartitionedCodec, NodeFirstCodec]
Slot = Union[SlotCodec, PartitionedSlot, NodeFirstSlot]


def make_codec(
    compression: Compression,
    numel: int,
    nflags: int,
    world: int,
    dtype: torch.dtype,
    device: torch.device,
    slots: int = 1,
    partition_bytes: int | None = None,
    node_size: int = 1,
) -> Codec:
    """A bucket's codec: one unit (``partition_bytes`` None), or partitions of
    ``partition_bytes`` of the uncompressed bucket (at least one value each), as
    ``backend="pushpull"`` cuts it; with ``node_size`` > 1 ranks per node, summed node first."""
    if node_size > 1:
        if partition_bytes is not None or world % node_size:
            raise ConfigurationError(
                f"node-first sums need whole nodes and no partitions; got world {world}, "
                f"{node_size} ranks per node, partition_bytes={partition_bytes}"
            )
        return NodeFirstCodec(
            compression, numel, nflags, world // node_size, node_size, dtype, device, slots
        )
    if partition_bytes is None:
        return BucketCodec(compression, numel, nflags, world, dtype, device, slots)
    per_partition = max(1, partition_bytes // torch.empty((), dtype=dtype).element_size())
    return PartitionedCodec(
        compression, numel, nflags, world, dtype, device, slots, per_partition=per_partition
    )


def _clone(tensor: Tensor | None) -> Tensor | None:
    return tensor.clone() if tensor is not None else None


__all__ = [
    "COMPRESSIONS",
    "INT8_BLOCK",
    "Codec",
    "Compression",
    "WireFormat",
    "BucketCodec",
    "SlotCodec",
    "NodeFirstCodec",
    "NodeFirstSlot",
    "PartitionedCodec",
    "PartitionedFormat",
    "PartitionedSlot",
    "Slot",
    "SpanningGradient",
    "intake_views",
    "make_codec",
    "partition_bounds",
    "FP16",
    "BF16",
    "Int8",
    "register_compression",
    "resolve",
]
