"""sapipe's settings, each declared once: its default, its check, and its place in the fingerprint.

Every keyword argument of :class:`sapipe.DistributedOptimizer` other than the optimizer,
the model, the process group and tracing is a field of :class:`Settings`. The field's
metadata holds the check that validates it, so validation, the defaults and the list of
what ranks must agree on all come from this one declaration. Every invalid value raises
:class:`ConfigurationError` naming the argument, the value and what is allowed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from dataclasses import dataclass, field
from datetime import timedelta
from numbers import Real
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # typing.TypeGuard is Python 3.10+; torch brings typing_extensions
    from typing_extensions import TypeGuard

from sapipe.comm import BACKENDS, compression_refusal
from sapipe.compression.codec import COMPRESSIONS, Compression, resolve
from sapipe.errors import ConfigurationError
from sapipe.optim.compensation import MODES, Compensation
from sapipe.optim.compensation import resolve as resolve_compensation

DC_FORMS = ("outer", "diagonal")
#: what a non-finite gradient without a GradScaler does (sapipe.runtime.nonfinite)
NONFINITE_GRADIENTS = ("warn", "raise", "ignore")
AUTO = "auto"
#: With "auto", the job's first iterations are never profiled: they pay one-off costs (the
#: allocator, caches, connections) that would make the whole profile slow.
UNPROFILED_STEPS = 5


def _is_int(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, Real) and not isinstance(value, bool) and math.isfinite(value)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigurationError(f"{message}")


def _int_at_least(low: int) -> Callable[[str, Any], int]:
    def check(name: str, value: Any) -> int:
        _require(_is_int(value) and value >= low, f"{name} must be an int >= {low}; got {value!r}")
        return value

    return check


MAX_MIB = 2.0**40  # a size in MiB whose bytes (2**60) still fit an int64


def _mebibytes(name: str, value: Any) -> float:
    _require(
        _is_number(value) and 0 < value <= MAX_MIB,
        f"{name} must be a number of MiB > 0 and <= 2**40; got {value!r}",
    )
    return float(value)


def _non_negative_number(name: str, value: Any) -> float:
    _require(
        _is_number(value) and value >= 0, f"{name} must be a finite number >= 0; got {value!r}"
    )
    return float(value)


def _one_of(choices) -> Callable[[str, Any], Any]:
    def check(name: str, value: Any) -> Any:
        _require(
            isinstance(value, str) and value in choices,
            f"{name} must be one of {sorted(choices)}; got {value!r}",
        )
        return value

    return check


def _boolean(name: str, value: Any) -> bool:
    _require(isinstance(value, bool), f"{name} must be True or False; got {value!r}")
    return value


def _optional_boolean(name: str, value: Any) -> bool | None:
    _require(
        value is None or isinstance(value, bool),
        f"{name} must be None, True or False; got {value!r}",
    )
    return value


def _optional_int_at_least(low: int) -> Callable[[str, Any], int | None]:
    check_int = _int_at_least(low)

    def check(name: str, value: Any) -> int | None:
        _require(
            value is None or _is_int(value),
            f"{name} must be None or an int >= {low}; got {value!r}",
        )
        return None if value is None else check_int(name, value)

    return check


def _compression(name: str, value: Any) -> str | Compression | None:
    _require(
        value is None
        or isinstance(value, Compression)
        or (isinstance(value, str) and value in COMPRESSIONS),
        f"{name} must be None, a sapipe.compression.Compression or one of "
        f"{', '.join(map(repr, COMPRESSIONS))}; got {value!r}",
    )
    return value


def _compensation(name: str, value: Any) -> str | Compensation:
    _require(
        isinstance(value, Compensation) or (isinstance(value, str) and value in MODES),
        f"{name} must be a sapipe.optim.compensation.Compensation or one of {sorted(MODES)}; got "
        f"{value!r}",
    )
    return value


def _stale_layers(name: str, value: Any) -> int | str:
    # Its range [0, m] needs the model's m: checked in Settings._check_together.
    return value


def parse_timeout(name: str, value: None | float | Real | timedelta) -> timedelta | None:
    """``None`` (inherit the process group's), seconds > 0, or a positive timedelta."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    else:
        _require(
            isinstance(value, Real) and not isinstance(value, bool),
            f"{name} must be None, seconds or a timedelta; got {value!r}",
        )
        seconds = float(value)
    _require(math.isfinite(seconds) and seconds > 0, f"{name} must be > 0 seconds; got {value!r}")
    return timedelta(seconds=seconds)


def _setting(
    default: Any, check: Callable[[str, Any], Any], help: str, *, resume: bool = True
) -> Any:
    """A field of :class:`Settings`: its default, its check, its documentation; ``resume=False``:
    a checkpoint may be resumed with another value."""
    return field(default=default, metadata={"check": check, "help": help, "resume": resume})


@dataclass(frozen=True)
class Settings:
    """The validated keyword arguments of :class:`sapipe.DistributedOptimizer` (defaults
    included)."""

    stale_layers: int | str = _setting(
        0,
        _stale_layers,
        "k, the leading layers (forward order) on stale gradients: 0 equals DDP, m is Pipe-SGD; "
        '``"auto"``: the scheduler picks k (:mod:`sapipe.auto`).',
    )
    compensation: str | Compensation = _setting(
        "none",
        _compensation,
        'the stale layers\' compensation: a registered name, ``"none"``, ``"dc"``, ``"wp1"``, '
        '``"wp2"``, ``"wp3"``, ``"t2"`` (PipeMare\'s velocity extrapolation) or ``"auto"`` (each '
        "stale bucket's weight prediction chosen online by how well it predicts the next "
        "weights: ``opt.compensation_choice``), or a "
        ":class:`sapipe.optim.compensation.Compensation` (``ExtrapolateVelocity(decay=D)``, "
        "``ChooseOnline(candidates=..., probe_steps=...)``, or one of your own: a subclass).",
    )
    dc_lambda: float = _setting(
        0.2,
        _non_negative_number,
        "λ ≥ 0 of delay compensation (``dc`` and ``wp3``).",
    )
    dc_form: str = _setting(
        "outer",
        _one_of(DC_FORMS),
        """``"outer"`` (the paper's rank-one form) or ``"diagonal"`` (DC-ASGD).""",
    )
    staleness: int = _setting(
        1,
        _int_at_least(1),
        "s ≥ 1, iterations of delay of stale gradients (> 1 with none/dc only).",
    )
    warmup_steps: int = _setting(
        0,
        _int_at_least(0),
        "iterations run fully synchronously (every layer, as DDP) before the stale layers take "
        "stale gradients.",
    )
    bucket_cap_mb: float = _setting(
        25.0,
        _mebibytes,
        "bucket size cap; a layer larger than the cap gets its own bucket.",
    )
    timeout: timedelta | None = _setting(
        None,
        parse_timeout,
        "seconds (or a ``timedelta``) after which a collective a peer never joins raises "
        ":class:`~sapipe.errors.CommunicationError`; default: the group's.",
        resume=False,
    )
    lr_ramp_steps: int = _setting(
        0,
        _int_at_least(0),
        "PipeMare's T1 for staleness > 1: the stale layers' LR is divided by ``s ** (1 - min(t / "
        "K, 1))`` over the first K steps of each start of the pipeline.",
    )
    profile_steps: int = _setting(
        5,
        _int_at_least(1),
        'with ``"auto"``, warm-up iterations profiled (warm-up then lasts ``max(warmup_steps, '
        "profile_steps + 5)``: the first 5 are never profiled).",
    )
    backend: str = _setting(
        "torch",
        _one_of(BACKENDS),
        """how buckets are summed (:mod:`sapipe.comm`): ``"torch"`` (one all-reduce per bucket, """
        """NCCL or Gloo), ``"pushpull"`` (BytePS's chunked reduce-scatter/all-gather, most """
        """urgent first), ``"horovod"`` (``hvd.init()`` first) or ``"byteps"``.""",
    )
    compression: str | Compression | None = _setting(
        None,
        _compression,
        """how bucket gradients travel: ``None`` (their own dtype), a """
        """:class:`sapipe.compression.Compression` (``FP16()``, ``BF16()``, ``Int8()``, or a """
        """format of your own), or a registered name: ``"fp16"``, ``"bf16"`` (16-bit), """
        """``"int8"`` (per-block scaled, with error feedback); every bucket, sync and stale; """
        """summed in the gradients' own dtype.""",
    )
    error_feedback: bool | None = _setting(
        None,
        _optional_boolean,
        """with ``compression`` given by name: whether each rank keeps what rounding dropped and """
        """adds it to its next gradient; ``None``: the format's default (on for ``"int8"``, off """
        """for ``"fp16"``/``"bf16"``). A :class:`~sapipe.compression.Compression` object carries """
        """its own.""",
    )
    hierarchical: bool | None = _setting(
        None,
        _optional_boolean,
        """with ``backend="torch"``: sum each bucket inside each node first, then across nodes, """
        """then inside the node again (Horovod's hierarchical all-reduce; """
        """:mod:`sapipe.comm.hierarchical`); with ``compression``, only the sum across nodes is """
        """compressed; ``None``: wherever the job spans several nodes of the same number (> 1) """
        """of ranks (torchrun's ``GROUP_RANK``, else the host name, tells a rank's node); """
        """``True``: required; ``False``: one flat all-reduce.""",
    )
    partition_mb: float = _setting(
        4.0,
        _mebibytes,
        """chunk size of ``backend="pushpull"``, in MiB (BytePS's default: 4 MiB).""",
    )
    tune_steps: int = _setting(
        4,
        _int_at_least(0),
        """with ``"auto"``, iterations measured per trial of the search for k """
        """(:mod:`sapipe.auto.search`), more while too noisy to tell 3% apart; 0 keeps the """
        """model's k unmeasured.""",
        resume=False,
    )
    auto_budget: int | None = _setting(
        30,
        _optional_int_at_least(1),
        """with ``"auto"``, the iteration by which k is final, warm-up included: the search """
        """probes where the model, calibrated on its trials, points, and stops with the best k """
        """it measured when the next trial would not fit; ``None``: no limit (trials lengthened """
        """while noisy, a bisection between the model's k and m).""",
        resume=False,
    )
    broadcast_buffers: bool = _setting(
        True,
        _boolean,
        """as DDP's: rank 0's module buffers (BatchNorm running statistics, ...) are copied to """
        """every rank before a forward whose previous forward ran with gradients outside """
        """``no_sync()`` (:mod:`sapipe.runtime.buffers`); ``False``: each rank keeps its own.""",
        resume=False,
    )

    expose_gradients: bool = _setting(
        True,
        _boolean,
        """as DDP's contract: once backward ends, ``p.grad`` holds the averaged gradient """
        """``step()`` applies (sync layers' g_t, stale layers' g_{t-s}), so clipping, """
        """``GradScaler.unscale_``, logging and edits of ``p.grad`` act on it """
        """(:mod:`sapipe.runtime.exposure`). A sync layer's all-reduce is waited for only when """
        """its ``p.grad`` is first read (its update then runs in ``step()``); unread, it keeps """
        """overlapping ``step()`` and the next forward. ``False``: ``p.grad`` keeps this rank's """
        """own gradient and a change to it raises at ``step()``.""",
        resume=False,
    )
    nonfinite_gradients: str = _setting(
        "warn",
        _one_of(NONFINITE_GRADIENTS),
        """what a NaN or inf in a rank's own gradient does without a GradScaler (the average, """
        """and the update that applies it, then turn non-finite on every rank, as under DDP; """
        """:mod:`sapipe.runtime.nonfinite`): ``"warn"``: every rank emits one """
        """``RuntimeWarning``, the first time only, naming the iteration, the bucket and the """
        """rank(s) whose gradient it was; ``"raise"``: """
        """:class:`~sapipe.errors.NonFiniteGradientError` instead, on every rank in the same """
        """``step()``: the ``step()`` after the one whose sync gradient was not finite, the one """
        """that applies a stale gradient (or the next, with ``expose_gradients=False``), one """
        """step later on CUDA; ``"ignore"``: nothing is checked, and nothing more travels. Each """
        """rank judges what it sends with one reduction per bucket; the verdict travels behind """
        """the gradient in the same collective. Under ``scaler.step(opt)`` the GradScaler skips """
        """such steps, and nothing is reported.""",
        resume=False,
    )

    @classmethod
    def names(cls) -> list[str]:
        """Every setting's name, in declaration order."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def validate(cls, num_layers: int, **arguments: Any) -> Settings:
        """Check every argument against its declared range; the typed settings."""
        unknown = sorted(set(arguments) - set(cls.names()))
        _require(not unknown, f"unknown settings {unknown}")
        values = {
            f.name: f.metadata["check"](f.name, arguments.get(f.name, f.default))
            for f in dataclasses.fields(cls)
        }
        settings = cls(**values)
        settings._check_together(num_layers)
        return settings

    def _check_together(self, num_layers: int) -> None:
        """The checks that involve two settings, or the model."""
        k = self.stale_layers
        _require(
            k == AUTO or (_is_int(k) and 0 <= k <= num_layers),
            f"stale_layers must be 'auto' or an int in [0, m] where m={num_layers} is the number "
            "of "
            f"layers (modules that directly own trainable parameters); got {self.stale_layers!r}",
        )
        refusal = compression_refusal(self.backend, self.compression)
        _require(refusal is None, str(refusal))
        _require(
            self.error_feedback is None or isinstance(self.compression, str),
            f"error_feedback={self.error_feedback!r} needs a compression; got compression=None"
            if self.compression is None
            else f"error_feedback={self.error_feedback!r} goes with a compression name; got "
            f"compression={self.compression!r} (give error_feedback to the Compression object)",
        )
        _require(
            self.auto_budget is None or not self.auto or self.auto_budget >= self.effective_warmup,
            f"auto_budget={self.auto_budget} ends before the warm-up does ({self.effective_warmup} "
            "iterations: "
            f"max(warmup_steps, profile_steps + {UNPROFILED_STEPS})); raise it or profile fewer "
            "steps",
        )
        limit = resolve_compensation(self.compensation).max_staleness
        _require(
            limit is None or self.staleness <= limit,
            f"compensation={self.compensation!r} is defined for staleness 1 only (docs/design.md "
            "§3); "
            f"got staleness={self.staleness}. Use 'none' or 'dc' for staleness > 1",
        )

    @property
    def auto(self) -> bool:
        return self.stale_layers == AUTO

    @property
    def wire_compression(self) -> Compression | None:
        """The compression, with error feedback resolved (None: uncompressed)."""
        return resolve(self.compression, self.error_feedback)

    @property
    def bucket_cap_bytes(self) -> int:
        return int(self.bucket_cap_mb * 1024 * 1024)

    @property
    def partition_bytes(self) -> int:
        return max(1, int(self.partition_mb * 1024 * 1024))

    @property
    def effective_warmup(self) -> int:
        """Synchronous iterations before the pipeline starts.

        With ``stale_layers="auto"`` the scheduler profiles the last ``profile_steps`` of
        them, and the first :data:`UNPROFILED_STEPS` are never profiled, so warm-up lasts
        at least ``profile_steps + UNPROFILED_STEPS`` iterations.
        """
        return (
            max(self.warmup_steps, self.profile_steps + UNPROFILED_STEPS)
            if self.auto
            else self.warmup_steps
        )

    def resume_fingerprint(self) -> dict[str, str]:
        """What a checkpoint must agree on (not the timeout, nor the search's trial length), the
        wire format's constants included (its residuals are laid out by them)."""
        settings = {
            f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.metadata["resume"]
        }
        return describe(
            dict(settings, **compression_identity(self.compression, self.error_feedback))
        )


def settings_help(indent: int = 0) -> str:
    """The settings' documentation, one entry per field, for a docstring."""
    pad = " " * indent
    lines = ["", "", pad + "Settings (keyword arguments, with their defaults):"]
    for f in dataclasses.fields(Settings):
        default = f.default if not isinstance(f.default, str) else repr(f.default)
        lines.append(f"{pad}    {f.name} (default {default}): {f.metadata['help']}")
    return "\n".join(lines) + "\n"


def compensation_identity(compensation: Any) -> Any:
    """What ranks and checkpoints compare of the compensation (:meth:`Compensation.describe`);
    an invalid value as given (its own check raises)."""
    try:
        return resolve_compensation(compensation).describe()
    except (KeyError, TypeError):
        return compensation


def compression_identity(compression: Any, error_feedback: Any) -> dict[str, Any]:
    """What ranks and checkpoints compare of the compression: its format (by name; a format of
    a user's own also by its class), its error feedback as it acts (a name with
    ``error_feedback=None`` and the format's object alike), and the format's fixed constants
    (int8's block). Never raises: an invalid value is compared as given (its own check raises)."""
    try:
        resolved = resolve(compression, error_feedback)
    except ConfigurationError:
        return {"compression": compression, "error_feedback": error_feedback}
    if resolved is None:
        return {"compression": None, "error_feedback": None}
    kind = type(resolved)
    name = (
        resolved.name
        if COMPRESSIONS.get(resolved.name) is kind
        else f"{kind.__module__}.{kind.__qualname__}:{resolved.name}"
    )
    settings = {k: v for k, v in vars(resolved).items() if k != "error_feedback"}
    return {
        "compression": name + (f" {settings}" if settings else ""),
        "error_feedback": resolved.error_feedback,
        **resolved.wire_constants(),
    }


def describe(args: dict[str, Any]) -> dict[str, str]:
    """A rank's configuration as comparable strings (large items hashed)."""
    out = {}
    for key, value in args.items():
        text = repr(value)
        out[key] = (
            text if len(text) <= 120 else "sha1:" + hashlib.sha1(text.encode()).hexdigest()[:12]
        )
    return out


def mismatches(fingerprints: list[dict[str, str]]) -> list[str]:
    """Human-readable differences of every rank's fingerprint from rank 0's."""
    reference = fingerprints[0]
    lines = []
    for rank, fp in enumerate(fingerprints[1:], start=1):
        for key in sorted(set(reference) | set(fp)):
            if reference.get(key) != fp.get(key):
                lines.append(
                    f"rank {rank} has {key}={fp.get(key)} but rank 0 has {key}={reference.get(key)}"
                )
    return lines


def first_difference(key: str, value: Any, reference: Any) -> str:
    """Where ``value`` first differs from rank 0's ``reference``, as ``key[i].name=...``: the
    readable form of a difference whose fingerprint was hashed (a list of param groups,
    of parameters)."""
    if isinstance(value, dict) and isinstance(reference, dict):
        for name in sorted(set(value) | set(reference), key=str):
            if repr(value.get(name)) != repr(reference.get(name)):  # repr: tensors compare too
                return first_difference(f"{key}.{name}", value.get(name), reference.get(name))
    if isinstance(value, list) and isinstance(
        reference, list
    ):  # a tuple is one record: shown whole
        for i, (mine, theirs) in enumerate(zip(value, reference)):
            if repr(mine) != repr(theirs):
                return first_difference(f"{key}[{i}]", mine, theirs)
        if len(value) != len(reference):
            return f"{key} of {len(value)} entries but rank 0 has {len(reference)}"
    return f"{key}={value!r} but rank 0 has {reference!r}"


__all__ = [
    "AUTO",
    "Settings",
    "parse_timeout",
    "settings_help",
    "describe",
    "first_difference",
    "mismatches",
]
