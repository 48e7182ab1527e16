"""Choosing k, the number of stale layers (docs/design.md §4, SAPipe paper §3.1).

Two answers are kept side by side:

* :func:`closed_form_k` -- the paper's program. With u_i, b_i, v_i the forward, backward and
  all-reduce times of layer i (forward order, 1-based), minimise k subject to

      (1)  Σ_i v_i ≤ Σ_i b_i + Σ_i u_i
      (2)  Σ_{i=k+1..m} v_i ≤ Σ_{i=1..m-1} b_i + Σ_{i=1..k} u_i

  (indices as in both the paper and docs/design.md). (1) says the link can carry one
  iteration's traffic in one iteration's compute; (2) says the sync layers' traffic fits
  between the end of the last layer's backward and the start of layer k+1's forward in the
  next iteration. Both are *necessary* for a stall-free pipeline but not sufficient: (2)
  lets a sync layer's all-reduce start before its own gradient exists. For example, with
  k = 0 layer 1's gradient is ready only at the very end of backward and its update is needed
  at the very start of the next forward, so any v_1 > 0 stalls, yet (2) may hold. Hence in
  the simulator's idealised setting (one layer per bucket, α = 0, FIFO) the simulated k is
  never *smaller* than the closed form's (up to the stall tolerance), and often larger.
* :func:`choose_k` -- the decision the runtime uses: simulate every k with the runtime's
  bucketing, launch order and link (``simulator.simulate``) and take the smallest k whose
  predicted stall is within a tolerance.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from sapipe.errors import ConfigurationError
from sapipe.schedule.simulator import DEFAULT_ITERATIONS, SimResult, simulate

__all__ = [
    "LayerProfile",
    "Decision",
    "STALL_TOLERANCE",
    "closed_form_k",
    "brute_force_k",
    "choose_k",
]

#: A predicted stall below this fraction of compute counts as none (docs/design.md §4.4).
#: Profiles taken on a live job carry a few percent of noise, and staling a layer costs some
#: accuracy, so "auto" only makes layers stale for a gain larger than that.
STALL_TOLERANCE = 0.03

_REL_EPS = 1e-12  # comparisons in the closed form tolerate rounding of the sums


@dataclass
class LayerProfile:
    """Measured costs of one layer (times in seconds).

    ``comm`` is v_i, the all-reduce time of this layer's gradients alone; ``numel`` is its
    parameter count (for κ and, by default, 4 bytes per element for the α–β model).
    """

    name: str
    forward: float
    backward: float
    comm: float
    numel: int = 0


def _leq(a: float, b: float) -> bool:
    return a <= b + _REL_EPS * max(abs(a), abs(b), 1e-300)


# --------------------------------------------------------------------------- closed form


def closed_form_k(profiles: Sequence[LayerProfile]) -> int | None:
    """The paper's minimal k, or None when constraint (1) fails (communication-bound).

    O(m): the left side of (2) shrinks and its right side grows with k, so the feasible k
    form a suffix 0..m -> the first feasible k is the answer. At k = m (2) always holds, so
    the program is infeasible exactly when (1) fails.
    """
    m = len(profiles)
    u = [p.forward for p in profiles]
    b = [p.backward for p in profiles]
    v = [p.comm for p in profiles]
    if not _leq(math.fsum(v), math.fsum(b) + math.fsum(u)):
        return None
    backward_but_last = math.fsum(b[: m - 1])
    prefix_u = list(itertools.accumulate(u, initial=0.0))  # prefix_u[k] = Σ_{i<=k} u_i
    suffix_v = list(itertools.accumulate(reversed(v), initial=0.0))[
        ::-1
    ]  # suffix_v[k] = Σ_{i>k} v_i
    for k in range(m + 1):
        if _leq(suffix_v[k], backward_but_last + prefix_u[k]):
            return k
    return m  # unreachable: (2) holds at k = m


def brute_force_k(profiles: Sequence[LayerProfile]) -> int | None:
    """Reference for :func:`closed_form_k`: test every k with sums written out (O(m²))."""
    m = len(profiles)
    u = [p.forward for p in profiles]
    b = [p.backward for p in profiles]
    v = [p.comm for p in profiles]
    for k in range(m + 1):
        overlap = _leq(math.fsum(v), math.fsum(b) + math.fsum(u))
        sync_in_time = _leq(
            math.fsum(v[i] for i in range(k, m)),
            math.fsum(b[i] for i in range(m - 1)) + math.fsum(u[i] for i in range(k)),
        )
        if overlap and sync_in_time:
            return k
    return None


# --------------------------------------------------------------------------- simulated choice


@dataclass
class Decision:
    """The scheduler's choice of k and the predictions behind it (times in seconds)."""

    k: int  # chosen number of stale layers (layers 1..k)
    m: int  # number of layers
    kappa: float  # fraction of parameters that are stale
    iteration_time: float  # predicted at k
    iteration_time_sync: float  # predicted at k = 0 (fully synchronous)
    iteration_time_all_stale: float  # predicted at k = m
    compute_time: float  # sum of forward and backward times
    stall: float  # iteration_time - compute_time at k
    comm_time: float  # link busy time per iteration at k
    comm_bound: bool  # even k = m stalls: throughput is set by the link
    tolerance: float  # stall accepted as "no stall", seconds
    closed_form_k: (
        int | None
    )  # the paper's program (per-layer v_i from the same comm model), for reference
    stalls: dict[int, float] = field(default_factory=dict)  # every simulated k -> its stall

    @property
    def averaging_period(self) -> int | None:
        """Where even k = m stalls: the period τ of elastic averaging
        (``sapipe.ElasticAveraging``) whose τ iterations of compute hide one all-reduce of
        the model, with a quarter to spare; None where the link is not the limit."""
        if not self.comm_bound or self.compute_time <= 0:
            return None
        return max(2, math.ceil(1.25 * self.comm_time / self.compute_time))

    @property
    def advice(self) -> str | None:
        """What to do where no k hides the link (None: nothing)."""
        period = self.averaging_period
        if period is None:
            return None
        return (
            f"no k hides this link: one all-reduce takes {self.comm_time / self.compute_time:.2g}x "
            f"an iteration's compute. Periodic averaging hides it behind {period} local steps: "
            f"sapipe.ElasticAveraging(optimizer, model, period={period}) in place of "
            "DistributedOptimizer (docs/guide.md, links too slow for any k)"
        )

    @property
    def throughput(self) -> float:
        """Predicted iterations per second at the chosen k."""
        return 1.0 / self.iteration_time if self.iteration_time > 0 else math.inf

    def summary(self) -> str:
        """One line for the log."""
        cf = "infeasible" if self.closed_form_k is None else str(self.closed_form_k)
        tail = (
            f"k=0: {_ms(self.iteration_time_sync)}, k={self.m}: "
            f"{_ms(self.iteration_time_all_stale)}; "
            f"closed form k={cf}"
        )
        if self.comm_bound:
            return (
                f"sapipe schedule: COMMUNICATION-BOUND (comm {_ms(self.comm_time)} vs compute "
                f"{_ms(self.compute_time)} per iteration; even all {self.m} layers stale stall): "
                f"k={self.k} (kappa={self.kappa:.1%}), predicted {_ms(self.iteration_time)}/iter "
                f"= {self.throughput:.3g} it/s, limited by communication; {tail}; {self.advice}"
            )
        return (
            f"sapipe schedule: k={self.k} of {self.m} layers stale (kappa={self.kappa:.1%}), "
            "predicted "
            f"{_ms(self.iteration_time)}/iter (compute {_ms(self.compute_time)}, stall "
            f"{_ms(self.stall)}, "
            f"comm {_ms(self.comm_time)}); {tail}"
        )


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g} ms"


def _kappa(
    profiles: Sequence[LayerProfile], k: int, bytes_per_layer: Sequence[int] | None
) -> float:
    """Stale share of parameters: by numel, else by bytes, else by layer count."""
    for sizes in ([p.numel for p in profiles], list(bytes_per_layer or [])):
        total = sum(sizes)
        if total > 0:
            return sum(sizes[:k]) / total
    return k / len(profiles) if profiles else 0.0


def _with_model_comm(
    profiles: Sequence[LayerProfile],
    alpha: float | None,
    beta: float | None,
    bytes_per_layer: Sequence[int] | None,
) -> Sequence[LayerProfile]:
    """Profiles whose ``comm`` is the α–β time of each layer alone, when α and β are given."""
    if alpha is None or beta is None:
        return profiles
    nbytes = bytes_per_layer if bytes_per_layer is not None else [4 * p.numel for p in profiles]
    return [replace(p, comm=alpha + beta * n) for p, n in zip(profiles, nbytes)]


def choose_k(
    profiles: Sequence[LayerProfile],
    *,
    bucket_cap_bytes: float,
    alpha: float | None = None,
    beta: float | None = None,
    bytes_per_layer: Sequence[int] | None = None,
    tolerance: float = STALL_TOLERANCE,
    iterations: int = DEFAULT_ITERATIONS,
    step_time: float = 0.0,
    slowdown: float = 0.0,
    shared_link: bool = False,
    only_k: int | None = None,
    update_per_element: float = 0.0,
    sync_at_step: bool = False,
) -> Decision:
    """Smallest k whose simulated steady-state stall is at most ``tolerance`` × compute time.

    Every k in 0..m is a candidate: buckets are rebuilt for each k the way the runtime
    builds them (cap ``bucket_cap_bytes``, always closed at the S/N boundary), so the cut is
    a bucket boundary by construction. ``alpha``/``beta`` give the α–β all-reduce model
    (seconds, seconds per byte) on ``bytes_per_layer`` (default 4 × numel); leave both None
    to charge each bucket the sum of its layers' profiled ``comm``.

    ``slowdown``, ``shared_link``, ``update_per_element`` and ``sync_at_step`` are the
    simulator's (compute slowed by a busy link; sync and stale traffic on two process groups
    sharing it; the optimizer update's cost per parameter; sync all-reduces waited for at
    the end of backward and their updates in ``step()``, as with ``expose_gradients``), see
    :func:`simulate`.

    When even k = m stalls beyond the tolerance, the chosen k is the smallest whose
    iteration time is within the tolerance of the best k's. That happens when the job is
    communication-bound (k = m still *waits* for the link: ``comm_bound``), or when
    overlapping communication with compute costs compute time (``slowdown`` > 0), so that
    no k is stall-free and the best k is the one that loses least.

    ``only_k``: no choice; the decision (predictions and all) for this k, e.g. one that was
    measured on the job (:mod:`sapipe.auto.search`).
    """
    m = len(profiles)
    cache: dict[int, SimResult] = {}

    def sim(k: int) -> SimResult:
        if k not in cache:
            cache[k] = simulate(
                profiles,
                k,
                bucket_cap_bytes=bucket_cap_bytes,
                alpha=alpha,
                beta=beta,
                bytes_per_layer=bytes_per_layer,
                iterations=iterations,
                record_events=False,
                step_time=step_time,
                slowdown=slowdown,
                shared_link=shared_link,
                update_per_element=update_per_element,
                sync_at_step=sync_at_step,
            )
        return cache[k]

    compute = sim(0).compute_time  # the same for every k
    tol = tolerance * compute
    comm_bound = sim(m).wait > tol  # = its stall without a slow-down
    if only_k is not None:
        if not 0 <= only_k <= m:
            raise ConfigurationError(f"k={only_k} outside 0..{m}")
        chosen = only_k
    elif sim(m).stall <= tol:
        chosen = next(k for k in range(m + 1) if sim(k).stall <= tol)
    else:
        best = min(sim(k).iteration_time for k in range(m + 1))
        chosen = next(k for k in range(m + 1) if sim(k).iteration_time <= best + tol)
    result = sim(chosen)
    return Decision(
        k=chosen,
        m=m,
        kappa=_kappa(profiles, chosen, bytes_per_layer),
        iteration_time=result.iteration_time,
        iteration_time_sync=sim(0).iteration_time,
        iteration_time_all_stale=sim(m).iteration_time,
        compute_time=compute,
        stall=result.stall,
        comm_time=result.comm_time,
        comm_bound=comm_bound,
        tolerance=tol,
        closed_form_k=closed_form_k(_with_model_comm(profiles, alpha, beta, bytes_per_layer)),
        stalls={k: r.stall for k, r in sorted(cache.items())},
    )
