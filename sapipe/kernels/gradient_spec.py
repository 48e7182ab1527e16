"""The gradient an update consumes, described rather than materialised (docs/design.md §5).

Staleness compensation changes which gradient the optimizer applies: delay compensation
DC_λ(g, Δ), weight prediction's mixes of this rank's own gradients. A :class:`GradientSpec`
names the terms of

    g̃ = DC_λ(grad − prev_local / n, Δ) + local / n,    Δ = delta − delta_ref

(every term but ``grad`` optional), and the fused kernels (sapipe/kernels/ops.py, csrc/) compose it
element by element while they stream the weights and optimizer state: one pass over memory
per segment, no temporaries. It travels unchanged from the compensation strategies
(sapipe/optim/compensation.py, whole buckets) through :meth:`GradientSpec.slice` (one segment) and
the optimizer rule (sapipe/optim/fused.py) to the kernels, where it becomes the C++ struct
``GradSpec`` (csrc/common.h) from the operators' flat arguments, built in one place
(``ops._spec_args``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch import Tensor

from sapipe.errors import ConfigurationError

DC_FORMS = ("outer", "diagonal")


@dataclass(frozen=True, eq=False)
class GradientSpec:
    """g̃ = DC_λ(grad − prev_local/n, delta − delta_ref) + local/n, n = ``world_size``.

    Delay compensation applies when Δ has a source: ``delta`` (``delta_ref=None``: Δ is
    ``delta`` itself), ``delta_is_step``, or, outer form, precomputed ``dots``. Forms:
    ``"outer"`` g + λ·<g, Δ>_tensor·g, whose per-tensor dot products need the tensor sizes
    along the flat slice (``lengths``) and a first pass over memory unless ``dots`` (float64,
    one per tensor) are given; ``"diagonal"`` g + λ·g⊙g⊙Δ (DC-ASGD), one pass.

    ``delta_is_step`` (a prediction's gradient, the ``peek`` of a fused update only): Δ is
    x_t − x_{t−1}, the step the real update of the same call takes, computed on the fly, so
    no weight history is kept for it. Such a spec's ``dots``, when given, are *written*: the
    update fills them with <grad − prev_local/n, x_t − x_{t−1}> per tensor, for the outer
    form's peek, which then runs as a second call given those dots.

    ``hist``: an in-place update also writes the new weights x_t there (a weight-history
    slot; it may alias ``delta_ref``, every element being read before it is written).
    """

    grad: Tensor
    delta: Tensor | None = None
    delta_ref: Tensor | None = None
    prev_local: Tensor | None = None
    local: Tensor | None = None
    lam: float = 0.0
    form: str = "outer"
    world_size: int = 1
    lengths: Sequence[int] | None = None
    dots: Tensor | None = None
    delta_is_step: bool = False
    hist: Tensor | None = None

    def __post_init__(self) -> None:
        if self.form not in DC_FORMS:
            raise ConfigurationError(f"unknown delay-compensation form {self.form!r}")
        if self.delta is None and self.delta_ref is not None:
            raise ConfigurationError("delta_ref given without delta")
        if self.delta_is_step and self.delta is not None:
            raise ConfigurationError("delta_is_step: Δ is the update's own step, no delta is given")
        if self.dots is not None and self.lengths is None:
            raise ConfigurationError("per-tensor dots need the tensor lengths")

    @classmethod
    def plain(cls, grad: Tensor) -> GradientSpec:
        """The gradient ``grad`` as it is (no compensation)."""
        return cls(grad)

    @property
    def compensates(self) -> bool:
        """Whether delay compensation applies (Δ has a source)."""
        return (
            self.delta is not None
            or self.delta_is_step
            or (self.dots is not None and self.form == "outer")
        )

    def flat_tensors(self) -> tuple[Tensor | None, ...]:
        """The element-wise tensors (all of the slice's size); not ``dots`` (one per tensor)."""
        return (self.grad, self.delta, self.delta_ref, self.prev_local, self.local, self.hist)

    def slice(self, start: int, end: int, lengths: Sequence[int]) -> GradientSpec:
        """The spec of the flat slice [start, end) (a segment), whose parameter tensors have
        ``lengths`` elements each."""
        if self.dots is not None:
            raise ConfigurationError("per-tensor dots cannot be sliced by elements")

        def part(t: Tensor | None) -> Tensor | None:
            return None if t is None else t[start:end]

        return self.replace(
            grad=self.grad[start:end],
            delta=part(self.delta),
            delta_ref=part(self.delta_ref),
            prev_local=part(self.prev_local),
            local=part(self.local),
            hist=part(self.hist),
            lengths=lengths,
        )

    def with_history(self, hist: Tensor | None) -> GradientSpec:
        """This spec, its in-place update also writing x_t into ``hist``."""
        return self.replace(hist=hist)

    def with_dots(self, dots: Tensor | None) -> GradientSpec:
        """This spec with per-tensor dot products ``dots`` (read, or written: class doc)."""
        return self.replace(dots=dots)

    def replace(self, **changes: Any) -> GradientSpec:
        """A copy with ``changes`` (``dataclasses.replace``, without its per-call field scan:
        specs are made per segment per step)."""
        return GradientSpec(**{**self.__dict__, **changes})


__all__ = ["GradientSpec", "DC_FORMS"]
