"""Chrome-trace (Perfetto-loadable) output for simulated and recorded timelines.

Both the scheduler's simulator and the runtime's :class:`sapipe.tracing.tracer.Tracer` describe a
timeline as :class:`TraceEvent` tuples ``(name, category, start, end, args)`` with times in
seconds. :func:`write_chrome_trace` turns such a list into the Chrome trace-event JSON
format ("ph": "X" complete events, microsecond timestamps), which https://ui.perfetto.dev
and chrome://tracing load directly, so a predicted schedule and a measured one can be
looked at side by side.

Tracks: each category goes to a named thread of one process -- ``forward``/``backward``/
``step`` to "compute", ``comm`` to "comm", ``wait`` to "wait", ``iteration`` to
"iteration". Slices on one thread must nest, so events of a track that overlap without
nesting (e.g. several all-reduces queued in the background at once) are spread over extra
lanes ("comm #2", ...).
"""

from __future__ import annotations

import json
import os
from collections import defaultdict, deque
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Union

__all__ = [
    "TraceEvent",
    "CATEGORIES",
    "chrome_trace_dict",
    "write_chrome_trace",
    "events_from_tracer",
]


class TraceEvent(NamedTuple):
    """One interval of a timeline. Times in seconds; ``args`` is shown in the trace viewer."""

    name: str
    category: str  # one of CATEGORIES (others are accepted and get a track of their own)
    start: float
    end: float
    args: dict[str, Any]


#: Categories the simulator and the tracer conversion produce, and the track each goes to.
CATEGORIES: dict[str, str] = {
    "forward": "compute",
    "backward": "compute",
    "step": "compute",
    "update": "compute",
    "comm": "comm",
    "wait": "wait",
    "iteration": "iteration",
}
_TRACK_ORDER = ("compute", "comm", "wait", "iteration")

EventLike = Union[TraceEvent, tuple[str, str, float, float, Mapping[str, Any]]]


# --------------------------------------------------------------------------- writing


def _assign_lanes(events: Sequence[TraceEvent]) -> list[int]:
    """Lane per event so that events within a lane are disjoint or properly nested.

    Greedy: sorted by (start, longest first), an event joins the first lane where it either
    starts after everything open has ended or fits inside the innermost open slice.
    """
    order = sorted(
        range(len(events)), key=lambda i: (events[i].start, -(events[i].end - events[i].start))
    )
    stacks: list[list[float]] = []  # per lane: end times of the currently open (nested) slices
    lanes = [0] * len(events)
    for i in order:
        ev = events[i]
        for lane, stack in enumerate(stacks):
            while stack and stack[-1] <= ev.start:
                stack.pop()
            if not stack or ev.end <= stack[-1]:
                stack.append(ev.end)
                lanes[i] = lane
                break
        else:
            stacks.append([ev.end])
            lanes[i] = len(stacks) - 1
    return lanes


def _json_safe(value: Any) -> Any:
    """Args must serialise: keep JSON scalars and containers, stringify anything else."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)


def chrome_trace_dict(
    events: Iterable[EventLike], *, process_name: str, pid: int = 0
) -> dict[str, Any]:
    """The Chrome trace-event JSON object for ``events`` (see :func:`write_chrome_trace`)."""
    evs = [
        TraceEvent(str(e[0]), str(e[1]), float(e[2]), float(e[3]), dict(e[4] or {})) for e in events
    ]
    origin = min((e.start for e in evs), default=0.0)
    origin = min(
        origin, 0.0
    )  # only shift when something starts before 0 (trace viewers want ts >= 0)

    by_track: dict[str, list[TraceEvent]] = defaultdict(list)
    for ev in evs:
        by_track[CATEGORIES.get(ev.category, ev.category)].append(ev)
    tracks = [t for t in _TRACK_ORDER if t in by_track] + sorted(
        t for t in by_track if t not in _TRACK_ORDER
    )

    trace: list[dict[str, Any]] = [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": process_name}}
    ]
    tid = 0
    for track in tracks:
        track_events = by_track[track]
        lanes = _assign_lanes(track_events)
        first_tid = tid + 1
        for lane in range(max(lanes) + 1):
            tid += 1
            thread = track if lane == 0 else f"{track} #{lane + 1}"
            trace.append(
                {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": thread}}
            )
            trace.append(
                {
                    "ph": "M",
                    "name": "thread_sort_index",
                    "pid": pid,
                    "tid": tid,
                    "args": {"sort_index": tid},
                }
            )
        for ev, lane in zip(track_events, lanes):
            trace.append(
                {
                    "name": ev.name,
                    "cat": ev.category,
                    "ph": "X",
                    "ts": (ev.start - origin) * 1e6,
                    "dur": max(ev.end - ev.start, 0.0) * 1e6,
                    "pid": pid,
                    "tid": first_tid + lane,
                    "args": _json_safe(ev.args),
                }
            )
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def write_chrome_trace(
    path: str | os.PathLike[str],
    events: Iterable[EventLike],
    *,
    process_name: str,
    pid: int = 0,
) -> None:
    """Write ``events`` as a Chrome trace JSON file, loadable in Perfetto or chrome://tracing.

    ``events`` are :class:`TraceEvent` (or plain 5-tuples of the same shape) with times in
    seconds; they become "ph": "X" events with ``ts``/``dur`` in microseconds. Several
    processes (e.g. a simulated and a measured timeline) can be compared by writing each
    with its own ``pid`` and concatenating their ``traceEvents``.
    """
    with open(path, "w", encoding="utf-8") as f:
        json.dump(chrome_trace_dict(events, process_name=process_name, pid=pid), f)


# --------------------------------------------------------------------------- runtime tracer

#: start kind -> (end kind, category, fields that pair a start with its end)
_PAIRS = {
    "layer_forward_start": ("layer_forward_end", "forward", ("layer", "iteration")),
    "layer_backward_start": ("layer_backward_end", "backward", ("layer", "iteration")),
    "comm_start": ("comm_done", "comm", ("what", "stream")),
    "comm_wait_start": ("comm_wait", "wait", ("what", "stream")),
    "step_start": ("step_end", "step", ("iteration",)),
    "forward_start": ("step_end", "iteration", ("iteration",)),
}
_END_KINDS = {end for end, _, _ in _PAIRS.values()}


def _event_name(start_kind: str, fields: Mapping[str, Any]) -> str:
    if start_kind in ("layer_forward_start", "layer_backward_start"):
        return str(fields.get("layer", "?"))
    if start_kind == "comm_start":
        return str(fields.get("what", "all-reduce"))
    if start_kind == "comm_wait_start":
        return f"wait {fields.get('what', 'all-reduce')}"
    if start_kind == "step_start":
        return "step"
    return f"iteration {fields.get('iteration', '?')}"


def events_from_tracer(
    tracer_events: Iterable[tuple[int, str, Mapping[str, Any]]],
) -> list[TraceEvent]:
    """Convert the runtime's tracer log ``(time_ns, kind, fields)`` into :class:`TraceEvent` s.

    Start/end kinds are paired on their identifying fields, first-in first-out:

    * ``layer_forward_start``/``_end`` and ``layer_backward_start``/``_end`` on
      (layer, iteration) -> "forward"/"backward";
    * ``comm_start``/``comm_done`` on (what, stream) -> "comm" (launch to completion, so it
      includes time queued behind earlier collectives);
    * ``comm_wait_start``/``comm_wait`` on (what, stream) -> "wait";
      a ``comm_wait`` with no start becomes a zero-length "wait" marker (the runtime records
      only the end of a wait);
    * ``step_start``/``step_end`` on iteration -> "step";
      ``forward_start``/``step_end`` on iteration -> "iteration".

    Unknown kinds and unmatched starts are ignored. Times are seconds from the earliest event.
    """
    log = sorted(tracer_events, key=lambda e: e[0])
    if not log:
        return []
    origin = log[0][0]
    open_starts: dict[tuple[str, tuple[Any, ...]], deque[tuple[int, Mapping[str, Any]]]] = (
        defaultdict(deque)
    )
    out: list[TraceEvent] = []
    for time_ns, kind, fields in log:
        fields = fields or {}
        if kind in _PAIRS:
            key_fields = _PAIRS[kind][2]
            open_starts[(kind, tuple(fields.get(f) for f in key_fields))].append((time_ns, fields))
        if kind in _END_KINDS:
            for start_kind in [s for s, (end, _, _) in _PAIRS.items() if end == kind]:
                _, category, key_fields = _PAIRS[start_kind]
                queue = open_starts.get((start_kind, tuple(fields.get(f) for f in key_fields)))
                if queue:
                    t0, start_fields = queue.popleft()
                    args = {**dict(start_fields), **dict(fields)}
                    out.append(
                        TraceEvent(
                            _event_name(start_kind, args),
                            category,
                            (t0 - origin) * 1e-9,
                            (time_ns - origin) * 1e-9,
                            args,
                        )
                    )
                elif kind == "comm_wait":
                    t = (time_ns - origin) * 1e-9
                    out.append(
                        TraceEvent(
                            f"wait {fields.get('what', 'all-reduce')}", "wait", t, t, dict(fields)
                        )
                    )
    out.sort(key=lambda e: (e.start, e.end))
    return out
