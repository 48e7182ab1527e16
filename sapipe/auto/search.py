"""Check the scheduler's k on the running job, and move it where measurement says.

The simulator predicts each k from a profile taken while the job is fully synchronous.
What that profile cannot show is how synchronous and stale all-reduces, and the compute
beside them, slow each other down once the pipeline runs (on a CPU host they share the
cores; on any host they share the NIC). So ``stale_layers="auto"`` does not stop at the
model's k: it trains a few iterations at that k and, if they still wait for communication,
measures other k on the job itself.

The search, over measured iteration times T(k) (the slowest rank's, robust to outliers):

1. Try the model's k₁. If its iterations wait for communication no more than the tolerance
   allows, keep it: the model was right.
2. Else try k = m (everything stale, all communication hidden if anything hides it). If it
   is not faster than k₁ by more than the tolerance, keep k₁: staling more layers would
   cost accuracy for nothing.
3. Else search between them for the smallest k with T(k) within the tolerance of the best
   time measured, T_best (T(m), or a probe's where one measured faster: on a noisy host
   staling every layer need not measure fastest, and the k chosen is then the smallest
   within the tolerance of the fastest k seen, not of T(m)). A probe judged too slow stays
   so, since T_best only falls; one that sets a new T_best is within it. Each probe is one
   trial; a k is never measured twice. The probe is the bracket's
   midpoint (a bisection) or, where the caller gives ``suggest``, the k its model points
   at: the simulator calibrated on the trials so far usually lands on the answer at once,
   and a search with an iteration budget (``auto_budget``) has room for only one or two
   probes. A suggestion at the bracket's good end ends the search there.

A search out of budget ends (:meth:`stop`) with the best k measured so far: the good end of
the bracket (k = m, or a probe within the tolerance of T_best), else the model's k.

This class only decides; the optimizer runs the trials (restarting the pipeline at each
new k) and feeds in measurements that every rank agrees on, so every rank walks the same
path. Pure Python.

The trials also calibrate the model (:func:`fit_slowdown`): the compute slow-down σ while
the link is busy, which the profile cannot measure reliably (see ``profiler``), is the one
that best explains the measured iteration times; the final decision predicts with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import astuple, dataclass
from typing import Any, Callable

from sapipe.errors import ConfigurationError, SapipeError

__all__ = ["LINK_SCALES", "SLOWDOWN_GRID", "Trial", "Tuner", "fit_link_scale", "fit_slowdown"]

#: Candidate σ for :func:`fit_slowdown`: 0 (communication costs compute nothing) up to 8
#: (compute at 1/9 speed while the link is busy: in effect, no overlap at all).
SLOWDOWN_GRID = (0.0, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 8.0)

#: Candidate factors for :func:`fit_link_scale`: the link as the profile measured it, times c.
LINK_SCALES = (0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0, 8.0)


@dataclass(frozen=True)
class Trial:
    """One measured k: its iteration time and communication wait per iteration (s)."""

    k: int
    iteration_time: float
    waits: float


class Tuner:
    """The measured search for k described in the module docstring.

    ``trial`` is the k to run and measure now (None once ``final`` is set); :meth:`record`
    takes its measurement and moves on. ``tolerance`` is a fraction of the iteration time.
    """

    def __init__(
        self,
        first_k: int,
        m: int,
        tolerance: float,
        suggest: Callable[[int, int], int] | None = None,
    ) -> None:
        if not 0 <= first_k <= m:
            raise ConfigurationError(f"first k={first_k} outside 0..{m}")
        if not 0.0 <= tolerance < 1.0:
            raise ConfigurationError(f"tolerance must be in [0, 1); got {tolerance}")
        self.m = m
        self.first_k = first_k
        self.tolerance = tolerance
        self.trials: list[Trial] = []
        self.trial: int | None = first_k
        self.final: int | None = None
        self._lo = self._hi = -1  # bisection: lo is known slow, hi known good
        #: ``suggest(lo, hi)``: the k in (lo, hi] to probe next (not checkpointed: the caller's
        #: model)
        self.suggest = suggest

    @property
    def measured(self) -> dict[int, Trial]:
        return {t.k: t for t in self.trials}

    def record(self, iteration_time: float, waits: float) -> None:
        """The measurement of ``trial``; sets the next ``trial`` or ``final``."""
        if self.trial is None:
            raise SapipeError("the search is over; nothing to record")
        self.trials.append(Trial(self.trial, iteration_time, waits))
        self.trial = self._next()
        if self.trial is None:
            assert self.final is not None

    def _next(self) -> int | None:
        got = self.measured
        first = got[self.first_k]
        if len(self.trials) == 1:
            if first.waits <= self.tolerance * first.iteration_time or self.first_k == self.m:
                return self._finish(self.first_k)
            return self.m
        if len(self.trials) == 2:
            if got[self.m].iteration_time >= first.iteration_time * (1.0 - self.tolerance):
                return self._finish(self.first_k)
            self._lo, self._hi = self.first_k, self.m
        else:
            last = self.trials[-1]
            if last.iteration_time <= self.best_time * (1.0 + self.tolerance):
                self._hi = last.k
            else:
                self._lo = last.k
        if self._hi - self._lo <= 1:
            return self._finish(self._hi)
        probe = (
            (self._lo + self._hi) // 2 if self.suggest is None else self.suggest(self._lo, self._hi)
        )
        probe = max(self._lo + 1, probe)
        return self._finish(self._hi) if probe >= self._hi else probe

    @property
    def best_time(self) -> float:
        """T_best: the fastest iteration time measured so far (inf before any trial)."""
        return min((t.iteration_time for t in self.trials), default=math.inf)

    def margin(self, iteration_time: float, waits: float) -> float:
        """How far, as a fraction of ``iteration_time``, a measurement of ``trial`` lies from
        the threshold its verdict turns on (k₁'s waits against the tolerance, T(m) against
        T(k₁), a probe against T_best): a trial noisier than this has not settled its
        verdict."""
        if self.trial is None:
            raise SapipeError("the search is over; nothing to judge")
        if not self.trials:
            return abs(waits - self.tolerance * iteration_time) / iteration_time
        if self.trial == self.m and len(self.trials) == 1:
            threshold = self.trials[0].iteration_time * (1.0 - self.tolerance)
        else:
            threshold = self.best_time * (1.0 + self.tolerance)
        return abs(iteration_time - threshold) / iteration_time

    def stop(self) -> None:
        """End the search now (its budget is spent) with the best k measured so far."""
        if self.trial is None:
            raise SapipeError("the search is over already")
        self.trial = self._finish(self._hi if self._hi >= 0 else self.first_k)

    def _finish(self, k: int) -> None:
        self.final = k
        return None

    def state_dict(self) -> dict[str, Any]:
        """Where the search stands (checkpoints)."""
        return {
            "first_k": self.first_k,
            "m": self.m,
            "tolerance": self.tolerance,
            "trials": [astuple(t) for t in self.trials],
            "trial": self.trial,
            "final": self.final,
            "bracket": (self._lo, self._hi),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> Tuner:
        tuner = cls(state["first_k"], state["m"], state["tolerance"])
        tuner.trials = [Trial(*t) for t in state["trials"]]
        tuner.trial, tuner.final = state["trial"], state["final"]
        tuner._lo, tuner._hi = state["bracket"]
        return tuner

    def summary(self) -> str:
        """The measurements, for the log: "k=7: 61.8 ms (waits 5.1 ms), k=16: 47.3 ms, ..."."""
        parts = [
            f"k={t.k}: {t.iteration_time * 1e3:.3g} ms (waits {t.waits * 1e3:.2g} ms)"
            for t in self.trials
        ]
        return (
            "measured "
            + ", ".join(parts)
            + (f" -> k={self.final}" if self.final is not None else "")
        )


def fit_slowdown(
    trials: Sequence[Trial],
    predict: Callable[[int, float], float],
    grid: Sequence[float] = SLOWDOWN_GRID,
) -> float:
    """The σ of ``grid`` whose predictions ``predict(k, σ)`` best match the measured trials
    (least squares of log(predicted / measured); the smallest σ on a tie, 0 without trials).

    How much a busy link slows compute ranges from not at all (a rate-limited link) to
    nearly serialising it (a full-speed loopback on few cores, where the "link" is the same
    cores); a single profiled iteration cannot tell, a trial of ten can.
    """
    usable = [t for t in trials if t.iteration_time > 0 and math.isfinite(t.iteration_time)]
    if not usable:
        return 0.0

    def misfit(sigma: float) -> float:
        return math.fsum(math.log(predict(t.k, sigma) / t.iteration_time) ** 2 for t in usable)

    return min(sorted(grid), key=misfit)


def fit_link_scale(
    trials: Sequence[Trial],
    predict: Callable[[int, float], tuple[float, float]],
    scales: Sequence[float] = LINK_SCALES,
) -> float:
    """The factor c of ``scales`` on the profiled link whose predictions ``predict(k, c)`` =
    (iteration time, waits) best match the measured trials: least squares of the log ratio of
    the times plus the waits' error relative to the measured time (on a tie, the c nearest 1).

    The model chose k₁ as a k with no stall; when k₁'s trial waits, the link under the
    running pipeline is slower than the synchronous profile saw (stale and sync traffic
    share it, the host's cores are shared). The waits say by how much, so the search's next
    probe can be placed where the corrected model expects the waits to vanish.
    """
    usable = [
        t
        for t in trials
        if t.iteration_time > 0 and math.isfinite(t.iteration_time) and math.isfinite(t.waits)
    ]
    if not usable:
        return 1.0

    def misfit(scale: float) -> float:
        total = 0.0
        for t in usable:
            time, waits = predict(t.k, scale)
            total += (
                math.log(time / t.iteration_time) ** 2 + ((waits - t.waits) / t.iteration_time) ** 2
            )
        return total

    return min(sorted(scales, key=lambda c: abs(math.log(c))), key=misfit)
