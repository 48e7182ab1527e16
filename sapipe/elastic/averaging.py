"""``ElasticAveraging``: elastic averaging SGD (EASGD; EA-Pipe's eq. (1)) for data-parallel
training on links so slow that one all-reduce of the model takes several steps of compute.

No gradient is ever communicated. Every rank takes plain local steps with the wrapped
optimizer on its own data; every ``period`` (τ) steps each rank's model and a *centre*
variable x̄ pull towards each other, and the sum over ranks that moves the centre travels
while the next τ local steps run.

The rule
--------

n ranks, rank i's model x_i (its trainable parameters and, with ``average_buffers``, its
floating-point buffers, as one flat vector), the centre x̄ (a replica on every rank,
identical everywhere), α = ``alpha``, β = n·α. Steps k = 1, 2, …; **sync point p** is the end
of step() of step k = pτ, after the wrapped optimizer's own update. x̄⁰ = x_i at
construction (rank 0's model, broadcast to every rank, as DDP does). At sync point p, with
x_i the rank's model just after the local update of step pτ:

    d_i^p   = x_i − x̄^{p−1}                      (this rank's elastic difference)
    x_i    ← x_i − α·d_i^p                        (the rank moves towards the centre)
    x̄^p    = x̄^{p−1} + α·Σ_j d_j^p               (the centre moves towards the ranks)

This is EASGD's synchronous symmetric rule (Zhang, Choromanska & LeCun, 2015, with β = nα):
x̄^p = (1 − β)·x̄^{p−1} + β·mean_j(x_j), the **sum** of the differences, not their mean. The
sum makes the force between each rank and the centre equal and opposite, so every sync
conserves Σ_i x_i + x̄ (the mixing matrix of the n + 1 variables, diagonal 1 − α (ranks) and
1 − β (centre), α elsewhere on the centre's row and column, is symmetric and doubly
stochastic), which is what Cooperative SGD's analysis that EA-Pipe's Theorem 1 builds on
(its refs. [20], [22]) requires; its entries are non-negative, so the centre is a convex
combination of itself and the ranks, exactly when β = nα ≤ 1, which is why α must lie in
(0, 1/n]. With the mean instead, the centre would move n times slower than the ranks pull
and Σ_i x_i + x̄ would drift. The update is the paper's eq. (13), X ← (X − ηG)·S: the local
step first, then the mixing, at the same iterate.

**Nothing is stale.** A rank's pull needs only x̄^{p−1}, which it holds; the sum Σ_j d_j^p is
needed only at sync point p + 1, to form x̄^p for the next differences. So the sum is started
(asynchronously, on a process group of its own) at sync point p and waited for at sync
point p + 1, hidden behind τ local steps, and the trajectory is *bit-identical* to waiting
for it at once (``overlap=False``, kept for comparison and timing). What is "one period
late" is only when x̄^p is written into the centre replica, which nothing reads in between;
whatever reads it (:meth:`centre_weights`, :meth:`state_dict`, :meth:`synchronize`) waits for
the sum first and writes x̄^p then, with the same arithmetic, so it changes nothing either.
The all-reduce hides completely while it takes at most τ steps of compute.

**Round-robin (EA-Pipe's Algorithms 2–3) is not what this is.** There a stage's n model
replicas and its one master sit on the *same* device and take turns because the pipeline
hands the stage one mini-batch at a time; the exchange costs no communication. Across
data-parallel ranks a round-robin would make the n exchanges of a sync point a chain (rank i
waits for x̄ as rank i−1 left it: Algorithm 2, line 5), n dependent collectives that cannot
overlap anything, or, with one rank per period, an effective period of nτ per rank. The
simultaneous rule above is the data-parallel form; its mixing matrix is moreover symmetric
(the round-robin one is not), i.e. it meets Assumption 5 of the paper's analysis directly.

**Compression** (``"bf16"``, ``"fp16"``) casts what travels — each rank's d_i, then each
shard's sum — to 16 bits (:mod:`sapipe.elastic.exchange`); the rank's own pull uses its
exact d_i (it is never sent). int8 is refused.

**Buffers.** With ``average_buffers=True`` (default) the floating-point buffers (BatchNorm's
running mean and variance) take part in the rule exactly as parameters do, so the centre is
a whole model whose statistics are the same convex combination as its weights; integer
buffers (``num_batches_tracked``) stay each rank's own. With ``False`` every buffer stays
local and the centre holds rank 0's initial buffers.

**What is not done.** No gradient all-reduce, no DDP (a model wrapped in DDP is refused),
no ``sapipe.DistributedOptimizer`` inside or around it (refused by name: its stale layers
hide a gradient all-reduce behind one step, and elastic averaging sends no gradients).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from numbers import Integral, Real
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sapipe import config, rendezvous
from sapipe.comm.groups import new_group_like, release_group
from sapipe.elastic.exchange import (
    HALF_PRECISION,
    Exchange,
    FullPrecisionSum,
    HalfPrecisionSum,
    timed_wait,
)
from sapipe.errors import ConfigurationError, SapipeError, UsageError
from sapipe.layout.layers import uncompiled
from sapipe.optim.generic import DISTRIBUTED_MODULES
from sapipe.optimizer import DistributedOptimizer
from sapipe.runtime.shutdown import close_at_exit

#: the checkpoint format :meth:`ElasticAveraging.state_dict` writes
CHECKPOINT_FORMAT = "sapipe.elastic/1"
#: EASGD's recommended β = nα (Zhang et al., 2015, §5): the default α is this over n
DEFAULT_BETA = 0.9
#: settings a checkpoint must agree on (``overlap`` may differ: both forms train alike)
_RESUMED_SETTINGS = ("period", "alpha", "compression", "average_buffers")


class ElasticAveraging(torch.optim.Optimizer):
    """Wrap ``optimizer`` for elastic averaging (EASGD) of ``model`` over the ranks.

    Each rank steps ``model`` with ``optimizer`` on its own gradient (nothing is averaged);
    every ``period`` steps, inside ``step()``, the rank's model and the centre x̄ pull towards
    each other with moving rate ``alpha``, and the sum over ranks that moves the centre is
    started, to be waited for at the next sync point (the module docstring has the rule).
    Evaluate and keep the centre: ``with opt.centre_weights(): evaluate(model)``, and
    :meth:`finish` at the end leaves it in the model.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over ``model``'s parameters; its own
            ``step()`` makes the local steps (closures, LBFGS included). Its ``param_groups``
            and ``state`` are shared with this object (LR schedulers keep working).
        model: the plain ``nn.Module`` (not DDP), on its final device and dtype. Its
            trainable parameters (and floating-point buffers) must share one dtype and device.
        period: τ, local steps between sync points; an int >= 1.
        alpha: α, the moving rate, in (0, 1/n] for n ranks (β = nα <= 1, module docstring).
            Default: 0.9/n (EASGD's β = 0.9).
        overlap: True (default): the sum started at a sync point is waited for at the next
            one. False: waited for at once (the same trajectory, bit for bit; for comparison).
        compression: None, ``"bf16"`` or ``"fp16"``: what travels is cast to 16 bits.
        average_buffers: floating-point buffers follow the rule as parameters do (default),
            or (False) stay each rank's own.
        process_group: the ranks to average over (default: the world).
        timeout: seconds (or a timedelta) a sum may take before it fails with
            :class:`~sapipe.errors.CommunicationError`; default: the process group's.

    Construction is collective: every rank of ``process_group`` calls it with the same
    settings, else every rank raises :class:`~sapipe.errors.ConfigurationError` naming the
    difference. It broadcasts rank 0's parameters and buffers, as DDP does.
    """

    _step_supports_amp_scaling = True  # GradScaler hands found_inf and grad_scale to step()

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        period: int,
        alpha: float | None = None,
        overlap: bool = True,
        compression: str | None = None,
        average_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
        timeout: None | float | timedelta = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigurationError(
                "torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() (e.g. under torchrun) first"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        world_size = dist.get_world_size(group)
        arguments = {
            "period": period,
            "alpha": alpha,
            "overlap": overlap,
            "compression": compression,
            "average_buffers": average_buffers,
            "timeout": timeout,
        }
        checked: dict[str, Any] | None = None
        local_error: SapipeError | None = None
        try:
            checked = _check_locally(optimizer, model, arguments, world_size)
        except SapipeError as exc:
            local_error = exc  # raised after the ranks compared notes: alone it would hang them
        agreed = dict(
            arguments,
            alpha=checked["alpha"] if checked is not None else alpha,  # the default filled in
            period=checked["period"] if checked is not None else period,
            timeout=_seconds(timeout),
            kind="ElasticAveraging",  # a rank that built another wrapper differs here
        )
        rendezvous.agree(group, agreed, optimizer, model, local_error)
        assert checked is not None  # agree() raised on every rank unless every check passed

        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # shared, so schedulers see one truth
        self.state = optimizer.state
        self.optimizer = optimizer
        self.model = model
        self._period: int = checked["period"]
        self._alpha: float = checked["alpha"]
        self._overlap = overlap
        self._compression = compression
        self._average_buffers = average_buffers
        self._group: Any = group
        self._rank, self._world_size = dist.get_rank(group), world_size

        rendezvous.broadcast_from_first_rank(model, group)
        self._names: list[str] = checked["names"]
        self._tensors: list[torch.Tensor] = checked["tensors"]
        first = self._tensors[0]
        self._numel = sum(t.numel() for t in self._tensors)
        # x̄, and the differences' buffer (the full-precision sum runs in place on it)
        self._centre = torch.cat([t.detach().reshape(-1) for t in self._tensors])
        self._differences = torch.empty_like(self._centre)
        self._centre_views = _views(self._centre, self._tensors)
        self._difference_views = _views(self._differences, self._tensors)

        # a group of its own: the sums never interleave with the job's collectives
        self._sum_group: Any = new_group_like(group, config.parse_timeout("timeout", timeout))
        self._exchange: Exchange = (
            HalfPrecisionSum(
                self._sum_group, HALF_PRECISION[compression], self._numel, first.dtype, first.device
            )
            if compression is not None
            else FullPrecisionSum(self._sum_group)
        )
        self._steps = 0  # completed step() calls
        self._syncs = 0  # sync points passed
        self._waited = 0.0
        self._closed = False
        close_at_exit(self)  # a job that never calls close() still exits cleanly

    # ------------------------------------------------------------------ public API

    @property
    def period(self) -> int:
        """τ: local steps between sync points."""
        return self._period

    @property
    def alpha(self) -> float:
        """α: the moving rate of each rank towards the centre (and of the centre per rank)."""
        return self._alpha

    @property
    def beta(self) -> float:
        """β = nα: the centre's moving rate towards the ranks' mean (EASGD's β)."""
        return self._alpha * self._world_size

    @property
    def overlap(self) -> bool:
        """Whether each sum is waited for at the next sync point (True) or at once."""
        return self._overlap

    @property
    def compression(self) -> str | None:
        """None, ``"bf16"`` or ``"fp16"``: the wire format of the sums."""
        return self._compression

    @property
    def steps(self) -> int:
        """Completed ``step()`` calls (those GradScaler skipped included)."""
        return self._steps

    @property
    def syncs(self) -> int:
        """Sync points passed: ``steps // period``."""
        return self._syncs

    @property
    def rank(self) -> int:
        """This process's rank in :attr:`process_group`."""
        return self._rank

    @property
    def world_size(self) -> int:
        """n, the number of ranks averaged over."""
        return self._world_size

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group this optimizer averages over (None after :meth:`close`)."""
        return self._group

    @property
    def communication_wait(self) -> float:
        """Seconds this rank has blocked waiting for sums so far: the communication the
        local steps did not hide."""
        return self._waited

    @property
    def names(self) -> list[str]:
        """The names (as in ``model.state_dict()``) of what the rule averages, in flat order."""
        return list(self._names)

    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """The wrapped optimizer's local step; at every ``period``-th call, a sync point.

        With ``torch.amp.GradScaler`` call ``scaler.step(opt)`` as usual: a step whose
        gradients overflowed skips this rank's local update, as the scaler would, but still
        counts, so every rank reaches each sync point at the same call (a skipped call that
        did not count would leave the ranks' collectives out of line). Returns the closure's
        loss.
        """
        self._check_open("step()")
        found_inf = getattr(self, "found_inf", None)  # set by GradScaler.step for this call
        if found_inf is None:
            loss = self.optimizer.step(closure) if closure is not None else self.optimizer.step()
        else:
            loss = self._scaled_step(found_inf, getattr(self, "grad_scale", None))
        self._steps += 1
        if self._steps % self._period == 0:
            self._sync()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped optimizer's ``zero_grad``."""
        self.optimizer.zero_grad(set_to_none=set_to_none)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Wait for the sum in flight (if any) and write the centre it gives now. Changes no
        rank's weights and no later result (module docstring): before reading the centre."""
        if self._exchange.in_flight:
            summed, waited = timed_wait(self._exchange, self._what(self._syncs))
            self._waited += waited
            self._centre.add_(summed, alpha=self._alpha)

    @contextlib.contextmanager
    def centre_weights(self) -> Iterator[nn.Module]:
        """Within the block the model holds the centre x̄ (what EASGD trains for: evaluate
        it), with the rank's own integer buffers; the rank's own model is put back after,
        bit for bit. Waits for the sum in flight first (:meth:`synchronize`)."""
        self._check_open("centre_weights()")
        self.synchronize()
        with torch.no_grad():
            own = [t.detach().clone() for t in self._tensors]
            torch._foreach_copy_(self._tensors, self._centre_views)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                torch._foreach_copy_(self._tensors, own)

    def centre_state_dict(self) -> dict[str, torch.Tensor]:
        """The centre x̄ as ``{name: tensor}`` (copies), named as in ``model.state_dict()``."""
        self._check_open("centre_state_dict()")
        self.synchronize()
        return {name: view.clone() for name, view in zip(self._names, self._centre_views)}

    def finish(self) -> None:
        """End training with the centre in the model, for good, then :meth:`close`. For
        evaluation or export after training. Collective (every rank calls it); idempotent."""
        if self._closed:
            return
        self.synchronize()
        with torch.no_grad():
            torch._foreach_copy_(self._tensors, self._centre_views)
        self.close()

    def close(self) -> None:
        """Wait for the sum in flight (writing the centre it gives) and destroy the process
        group made for the sums. The model keeps the rank's own weights. Collective;
        idempotent; run at exit if the job did not call it. Raises, after releasing the
        group, if the wait failed (a dead peer)."""
        if self._closed:
            return
        self._closed = True
        try:
            if self._exchange.in_flight:
                if dist.is_initialized():
                    self.synchronize()
                else:  # the job destroyed its groups first: nothing can complete the sum now
                    self._exchange.discard()
        finally:
            self._exchange.group = None
            release_group(self, "_sum_group")
            self._group = None

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once wrapped (:class:`~sapipe.errors.UsageError`): the averaged vector is
        laid out at construction; add groups to the optimizer before wrapping it."""
        if hasattr(self, "_tensors"):
            raise UsageError("add param groups to the optimizer before wrapping it")
        super().add_param_group(param_group)

    def __repr__(self) -> str:
        return (
            f"sapipe.ElasticAveraging({type(self.optimizer).__name__}, period={self._period}, "
            f"alpha={self._alpha:g}, overlap={self._overlap}, "
            f"compression={self._compression!r}, world_size={self._world_size})"
        )

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything besides the model that continues this rank's training bit-exactly: the
        centre (the sum in flight waited for and written into it, which changes nothing
        later), the step count and the wrapped optimizer's state. Save it with
        ``model.state_dict()``, per rank (each rank's model is its own):
        ``sapipe.save_checkpoint(path, model, opt)`` does both."""
        self._check_open("state_dict()")
        return {
            "format": CHECKPOINT_FORMAT,
            "rank": self._rank,
            "world_size": self._world_size,
            "settings": self._settings(),
            "steps": self._steps,
            "syncs": self._syncs,
            "centre": self.centre_state_dict(),
            "optimizer": self.optimizer.state_dict(),
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (this rank's) into a freshly constructed optimizer, with
        the rank's model loaded from the same checkpoint. Refuses, naming the difference, a
        checkpoint of another rank or of other settings (``overlap`` may differ). A checkpoint
        of a job of another world size resumes too, with a warning and this job's α: every
        rank continues from the saved centre (the same on every rank) and the model it loaded
        (``sapipe.load_checkpoint(..., rank=0)`` for a rank the old job did not have). A sum
        still in flight here is waited for and dropped."""
        self._check_open("load_state_dict()")
        state = state_dict
        if state.get("format") != CHECKPOINT_FORMAT:
            raise ConfigurationError(
                f"not an ElasticAveraging checkpoint (format {state.get('format')!r}, expected "
                f"{CHECKPOINT_FORMAT!r})"
            )
        mine = self._settings()
        same_world = state["world_size"] == self._world_size
        for key in _RESUMED_SETTINGS:
            if key == "alpha" and not same_world:
                continue  # α is bounded by 1/n: a job of another size may need another one
            if state["settings"].get(key) != mine[key]:
                raise ConfigurationError(
                    f"the checkpoint was written with {key}={state['settings'].get(key)!r}; "
                    f"this job has {key}={mine[key]!r}"
                )
        centre = state["centre"]
        shapes = [tuple(v.shape) for v in self._centre_views]
        if list(centre) != self._names or [tuple(t.shape) for t in centre.values()] != shapes:
            raise ConfigurationError(
                "the checkpoint's centre does not match this model's averaged tensors "
                f"({list(centre)[:4]}... vs {self._names[:4]}...)"
            )
        if same_world and state["rank"] != self._rank:
            raise ConfigurationError(
                f"rank {self._rank} was handed rank {state['rank']}'s checkpoint"
            )
        if not same_world:
            warnings.warn(
                f"sapipe: resumed an ElasticAveraging checkpoint of {state['world_size']} ranks "
                f"on {self._world_size}: every rank continues from the saved centre and the "
                "model it loaded",
                stacklevel=2,
            )
        if self._exchange.in_flight:
            self._exchange.wait(self._what(self._syncs))  # this run's sum: superseded
        with torch.no_grad():
            torch._foreach_copy_(self._centre_views, [centre[n] for n in self._names])
        self.optimizer.load_state_dict(state["optimizer"])
        self._steps, self._syncs = int(state["steps"]), int(state["syncs"])

    # ------------------------------------------------------------------ the rule

    @torch.no_grad()
    def _sync(self) -> None:
        """Sync point p = syncs + 1 (module docstring)."""
        self.synchronize()  # x̄^{p−1}: the sum of sync point p − 1, written now
        d = self._differences
        torch.cat([t.detach().reshape(-1) for t in self._tensors], out=d)
        d.sub_(self._centre)  # d_i^p = x_i − x̄^{p−1}
        # the pull reads d before the sum may overwrite it (the full-precision sum is in place)
        torch._foreach_add_(self._tensors, self._difference_views, alpha=-self._alpha)
        self._syncs += 1
        self._exchange.start(d)  # Σ_j d_j^p, for x̄^p
        if not self._overlap:
            self.synchronize()

    @torch.no_grad()
    def _scaled_step(self, found_inf: torch.Tensor, grad_scale: torch.Tensor | None) -> None:
        """A step under GradScaler: skipped if this rank's gradients overflowed, else the
        gradients unscaled (as ``GradScaler.unscale_`` does: times the float32 reciprocal of
        the scale) and the wrapped optimizer stepped."""
        if bool(found_inf.item()):
            return None
        if grad_scale is not None:  # not unscaled yet
            inverse = grad_scale.double().reciprocal().float()
            grads = [p.grad for g in self.param_groups for p in g["params"] if p.grad is not None]
            by_device: dict[torch.device, list[torch.Tensor]] = {}
            for g in grads:
                by_device.setdefault(g.device, []).append(g)
            for device, same in by_device.items():
                torch._foreach_mul_(same, inverse.to(device))
        self.optimizer.step()
        return None

    def _what(self, sync: int) -> str:
        return f"the elastic averaging sum of sync point {sync}"

    def _settings(self) -> dict[str, Any]:
        return {
            "period": self._period,
            "alpha": self._alpha,
            "overlap": self._overlap,
            "compression": self._compression,
            "average_buffers": self._average_buffers,
        }

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise UsageError(f"ElasticAveraging.{what} after close()")


# ---------------------------------------------------------------------- construction


def _seconds(timeout: Any) -> Any:
    """A timeout as ranks compare it: seconds for a timedelta, else as given."""
    return timeout.total_seconds() if isinstance(timeout, timedelta) else timeout


def _check_locally(
    optimizer: Any, model: Any, arguments: dict[str, Any], world_size: int
) -> dict[str, Any]:
    """Everything that can be checked without the other ranks; raises :class:`SapipeError`.
    Returns α (the default filled in) and the averaged tensors with their names."""
    if isinstance(optimizer, DistributedOptimizer):
        raise ConfigurationError(
            "ElasticAveraging cannot wrap a sapipe.DistributedOptimizer: elastic averaging "
            "sends no gradients (each rank steps on its own), so there is no gradient "
            "all-reduce for stale layers to hide; wrap the plain torch optimizer"
        )
    if isinstance(optimizer, ElasticAveraging):
        raise ConfigurationError("the optimizer is already a sapipe.ElasticAveraging")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise ConfigurationError(
            f"optimizer must be a torch.optim.Optimizer instance; got {type(optimizer).__name__}"
        )
    module = type(optimizer).__module__
    if any(module == m or module.startswith(m + ".") for m in DISTRIBUTED_MODULES):
        raise ConfigurationError(
            f"ElasticAveraging cannot wrap {module}.{type(optimizer).__qualname__}: it "
            "communicates in step() itself; wrap the local optimizer"
        )
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"model must be an nn.Module; got {type(model).__name__}")
    if isinstance(uncompiled(model), nn.parallel.DistributedDataParallel):
        raise ConfigurationError(
            "pass the plain model, not a DistributedDataParallel wrapper: elastic averaging "
            "all-reduces no gradients (DDP would, every step)"
        )
    period = arguments["period"]
    if not (isinstance(period, Integral) and not isinstance(period, bool) and int(period) >= 1):
        raise ConfigurationError(f"period must be an int >= 1; got {period!r}")
    period = int(period)
    alpha = arguments["alpha"]
    if alpha is None:
        alpha = DEFAULT_BETA / world_size
    if not (
        isinstance(alpha, Real) and not isinstance(alpha, bool) and math.isfinite(alpha)
    ) or not (0 < float(alpha) < 1):
        raise ConfigurationError(f"alpha must be a number in (0, 1); got {alpha!r}")
    alpha = float(alpha)
    if alpha * world_size > 1 + 1e-12:
        raise ConfigurationError(
            f"alpha={alpha:g} on {world_size} ranks gives beta = n*alpha = "
            f"{alpha * world_size:g} > 1: the centre would overshoot the ranks' mean (it "
            f"moves by alpha times the sum of the {world_size} differences); use "
            f"alpha <= 1/{world_size}"
        )
    for name in ("overlap", "average_buffers"):
        if not isinstance(arguments[name], bool):
            raise ConfigurationError(f"{name} must be True or False; got {arguments[name]!r}")
    compression = arguments["compression"]
    if compression is not None and not (
        isinstance(compression, str) and compression in HALF_PRECISION
    ):
        why = (
            ": int8 needs error feedback and a scale per block, which this sum does not carry"
            if compression == "int8"
            else ""
        )
        raise ConfigurationError(
            f"ElasticAveraging cannot carry compression={compression!r}{why}; use None, "
            f"{', '.join(map(repr, HALF_PRECISION))}"
        )
    config.parse_timeout("timeout", arguments["timeout"])
    names, tensors = _averaged(optimizer, model, arguments["average_buffers"])
    return {"period": period, "alpha": alpha, "names": names, "tensors": tensors}


def _averaged(
    optimizer: torch.optim.Optimizer, model: nn.Module, with_buffers: bool
) -> tuple[list[str], list[torch.Tensor]]:
    """What the rule averages: the model's trainable parameters (each once), then its
    floating-point buffers if ``with_buffers``; checks that the optimizer holds only the
    model's parameters and that everything averaged shares one dtype and device."""
    module = uncompiled(model)
    owned = {id(p) for p in module.parameters()}
    for index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in owned:
                raise ConfigurationError(
                    f"the optimizer's param group {index} holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a parameter of the model"
                )
    names: list[str] = []
    tensors: list[torch.Tensor] = []
    for name, p in module.named_parameters():  # each Parameter once (tied weights too)
        if p.requires_grad:
            names.append(name)
            tensors.append(p)
    if not tensors:
        raise ConfigurationError("the model has no trainable parameters to average")
    if with_buffers:
        for name, b in module.named_buffers():
            if b.is_floating_point():
                names.append(name)
                tensors.append(b)
    kinds = sorted({f"{t.dtype} on {t.device}" for t in tensors})
    if len(kinds) > 1:
        raise ConfigurationError(
            "everything ElasticAveraging averages (trainable parameters"
            + (" and floating-point buffers" if with_buffers else "")
            + f") must share one dtype and device; found {kinds}"
        )
    if not tensors[0].is_floating_point():
        raise ConfigurationError(f"the model's parameters must be floating point; got {kinds}")
    return names, tensors


def _views(flat: torch.Tensor, like: list[torch.Tensor]) -> list[torch.Tensor]:
    """Views of consecutive slices of ``flat`` shaped as ``like``."""
    views, offset = [], 0
    for t in like:
        views.append(flat[offset : offset + t.numel()].view_as(t))
        offset += t.numel()
    return views


__all__ = ["CHECKPOINT_FORMAT", "DEFAULT_BETA", "ElasticAveraging"]
