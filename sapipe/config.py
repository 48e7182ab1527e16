"""sapipe's settings: strict validation, and the fingerprint ranks compare at construction.

Every invalid value raises :class:`ConfigurationError` naming the argument, the value and
what is allowed. Ranks compare fingerprints before any bucket collective, so a rank
configured differently fails fast on every rank instead of deadlocking later.
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from datetime import timedelta
from numbers import Real
from typing import Any, Dict, List, Optional, Union

from .comm import BACKENDS
from .compensation import MODES
from .errors import ConfigurationError

DC_FORMS = ("outer", "diagonal")
AUTO = "auto"
#: With "auto", the job's first iterations are never profiled: they pay one-off costs (the
#: allocator, caches, connections), and on this project's CPU host they ran 10-60% slower
#: than the iterations after them, which made the whole profile slow.
UNPROFILED_STEPS = 5


@dataclass(frozen=True)
class Settings:
    """The validated keyword arguments of :class:`sapipe.DistributedOptimizer`."""

    stale_layers: Union[int, str]  # an int k, or "auto" (the scheduler picks k)
    compensation: str
    dc_lambda: float
    dc_form: str
    staleness: int
    warmup_steps: int
    bucket_cap_mb: float
    lr_ramp_steps: int
    timeout: Optional[timedelta]
    profile_steps: int
    backend: str = "torch"
    partition_mb: float = 4.0
    tune_steps: int = 10

    @property
    def auto(self) -> bool:
        return self.stale_layers == AUTO

    @property
    def effective_warmup(self) -> int:
        """Synchronous iterations before the pipeline starts.

        With ``stale_layers="auto"`` the scheduler profiles the last ``profile_steps`` of
        them, and the first :data:`UNPROFILED_STEPS` are never profiled, so warm-up lasts
        at least ``profile_steps + UNPROFILED_STEPS`` iterations.
        """
        return max(self.warmup_steps, self.profile_steps + UNPROFILED_STEPS) if self.auto else self.warmup_steps


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigurationError(f"sapipe: {message}")


def validate(
    *,
    stale_layers: Any,
    compensation: Any,
    dc_lambda: Any,
    dc_form: Any,
    staleness: Any,
    warmup_steps: Any,
    bucket_cap_mb: Any,
    lr_ramp_steps: Any,
    timeout: Any,
    num_layers: int,
    profile_steps: Any = 5,
    backend: Any = "torch",
    partition_mb: Any = 4.0,
    tune_steps: Any = 10,
) -> Settings:
    """Check every argument against its documented range; return the typed settings."""
    _require(
        stale_layers == AUTO or (_is_int(stale_layers) and 0 <= stale_layers <= num_layers),
        f"stale_layers must be 'auto' or an int in [0, m] where m={num_layers} is the number of "
        f"layers (modules that directly own trainable parameters); got {stale_layers!r}",
    )
    _require(
        compensation in MODES,
        f"compensation must be one of {sorted(MODES)}; got {compensation!r}",
    )
    _require(
        isinstance(dc_lambda, Real) and not isinstance(dc_lambda, bool)
        and math.isfinite(dc_lambda) and dc_lambda >= 0,
        f"dc_lambda must be a finite number >= 0; got {dc_lambda!r}",
    )
    _require(dc_form in DC_FORMS, f"dc_form must be one of {list(DC_FORMS)}; got {dc_form!r}")
    _require(_is_int(staleness) and staleness >= 1, f"staleness must be an int >= 1; got {staleness!r}")
    limit = MODES[compensation].max_staleness
    _require(
        limit is None or staleness <= limit,
        f"compensation={compensation!r} is defined for staleness 1 only (DESIGN.md §3); "
        f"got staleness={staleness}. Use 'none' or 'dc' for staleness > 1",
    )
    _require(_is_int(warmup_steps) and warmup_steps >= 0, f"warmup_steps must be an int >= 0; got {warmup_steps!r}")
    _require(
        isinstance(bucket_cap_mb, Real) and not isinstance(bucket_cap_mb, bool)
        and math.isfinite(bucket_cap_mb) and bucket_cap_mb > 0,
        f"bucket_cap_mb must be a number > 0; got {bucket_cap_mb!r}",
    )
    _require(_is_int(lr_ramp_steps) and lr_ramp_steps >= 0, f"lr_ramp_steps must be an int >= 0; got {lr_ramp_steps!r}")
    _require(_is_int(profile_steps) and profile_steps >= 1, f"profile_steps must be an int >= 1; got {profile_steps!r}")
    _require(_is_int(tune_steps) and tune_steps >= 0, f"tune_steps must be an int >= 0; got {tune_steps!r}")
    _require(backend in BACKENDS, f"backend must be one of {list(BACKENDS)}; got {backend!r}")
    _require(
        isinstance(partition_mb, Real) and not isinstance(partition_mb, bool)
        and math.isfinite(partition_mb) and partition_mb > 0,
        f"partition_mb must be a number > 0; got {partition_mb!r}",
    )
    return Settings(
        stale_layers=stale_layers,
        compensation=compensation,
        dc_lambda=float(dc_lambda),
        dc_form=dc_form,
        staleness=staleness,
        warmup_steps=warmup_steps,
        bucket_cap_mb=float(bucket_cap_mb),
        lr_ramp_steps=lr_ramp_steps,
        timeout=parse_timeout(timeout),
        profile_steps=profile_steps,
        backend=backend,
        partition_mb=float(partition_mb),
        tune_steps=tune_steps,
    )


def parse_timeout(timeout: Union[None, Real, timedelta]) -> Optional[timedelta]:
    """``None`` (inherit the process group's), seconds > 0, or a positive timedelta."""
    if timeout is None:
        return None
    if isinstance(timeout, timedelta):
        seconds = timeout.total_seconds()
    elif isinstance(timeout, Real) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise ConfigurationError(f"sapipe: timeout must be None, seconds or a timedelta; got {timeout!r}")
    _require(math.isfinite(seconds) and seconds > 0, f"timeout must be > 0 seconds; got {timeout!r}")
    return timedelta(seconds=seconds)


def describe(args: Dict[str, Any]) -> Dict[str, str]:
    """A rank's configuration as comparable strings (large items hashed)."""
    out = {}
    for key, value in args.items():
        text = repr(value)
        out[key] = text if len(text) <= 120 else "sha1:" + hashlib.sha1(text.encode()).hexdigest()[:12]
    return out


def mismatches(fingerprints: List[Dict[str, str]]) -> List[str]:
    """Human-readable differences of every rank's fingerprint from rank 0's."""
    reference = fingerprints[0]
    lines = []
    for rank, fp in enumerate(fingerprints[1:], start=1):
        for key in sorted(set(reference) | set(fp)):
            if reference.get(key) != fp.get(key):
                lines.append(f"rank {rank} has {key}={fp.get(key)} but rank 0 has {key}={reference.get(key)}")
    return lines


__all__ = ["Settings", "validate", "parse_timeout", "describe", "mismatches"]
