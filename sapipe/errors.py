"""Exceptions raised by sapipe.

Every error names its cause, so a user reading one line of a failed job's log knows which
argument, rank or peer to look at.
"""

PREFIX = "sapipe: "


class SapipeError(RuntimeError):
    """Base class of every error sapipe raises on purpose. Its message starts with
    ``"sapipe: "`` (added here, so that no message types it), which tells a user reading a
    job's log which library raised it."""

    def __init__(self, message: str = "", *args: object) -> None:
        message = str(message)
        super().__init__(message if message.startswith(PREFIX) else PREFIX + message, *args)


class ConfigurationError(SapipeError, ValueError):
    """An argument is invalid, or the ranks of one job were configured differently."""


class UnsupportedOptimizerError(SapipeError, TypeError):
    """The wrapped optimizer (or one of its options) has no exact staleness-aware rule."""


class CommunicationError(SapipeError):
    """A collective failed or timed out: a peer rank died, hung, or the link broke."""


class UsageError(SapipeError):
    """The training loop called sapipe in an order it cannot honour (e.g. step before backward)."""


class NonFiniteGradientError(SapipeError):
    """A rank's own gradient held NaN or inf, so every rank's average did
    (``nonfinite_gradients="raise"``)."""
