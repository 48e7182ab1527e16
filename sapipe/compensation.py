"""Staleness compensation: one small strategy per mode (DESIGN.md §3).

At ``step()`` of pipeline iteration t a stale bucket has the averaged gradient g_{t-s}
that just arrived. A strategy says which gradient ĝ the *real* update uses, and (weight
prediction only) which gradient g̃ produces the predicted weights x̃_{t+1} the model runs
its next forward on. Strategies only compute gradients; the engine owns the update order,
the buffers and the optimizer rule.

| mode | ĝ | g̃ (prediction) | paper |
| --- | --- | --- | --- |
| none | g_{t-s} | — | Pipe-SGD, vanilla SAPipe (Alg. 1) |
| dc   | DC_λ(g_{t-s}, x_{t-1} − x_{t-1-s}) | — | SAPipe-DC (Alg. 2) |
| wp1  | g_{t-1} | l_t | SAPipe-WP option 1 (Alg. 3) |
| wp2  | g_{t-1} | g_{t-1} | option 2 |
| wp3  | g_{t-1} | DC_λ(g_{t-1} − l_{t-1}/n, x_t − x_{t-1}) + l_t/n | option 3 |
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Sequence, Type

from torch import Tensor

from . import ops


@dataclass
class StaleStep:
    """What a strategy may read for one stale bucket at one ``step()``.

    ``g`` is the averaged stale gradient (None while the pipeline fills, or when GradScaler
    skipped its iteration); the strategy may overwrite it in place. ``x_oldest`` is
    x_{t-1-s}, ``x_newest`` is x_{t-1} once the real update has run (for wp3), ``local`` /
    ``prev_local`` this rank's l_t / l_{t-1} (None when their iteration was skipped).
    """

    g: Optional[Tensor]
    x: Tensor
    local: Optional[Tensor]
    prev_local: Optional[Tensor]
    x_oldest: Optional[Tensor]
    x_newest: Optional[Tensor]
    world_size: int
    lam: float
    form: str
    lengths: Sequence[int]


class Compensation:
    """Base strategy: ĝ = g (no compensation), no prediction."""

    name = "none"
    predicts = False  # the model holds predicted weights x̃ for the stale layers
    needs_local = False  # keeps this rank's own gradient l_t in a flat buffer
    needs_prev_local = False  # ... and l_{t-1}
    history_length = 0  # how many past real weights the strategy reads (0, 1 or s)
    max_staleness: Optional[int] = None  # None: any staleness

    def __init__(self, staleness: int):
        self.staleness = staleness

    def real_gradient(self, step: StaleStep) -> Tensor:
        """ĝ for the real update; ``step.g`` is not None here."""
        assert step.g is not None
        return step.g

    def prediction_gradient(self, step: StaleStep) -> Optional[Tensor]:
        """g̃ for x̃_{t+1} = OPT_peek(x_t, g̃), or None for x̃_{t+1} = x_t."""
        return None


class DelayCompensation(Compensation):
    name = "dc"

    @property
    def history_length(self) -> int:  # type: ignore[override]
        return self.staleness

    def real_gradient(self, step):
        assert step.g is not None and step.x_oldest is not None
        delta = step.x - step.x_oldest  # x_{t-1} − x_{t-1-s}
        return ops.delay_compensate(step.g, delta, step.lam, step.form, step.lengths, out=step.g)


class PredictFromLocal(Compensation):
    name = "wp1"
    predicts = True
    needs_local = True
    max_staleness = 1

    def prediction_gradient(self, step):
        return step.local


class PredictFromSynchronised(Compensation):
    name = "wp2"
    predicts = True
    max_staleness = 1

    def prediction_gradient(self, step):
        return step.g


class PredictMixed(Compensation):
    name = "wp3"
    predicts = True
    needs_local = True
    needs_prev_local = True
    history_length = 1
    max_staleness = 1

    def prediction_gradient(self, step):
        if step.g is None or step.local is None or step.prev_local is None:
            return None  # pipeline filling, or a term from a step GradScaler skipped
        assert step.x_newest is not None
        n = step.world_size
        others = step.g - step.prev_local / n  # others' part of g_{t-1}
        ops.delay_compensate(others, step.x - step.x_newest, step.lam, step.form, step.lengths, out=others)
        return others.add_(step.local, alpha=1.0 / n)


MODES: Dict[str, Type[Compensation]] = {
    cls.name: cls
    for cls in (Compensation, DelayCompensation, PredictFromLocal, PredictFromSynchronised, PredictMixed)
}
