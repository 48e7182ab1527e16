"""The scheduler's side of ``stale_layers="auto"`` (:mod:`sapipe.auto.controller`)."""

from sapipe.auto.controller import STALL_TOLERANCE, TRIAL_MAX_ROUNDS, AutoController

__all__ = ["AutoController", "STALL_TOLERANCE", "TRIAL_MAX_ROUNDS"]
