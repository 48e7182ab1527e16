"""``compensation="auto"``: each stale bucket's weight prediction, chosen by measurement
(docs/design.md §3.14; the policy is :class:`~sapipe.optim.compensation.ChooseOnline`).

For ``probe_steps`` pipeline steps after a layout, every stale bucket's ``step()`` also
computes each candidate's prediction x̃_{t+1} into a scratch buffer, with the optimizer's own
OPT_peek from the freshly updated x_t:

* ``none``: x̃ = x_t (the baseline);
* ``wp1``: g̃ = l_t; ``wp2``: g̃ = g_{t-1};
* ``wp3``: g̃ = DC_λ(g_{t-1} − l_{t-1}/n, x_t − x_{t-1}) + l_t/n.

At the next step, once x_{t+1} exists, each candidate adds ‖x̃_{t+1} − x_{t+1}‖² to its
bucket's score. A step whose candidates cannot all predict (the pipeline filling, a rank's
own gradient from an iteration GradScaler skipped) is not scored. At a pipeline step every
rank reaches alike, the ranks add their scores (the control channel) and every bucket keeps
its best candidate; the scratch buffers are freed. The real weights and the optimizer state
never depend on the choice (the candidates share ĝ = g_{t-1}), so the switch needs no restart.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
from torch import Tensor

from sapipe.kernels.gradient_spec import GradientSpec
from sapipe.optim.compensation import ChooseOnline, Compensation, StaleStep

#: OPT_peek of one bucket: (g̃, out) → x̃ from its current real weights and state
Peek = Callable[[GradientSpec, Tensor], None]


class _BucketProbe:
    """One stale bucket's scratch while probing: each candidate's last prediction, x_{t-1}, and
    the running scores."""

    def __init__(self, weights: Tensor, candidates: tuple[str, ...]):
        self.predicted = {name: torch.empty_like(weights) for name in candidates if name != "none"}
        self.previous = torch.empty_like(weights)  # x_{t-1}; also none's x̃_t
        self.has_previous = False  # previous holds x_{t-1}
        self.has_predictions = False  # predicted hold every candidate's x̃ of this step
        self.scores = torch.zeros(len(candidates), dtype=torch.float64, device=weights.device)
        self.scored_steps = 0


class PredictionChoice:
    """The probe and the choice of ``compensation="auto"``, for the stale buckets of the
    current layout. Owned by the runtime's :class:`~sapipe.runtime.updates.Updater`."""

    def __init__(self, policy: ChooseOnline):
        self.policy = policy
        self._candidates = {name: policy.candidate(name) for name in policy.candidates}
        self._during_probe = policy.candidate(policy.during_probe)
        self._probes: dict[int, _BucketProbe] = {}
        self._steps = 0  # pipeline steps since the layout
        #: bucket index → the candidate it runs, once decided
        self.choices: dict[int, str] = {}
        #: bucket index → {candidate: its score ÷ none's}, of the decision
        self.relative_errors: dict[int, dict[str, float]] = {}
        self.decided = False

    def reset(self) -> None:
        """A new layout (buckets, k): probe anew."""
        self._probes.clear()
        self._steps = 0
        self.choices = {}
        self.relative_errors = {}
        self.decided = False

    def compensation_for(self, bucket: int) -> Compensation:
        """The prediction ``bucket`` runs now."""
        if not self.decided:
            return self._during_probe
        return self._candidates[self.choices.get(bucket, self.policy.during_probe)]

    @torch.no_grad()
    def observe(self, bucket: int, real: Tensor, view: StaleStep, peek: Peek) -> None:
        """After ``bucket``'s real update of this step (``real`` = x_t): score the predictions of
        the last step against x_t, then predict x_{t+1} with every candidate (while probing)."""
        probe = self._probes.get(bucket)
        if probe is None:
            probe = self._probes[bucket] = _BucketProbe(real, self.policy.candidates)
        if probe.has_predictions:
            for i, name in enumerate(self.policy.candidates):
                guess = probe.previous if name == "none" else probe.predicted[name]
                probe.scores[i] += torch.sub(guess, real).double().square().sum()
            probe.scored_steps += 1
        probe.has_predictions = probe.has_previous and self._predict(probe, real, view, peek)
        probe.previous.copy_(real)
        probe.has_previous = True

    def _predict(self, probe: _BucketProbe, real: Tensor, view: StaleStep, peek: Peek) -> bool:
        """Every candidate's x̃_{t+1} into its scratch; False if one cannot predict this step."""
        specs = {}
        for name, candidate in self._candidates.items():
            if name == "none":
                continue
            spec = candidate.prediction_gradient(view)
            if spec is None:
                return False
            if spec.delta_is_step:  # wp3's Δ = x_t − x_{t-1}, given explicitly
                spec = spec.replace(delta_is_step=False, delta=real, delta_ref=probe.previous)
            specs[name] = spec
        for name, spec in specs.items():
            peek(spec, probe.predicted[name])
        return True

    def end_step(self, control) -> None:
        """After a ``step()``'s stale updates: decide once the probe has run ``probe_steps``
        steps (every rank reaches it at the same step, so the agreement is collective)."""
        if self.decided:
            return
        self._steps += 1
        if self._steps < self.policy.probe_steps + 2 or not self._probes:
            return
        order = sorted(self._probes)
        names = self.policy.candidates
        local: list[float] = []
        for bucket in order:
            probe = self._probes[bucket]
            local += probe.scores.tolist() + [float(probe.scored_steps)]
        summed = control.agree_on_sum(local, "compensation='auto' scores")
        width = len(names) + 1
        for j, bucket in enumerate(order):
            row = summed[j * width : (j + 1) * width]
            scores, steps = row[:-1], row[-1]
            baseline = scores[names.index("none")] if "none" in names else None
            if steps > 0:
                best = min(range(len(names)), key=lambda i: (scores[i], i))
                self.choices[bucket] = names[best]
            else:
                self.choices[bucket] = self.policy.during_probe
            self.relative_errors[bucket] = {
                name: (scores[i] / baseline if baseline else float("nan"))
                for i, name in enumerate(names)
            }
        self._probes.clear()
        self.decided = True

    def report(self, bucket_names: dict[int, str] | None = None) -> dict[str, Any]:
        """The choice and its reasons: per stale bucket, the candidate it runs and each
        candidate's summed ‖x̃ − x‖² relative to ``none``'s (below 1: it beat no prediction)."""
        names = bucket_names or {}
        return {
            "decided": self.decided,
            "probe_steps": self.policy.probe_steps,
            "buckets": {
                names.get(b, str(b)): {
                    "choice": self.choices[b],
                    "error_vs_none": self.relative_errors.get(b, {}),
                }
                for b in sorted(self.choices)
            },
        }

    def state_dict(self) -> dict[str, Any]:
        """The decision (a probe not yet decided starts again after a resume)."""
        return {"decided": self.decided, "choices": dict(self.choices)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        if state.get("decided"):
            self.choices = {int(b): str(c) for b, c in state["choices"].items()}
            self.decided = True


__all__ = ["PredictionChoice"]
