"""Staleness compensation: one small strategy per mode (docs/design.md §3).

At ``step()`` of pipeline iteration t a stale bucket has the averaged gradient g_{t-s}
that just arrived. A strategy says which gradient ĝ the *real* update uses, and (weight
prediction only) which gradient g̃ produces the predicted weights x̃_{t+1} the model runs
its next forward on. Strategies only describe gradients, as a
:class:`~sapipe.kernels.gradient_spec.GradientSpec` of the whole bucket, so the optimizer rule
evaluates them inside its fused kernels, one pass over memory per segment, with no
temporaries (docs/design.md §5); the engine owns the update order, the buffers and the
optimizer rule.

| mode | ĝ | g̃ (prediction) | paper |
| --- | --- | --- | --- |
| none | g_{t-s} | — | Pipe-SGD, vanilla SAPipe (Alg. 1) |
| dc   | DC_λ(g_{t-s}, x_{t-1} − x_{t-1-s}) | — | SAPipe-DC (Alg. 2) |
| wp1  | g_{t-1} | l_t | SAPipe-WP option 1 (Alg. 3) |
| wp2  | g_{t-1} | g_{t-1} | option 2 |
| wp3  | g_{t-1} | DC_λ(g_{t-1} − l_{t-1}/n, x_t − x_{t-1}) + l_t/n | option 3 |
| t2   | g_{t-s} | — : x̃_{t+1} = x_t + s·δ_t, δ an EMA of x_t − x_{t-1} | PipeMare T2 (§3.2) |
| auto | g_{t-1} | per bucket, that of none/wp1/wp2/wp3 nearest the real x_{t+1} | §3.14 |
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

from torch import Tensor

from sapipe.errors import ConfigurationError
from sapipe.kernels.gradient_spec import GradientSpec


@dataclass
class StaleStep:
    """What a strategy may read for one stale bucket at one ``step()``.

    ``g`` is the averaged stale gradient (None while the pipeline fills, or when GradScaler
    skipped its iteration). ``x`` is the real weights: x_{t-1} when the real gradient is
    described, x_t (updated) when the prediction is. ``x_oldest`` is x_{t-1-s} (the oldest
    of the weight history). ``local`` / ``prev_local``: this rank's l_t / l_{t-1} (None when
    their iteration was skipped).
    """

    g: Tensor | None
    x: Tensor
    local: Tensor | None
    prev_local: Tensor | None
    x_oldest: Tensor | None
    world_size: int
    lam: float
    form: str


class Compensation:
    """A staleness compensation: which gradients the stale layers' updates use. The base is
    ``"none"``: ĝ = g, no prediction.

    ``compensation=`` takes a registered name (``"dc"``, :func:`register_compensation`) or an
    instance. A compensation of your own is a subclass that names itself (``name``), declares
    what it reads (``predicts``, ``needs_local``, ``needs_prev_local``, ``history_length``,
    ``max_staleness``), and overrides the two hooks, each returning a
    :class:`~sapipe.kernels.gradient_spec.GradientSpec` built from the :class:`StaleStep` it
    is given (``DC_λ(grad − prev_local/n, Δ) + local/n``, any term left out), which the
    fused update kernels evaluate in one pass:

    * :meth:`real_gradient`: ĝ, the gradient the real update of a stale layer applies;
    * :meth:`prediction_gradient`: g̃, for weight prediction x̃ = OPT_peek(x, g̃) (or None).

    A compensation that ``extrapolates`` predicts without the optimizer: x̃_{t+1} = x_t +
    s·δ_t, with δ an exponential moving average of the real weights' change at rate
    :attr:`velocity_decay` (PipeMare's T2, :class:`ExtrapolateVelocity`).

    The runtime binds a copy of it to the job's staleness (:meth:`for_staleness`); every rank
    must give an equal compensation (the same class, ``name`` and attributes).
    """

    name = "none"
    predicts = False  # the model holds predicted weights x̃ for the stale layers
    needs_local = False  # keeps this rank's own gradient l_t in a flat buffer
    needs_prev_local = False  # ... and l_{t-1}
    history_length = 0  # past real weights kept (the newest is x_{t-1} during step t)
    extrapolates = False  # x̃ = x + s·δ (a velocity kept per stale weight), not OPT_peek
    max_staleness: int | None = None  # None: any staleness
    staleness = 1  # s, set by for_staleness()

    def for_staleness(self, staleness: int) -> Compensation:
        """A copy of this compensation for a job whose stale layers use g_{t-s}, s =
        ``staleness``."""
        bound = copy.copy(self)
        bound.staleness = staleness
        return bound

    def describe(self) -> str:
        """What ranks and checkpoints compare: the name; a compensation of a user's own also its
        class and attributes."""
        cls = type(self)
        if MODES.get(self.name) is cls and not vars(self):
            return self.name
        settings = {k: v for k, v in vars(self).items() if k != "staleness"}
        return f"{cls.__module__}.{cls.__qualname__}:{self.name}" + (
            f" {settings}" if settings else ""
        )

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and vars(other) == vars(self)

    def __hash__(self) -> int:
        return hash((type(self), self.name))

    def __repr__(self) -> str:
        return f"{type(self).__qualname__}()"

    def real_gradient(self, step: StaleStep) -> GradientSpec:
        """ĝ for the real update; ``step.g`` is not None here."""
        assert step.g is not None
        return GradientSpec.plain(step.g)

    def prediction_gradient(self, step: StaleStep) -> GradientSpec | None:
        """g̃ for x̃_{t+1} = OPT_peek(x_t, g̃), or None for x̃_{t+1} = x_t."""
        return None

    @property
    def velocity_decay(self) -> float:
        """γ of the velocity δ_t = γ·δ_{t-1} + (1 − γ)·(x_t − x_{t-1}), where it
        :attr:`extrapolates`."""
        raise NotImplementedError


class DelayCompensation(Compensation):
    """``"dc"``: ĝ = DC_λ(g_{t-s}, x_{t-1} − x_{t-1-s}), SAPipe-DC (Alg. 2)."""

    name = "dc"

    @property
    def history_length(self) -> int:  # type: ignore[override]
        return self.staleness + 1  # x_{t-1-s} .. x_{t-1}

    def real_gradient(self, step):
        assert step.g is not None and step.x_oldest is not None
        # DC_λ(g, x_{t-1} − x_{t-1-s})
        return GradientSpec(
            step.g, delta=step.x, delta_ref=step.x_oldest, lam=step.lam, form=step.form
        )


class PredictFromLocal(Compensation):
    """``"wp1"``: weight prediction from this rank's fresh gradient, g̃ = l_t (SAPipe-WP option
    1)."""

    name = "wp1"
    predicts = True
    needs_local = True
    max_staleness = 1

    def prediction_gradient(self, step):
        return None if step.local is None else GradientSpec.plain(step.local)


class PredictFromSynchronised(Compensation):
    """``"wp2"``: weight prediction from the latest averaged gradient, g̃ = g_{t-1} (option 2)."""

    name = "wp2"
    predicts = True
    max_staleness = 1

    def prediction_gradient(self, step):
        return None if step.g is None else GradientSpec.plain(step.g)


class PredictMixed(Compensation):
    """``"wp3"``: g̃ = DC_λ(g_{t-1} − l_{t-1}/n, x_t − x_{t-1}) + l_t/n, the others' part
    delay-compensated plus this rank's fresh one (option 3)."""

    name = "wp3"
    predicts = True
    needs_local = True
    needs_prev_local = True
    max_staleness = 1
    # No weight history: Δ = x_t − x_{t-1} is the real update of the same step() (a
    # prediction needs g_{t-1}, so that update happened), taken by the kernel as it goes.

    def prediction_gradient(self, step):
        if step.g is None or step.local is None or step.prev_local is None:
            return None  # pipeline filling, or a term from a step GradScaler skipped
        # DC_λ(g_{t-1} − l_{t-1}/n, x_t − x_{t-1}) + l_t/n
        return GradientSpec(
            step.g,
            delta_is_step=True,
            prev_local=step.prev_local,
            local=step.local,
            lam=step.lam,
            form=step.form,
            world_size=step.world_size,
        )


class ExtrapolateVelocity(Compensation):
    """``"t2"``: PipeMare's discrepancy correction (T2, §3.2), as a weight prediction.

    ĝ = g_{t-s}, as ``"none"``. The forward of a stale layer runs on its real weights
    extrapolated by their recent velocity to where its gradient will be applied, s steps
    later: x̃_{t+1} = x_t + s·δ_t, δ_t = γ·δ_{t-1} + (1 − γ)·(x_t − x_{t-1}), δ_0 = 0, with
    γ = D^{1/s} (PipeMare's per-stage decay, D = ``decay``). One axpy per step and one
    buffer per stale weight; no optimizer peek, so it suits any optimizer, the generic
    update path included, and any staleness.

    ``ExtrapolateVelocity(decay=D)`` sets D in (0, 1); ``"t2"`` is D = 0.1.
    """

    name = "t2"
    predicts = True
    extrapolates = True
    decay = 0.1  # D

    def __init__(self, decay: float | None = None):
        if decay is not None:
            if not (isinstance(decay, (int, float)) and 0.0 < decay < 1.0):
                raise ConfigurationError(
                    f"ExtrapolateVelocity(decay=...) takes D in (0, 1); got {decay!r}"
                )
            if decay != type(self).decay:  # the default's instances stay equal to "t2"
                self.decay = float(decay)

    def __repr__(self) -> str:
        return f"ExtrapolateVelocity(decay={self.decay})"

    @property
    def velocity_decay(self) -> float:
        return self.decay ** (1.0 / self.staleness)


class ChooseOnline(Compensation):
    """``"auto"``: each stale bucket's weight prediction chosen online (docs/design.md §3.14).

    At staleness 1, ``none``, ``wp1``, ``wp2`` and ``wp3`` apply the same real update
    (ĝ = g_{t-1}); they differ only in the weights x̃_{t+1} the next forward runs on. For
    ``probe_steps`` steps after the stale layers are laid out, every stale bucket runs the
    last candidate's prediction (``wp3`` by default) while each candidate's x̃_{t+1} is also
    computed on the side and, once the real x_{t+1} exists, scored by ‖x̃_{t+1} − x_{t+1}‖².
    The ranks then add
    their scores, and each bucket keeps the candidate with the smallest sum (``none``, which
    predicts x_t, is the baseline the others must beat). Switching is safe at any step: the
    real weights and optimizer state do not depend on the choice.

    ``ChooseOnline(candidates=("none", "wp1", "wp3"), probe_steps=40)`` narrows or lengthens
    the probe. ``dc`` (another ĝ, a weight history) and ``t2`` are not candidates.
    """

    name = "auto"
    predicts = True
    needs_local = True  # wp1 and wp3 read l_t
    needs_prev_local = True  # wp3 reads l_{t-1}
    max_staleness = 1
    candidates: tuple[str, ...] = ("none", "wp1", "wp2", "wp3")
    probe_steps = 20

    def __init__(self, candidates: tuple[str, ...] | None = None, probe_steps: int | None = None):
        allowed = ("none", "wp1", "wp2", "wp3")
        if candidates is not None:
            if (
                not isinstance(candidates, (tuple, list))
                or not candidates
                or any(c not in allowed for c in candidates)
                or len(set(candidates)) != len(candidates)
            ):
                raise ConfigurationError(
                    f"ChooseOnline(candidates=...) takes distinct names of {allowed}; "
                    f"got {candidates!r}"
                )
            if tuple(candidates) != type(self).candidates:
                self.candidates = tuple(candidates)
        if probe_steps is not None:
            if isinstance(probe_steps, bool) or not isinstance(probe_steps, int) or probe_steps < 2:
                raise ConfigurationError(
                    f"ChooseOnline(probe_steps=...) takes an int ≥ 2; got {probe_steps!r}"
                )
            if probe_steps != type(self).probe_steps:
                self.probe_steps = probe_steps

    def __repr__(self) -> str:
        return f"ChooseOnline(candidates={self.candidates!r}, probe_steps={self.probe_steps})"

    @property
    def during_probe(self) -> str:
        """The prediction every stale bucket runs until the probe decides: the last candidate."""
        return self.candidates[-1]

    def candidate(self, name: str) -> Compensation:
        """The compensation ``name`` stands for, bound to this job's staleness."""
        return MODES[name]().for_staleness(self.staleness)

    def prediction_gradient(self, step):
        """g̃ of the prediction the probe runs (the runtime asks per bucket once it has chosen)."""
        return self.candidate(self.during_probe).prediction_gradient(step)


#: names ``compensation=`` accepts, and the strategy each stands for (:func:`register_compensation`)
MODES: dict[str, type[Compensation]] = {
    cls.name: cls
    for cls in (
        Compensation,
        DelayCompensation,
        PredictFromLocal,
        PredictFromSynchronised,
        PredictMixed,
        ExtrapolateVelocity,
        ChooseOnline,
    )
}


def register_compensation(cls: type[Compensation]) -> type[Compensation]:
    """Let ``compensation=cls.name`` stand for ``cls()`` (usable as a class decorator)."""
    if not (isinstance(cls, type) and issubclass(cls, Compensation) and cls.name):
        raise ConfigurationError(
            f"register_compensation takes a named Compensation subclass; got {cls!r}"
        )
    if MODES.get(cls.name, cls) is not cls:
        raise ConfigurationError(
            f"compensation {cls.name!r} is registered already ({MODES[cls.name]})"
        )
    MODES[cls.name] = cls
    return cls


def resolve(compensation: str | Compensation) -> Compensation:
    """The compensation a registered name stands for, or the one given."""
    return compensation if isinstance(compensation, Compensation) else MODES[compensation]()


__all__ = [
    "MODES",
    "ChooseOnline",
    "Compensation",
    "DelayCompensation",
    "ExtrapolateVelocity",
    "PredictFromLocal",
    "PredictFromSynchronised",
    "PredictMixed",
    "StaleStep",
    "register_compensation",
    "resolve",
]
