"""The per-layer part of a recorded timeline: each layer's backward span, from its gradients.

Backward has no per-layer hooks that fire at a layer's start, so a layer's backward span
is taken to run from the previous layer's last gradient (or the end of forward) to its own
last gradient. Only used while tracing is on.
"""

from __future__ import annotations

import os
import time

from sapipe.errors import UsageError
from sapipe.layout.layers import Layer
from sapipe.tracing import chrome_trace
from sapipe.tracing.tracer import Tracer


class BackwardSpans:
    """Records ``layer_backward_start`` / ``layer_backward_end`` events on a :class:`Tracer`."""

    def __init__(self, tracer: Tracer):
        self._tracer = tracer
        self._pending: dict[tuple[int, int], int] = {}  # (iteration, layer) -> gradients to come
        self._forward_end = 0
        self._last_release = 0

    def forward_ended(self) -> None:
        self._forward_end = time.perf_counter_ns()
        self._pending.clear()

    def gradient_arrived(self, layer: Layer, iteration: int) -> None:
        """One of ``layer``'s gradients arrived; its last one closes the layer's span."""
        key = (iteration, layer.index)
        pending = self._pending.setdefault(key, len(layer.params))
        self._pending[key] = pending - 1
        if pending == 1:
            now = time.perf_counter_ns()
            start = max(self._last_release, self._forward_end)
            self._tracer.record(
                "layer_backward_start", at_ns=start, layer=layer.name, iteration=iteration
            )
            self._tracer.record(
                "layer_backward_end", at_ns=now, layer=layer.name, iteration=iteration
            )
            self._last_release = now


def trace_argument(trace: bool | str | None) -> bool | str:
    """``trace=`` as given, or where it was not (None) ``$SAPIPE_TRACE``: 1/true/yes/on turn
    recording on, 0/false/no/off or unset leave it off, anything else is a path."""
    if trace is not None:
        return trace
    value = os.environ.get("SAPIPE_TRACE", "").strip()
    if value.lower() in ("", "0", "false", "no", "off"):
        return False
    return True if value.lower() in ("1", "true", "yes", "on") else value


class TraceFiles:
    """Writes a rank's recorded timeline, and with ``"auto"`` the scheduler's predicted
    iteration beside it, as Chrome traces (Perfetto)."""

    def __init__(self, tracer: Tracer, rank: int, world_size: int, path: str | None, auto):
        self._tracer, self._rank, self._world_size = tracer, rank, world_size
        self.path = path
        self._auto = auto

    def write(self, path: str, predicted: bool = False) -> None:
        """The recorded events, or (``predicted``) the scheduler's simulated iteration at its k."""
        if predicted:
            auto = self._auto
            if auto is None or auto.layer_profiles is None or auto.decision is None:
                raise UsageError("a predicted trace needs stale_layers='auto' after its decision")
            events = auto.predict(auto.decision.k).events
            name = f"rank {self._rank} predicted (k={auto.decision.k})"
        else:
            events = chrome_trace.events_from_tracer(self._tracer.events())
            name = f"rank {self._rank}"
        chrome_trace.write_chrome_trace(path, events, process_name=name, pid=self._rank)

    def write_files(self) -> None:
        """This rank's trace (and auto's prediction) at the ``trace`` path given at construction."""
        if not self.path:
            raise UsageError("no trace path was given (trace=PATH or SAPIPE_TRACE)")
        path = per_rank_path(self.path, self._rank, self._world_size)
        self.write(path)
        if self._auto is not None and self._auto.decision is not None:
            self.write(os.path.splitext(path)[0] + ".predicted.json", predicted=True)


def per_rank_path(path: str, rank: int, world_size: int) -> str:
    """``{rank}`` in ``path`` replaced by the rank; else ``.rank<r>`` added when world_size > 1."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if world_size == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


__all__ = ["BackwardSpans", "TraceFiles", "per_rank_path"]
