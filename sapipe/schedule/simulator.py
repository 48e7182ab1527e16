"""Steady-state timeline of one training iteration for a given number of stale layers k.

The paper's closed form (``solver.closed_form_k``) ignores bucketing, launch order, the
latency term of the α–β model and stale traffic left over from the previous iteration.
This module simulates what the runtime actually does (docs/design.md §4–§5), so the solver can
predict the iteration time of every k and pick the smallest one with no stall.

Model (one rank; every rank is assumed identical):

* **Compute** is one serial stream: forward of layers 1..m, then backward of m..1, then
  ``step()``. Layer i takes ``u_i`` forward and ``b_i`` backward.
* **Buckets** pack whole layers in reverse forward order with the runtime's own rule
  (:func:`sapipe.layout.packing.bucket_layout`, which ``sapipe.layout.buckets.build_buckets``
  calls too): a bucket closes when the next layer would push it
  over ``bucket_cap_bytes`` (a larger layer gets a bucket of its own) and always at the
  S/N boundary between layers k and k+1. Layers 1..k (stale set S) are the last buckets.
* **Launch**: bucket j's all-reduce is issued when the backward of all its layers is done
  *and* bucket j-1 has been issued (collectives are issued in index order on every rank).
* **Link**: one shared link. By default (:class:`Link`) it runs one all-reduce at a time,
  never pre-empting a running one; the next to run is the earliest issued (FIFO). With
  ``shared_link=True`` (:class:`SharedLink`) sync and stale buckets go on
  two process groups, as the runtime sends them: each group is a FIFO queue, and while
  both have a transfer running they split the bandwidth evenly (fluid processor sharing).
  A bucket takes ``alpha + beta * bytes`` of the link at full rate (or, with
  ``alpha = beta = None``, the sum of its layers' profiled ``comm`` times).
* **Compute slow-down**: with ``slowdown`` σ > 0, compute runs at 1/(1+σ) of its speed
  while the link carries any transfer (on a CPU host the communication threads and the
  kernel's copies take cores from compute, docs/design.md §6). Transfers are not slowed in
  turn: ``beta`` should be the link as seen under training (``profiler`` fits it there).
* **Sync bucket** of iteration t: the forward of its first layer (in forward order) in
  iteration t+1 waits for its all-reduce, then applies its deferred update
  (``update_per_element`` × its parameters of compute) and only then runs.
  With ``sync_at_step`` (the runtime's timeline when the script reads the exposed
  ``p.grad`` before ``step()``, as clipping does) the end of iteration t's backward waits
  for all its sync all-reduces instead, and ``step()`` applies their updates (before
  ``step_time``); the next forward waits for nothing.
* **Stale bucket** of iteration t: its all-reduce may run through iteration t+1; the
  ``step()`` at the end of iteration t+1 waits for it, then updates the stale buckets
  (``update_per_element`` × their parameters, before ``step_time``). While in flight it
  occupies the link.

The simulation runs iteration after iteration, carrying in-flight stale traffic over,
until the pipeline repeats itself; the iteration time is the time between consecutive
iteration starts in that steady state.

Not modelled: hook overhead, compensation's extra work, communication
being slowed by computation (the fitted ``beta`` averages over it), a link whose sharing is
neither FIFO nor even (a deep queue in front of the link, as ``tc tbf`` with a large limit
has, lets the transfer that started first keep most of it), more than one transfer in
flight per process group (Gloo runs two at once per group; NCCL queues them), rank skew
(every rank is assumed identical) and noise. With σ = 0 and ``shared_link=False`` this is
exactly the one-at-a-time model above, the paper's setting plus bucketing and launch order.

FIFO is also earliest-deadline-first here: the only stale all-reduce a sync one could
overtake is from the previous iteration, and its deadline (this iteration's ``step()``)
comes before the sync one's (a forward of the next iteration; with ``sync_at_step`` the
same ``step()``, which waits for both, so their order does not matter).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from sapipe.errors import ConfigurationError
from sapipe.layout.packing import bucket_layout
from sapipe.tracing.chrome_trace import TraceEvent

if TYPE_CHECKING:  # pragma: no cover
    from sapipe.schedule.solver import LayerProfile

__all__ = ["BucketPlan", "SimResult", "plan_buckets", "simulate"]

DEFAULT_ITERATIONS = 30
_LONGEST_CYCLE = 4  # periodic patterns up to this many iterations are detected


# --------------------------------------------------------------------------- buckets


@dataclass(frozen=True)
class BucketPlan:
    """One gradient bucket: its layers (0-based forward indices, in backward order)."""

    index: int
    layers: tuple[int, ...]
    nbytes: int
    stale: bool
    comm_time: float

    @property
    def first_layer(self) -> int:
        """The bucket's first layer in forward order: its deferred update happens before it."""
        return min(self.layers)


def plan_buckets(
    profiles: Sequence[LayerProfile],
    k: int,
    *,
    bucket_cap_bytes: float,
    alpha: float | None,
    beta: float | None,
    bytes_per_layer: Sequence[int] | None = None,
) -> list[BucketPlan]:
    """Buckets for k stale layers with their all-reduce times, laid out by
    :func:`sapipe.layout.packing.bucket_layout` as the runtime lays them out.

    ``bytes_per_layer`` defaults to 4 bytes per element (``profile.numel``). Communication
    time is ``alpha + beta * bytes`` when both are given, or the sum of the layers' profiled
    ``comm`` when both are None (the closed form's additive view).
    """
    nbytes = _bytes_per_layer(profiles, bytes_per_layer)
    if (alpha is None) != (beta is None):
        raise ConfigurationError(
            "give both alpha and beta (α–β model) or neither (use profiled comm)"
        )
    plans = []
    for index, layers in enumerate(bucket_layout(nbytes, k, bucket_cap_bytes)):
        size = sum(nbytes[i] for i in layers)
        if alpha is None:
            comm = math.fsum(profiles[i].comm for i in layers)
        else:
            comm = alpha + beta * size  # type: ignore[operator]
        plans.append(BucketPlan(index, tuple(layers), size, layers[0] < k, comm))
    return plans


def _bytes_per_layer(
    profiles: Sequence[LayerProfile], bytes_per_layer: Sequence[int] | None
) -> list[int]:
    if bytes_per_layer is None:
        return [4 * p.numel for p in profiles]
    if len(bytes_per_layer) != len(profiles):
        raise ConfigurationError(
            f"bytes_per_layer has {len(bytes_per_layer)} entries for {len(profiles)} layers"
        )
    return list(bytes_per_layer)


# --------------------------------------------------------------------------- the link


@dataclass
class Transfer:
    """One all-reduce of one bucket in one iteration, and where the link placed it."""

    iteration: int
    bucket: BucketPlan
    issue: float
    start: float = math.nan
    end: float = math.nan

    @property
    def order(self) -> tuple[int, int]:
        """Launch order: iterations in turn, buckets by index within one."""
        return (self.iteration, self.bucket.index)


class Link:
    """One shared network link: all-reduces run one at a time and are never pre-empted.

    Transfers are submitted one iteration at a time, in launch order. A placement decision
    made at time τ only depends on transfers issued by τ, so submitting transfers issued
    from τ on keeps every transfer that started before τ and re-places the rest.
    """

    def __init__(self) -> None:
        self.placed: list[Transfer] = []  # in start order (= end order: the link is serial)

    def submit(self, transfers: Sequence[Transfer]) -> None:
        if not transfers:
            return
        tau = min(t.issue for t in transfers)
        redo: list[Transfer] = []
        while self.placed and self.placed[-1].start >= tau:
            redo.append(self.placed.pop())
        free = self.placed[-1].end if self.placed else -math.inf
        self._place(sorted(redo + list(transfers), key=lambda t: t.order), free)

    def busy_from(self, t: float) -> list[tuple[float, float]]:
        """Busy intervals of the link after ``t`` given the transfers submitted so far."""
        out: list[tuple[float, float]] = []
        for tr in reversed(self.placed):  # in start order, serial: ends increase too
            if tr.end <= t:
                break
            out.append((max(tr.start, t), tr.end))
        return out[::-1]

    def _place(self, waiting: list[Transfer], free: float) -> None:
        """List-schedule ``waiting`` (in launch order, hence in issue order) from time ``free``."""
        now = free
        while waiting:
            now = max(now, waiting[0].issue)
            nxt = waiting.pop(0)  # FIFO: the earliest launched
            nxt.start = now
            nxt.end = now + nxt.bucket.comm_time
            now = nxt.end
            self.placed.append(nxt)


class SharedLink:
    """Two process groups sharing one link: processor sharing between two FIFO queues.

    The runtime sends sync buckets on one process group and stale buckets on another
    (``sapipe.comm``). Each group runs its all-reduces one after the other; when both have
    one running, they split the bandwidth evenly (a fluid model of two TCP flows through
    the same bottleneck), and one alone gets all of it. A transfer needs ``comm_time`` of
    the link at full rate. The link is work-conserving, so its busy periods, and the total
    traffic, are those of the one-at-a-time :class:`Link`; what changes is who finishes when:
    a sync all-reduce that shares the link with a stale one takes up to twice as long.

    Transfers must be submitted in issue order. ``start``/``end`` of a transfer still in
    flight are projections assuming nothing more is submitted; they are exact for any
    question asked before the next submission's issue time, which is all the simulator asks.
    """

    def __init__(self) -> None:
        self.placed: list[Transfer] = []  # every submitted transfer, in issue order
        self.now = -math.inf  # the fluid state below is as of this time
        self._queues: tuple[list[Transfer], list[Transfer]] = ([], [])  # sync, stale: pending, FIFO
        self._remaining: dict[int, float] = {}  # id(transfer) -> link time left, for queue heads
        self._busy_until = -math.inf  # end of the projected busy period

    def submit(self, transfers: Sequence[Transfer]) -> None:
        for tr in transfers:
            if tr.issue < self.now:
                raise ConfigurationError("transfers must be submitted in issue order")
            self._advance(tr.issue)
            queue = self._queues[tr.bucket.stale]
            queue.append(tr)
            self.placed.append(tr)
            if len(queue) == 1:
                tr.start = tr.issue
                self._remaining[id(tr)] = tr.bucket.comm_time
        self._project()

    def busy_from(self, t: float) -> list[tuple[float, float]]:
        lo = max(t, self.now)
        return [(lo, self._busy_until)] if self._busy_until > lo else []

    def _advance(self, until: float) -> None:
        """Run the fluid model from ``now`` to ``until`` (final: nothing else arrives before)."""
        self.now = self._run(self._queues, self._remaining, self.now, until)

    def _project(self) -> None:
        """Tentative start/end of everything pending, if nothing else arrives."""
        queues = (list(self._queues[0]), list(self._queues[1]))
        self._busy_until = self._run(queues, dict(self._remaining), self.now, math.inf)

    @staticmethod
    def _run(
        queues: tuple[list[Transfer], list[Transfer]],
        remaining: dict[int, float],
        now: float,
        until: float,
    ) -> float:
        while True:
            heads = [q[0] for q in queues if q]
            if not heads:
                return until if until < math.inf else now
            share = len(heads)
            step = min(remaining[id(tr)] for tr in heads)  # link time of the first to finish
            if now + step * share > until:
                for tr in heads:
                    remaining[id(tr)] -= (until - now) / share
                return until
            now += step * share
            for queue in queues:
                if queue and remaining[id(queue[0])] - step <= 0.0:
                    done = queue.pop(0)
                    done.end = now
                    del remaining[id(done)]
                    if queue:
                        queue[0].start = now
                        remaining[id(queue[0])] = queue[0].bucket.comm_time
                elif queue:
                    remaining[id(queue[0])] -= step


def _compute_end(cursor: float, work: float, link, slowdown: float) -> float:
    """When ``work`` seconds of compute that start at ``cursor`` end: compute runs at
    1/(1+σ) of its speed while the link is busy (with the transfers submitted so far)."""
    if slowdown <= 0.0 or work <= 0.0:
        return cursor + work
    for lo, hi in link.busy_from(cursor):
        if lo > cursor:  # idle until lo: full speed
            if work <= lo - cursor:
                return cursor + work
            work -= lo - cursor
            cursor = lo
        capacity = (hi - cursor) / (1.0 + slowdown)
        if work <= capacity:
            return cursor + work * (1.0 + slowdown)
        work -= capacity
        cursor = hi
    return cursor + work


# --------------------------------------------------------------------------- simulation


@dataclass
class SimResult:
    """Steady-state prediction for one k. Times in seconds."""

    k: int
    iteration_time: float  # between consecutive iteration starts, steady state
    compute_time: (
        float  # sum(u) + sum(b) + step + updates: the iteration time with no communication
    )
    stall: float  # iteration_time - compute_time: waits and, with a slow-down, compute lost to it
    comm_time: float  # link busy time per iteration (sum of bucket all-reduce times)
    forward_wait: (
        float  # of the stall: waiting for sync all-reduces before forwards (0 with sync_at_step)
    )
    step_wait: float  # of the stall: step() waiting for the previous iteration's stale all-reduces
    # (and, with sync_at_step, the end of backward waiting for this iteration's sync ones)
    converged: bool  # False: no repeat within `iterations`; iteration_time is an estimate
    cycle: int  # the steady state repeats every `cycle` iterations (0: not converged)
    iterations: int  # iterations simulated
    buckets: list[BucketPlan] = field(default_factory=list)
    events: list[TraceEvent] = field(
        default_factory=list
    )  # one steady-state iteration, starting at 0
    wait: float = (
        math.nan
    )  # of the stall: time compute waited for communication (= stall without slow-down)


@dataclass
class _Iteration:
    """Compute timeline of one simulated iteration."""

    start: float
    backward_end: float = 0.0
    step_end: float = math.nan  # = next iteration's start
    forward_wait: float = 0.0
    busy: float = 0.0  # time spent computing (slowed down or not)
    events: list[TraceEvent] = field(default_factory=list)


def _run_forward_backward(
    t: int,
    start: float,
    profiles: Sequence[LayerProfile],
    buckets: Sequence[BucketPlan],
    previous: dict[int, Transfer],
    link,
    slowdown: float,
    update_work: dict[int, float],
) -> tuple[_Iteration, list[Transfer]]:
    """Forward (waiting for last iteration's sync all-reduces, then applying their updates)
    and backward of iteration t.

    ``previous``: the all-reduces (by bucket index) whose sync buckets the forward waits
    for: last iteration's, or none with ``sync_at_step`` (``step()`` consumed them).
    ``update_work``: the seconds of each bucket's optimizer update (by bucket index).
    Returns the timeline and the all-reduces the backward issues. With a slow-down they are
    submitted to ``link`` as they are issued (compute after them depends on them); without,
    the caller submits them all at once.
    """
    it = _Iteration(start=start)
    sync_bucket_at = {b.first_layer: b for b in buckets if not b.stale}
    cursor = start
    for i, prof in enumerate(profiles):
        bucket = sync_bucket_at.get(i)
        if bucket is not None and bucket.index in previous:
            done = previous[bucket.index].end
            if done > cursor:
                it.events.append(
                    TraceEvent(
                        f"wait sync bucket {bucket.index}",
                        "wait",
                        cursor,
                        done,
                        {"bucket": bucket.index, "before_layer": prof.name},
                    )
                )
                it.forward_wait += done - cursor
                cursor = done
            work = update_work[bucket.index]
            if work > 0:
                end = _compute_end(cursor, work, link, slowdown)
                it.events.append(
                    TraceEvent(
                        f"update bucket {bucket.index}",
                        "update",
                        cursor,
                        end,
                        {"bucket": bucket.index},
                    )
                )
                it.busy += end - cursor
                cursor = end
        end = _compute_end(cursor, prof.forward, link, slowdown)
        it.events.append(TraceEvent(prof.name, "forward", cursor, end, {"layer": i}))
        it.busy += end - cursor
        cursor = end
    incremental = slowdown > 0.0
    pending = {i: len(b.layers) for i, b in enumerate(buckets)}
    bucket_of = {layer: b.index for b in buckets for layer in b.layers}
    transfers: list[Transfer] = []
    issue = -math.inf
    for i in reversed(range(len(profiles))):
        prof = profiles[i]
        end = _compute_end(cursor, prof.backward, link, slowdown)
        it.events.append(TraceEvent(prof.name, "backward", cursor, end, {"layer": i}))
        it.busy += end - cursor
        cursor = end
        pending[bucket_of[i]] -= 1
        # buckets go in index order, each once all its layers' gradients are in
        while len(transfers) < len(buckets) and pending[len(transfers)] == 0:
            issue = max(issue, cursor)
            tr = Transfer(t, buckets[len(transfers)], issue)
            transfers.append(tr)
            if incremental:
                link.submit([tr])
    it.backward_end = cursor
    return it, transfers


def _comm_events(link, lo: float, hi: float, t: int) -> list[TraceEvent]:
    """Iteration t's all-reduces (even those running on into t+1) and any others running in [lo,
    hi)."""
    events = []
    for tr in link.placed:
        if tr.iteration == t or (tr.end > lo and tr.start < hi):
            kind = "stale" if tr.bucket.stale else "sync"
            events.append(
                TraceEvent(
                    f"{kind} bucket {tr.bucket.index}",
                    "comm",
                    tr.start,
                    tr.end,
                    {
                        "iteration": tr.iteration - t,
                        "bucket": tr.bucket.index,
                        "stale": tr.bucket.stale,
                        "bytes": tr.bucket.nbytes,
                        "layers": list(tr.bucket.layers),
                        "queued": tr.start - tr.issue,
                    },
                )
            )
    return events


def simulate(
    profiles: Sequence[LayerProfile],
    k: int,
    *,
    bucket_cap_bytes: float,
    alpha: float | None,
    beta: float | None,
    bytes_per_layer: Sequence[int] | None = None,
    iterations: int = DEFAULT_ITERATIONS,
    record_events: bool = True,
    step_time: float = 0.0,
    slowdown: float = 0.0,
    shared_link: bool = False,
    update_per_element: float = 0.0,
    sync_at_step: bool = False,
) -> SimResult:
    """Predict the steady-state iteration time with the first ``k`` layers stale.

    ``profiles`` are in forward order. See the module docstring for the model; pass
    ``alpha=None, beta=None`` to use each layer's profiled ``comm`` instead of the α–β model.
    Iterations are simulated until the pipeline repeats itself -- the last iteration's
    all-reduces sit at the same offsets from the next iteration's start as c = 1..4
    iterations before; the iteration time is then the mean period over that cycle -- or
    for ``iterations`` at most. If it has not settled by then (a backlog still growing on a
    saturated link), the iteration time is estimated as the mean period of the second half
    of the run, but no less than the link's busy time per iteration.

    ``step_time`` is serial compute between the end of backward (and of ``step()``'s wait
    for stale all-reduces) and the next forward: the optimizer step, ``zero_grad``, loading
    the next batch. It counts as compute.

    ``update_per_element``: seconds of optimizer update per parameter element, charged to
    each bucket after its all-reduce (sync: before its first layer's next forward; stale:
    in ``step()``, before ``step_time``). It counts as compute.

    ``sync_at_step``: the runtime's timeline when the script reads the exposed ``p.grad``
    before ``step()`` (clipping, logging, a GradScaler's ``unscale_``): the end of
    backward waits for this iteration's sync all-reduces, and ``step()`` applies their
    updates with the stale ones' (serial, before ``step_time``), not before the next forward.

    ``slowdown`` σ ≥ 0: compute runs at 1/(1+σ) of its speed while the link carries a
    transfer (0: communication costs compute nothing, the paper's and the old model).
    ``shared_link``: sync and stale all-reduces run on two process groups that share the
    link (:class:`SharedLink`) instead of one at a time (:class:`Link`).

    ``events`` (if ``record_events``) is the last simulated iteration, shifted to start at
    0: its compute, waits, its own all-reduces (some run on into the next iteration) and
    those carried over from the previous one (negative start times).
    """
    _check_arguments(len(profiles), k, slowdown, update_per_element)
    buckets = plan_buckets(
        profiles,
        k,
        bucket_cap_bytes=bucket_cap_bytes,
        alpha=alpha,
        beta=beta,
        bytes_per_layer=bytes_per_layer,
    )
    update_work = {
        b.index: update_per_element * sum(profiles[i].numel for i in b.layers) for b in buckets
    }
    # step() updates the stale buckets, and with sync_at_step the sync ones too
    step_work = (
        math.fsum(update_work[b.index] for b in buckets if b.stale or sync_at_step) + step_time
    )
    compute = (
        math.fsum(p.forward for p in profiles)
        + math.fsum(p.backward for p in profiles)
        + step_time
        + update_per_element * sum(p.numel for p in profiles)
    )
    comm = math.fsum(b.comm_time for b in buckets)
    link = SharedLink() if shared_link else Link()
    history, cycle = _run_iterations(
        profiles,
        buckets,
        link,
        update_work,
        step_work,
        slowdown,
        max(iterations, 2),
        compute + comm,
        sync_at_step,
    )
    iteration_time, busy = _period(history, cycle, comm)
    last = history[-1]
    return SimResult(
        k=k,
        iteration_time=iteration_time,
        compute_time=compute,
        stall=max(iteration_time - compute, 0.0),
        comm_time=comm,
        forward_wait=last.forward_wait,
        step_wait=_step_wait(last, step_work, slowdown),
        converged=bool(cycle),
        cycle=cycle,
        iterations=len(history),
        buckets=buckets,
        events=_last_iteration_events(link, history) if record_events else [],
        wait=max(iteration_time - busy, 0.0)
        if slowdown > 0.0
        else max(iteration_time - compute, 0.0),
    )


def _check_arguments(m: int, k: int, slowdown: float, update_per_element: float) -> None:
    """Reject what :func:`simulate` cannot model (k outside 0..m, a negative or infinite σ or update
    cost)."""
    if not 0 <= k <= m:
        raise ConfigurationError(f"k={k} outside 0..{m}")
    if not slowdown >= 0.0 or math.isinf(slowdown):
        raise ConfigurationError(f"slowdown must be finite and >= 0; got {slowdown}")
    if not update_per_element >= 0.0 or math.isinf(update_per_element):
        raise ConfigurationError(
            f"update_per_element must be finite and >= 0; got {update_per_element}"
        )


def _run_iterations(
    profiles: Sequence[LayerProfile],
    buckets: Sequence[BucketPlan],
    link,
    update_work: dict[int, float],
    step_work: float,
    slowdown: float,
    iterations: int,
    scale: float,
    sync_at_step: bool = False,
) -> tuple[list[_Iteration], int]:
    """Simulate iterations until the pipeline repeats itself (or ``iterations`` of them).

    Returns the iterations' timelines and the cycle length (0: not converged). ``scale``
    (a typical iteration time) sets the tolerance of "repeats". ``sync_at_step``: the sync
    all-reduces are waited for at the end of backward (their updates are in ``step_work``),
    not by the next forward.
    """
    history: list[_Iteration] = []
    sent: list[dict[int, Transfer]] = []  # per iteration: bucket index -> its all-reduce
    states: list[tuple[float, ...]] = []
    start = 0.0
    for t in range(iterations):
        previous = sent[t - 1] if t else {}
        it, transfers = _run_forward_backward(
            t,
            start,
            profiles,
            buckets,
            {} if sync_at_step else previous,
            link,
            slowdown,
            update_work,
        )
        if slowdown <= 0.0:
            link.submit(transfers)  # with a slow-down they were submitted as issued
        sent.append({tr.bucket.index: tr for tr in transfers})
        # every all-reduce of iteration t is on the link now, so the ends step() waits for are final
        sync = [tr for tr in transfers if not tr.bucket.stale] if sync_at_step else []
        _run_step(
            it, sync, [tr for tr in previous.values() if tr.bucket.stale], step_work, link, slowdown
        )
        history.append(it)
        start = it.step_end
        states.append(_state(transfers, start))
        cycle = _cycle(states, scale)
        if cycle:
            return history, cycle
    return history, 0


def _run_step(
    it: _Iteration,
    sync: Sequence[Transfer],
    stale: Sequence[Transfer],
    step_work: float,
    link,
    slowdown: float,
) -> None:
    """The end of ``it``'s backward waits for ``sync`` (this iteration's sync all-reduces,
    with ``sync_at_step``), then ``step()`` for ``stale`` (the previous iteration's stale
    ones), then computes ``step_work``: the stale buckets' updates (and, with
    ``sync_at_step``, the sync ones'), then ``step_time``.

    The ends waited for are final: every transfer that could still delay them (on a
    :class:`SharedLink`) was issued by the end of this backward, and the next ones are
    issued after this step.
    """
    cursor = it.backward_end
    for kind, transfers in (("sync", sync), ("stale", stale)):
        done = max([cursor] + [tr.end for tr in transfers])
        if done > cursor:
            it.events.append(TraceEvent(f"step: wait {kind} all-reduces", "wait", cursor, done, {}))
            cursor = done
    it.step_end = _compute_end(cursor, step_work, link, slowdown)
    it.busy += it.step_end - cursor
    if step_work > 0:
        it.events.append(TraceEvent("step", "step", cursor, it.step_end, {}))


def _period(history: Sequence[_Iteration], cycle: int, comm: float) -> tuple[float, float]:
    """Steady-state iteration time and compute-busy time per iteration."""
    starts = [history[0].start] + [it.step_end for it in history]
    if cycle:  # periodic: the mean period over one cycle (cycles longer than 1 are rare)
        iteration_time = (starts[-1] - starts[-1 - cycle]) / cycle
        busy = math.fsum(it.busy for it in history[-cycle:]) / cycle
        return iteration_time, busy
    # not settled (e.g. a backlog still growing on a saturated link): average the second
    # half, and the link's busy time per iteration is a floor
    half = len(history) // 2
    iteration_time = max((starts[-1] - starts[half]) / (len(history) - half), comm)
    busy = math.fsum(it.busy for it in history[half:]) / (len(history) - half)
    return iteration_time, busy


def _last_iteration_events(link, history: Sequence[_Iteration]) -> list[TraceEvent]:
    """The last iteration's compute and communication events, shifted to start at 0."""
    last = history[-1]
    raw = last.events + _comm_events(link, last.start, last.step_end, len(history) - 1)
    return sorted(
        (
            TraceEvent(e.name, e.category, e.start - last.start, e.end - last.start, e.args)
            for e in raw
        ),
        key=lambda e: (e.start, e.end),
    )


def _step_wait(it: _Iteration, step_time: float, slowdown: float) -> float:
    """How long step() of ``it`` waited for stale all-reduces (and, with ``sync_at_step``,
    the end of its backward for its sync ones)."""
    if slowdown <= 0.0:
        return it.step_end - step_time - it.backward_end
    return math.fsum(
        e.end - e.start for e in it.events if e.category == "wait" and e.name.startswith("step:")
    )


def _state(transfers: Sequence[Transfer], next_start: float) -> tuple[float, ...]:
    """What the future depends on at an iteration start: the last iteration's all-reduces
    (issue, start, end), relative to that start. A repeated state means a periodic pipeline."""
    return tuple(x - next_start for tr in transfers for x in (tr.issue, tr.start, tr.end))


def _same_state(a: tuple[float, ...], b: tuple[float, ...], scale: float) -> bool:
    eps = 1e-9 * max(scale, 1e-30)
    return len(a) == len(b) and all(abs(x - y) <= eps for x, y in zip(a, b))


def _cycle(states: Sequence[tuple[float, ...]], scale: float, longest: int = _LONGEST_CYCLE) -> int:
    """Length c of the cycle the pipeline has entered (last state == state c iterations ago), else
    0."""
    for c in range(1, min(longest, len(states) - 1) + 1):
        if _same_state(states[-1], states[-1 - c], scale):
            return c
    return 0
