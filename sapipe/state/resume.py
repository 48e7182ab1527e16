"""What a sapipe checkpoint is, and whether this job can continue one.

A checkpoint is per rank: it holds the averaged stale gradients in flight, this rank's own
gradients and (under weight prediction) its predicted weights. It resumes bit-exactly on the
same rank of a job with the same world size and the same settings (docs/design.md §5.7). A
job of another world size (torchrun's elastic restarts) resumes from any rank's checkpoint:
the averaged gradients in flight are applied as plain updates and the pipeline starts anew,
as a pipeline restart does (§3.7), and this rank's residuals are dropped (:func:`resized`).
"""

from __future__ import annotations

from typing import Any

from sapipe import config
from sapipe.errors import ConfigurationError

CHECKPOINT_FORMAT = "sapipe-checkpoint/2"  # /2: pipeline restarts and the search for k


def check_resumable(state: Any, rank: int, world_size: int, fingerprint: dict[str, str]) -> bool:
    """Refuse, naming the difference, a checkpoint this rank cannot continue; whether it was
    written by a job of another world size (an elastic restart: :func:`resized`)."""
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ConfigurationError(f"not a sapipe checkpoint (expected format {CHECKPOINT_FORMAT!r})")
    other_world = state["world_size"] != world_size
    if not other_world and state["rank"] != rank:
        raise ConfigurationError(f"rank {rank} was given rank {state['rank']}'s checkpoint")
    differences = config.mismatches([_as_acting(state["settings"]), fingerprint])
    if differences:
        raise ConfigurationError(
            "the checkpoint's configuration differs from this optimizer's: "
            + "; ".join(
                d.replace("rank 1", "this job").replace("rank 0", "the checkpoint")
                for d in differences
            )
        )
    return other_world


def resized(state: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint of another world size, made loadable here: its error-feedback residuals
    (this rank's own rounding errors, kept per shard of the old world's sums) are dropped.
    The rest is the same on every rank of a data-parallel job (the real weights, the
    optimizer state, the averaged gradients in flight) or is used up when the pipeline
    restarts (this rank's own gradients)."""
    buckets = [dict(bucket, codec=None) for bucket in state["buckets"]]
    return dict(state, buckets=buckets)


def _as_acting(saved: dict[str, str]) -> dict[str, str]:
    """A saved fingerprint with ``error_feedback`` as it acted: checkpoints written before the
    fingerprint resolved it hold None (the format's default) there."""
    if saved.get("error_feedback") != "None" or saved.get("compression", "None") == "None":
        return saved
    return dict(saved, error_feedback=repr(saved["compression"] == repr("int8")))


__all__ = ["CHECKPOINT_FORMAT", "check_resumable", "resized"]
