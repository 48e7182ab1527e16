"""What a sapipe checkpoint is, and whether this job can continue one.

A checkpoint is per rank: it holds stale gradients and (under weight prediction) per-rank
predictions, which cannot be re-partitioned, so it resumes only on the same rank of a job
with the same world size and the same settings (docs/design.md §5).
"""

from __future__ import annotations

from typing import Any

from sapipe import config
from sapipe.errors import ConfigurationError

CHECKPOINT_FORMAT = "sapipe-checkpoint/2"  # /2: pipeline restarts and the search for k


def check_resumable(state: Any, rank: int, world_size: int, fingerprint: dict[str, str]) -> None:
    """Refuse, naming the difference, a checkpoint this rank cannot continue."""
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise ConfigurationError(f"not a sapipe checkpoint (expected format {CHECKPOINT_FORMAT!r})")
    if state["world_size"] != world_size:
        raise ConfigurationError(
            f"the checkpoint was written by a job of {state['world_size']} ranks; this job has "
            f"{world_size}. Stale gradients and per-rank predictions cannot be re-partitioned"
        )
    if state["rank"] != rank:
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


def _as_acting(saved: dict[str, str]) -> dict[str, str]:
    """A saved fingerprint with ``error_feedback`` as it acted: checkpoints written before the
    fingerprint resolved it hold None (the format's default) there."""
    if saved.get("error_feedback") != "None" or saved.get("compression", "None") == "None":
        return saved
    return dict(saved, error_feedback=repr(saved["compression"] == repr("int8")))


__all__ = ["CHECKPOINT_FORMAT", "check_resumable"]
