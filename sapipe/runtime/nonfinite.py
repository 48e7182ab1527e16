"""Non-finite gradients without a GradScaler: reported once, naming the ranks, the bucket and the
iteration (``nonfinite_gradients=``, docs/design.md §3.12).

As under DDP, a NaN or inf in one rank's gradient makes the average non-finite on every rank,
and the update applies it: the training math stays DDP's. What sapipe adds is the report, so
that a user does not hunt for a silent NaN: with ``"warn"`` (the default) every rank emits
one ``RuntimeWarning`` the first time, naming the iteration, the bucket and which ranks sent a
non-finite gradient of their own; later ones are not reported. ``"raise"`` raises
:class:`~sapipe.errors.NonFiniteGradientError` on every rank at the same point instead;
``"ignore"`` checks nothing, and the wire carries nothing more. Under ``scaler.step(opt)``
non-finite gradients are the GradScaler's business (it skips the step, docs/design.md §3.8):
nothing is judged or reported.

**The verdict travels with the gradient.** As a rank launches a bucket's collective it judges
what it sends of its own gradient (the slot, or the messages backward encoded into): one
reduction, ``torch.aminmax`` (min and max propagate NaN, and hold an inf where there is one;
no sum that could overflow), and three scalar operations write 1 (NaN or inf here) or 0 into
one value behind the bucket's unused-parameter flags (:mod:`sapipe.runtime.unused`). The
collective sums it with the gradient, so once the sum has arrived every rank holds the same
count of ranks that sent a non-finite gradient, with no collective of its own. As each sum is
consumed its count is added, on the device, to a running total; the total is read once per
step. Only where it is not zero do the ranks agree, once, on which ranks sent which bucket's
(one small collective on the control group).

**When.** The ranks must take the report's collective at the same point. It runs in
``step()`` t once its gradients are taken (the flush, ``p.grad`` exposed, the GradScaler
verdict), and covers the sums of iterations before t consumed since the last check. Those are
the same on every rank: every sync bucket's of t − 1 (backward t's flush applied any update
still pending) and each stale bucket's as its step applied it. A sync gradient of t may be
consumed already on some ranks only (a script that read its ``p.grad``), so a sum of the
current iteration counts toward the next check. So there are two totals: the next check's and
the one after. On the CPU the total is read at the check (memory: there is no device to wait
for); on CUDA it is copied to the host asynchronously there and read at the next check, so no
step waits for the device. A check under a GradScaler, or covering a gradient of an iteration
whose step ran under one, reports nothing. A gradient still unconsumed when the job ends (the
last iteration's) is not checked, nor one that a checkpoint carried across a restart.
"""

from __future__ import annotations

import sys
import warnings
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from sapipe.errors import NonFiniteGradientError
from sapipe.layout.buckets import Bucket
from sapipe.runtime.gradients import StalenessBuffer

Verdict = tuple[
    Tensor, Tensor
]  # a rank's own (min·0, max·0) of what it sent: 0 where finite, NaN where not


@dataclass
class Arrival:
    """A consumed sum: its iteration, its bucket, and this rank's own verdict on what it sent."""

    iteration: int
    bucket: Bucket
    mine: Verdict


def judge(values: Sequence[Tensor], out: Tensor) -> Verdict:
    """``out`` (0-dim) set to 1 where one of ``values`` is NaN or inf, else 0; the verdict, kept.

    A tensor holds NaN or inf exactly where its min or its max does (both propagate NaN), and
    x·0 is NaN where x is NaN or inf, else 0: no value is summed, so none can overflow.
    """
    lows, highs = [], []
    for tensor in values:
        if tensor.numel():
            low, high = torch.aminmax(tensor)
            lows.append(low)
            highs.append(high)
    if not lows:
        out.zero_()
        nothing = torch.zeros((), device=out.device)
        return nothing, nothing
    low, high = (
        (lows[0], highs[0])
        if len(lows) == 1
        else (torch.stack(lows).amin(), torch.stack(highs).amax())
    )
    low, high = low.mul_(0), high.mul_(0)  # fresh tensors: changed in place
    torch.ne(low, high, out=out)  # 0 ≠ NaN, NaN ≠ NaN
    return low, high


def is_bad(verdict: Verdict) -> bool:
    """Whether a kept verdict says NaN or inf (reads it on the host: for a report only)."""
    return bool(torch.stack([v.reshape(()).float() for v in verdict]).isnan().any())


def _read(total: Tensor) -> float:
    """A 0-dim CPU tensor's value, read through NumPy, not the dispatcher (on the CPU there is no
    device to wait for; a CUDA total was copied to a host tensor first)."""
    return float(total.numpy())


def _user_stacklevel() -> int:
    """The ``stacklevel`` of the first caller outside sapipe and torch (the script's
    ``opt.step()``)."""
    frame, level = sys._getframe(2), 2  # noqa: SLF001 - the caller of the caller: warnings.warn's stacklevel 1
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in (
        "sapipe",
        "torch",
    ):
        frame, level = frame.f_back, level + 1
    return level


@dataclass
class Window:
    """What one check covers: the sums consumed for it, and how many ranks' gradients were not
    finite in all of them (a running total, on the gradients' device)."""

    arrivals: list[Arrival]
    total: Tensor


class NonFiniteGradients:
    """Judges each launched gradient, totals the non-finite ones as their sums are consumed, and
    reports the first, once per job (see the module docstring)."""

    def __init__(self, mode: str, rank: int, world_size: int):
        self.mode = mode
        self.watching = mode != "ignore"  # until the first report
        #: the last step() ran under a GradScaler: the gradients launched since are its business
        self.scaled = False
        self._rank, self._world = rank, world_size
        self._device = torch.device("cpu")
        self._next_check = 1  # the iteration whose step() runs the next check
        self._windows: list[Window] = []  # the next check's, the one after (set by start)
        #: deferred: the last check's arrivals, its total (CUDA: on its way to the host, and the
        #: event after the copy)
        self._in_transit: tuple[list[Arrival], Tensor, torch.cuda.Event | None] | None = None
        self.start(self._device)

    @property
    def verdicts(self) -> bool:
        """Whether each slot's collective carries this rank's verdict (the layout allocates it)."""
        return self.mode != "ignore"

    def start(self, device: torch.device, next_check: int | None = None) -> None:
        """Count afresh, with gradients on ``device``, from the check in ``step()`` of
        ``next_check`` on (None: the next one): at the first layout, and when a checkpoint is
        restored (nothing counted before is reported)."""
        self._device = device
        #: read each total a check late (CUDA: copied to the host meanwhile, so no step waits for
        #: the device)
        self.deferred = device.type == "cuda"
        self._next_check = self._next_check if next_check is None else next_check
        self._windows = [
            Window([], torch.zeros((), dtype=torch.float64, device=device)) for _ in range(2)
        ]
        self._in_transit = None

    def launched(self, grads: StalenessBuffer, slot: int, values: Sequence[Tensor]) -> None:
        """At launch: this rank's verdict on ``values``, what it sends of its gradient in ``slot``,
        kept and written behind the flags (1: NaN or inf here), so that the sum counts such
        ranks."""
        if not self.watching or self.scaled or grads.nonfinite is None:
            grads.verdicts[slot] = None  # the sum's count is not read
            return
        grads.verdicts[slot] = judge(values, grads.nonfinite[slot])

    def arrived(self, bucket: Bucket, grads: StalenessBuffer, slot: int, iteration: int) -> None:
        """The sum in ``slot`` of ``bucket``'s buffers ``grads``, of ``iteration``, has arrived and
        is consumed: its count added to the total of the first check every rank is sure to have
        consumed it by (the next, unless it is of the current iteration)."""
        mine, grads.verdicts[slot] = grads.verdicts[slot], None
        if mine is None or not self.watching:
            return
        window = self._windows[0 if iteration < self._next_check else 1]
        window.total.add_(grads.nonfinite[slot])
        window.arrivals.append(Arrival(iteration, bucket, mine))

    def check(
        self, iteration: int, scaled: bool, scaled_iterations: Collection[int], control
    ) -> None:
        """At ``step()`` of ``iteration``, once its gradients are taken: report the first non-finite
        sums consumed since the last check (on CUDA, those of the check before). Collective where
        there are some, on every rank alike. ``scaled``: this step runs under a GradScaler;
        ``scaled_iterations``: the iterations whose step() did."""
        self.scaled = scaled
        if not self.watching:
            return
        window, later = self._windows
        arrivals, total = window.arrivals, window.total
        if scaled or any(a.iteration in scaled_iterations for a in arrivals):
            arrivals = []  # the GradScaler's business
        if self.deferred:
            cuda = self._device.type == "cuda"
            copied = total.to("cpu", non_blocking=True) if cuda else total.clone()
            done = torch.cuda.Event() if cuda else None
            if done is not None:
                done.record()
            previous, self._in_transit = self._in_transit, (arrivals, copied, done)
            arrivals, total = previous[:2] if previous is not None else ([], None)
            if previous is not None and previous[2] is not None and not previous[2].query():
                previous[2].synchronize()  # recorded a step ago: done, but for a stall
        count = _read(total) if arrivals else 0.0
        window.total.zero_()
        window.arrivals = []
        self._windows = [later, window]
        self._next_check = iteration + 1
        if count:
            self._report(arrivals, control)

    def _report(self, arrivals: list[Arrival], control) -> None:
        """Warn or raise, on every rank alike, naming each bucket's ranks (agreed once)."""
        self.watching = False  # once per job
        self._windows = [Window([], w.total) for w in self._windows]
        self._in_transit = None
        ranks = self._which_ranks(arrivals, control)
        bad = sorted(
            (a.iteration, a.bucket.index, a.bucket.describe(), named)
            for a, named in zip(arrivals, ranks)
            if named
        )
        message = describe(bad, self._world, self.mode)
        if self.mode == "raise":
            raise NonFiniteGradientError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=_user_stacklevel())

    def _which_ranks(self, arrivals: list[Arrival], control) -> list[list[int]]:
        """Per arrival, the ranks whose own gradient held NaN or inf: each rank puts its verdicts at
        its own place, so the maximum over ranks holds everyone's (one collective)."""
        world = self._world
        values = [0.0] * (len(arrivals) * world)
        for i, arrival in enumerate(arrivals):
            values[i * world + self._rank] = 1.0 if is_bad(arrival.mine) else 0.0
        agreed = control.agree_on_max(values, "which ranks' gradients were not finite")
        return [[r for r in range(world) if agreed[i * world + r]] for i in range(len(arrivals))]


def describe(bad: list[tuple[int, int, str, list[int]]], world: int, mode: str) -> str:
    """The report: the first non-finite sum (iteration, bucket index, bucket, ranks) in full, the
    others of the same check in brief."""

    def whose(named: list[int]) -> str:
        ranks = ("rank " if len(named) == 1 else "ranks ") + ", ".join(map(str, named))
        return f"{ranks} ({len(named)} of {world} ranks)"

    if (
        not bad
    ):  # counted, but no rank's verdict says so: cannot happen (each sum keeps every rank's)
        text = "sapipe: an averaged gradient holds NaN or inf, but no rank's own gradient did."
    else:
        iteration, _, bucket, named = bad[0]
        text = (
            f"sapipe: the averaged gradient of {bucket} in iteration {iteration} holds NaN or inf: "
            "the local "
            f"gradient of {whose(named)} did. As under DDP, every rank's update applies it (no "
            "GradScaler "
            "skips the step)."
        )
    if bad[1:]:
        text += (
            " Also not finite: "
            + "; ".join(f"{b} in iteration {i} ({whose(n)})" for i, _, b, n in bad[1:])
            + "."
        )
    if mode == "raise":
        return text + ' (nonfinite_gradients="raise"; "warn" reports it once and trains on)'
    return (
        text
        + ' Reported once per job; nonfinite_gradients="raise" raises instead, "ignore" checks '
        "nothing."
    )


__all__ = ["Arrival", "NonFiniteGradients", "Window", "describe", "is_bad", "judge"]
