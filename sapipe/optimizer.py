"""``DistributedOptimizer``: staleness-aware data-parallel training behind an optimizer.

The user keeps their model and ``torch.optim`` optimizer, drops DDP, and wraps the
optimizer. From then on (DESIGN.md §3, §5):

* every trainable parameter's gradient is copied into a flat bucket as soon as backward
  produces it, and a bucket's all-reduce starts as soon as it is full, in bucket order;
* **sync layers** (k+1..m) get ``x_t = OPT(x_{t-1}, g_t)``, deferred to just before the
  layer's next forward, so their all-reduce overlaps the rest of backward and the start
  of the next forward. They equal ``DistributedDataParallel`` with the same optimizer;
* **stale layers** (1..k) are updated at ``step()`` with the gradient of ``staleness``
  iterations ago, whose all-reduce ran in the background meanwhile, optionally compensated
  (``dc``) or with the model holding predicted weights (``wp1``-``wp3``).

Lifecycle per user iteration: forward (pre-hooks apply deferred sync updates) →
``loss.backward()`` (hooks fill buckets, collectives start) → ``step()`` (stale updates,
sync updates recorded as deferred with this step's hyper-parameters) → ``zero_grad()``.
"""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import math
import os
import statistics
import time
from datetime import timedelta
from typing import Any, Dict, Iterator, List, Optional, Union

import torch
import torch.distributed as dist
from torch import nn

from . import config
from .buckets import Bucket, StalenessBuffer, WeightHistory, build_buckets
from . import comm
from .comm import new_group_like
from .compensation import MODES, Compensation, StaleStep
from .errors import CommunicationError, ConfigurationError, SapipeError, UnsupportedOptimizerError, UsageError
from .layers import Layer, LayerRecorder
from .optim_math import OptimizerRule, rule_for
from .schedule import chrome_trace, profiler, simulator, solver, tuner
from .trace import Tracer

log = logging.getLogger("sapipe")

CHECKPOINT_FORMAT = "sapipe-checkpoint/2"  # /2: pipeline restarts and the search for k

#: A predicted stall below this fraction of compute counts as none. Profiles taken on a
#: live job carry a few percent of noise, and staling a layer costs some accuracy, so
#: "auto" only makes layers stale for a gain larger than that.
STALL_TOLERANCE = 0.03

#: A trial of the measured search for k lasts ``tune_steps`` iterations, and is extended by
#: as many again, up to this many times in all, while its time is too noisy to resolve
#: ``STALL_TOLERANCE`` (the median's standard error above half of it).
TRIAL_MAX_ROUNDS = 4


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` for partial-staleness data-parallel training of ``model``.

    Args:
        optimizer: a ``torch.optim.SGD``, ``Adam`` or ``AdamW`` over ``model``'s parameters.
            Its ``param_groups`` are shared with this object: LR schedulers built on either
            keep working, and every update uses the hyper-parameters of the step it
            belongs to (also when applied later, before the layer's next forward).
        model: the ``nn.Module`` that is trained; do not wrap it in DDP. Its forward order
            defines the layers (recorded during the first forward after construction).
        stale_layers: k, the number of leading layers (forward order) that take stale
            gradients. 0 is fully synchronous (equal to DDP); m (all layers) is Pipe-SGD.
            ``"auto"``: the scheduler profiles the warm-up iterations and picks the smallest
            k that hides all communication (:mod:`sapipe.schedule`), then checks that k
            on the running job (``tune_steps``).
        compensation: ``"none"``, ``"dc"``, ``"wp1"``, ``"wp2"`` or ``"wp3"`` for the stale
            layers (see :mod:`sapipe.compensation`).
        dc_lambda: λ ≥ 0 of delay compensation (``dc`` and ``wp3``).
        dc_form: ``"outer"`` (the paper's rank-one form) or ``"diagonal"`` (DC-ASGD).
        staleness: s ≥ 1, iterations of delay of stale gradients (> 1 with none/dc only).
        warmup_steps: iterations run fully synchronously before the stale layers switch.
        bucket_cap_mb: bucket size cap; a layer larger than the cap gets its own bucket.
        process_group: the group to train over (default: the world).
        timeout: seconds (or a ``timedelta``) after which a collective that a peer never
            joins raises :class:`~sapipe.errors.CommunicationError`; default: the process
            group's own timeout.
        lr_ramp_steps: PipeMare's T1 for staleness > 1: the stale layers' learning rate is
            divided by ``s ** (1 - min(t / K, 1))`` over the first K pipeline steps (counted
            from each start of the pipeline: the end of warm-up, and each restart while
            ``"auto"`` measures k).
        profile_steps: with ``"auto"``, how many warm-up iterations are profiled; warm-up
            then lasts ``max(warmup_steps, profile_steps + 5)`` iterations (the job's
            first 5 are never profiled: they pay one-off costs).
        backend: how buckets are summed over the ranks (:mod:`sapipe.comm`): ``"torch"``
            (default; one all-reduce per bucket, NCCL or Gloo), ``"pushpull"`` (BytePS's
            pattern on torch.distributed: chunks of ``partition_mb``, reduce-scatter then
            all-gather, those the next forward needs first going first), ``"horovod"``
            (``hvd.init()`` first) or ``"byteps"`` (an untested adapter).
        partition_mb: chunk size of ``backend="pushpull"`` (BytePS's default: 4 MB).
        tune_steps: with ``"auto"``, iterations measured per trial (up to
            :data:`TRIAL_MAX_ROUNDS` times as many while they are noisy) when the scheduler checks
            its k on the running job (:mod:`sapipe.schedule.tuner`): if the pipeline still
            waits for communication at the model's k, other k are measured (each trial
            restarts the pipeline: the stale gradients in flight are applied as plain
            updates, as at the end of warm-up) and the smallest k as fast as k = m within
            3% is kept. ``stale_layers`` says ``"auto"`` until that is over; the final
            decision's predictions then use the compute slow-down that best fits the
            trials (:func:`sapipe.schedule.tuner.fit_slowdown`). 0: keep the model's k
            unmeasured.
        trace: ``True`` records runtime events in ``opt.tracer``; a path also writes them
            at exit as a Chrome trace (Perfetto) — per layer forward/backward, per bucket
            communication, waits — with ``{rank}`` in the path replaced by the rank (else
            ``.rank<r>`` is added when there are several ranks). Default: the
            ``SAPIPE_TRACE`` environment variable. With ``"auto"``, the scheduler's predicted
            iteration is written beside it (``.predicted.json``) for comparison.

    Construction is collective: every rank of ``process_group`` must call it. It checks that
    all ranks were configured identically (else raises on every rank, naming the
    difference) and broadcasts rank 0's parameters and buffers, as DDP does.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        stale_layers: int = 0,
        compensation: str = "none",
        dc_lambda: float = 0.2,
        dc_form: str = "outer",
        staleness: int = 1,
        warmup_steps: int = 0,
        bucket_cap_mb: float = 25,
        process_group: Optional[dist.ProcessGroup] = None,
        timeout: Union[None, float, timedelta] = None,
        lr_ramp_steps: int = 0,
        profile_steps: int = 5,
        backend: str = "torch",
        partition_mb: float = 4.0,
        tune_steps: int = 10,
        trace: Union[None, bool, str] = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigurationError(
                "sapipe: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() (e.g. under torchrun) first"
            )
        group = process_group if process_group is not None else dist.group.WORLD
        args = dict(
            stale_layers=stale_layers, compensation=compensation, dc_lambda=dc_lambda,
            dc_form=dc_form, staleness=staleness, warmup_steps=warmup_steps,
            bucket_cap_mb=bucket_cap_mb, lr_ramp_steps=lr_ramp_steps, timeout=timeout,
            profile_steps=profile_steps, backend=backend, partition_mb=partition_mb, tune_steps=tune_steps,
        )
        # Validate locally, but report only after comparing with the other ranks: a rank
        # that raised here while the others went on into a collective would hang them.
        local_error: Optional[SapipeError] = None
        try:
            rule, params, recorder, settings = _check_locally(optimizer, model, args)
        except SapipeError as exc:
            local_error = exc
        unavailable = comm.availability(backend) if backend in comm.BACKENDS else None
        if local_error is None and unavailable is not None:
            local_error = ConfigurationError(unavailable)
        job = dict(_describe_job(optimizer, model), backend_available=unavailable is None)
        fingerprint = config.describe(dict(args, **job))
        gathered: List[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, fingerprint, group=group)
        differences = config.mismatches(gathered)
        if differences:
            raise ConfigurationError(
                "sapipe: ranks were configured differently: " + "; ".join(differences[:10])
            )
        if local_error is not None:
            raise local_error

        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # shared, so schedulers see one truth
        self.optimizer = optimizer
        self.model = model
        self.settings: config.Settings = settings
        if trace is None:
            trace = os.environ.get("SAPIPE_TRACE") or False
        self.tracer = Tracer(enabled=bool(trace))
        self._trace_path = trace if isinstance(trace, str) else None
        self._profiles: Optional[List[solver.LayerProfile]] = None
        self._rule: OptimizerRule = rule
        self._compensation: Compensation = MODES[settings.compensation](settings.staleness)
        self._group = group
        self._world_size = dist.get_world_size(group)
        self._rank = dist.get_rank(group)
        self._params = params
        self._group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._sync_comm = self._new_comm("sync")
        self._k: int = 0 if settings.auto else settings.stale_layers
        # The pipeline starts after this iteration: warm-up's end, or a restart while "auto" tunes k.
        self._origin = settings.effective_warmup
        self._stale_comm = self._new_comm("stale") if settings.auto or self._k > 0 else None
        _broadcast_from_first_rank(model, group)

        self._recorder: Optional[LayerRecorder] = recorder
        self._layers: Optional[List[Layer]] = None
        self._buckets: List[Bucket] = []
        self._where: Dict[int, tuple] = {}  # id(param) -> (bucket, position in bucket)
        self._bucket_of_layer: Dict[int, Bucket] = {}
        self._layer_of: Dict[int, int] = {}  # id(param) -> layer index
        self._eager: List[Bucket] = []  # buckets with a layer that never ran in forward
        self._timer: Optional[profiler.LayerTimer] = None
        self._trace_pending: Dict[tuple, int] = {}  # (iteration, layer) -> gradients to come
        self._trace_forward_end = self._trace_last_release = 0
        self.decision: Optional[solver.Decision] = None  # the scheduler's, with "auto"
        self._decided = False  # k is final (decided now, or restored from a checkpoint)
        self.tuner: Optional[tuner.Tuner] = None  # the measured search for k, once the model chose
        self._trial_start = 0  # the iteration the current trial's pipeline began after
        self._trial_times: List[float] = []  # per measured iteration of the trial: forward start to step end
        self._trial_waits: List[float] = []  # per measured iteration of the trial: seconds waited for comm
        self._waited = 0.0  # seconds this iteration waited for all-reduces so far
        self._waited_total = 0.0  # seconds waited since construction (communication_wait)
        self._forward_start: Optional[float] = None  # this iteration's first forward began
        self._next_launch = 0
        self._iteration = 0  # completed step() calls
        self._accumulating = False  # inside no_sync()
        self._root_wait = self._root_update = 0.0
        self._closed = False
        # iteration -> (gradients finite on every rank, 1 / loss scale); only with a GradScaler
        self._scaling: Dict[int, tuple] = {}
        self._control = new_group_like(group, settings.timeout)  # small control collectives
        self._hooks = [
            model.register_forward_pre_hook(self._before_model_forward),
            model.register_forward_hook(self._after_model_forward),
        ]
        self._hooks += [p.register_post_accumulate_grad_hook(self._on_gradient) for p in params]
        recorder.start()
        if self._trace_path:
            atexit.register(self._write_trace_at_exit)

    # ------------------------------------------------------------------ public API

    @property
    def stale_layers(self) -> Union[int, str]:
        """k: the leading layers (forward order) on stale gradients; "auto" until decided."""
        if self.settings.auto and not self._decided:
            return config.AUTO
        return self._k

    @property
    def num_layers(self) -> int:
        """m: layers (modules owning trainable parameters); exact after the first forward."""
        if self._layers is not None:
            return len(self._layers)
        assert self._recorder is not None
        return self._recorder.max_layers

    @property
    def communication_wait(self) -> float:
        """Seconds this rank has spent blocked on gradient all-reduces since construction.

        This is the communication the pipeline did not hide, as the host saw it: sample it
        around a span of iterations to tell a step that waits for the network from one whose
        compute ran slow. On CUDA with NCCL the host does not block (the device does), so
        there it counts only what ``wait()`` blocked on the host.
        """
        return self._waited_total

    @property
    def layers(self) -> List[Layer]:
        """The layers in forward-execution order (available after the first forward)."""
        if self._layers is None:
            raise UsageError("sapipe: the layer order is known only after the model's first forward")
        return list(self._layers)

    @property
    def buckets(self) -> List[Bucket]:
        """Communication buckets in launch order (reverse forward order)."""
        return list(self._buckets)

    # GradScaler hands itself to step() (see step's docstring) instead of unscaling p.grad.
    _step_supports_amp_scaling = True

    @torch.no_grad()
    def step(self, closure=None, grad_scaler=None) -> None:  # type: ignore[override]
        """End the iteration: stale layers update now, sync layers before their next forward.

        With ``torch.amp.GradScaler``, call ``scaler.step(opt)`` as usual: the scaler passes
        itself here. Whether this iteration's gradients are finite is decided over *all*
        ranks (and written back into the scaler, so every rank's scale evolves alike); the
        iteration's gradients are later unscaled with its own scale, or, if not finite,
        dropped wherever they would be used — now, at a deferred update, or one
        ``staleness`` later — without disturbing the staleness pipeline.
        """
        if closure is not None:
            raise UsageError("sapipe: step(closure) is not supported; call loss.backward() before step()")
        if self._layers is None:
            raise UsageError("sapipe: step() was called before the model's first forward and backward")
        iteration = self._iteration + 1
        hyperparams = [self._rule.hyperparams(g) for g in self.param_groups]
        if iteration == 1:
            self._allocate_state()
        self.tracer.record("step_start", iteration=iteration)
        self._flush()
        if grad_scaler is not None:
            self._scaling[iteration] = self._agree_on_scaling(grad_scaler)
            self._scaling.pop(iteration - self.settings.staleness - 2, None)
        pipeline_step = iteration - self._origin
        for bucket in self._buckets:
            if bucket.stale and pipeline_step >= 1:
                self._stale_update(bucket, pipeline_step, hyperparams, iteration)
            else:
                bucket.pending_update = (hyperparams, iteration)
            bucket.ready = [False] * len(bucket.params)
            bucket.num_ready = 0
        self._next_launch = 0
        self._iteration = iteration
        if self._timer is not None:
            self._timer.end_iteration()
            if iteration == self._origin:
                self._decide()
        elif self.tuner is not None and not self._decided:
            self._measure_trial(iteration, hyperparams)
        self._waited = 0.0
        self._forward_start = None
        self.tracer.record("step_end", iteration=iteration)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Apply every pending (deferred) synchronous update now.

        Use before evaluating or saving the model outside the training loop. Stale
        gradients still in flight stay pending: applying them is the next ``step()``'s job.
        """
        for bucket in self._buckets:
            self._apply_deferred(bucket)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation, as with DDP: backward passes inside the block only
        accumulate into ``p.grad``; the first backward outside it communicates the sum.

        ``for micro in batches[:-1]: with opt.no_sync(): loss(micro).backward()`` then
        ``loss(batches[-1]).backward(); opt.step()``.
        """
        previous, self._accumulating = self._accumulating, True
        try:
            yield
        finally:
            self._accumulating = previous

    @contextlib.contextmanager
    def real_weights(self) -> Iterator[nn.Module]:
        """Within the block, the model holds the real weights x (not WP's predicted x̃).

        Pending synchronous updates are applied first, so the model is exactly x_t.
        """
        self.synchronize()
        predicted = [(b, b.weights.clone()) for b in self._buckets if b.real is not None and b.real is not b.weights]
        with torch.no_grad():
            for bucket, _ in predicted:
                bucket.weights.copy_(bucket.real)
        try:
            yield self.model
        finally:
            with torch.no_grad():
                for bucket, saved in predicted:
                    bucket.weights.copy_(saved)

    def close(self) -> None:
        """Finish cleanly: wait for every collective still in flight (the last stale
        all-reduce is never consumed), remove sapipe's hooks from the model, and destroy
        the process groups sapipe created. The model keeps its current weights; under
        weight prediction call this outside ``real_weights()`` after copying what you need.
        Collective: every rank calls it. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        for bucket in self._buckets:
            if bucket.grads is not None:
                for i, handle in enumerate(bucket.grads.in_flight):
                    if handle is not None:
                        handle.wait()
                        bucket.grads.in_flight[i] = None
            bucket.pending_update = None
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self._recorder is not None:
            self._recorder.finish()
            self._recorder = None
        for backend in (self._sync_comm, self._stale_comm):
            if backend is not None:
                backend.close()
        comm.release_group(self._control)

    def _new_comm(self, name: str) -> comm.CommBackend:
        settings = self.settings
        return comm.create(settings.backend, self._group, name, settings.timeout, self.tracer,
                           partition_bytes=max(1, int(settings.partition_mb * 1024 * 1024)))

    def write_trace(self, path: str, predicted: bool = False) -> None:
        """Write the recorded events (or, ``predicted=True``, the scheduler's simulated
        iteration at the chosen k) as a Chrome trace JSON, viewable in Perfetto."""
        rank = self._rank
        if predicted:
            if self._profiles is None or self.decision is None:
                raise UsageError("sapipe: a predicted trace needs stale_layers='auto' after its decision")
            events = simulator.simulate(self._profiles, self.decision.k, **self._model_arguments()).events
            name = f"rank {rank} predicted (k={self.decision.k})"
        else:
            events = chrome_trace.events_from_tracer(self.tracer.events())
            name = f"rank {rank}"
        chrome_trace.write_chrome_trace(path, events, process_name=name, pid=rank)

    def _write_trace_at_exit(self) -> None:
        assert self._trace_path is not None
        path = per_rank_path(self._trace_path, self._rank, self._world_size)
        self.write_trace(path)
        if self.decision is not None:
            self.write_trace(os.path.splitext(path)[0] + ".predicted.json", predicted=True)

    def add_param_group(self, param_group: Dict[str, Any]) -> None:
        if hasattr(self, "_rule"):  # construction done: buckets are laid out
            raise UsageError("sapipe: add param groups to the optimizer before wrapping it")
        super().add_param_group(param_group)

    def state_dict(self) -> Dict[str, Any]:  # type: ignore[override]
        """Everything needed to continue bit-exactly: in-flight and pending gradients (their
        all-reduces are waited for), optimizer state, real vs predicted weights, Δx history,
        step counters and the scheduler's k. Save it with ``model.state_dict()``, per rank
        (see :func:`sapipe.save_checkpoint`), between ``step()`` and the next forward.
        """
        if self._iteration == 0:
            raise UsageError("sapipe: nothing to checkpoint before the first step()")
        if any(b.num_ready for b in self._buckets):
            raise UsageError("sapipe: checkpoint between step() and the next forward, not during backward")
        return {
            "format": CHECKPOINT_FORMAT,
            "rank": self._rank,
            "world_size": self._world_size,
            "settings": self._settings_fingerprint(),
            "iteration": self._iteration,
            "k": self._k,
            "decided": self._decided,
            "pipeline_origin": self._origin,
            # the measured search for k, if it is under way: where it stands, and this trial's iterations so far
            "search": None if self._decided or self.tuner is None else {
                "tuner": self.tuner.state_dict(), "trial_start": self._trial_start,
                "times": list(self._trial_times), "waits": list(self._trial_waits),
                # the model's inputs, so the resumed job predicts the final k as this one would
                "profiles": [dataclasses.asdict(p) for p in self._profiles or []], "link": self._link,
                "sim_options": dict(self._sim_options), "decision": dataclasses.asdict(self.decision),
            },
            "order": [layer.name for layer in self.layers if layer.executed],
            "layers": [layer.name for layer in self.layers],
            "buckets": [bucket.state_dict() for bucket in self._buckets],
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in self.param_groups],
            "scaling": dict(self._scaling),
        }

    def load_state_dict(self, state_dict: Dict[str, Any]) -> None:  # type: ignore[override]
        """Restore :meth:`state_dict` (this rank's) into a freshly constructed optimizer.

        Refuses, naming the difference, a checkpoint of another world size, rank or
        configuration. Load before the first forward of the resumed job (or any time
        between ``step()`` and the next forward).
        """
        state = state_dict
        if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
            raise ConfigurationError(f"sapipe: not a sapipe checkpoint (expected format {CHECKPOINT_FORMAT!r})")
        if state["world_size"] != self._world_size:
            raise ConfigurationError(
                f"sapipe: the checkpoint was written by a job of {state['world_size']} ranks; this job has "
                f"{self._world_size}. Stale gradients and per-rank predictions cannot be re-partitioned"
            )
        if state["rank"] != self._rank:
            raise ConfigurationError(f"sapipe: rank {self._rank} was given rank {state['rank']}'s checkpoint")
        differences = config.mismatches([state["settings"], self._settings_fingerprint()])
        if differences:
            raise ConfigurationError(
                "sapipe: the checkpoint's configuration differs from this optimizer's: "
                + "; ".join(d.replace("rank 1", "this job").replace("rank 0", "the checkpoint") for d in differences)
            )
        if any(b.num_ready for b in self._buckets):
            raise UsageError("sapipe: load a checkpoint between step() and the next forward, not during backward")
        self._decided = state["decided"]
        self._k = state["k"]
        self._origin = state["pipeline_origin"]
        search = state["search"]
        self.tuner = tuner.Tuner.from_state(search["tuner"]) if search else None
        if search:
            self._trial_start = search["trial_start"]
            self._trial_times, self._trial_waits = list(search["times"]), list(search["waits"])
            self._profiles = [solver.LayerProfile(**p) for p in search["profiles"]] or None
            self._link, self._sim_options = tuple(search["link"]), dict(search["sim_options"])
            self.decision = solver.Decision(**search["decision"])
        if self._layers is None:
            self._build_layout(state["order"])
        if [layer.name for layer in self._layers] != state["layers"]:
            raise ConfigurationError("sapipe: the checkpoint's layer order differs from this model's")
        self._timer = None if self._decided or self.tuner is not None or not self.settings.auto else self._timer
        previous = self._buckets if self._iteration > 0 else None
        self._lay_out_buckets()
        self._allocate_state(previous)
        if [[layer.name for layer in b.layers] for b in self._buckets] != [b["layers"] for b in state["buckets"]]:
            raise ConfigurationError("sapipe: the checkpoint's bucket layout differs (bucket_cap_mb or model changed)")
        for bucket, saved in zip(self._buckets, state["buckets"]):
            bucket.load_state_dict(saved)
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        self._iteration = state["iteration"]
        self._scaling = dict(state["scaling"])
        self._next_launch = 0

    def _settings_fingerprint(self) -> Dict[str, str]:
        """What a checkpoint must agree on (not the timeout, nor the search's trial length)."""
        fields = {k: v for k, v in vars(self.settings).items() if k not in ("timeout", "tune_steps")}
        return config.describe(dict(fields, optimizer=type(self.optimizer).__name__))

    def __repr__(self) -> str:
        s = self.settings
        return (
            f"sapipe.DistributedOptimizer({type(self.optimizer).__name__}, stale_layers={self.stale_layers!r}, "
            f"compensation={s.compensation!r}, staleness={s.staleness}, world_size={self._world_size})"
        )

    # ------------------------------------------------------------------ layout

    def _before_model_forward(self, module: nn.Module, args) -> None:
        iteration = self._iteration + 1
        if self._forward_start is None:
            self._forward_start = time.perf_counter()
        self.tracer.record("forward_start", iteration=iteration)
        if self._timer is not None and self._origin - self.settings.profile_steps < iteration <= self._origin:
            self._timer.begin_iteration()
        start = time.perf_counter()
        waited = sum(self._apply_deferred(bucket) for bucket in self._eager)
        # before the first layer, for the profiler: a stall, and update compute that followed it
        self._root_wait, self._root_update = waited, time.perf_counter() - start - waited

    def _after_model_forward(self, module: nn.Module, args, output) -> None:
        if self._layers is None:
            self._build_layout()
        if self._timer is not None:
            self._timer.forward_end()
        if self.tracer.enabled:
            self._trace_forward_end = time.perf_counter_ns()
            self._trace_pending.clear()

    def _build_layout(self, order: Optional[List[str]] = None) -> None:
        """After the first forward (or from a checkpoint's ``order``): fix the layer order,
        hook the layers, lay out buckets."""
        assert self._recorder is not None
        layers = self._recorder.finish(order)
        if self._k > len(layers):
            raise ConfigurationError(
                f"sapipe: stale_layers={self._k} exceeds the model's {len(layers)} layers "
                "(modules owning trainable parameters not tied to an earlier layer)"
            )
        self._layers = layers
        self._recorder = None
        self._layer_of = {id(p): layer.index for layer in layers for p in layer.params}
        for layer in layers:
            # A layer that never runs its own forward is updated when its host starts.
            target = layer.module if layer.executed else layer.host
            if target is not None:
                self._hooks.append(target.register_forward_pre_hook(self._pre_layer_hook(layer)))
            if self.tracer.enabled and layer.executed:
                self._hooks.append(layer.module.register_forward_hook(self._post_layer_hook(layer)))
        if self.settings.auto and not self._decided:
            self._timer = profiler.LayerTimer(len(layers), [layer.executed for layer in layers])
        self._lay_out_buckets()

    def _lay_out_buckets(self) -> None:
        """Buckets for the current k, with their gradient buffers (no weights moved yet)."""
        assert self._layers is not None
        cap = int(self.settings.bucket_cap_mb * 1024 * 1024)
        self._buckets = build_buckets(self._layers, self._k, cap, self._group_of)
        comp = self._compensation
        self._where, self._bucket_of_layer = {}, {}
        for bucket in self._buckets:
            depth = self.settings.staleness + 1 if bucket.stale else 1
            bucket.grads = StalenessBuffer(bucket.numel, bucket.dtype, bucket.device, depth)
            if bucket.stale and comp.needs_local:
                bucket.local = torch.zeros_like(bucket.grads.slots[0])
            if bucket.stale and comp.needs_prev_local:
                bucket.prev_local = torch.zeros_like(bucket.grads.slots[0])
            for i, p in enumerate(bucket.params):
                self._where[id(p)] = (bucket, i)
            for layer in bucket.layers:
                self._bucket_of_layer[layer.index] = bucket
        # Buckets with a layer nobody's pre-forward covers are updated when the model starts.
        self._eager = [b for b in self._buckets if any(not l.executed and l.host is None for l in b.layers)]

    def _pre_layer_hook(self, layer: Layer):
        index = layer.index

        def hook(module: nn.Module, args) -> None:
            bucket = self._bucket_of_layer.get(index)
            waited = updated = 0.0
            if bucket is not None and bucket.pending_update is not None:
                start = time.perf_counter()
                waited = self._apply_deferred(bucket)
                updated = time.perf_counter() - start - waited
            if self._timer is not None:
                if index == 0:
                    waited += self._root_wait
                    updated += self._root_update
                self._timer.layer_forward(index, waited, updated)
            self.tracer.record("layer_forward_start", layer=layer.name, iteration=self._iteration + 1)
        return hook

    def _post_layer_hook(self, layer: Layer):
        def hook(module: nn.Module, args, output) -> None:
            self.tracer.record("layer_forward_end", layer=layer.name, iteration=self._iteration + 1)
        return hook

    def _allocate_state(self, previous: Optional[List[Bucket]] = None) -> None:
        """Flatten weights (params become views) and create the optimizer state.

        Runs at the first step, and again when the scheduler re-lays the buckets out for
        the chosen k; then every parameter's state moves from its ``previous`` bucket.
        """
        moved: Dict[int, tuple] = {}  # id(param) -> (old segment, offset in that segment)
        for bucket in previous or []:
            for segment in bucket.segments:
                for p, offset in zip(bucket.params, bucket.offsets):
                    if segment.start <= offset < segment.end:
                        moved[id(p)] = (segment, offset - segment.start)
        for bucket in self._buckets:
            bucket.flatten_weights()
            bucket.real = bucket.weights
            for segment in bucket.segments:
                segment.state = self._rule.new_state(segment.of(bucket.weights))
                for p, offset in zip(bucket.params, bucket.offsets):
                    if id(p) in moved and segment.start <= offset < segment.end:
                        old, old_offset = moved[id(p)]
                        segment.state.steps = old.state.steps
                        segment.state.momentum_started = old.state.momentum_started
                        for name, buffer in segment.state.buffers.items():
                            start = offset - segment.start
                            buffer[start : start + p.numel()].copy_(
                                old.state.buffers[name][old_offset : old_offset + p.numel()]
                            )

    def _decide(self) -> None:
        """End of warm-up with "auto": profile, choose k, re-lay the buckets out for it."""
        assert self._timer is not None and self._layers is not None
        bucket = self._buckets[0]
        profile = profiler.measure(
            self._timer, self._sync_comm.group if self._sync_comm.group is not None else self._control,
            [b.nbytes for b in self._buckets], bucket.dtype, bucket.device
        )
        self.profile = profile  # what the decision was made from (benchmarks and diagnostics)
        self._timer = None
        element = self._buckets[0].params[0].element_size()
        layer_bytes = [layer.numel * element for layer in self._layers]
        self._profiles = [
            solver.LayerProfile(layer.name, u, b, profile.alpha + profile.beta * nbytes, layer.numel)
            for layer, u, b, nbytes in zip(self._layers, profile.forward, profile.backward, layer_bytes)
        ]
        self._link = (profile.alpha, profile.beta, layer_bytes, profile.step_time)
        # The runtime's link: sync and stale traffic on two process groups, sharing it;
        # no compute slow-down unless the profile measured one (it does not by default);
        # the measured search, if it runs, fits one for the final predictions.
        # Every layer was synchronous while profiling: its deferred updates covered all of them.
        numel = sum(layer.numel for layer in self._layers)
        self._sim_options = {"slowdown": profile.slowdown, "shared_link": True,
                             "update_per_element": profile.update_time / numel if numel else 0.0}
        self.decision = solver.choose_k(
            self._profiles,
            bucket_cap_bytes=int(self.settings.bucket_cap_mb * 1024 * 1024),
            alpha=profile.alpha,
            beta=profile.beta,
            bytes_per_layer=layer_bytes,
            tolerance=STALL_TOLERANCE,
            step_time=profile.step_time,
            **self._sim_options,
        )
        self._relayout(self.decision.k)
        m = len(self._layers)
        if self.settings.tune_steps > 0 and 0 < self.decision.k < m:
            # k = 0 and k = m need no check: the profile was measured at k = 0, and
            # nothing hides more communication than k = m.
            self.tuner = tuner.Tuner(self.decision.k, m, STALL_TOLERANCE)
            self._begin_trial(self._iteration)
        else:
            self._finish_decision()

    def _finish_decision(self) -> None:
        self._decided = True
        if self._rank == 0:
            tuned = (f"; {self.tuner.summary()}; predictions with the compute slow-down that fits them best, "
                     f"sigma={self._sim_options['slowdown']:g}" if self.tuner is not None else "")
            log.info("sapipe: %s%s", self.decision.summary(), tuned)

    def _relayout(self, k: int) -> None:
        """Buckets and optimizer state for ``k`` stale layers; every pending update applied first."""
        self.synchronize()  # every pending update uses the old layout's buffers
        previous = self._buckets
        self._k = k
        self._lay_out_buckets()
        self._allocate_state(previous)

    # ------------------------------------------------------------------ measured tuning of k

    def _begin_trial(self, iteration: int) -> None:
        """The pipeline (re)started after ``iteration``: measure the trial's iterations from here."""
        self._trial_start = iteration
        self._trial_times = []
        self._trial_waits = []

    def _measure_trial(self, iteration: int, hyperparams: List[Dict[str, Any]]) -> None:
        """Record one iteration of the trial; after ``tune_steps`` of them, report and move on.

        The pipeline's first s steps are not measured (no stale update waits in them yet).
        An iteration's time runs from its first forward to the end of its ``step()``, so what
        the training loop does between steps (evaluation, checkpoints) does not count. The
        slowest rank's values go to the tuner, so every rank takes the same next step. The
        value is the median of the means of consecutive pairs of iterations: a saturated
        link often alternates long and short iterations, which a plain median misreads,
        and a single hiccup (the host, the allocator) should not decide k. A trial whose
        value is too noisy to tell 3% apart goes on (:data:`TRIAL_MAX_ROUNDS`). On CUDA the host
        does not block on communication, so a trial iteration synchronises the device
        before it is timed and its waits count as unknown (the search then always measures
        k = m).
        """
        assert self.tuner is not None
        if iteration - self._trial_start <= self.settings.staleness:
            return
        device = self._params[0].device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = self._forward_start if self._forward_start is not None else time.perf_counter()
        self._trial_times.append(time.perf_counter() - start)
        self._trial_waits.append(math.inf if device.type == "cuda" else self._waited)
        measured = len(self._trial_times)
        if measured % self.settings.tune_steps:
            return
        pairs = _pair_means(self._trial_times)
        median = statistics.median(pairs)
        # the median's standard error, relative (≈ 1.25 σ / √n for a roughly normal sample)
        noise = 1.25 * statistics.stdev(pairs) / math.sqrt(len(pairs)) / median if len(pairs) > 1 else 0.0
        iteration_time, waits, noise = self._agree_on_max(
            [median, statistics.median(_pair_means(self._trial_waits)), noise], "the scheduler's measurements"
        )
        if noise > STALL_TOLERANCE / 2 and measured < TRIAL_MAX_ROUNDS * self.settings.tune_steps:
            return  # too noisy to decide on yet: every rank measures on (they agreed on the noise)
        self.tuner.record(iteration_time, waits)
        if self.tuner.trial is None:
            if self.tuner.final != self._k:
                self._restart_pipeline(self.tuner.final, iteration, hyperparams)
            self._sim_options["slowdown"] = tuner.fit_slowdown(self.tuner.trials, self._predict)
            self.decision = self._decision_for(self.tuner.final)
            self._finish_decision()
        else:
            self._restart_pipeline(self.tuner.trial, iteration, hyperparams)
            self._begin_trial(iteration)

    def _agree_on_max(self, values: List[float], what: str) -> List[float]:
        """The maximum over ranks of each of ``values`` (float64), on the control group."""
        device = self._params[0].device
        tensor = torch.tensor(values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu")
        try:
            dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=self._control)
        except Exception as exc:  # noqa: BLE001 - re-raised with context
            raise CommunicationError(f"sapipe: agreeing on {what} failed: {exc}") from exc
        return tensor.cpu().tolist()

    def _restart_pipeline(self, k: int, iteration: int, hyperparams: List[Dict[str, Any]]) -> None:
        """Back to the synchronous state after ``iteration``, then the pipeline anew with k stale layers.

        The stale gradients still in flight are applied now, oldest first, as plain updates
        (no compensation: their correction assumes a next step that will not come), and the
        weights the model holds become the real ones. That is the state at the end of
        warm-up, and the pipeline starts from it exactly as it did then.
        """
        t, s = iteration - self._origin, self.settings.staleness
        stale_hyperparams = self._stale_hyperparams(hyperparams, t)
        for bucket in self._buckets:
            if not self._in_pipeline(bucket, iteration):
                continue
            assert bucket.grads is not None and bucket.real is not None and bucket.weights is not None
            for j in range(max(t - s + 1, 1), t + 1):
                slot = bucket.grads.index(j)
                handle, bucket.grads.in_flight[slot] = bucket.grads.in_flight[slot], None
                grad = self._unscale(handle.wait(), self._origin + j)
                if grad is None:
                    continue
                for segment in bucket.segments:
                    self._rule.update(
                        segment.of(bucket.real), segment.state, stale_hyperparams[segment.group], {"grad": segment.of(grad)}
                    )
            if bucket.real is not bucket.weights:
                bucket.weights.copy_(bucket.real)  # the parameters are views of weights: re-laid out next
        self._origin = iteration
        self._relayout(k)

    def _model_arguments(self) -> Dict[str, Any]:
        """The simulator's inputs besides the profiles, as the profile set them."""
        alpha, beta, layer_bytes, step_time = self._link
        return dict(bucket_cap_bytes=int(self.settings.bucket_cap_mb * 1024 * 1024), alpha=alpha, beta=beta,
                    bytes_per_layer=layer_bytes, step_time=step_time, **self._sim_options)

    def _decision_for(self, k: int) -> solver.Decision:
        """The model's prediction for ``k`` (the one the search settled on)."""
        assert self._profiles is not None and self.decision is not None
        return solver.choose_k(self._profiles, tolerance=STALL_TOLERANCE, only_k=k, **self._model_arguments())

    def _predict(self, k: int, slowdown: float) -> float:
        """The model's iteration time for ``k`` with compute slow-down σ = ``slowdown``."""
        assert self._profiles is not None
        arguments = dict(self._model_arguments(), slowdown=slowdown)
        return simulator.simulate(self._profiles, k, record_events=False, **arguments).iteration_time

    # ------------------------------------------------------------------ backward

    def _in_pipeline(self, bucket: Bucket, iteration: int) -> bool:
        return bucket.stale and iteration > self._origin

    def _slot(self, bucket: Bucket, iteration: int) -> int:
        if not self._in_pipeline(bucket, iteration):
            return 0
        assert bucket.grads is not None
        return bucket.grads.index(iteration - self._origin)

    def _on_gradient(self, param: torch.Tensor) -> None:
        if self._accumulating:
            return  # gradient accumulation: p.grad keeps the running sum
        if self._layers is None:
            raise UsageError(
                "sapipe: backward ran before the wrapped model's forward; call model(...) "
                "(the module given to DistributedOptimizer) for the forward pass"
            )
        bucket, i = self._where[id(param)]
        if bucket.ready[i]:
            raise UsageError(
                "sapipe: a parameter received a second gradient before step(). For gradient "
                "accumulation, run every backward but the last inside `with opt.no_sync():`"
            )
        if bucket.num_ready == 0 and bucket.pending_update is not None:
            self._apply_deferred(bucket)  # its gradient buffer is about to be reused
        iteration = self._iteration + 1
        offset, n = bucket.offsets[i], param.numel()
        with torch.no_grad():
            grad = param.grad.reshape(-1)
            for target in self._gradient_targets(bucket, iteration):  # the 2nd read hits cache
                target[offset : offset + n].copy_(grad)
        bucket.ready[i] = True
        bucket.num_ready += 1
        if self._timer is not None:
            self._timer.gradient_released(self._layer_of[id(param)])
        if self.tracer.enabled:
            self._trace_gradient(param, iteration)
        if bucket.num_ready == len(bucket.params):
            self._launch_ready(iteration)

    def _trace_gradient(self, param: torch.Tensor, iteration: int) -> None:
        """A layer's backward span: from the previous release (or forward end) to its last gradient."""
        assert self._layers is not None
        layer = self._layers[self._layer_of[id(param)]]
        pending = self._trace_pending.setdefault((iteration, layer.index), len(layer.params))
        self._trace_pending[(iteration, layer.index)] = pending - 1
        if pending == 1:
            now = time.perf_counter_ns()
            start = max(self._trace_last_release, self._trace_forward_end)
            self.tracer.record("layer_backward_start", at_ns=start, layer=layer.name, iteration=iteration)
            self.tracer.record("layer_backward_end", at_ns=now, layer=layer.name, iteration=iteration)
            self._trace_last_release = now

    def _gradient_targets(self, bucket: Bucket, iteration: int) -> List[torch.Tensor]:
        """Where backward's gradient of ``bucket`` goes: its communication slot, or, when this
        rank's own l_t is kept (wp1, wp3), ``bucket.local`` — and then also the slot, if the
        bucket's parameters are large on average (:func:`_mirrors_local`); else
        :meth:`_launch` copies the whole flat ``local`` into the slot in one call."""
        assert bucket.grads is not None
        slot = bucket.grads.slots[self._slot(bucket, iteration)]
        if self._in_pipeline(bucket, iteration) and bucket.local is not None:
            return [bucket.local, slot] if _mirrors_local(bucket) else [bucket.local]
        return [slot]

    def _launch_ready(self, iteration: int) -> None:
        # Buckets start strictly in index order, so every rank issues the same sequence
        # of collectives whatever order its hooks happen to fire in.
        while self._next_launch < len(self._buckets):
            bucket = self._buckets[self._next_launch]
            if bucket.num_ready < len(bucket.params):
                return
            self._launch(bucket, iteration)
            self._next_launch += 1

    def _launch(self, bucket: Bucket, iteration: int) -> None:
        assert bucket.grads is not None
        slot = self._slot(bucket, iteration)
        buffer = bucket.grads.slots[slot]
        pipelined = self._in_pipeline(bucket, iteration)
        if pipelined and bucket.local is not None and not _mirrors_local(bucket):
            buffer.copy_(bucket.local)  # backward wrote l_t into local only
        backend = self._stale_comm if pipelined else self._sync_comm
        assert backend is not None
        # Priority: the forward index of the bucket's first layer (needed soonest when lowest).
        bucket.grads.in_flight[slot] = backend.start(
            buffer, f"{bucket.describe()} of iteration {iteration}", priority=min(layer.index for layer in bucket.layers)
        )
        if self._timer is not None:
            self._timer.comm_started(bucket.index, bucket.nbytes, bucket.grads.in_flight[slot])

    def _flush(self) -> None:
        """Start the buckets backward did not complete (parameters without gradients).

        Missing gradients count as zero. Starting them here, in index order, keeps the
        collective sequence identical on every rank.
        """
        iteration = self._iteration + 1
        for bucket in self._buckets[self._next_launch :]:
            if bucket.num_ready == 0 and bucket.pending_update is not None:
                self._apply_deferred(bucket)
            targets = self._gradient_targets(bucket, iteration)
            for i, p in enumerate(bucket.params):
                if not bucket.ready[i]:
                    for target in targets:
                        target[bucket.offsets[i] : bucket.offsets[i] + p.numel()].zero_()
                    bucket.ready[i] = True
            bucket.num_ready = len(bucket.params)
        self._launch_ready(iteration)

    # ------------------------------------------------------------------ updates

    def _agree_on_scaling(self, grad_scaler) -> tuple:
        """(finite on every rank, 1 / scale) for this iteration; tells the scaler the verdict."""
        # The private method is the one GradScaler itself uses for optimizers that handle
        # scaling: it records, per device, whether this rank's p.grad holds inf/NaN.
        found = grad_scaler._check_inf_per_device(self)  # noqa: SLF001
        local = max((float(t.item()) for t in found.values()), default=0.0)
        (flag,) = self._agree_on_max([local], "non-finite gradients")
        for tensor in found.values():
            tensor.fill_(flag)  # scaler.update() backs off on every rank or on none
        return flag == 0.0, 1.0 / grad_scaler.get_scale()

    def _unscale(self, grad: torch.Tensor, iteration: int) -> Optional[torch.Tensor]:
        """The summed gradient of ``iteration`` as a mean, unscaled; None if it was not finite."""
        finite, inverse_scale = self._scaling.get(iteration, (True, 1.0))
        if not finite:
            return None
        grad.div_(self._world_size)
        return grad if inverse_scale == 1.0 else grad.mul_(inverse_scale)

    @torch.no_grad()
    def _apply_deferred(self, bucket: Bucket) -> float:
        """x_t = OPT(x_{t-1}, g_t) for a synchronously-behaving bucket, if one is pending.

        Returns the seconds spent waiting for its all-reduce (a stall, for the profiler).
        """
        pending, bucket.pending_update = bucket.pending_update, None
        if pending is None:
            return 0.0
        hyperparams, iteration = pending
        assert bucket.grads is not None and bucket.weights is not None
        handle, bucket.grads.in_flight[0] = bucket.grads.in_flight[0], None
        summed, waited = self._wait(handle)
        grad = self._unscale(summed, iteration)
        if grad is None:  # a step GradScaler skipped
            return waited
        for segment in bucket.segments:
            self._rule.update(segment.of(bucket.weights), segment.state, hyperparams[segment.group], {"grad": segment.of(grad)})
        return waited

    def _wait(self, handle) -> tuple:
        """(the all-reduced buffer of ``handle``, seconds blocked on it), the wait counted."""
        start = time.perf_counter()
        summed = handle.wait()
        waited = time.perf_counter() - start
        self._waited += waited
        self._waited_total += waited
        return summed, waited

    def _stale_hyperparams(self, hyperparams: List[Dict[str, Any]], pipeline_step: int) -> List[Dict[str, Any]]:
        """PipeMare T1: lr / s^{p_t}, p_t = 1 − min(t/K, 1), for staleness s > 1."""
        s, ramp = self.settings.staleness, self.settings.lr_ramp_steps
        if s == 1 or ramp == 0:
            return hyperparams
        divisor = s ** (1.0 - min(pipeline_step / ramp, 1.0))
        return [dict(hp, lr=hp["lr"] / divisor) for hp in hyperparams]

    def _stale_update(self, bucket: Bucket, t: int, hyperparams: List[Dict[str, Any]], iteration: int) -> None:
        """``step()`` of pipeline iteration t (user iteration ``iteration``) for a stale bucket."""
        comp, s = self._compensation, self.settings.staleness
        assert bucket.grads is not None and bucket.weights is not None
        if t == 1:  # the pipeline starts: real weights and history begin at x_0
            bucket.real = bucket.weights.clone() if comp.predicts else bucket.weights
            if comp.history_length:
                bucket.history = WeightHistory(bucket.real, comp.history_length)
        grad = None
        if t > s:
            slot = bucket.grads.index(t - s)
            handle, bucket.grads.in_flight[slot] = bucket.grads.in_flight[slot], None
            grad = self._unscale(self._wait(handle)[0], iteration - s)
        local, prev_local = bucket.local, bucket.prev_local
        if local is not None and self._scaling:
            finite, inverse_scale = self._scaling.get(iteration, (True, 1.0))
            local = local.mul_(inverse_scale) if finite else None
            if prev_local is not None and not self._scaling.get(iteration - 1, (True, 1.0))[0]:
                prev_local = None
        history = bucket.history
        view = StaleStep(
            g=grad, x=bucket.real, local=local, prev_local=prev_local,
            x_oldest=history.oldest() if history else None,
            world_size=self._world_size, lam=self.settings.dc_lambda, form=self.settings.dc_form,
        )
        hyperparams = self._stale_hyperparams(hyperparams, t)
        # x̃_{t+1} = OPT_peek(x_t, g̃); recipes only describe, so g̃ can be known up front
        predictor = comp.prediction_gradient(view) if comp.predicts else None
        if grad is not None:
            # The real update x_t = OPT(x_{t-1}, ĝ), in one pass over memory with what else
            # this step writes: x_t into the history's oldest slot (the Δx reference it reads),
            # and the prediction from the freshly updated weights and state.
            recipe = comp.real_gradient(view)
            for segment in bucket.segments:
                terms = recipe.terms(segment.start, segment.end, segment.lengths)
                if history is not None:
                    terms["hist"] = segment.of(history.oldest())
                if predictor is None:
                    self._rule.update(segment.of(bucket.real), segment.state, hyperparams[segment.group], terms)
                else:
                    self._rule.update_and_peek(
                        segment.of(bucket.real), segment.state, hyperparams[segment.group], terms,
                        predictor.terms(segment.start, segment.end, segment.lengths), out=segment.of(bucket.weights),
                    )
            if history is not None:
                history.advance()  # x_t is in the oldest slot: it becomes the newest
        else:
            if predictor is not None:  # a prediction without an update (wp1/wp2, t = 1)
                assert not predictor.delta_is_step
                for segment in bucket.segments:
                    self._rule.peek(
                        segment.of(bucket.real), segment.state, hyperparams[segment.group],
                        predictor.terms(segment.start, segment.end, segment.lengths), out=segment.of(bucket.weights),
                    )
            if history is not None:
                history.push(bucket.real)  # x_t = x_{t-1} joins; the oldest is dropped
        if comp.predicts and predictor is None:
            bucket.weights.copy_(bucket.real)  # no prediction: x̃_{t+1} = x_t
        if comp.needs_prev_local:
            bucket.local, bucket.prev_local = bucket.prev_local, bucket.local


# ---------------------------------------------------------------------- helpers

#: Mean elements per parameter from which backward writes a kept local gradient into both
#: ``bucket.local`` and the communication slot (a second copy per parameter, its source still in
#: cache) rather than copying the flat ``local`` into the slot at launch (one call, one more read
#: of the bucket). Measured on this project's CPU models: a torch copy call costs ~4 µs, the
#: read it saves ~0.12 ns per float32 element, so the second copy pays from ~32K elements on.
#: On CUDA it never pays: each copy is a kernel launch, and the flat copy's extra read runs at
#: device bandwidth (ResNet-50 on an H100, wp1 at k = m: +8.8% / +6.3% per step with the
#: per-parameter copies, +0.1% / -6.3% with the flat one; benchmarks/RESULTS.md §2).
MIRROR_LOCAL_MIN_MEAN_NUMEL = 32768


def _pair_means(values: List[float]) -> List[float]:
    """Means of consecutive pairs (a lone last value is its own pair)."""
    return [statistics.fmean(values[i : i + 2]) for i in range(0, len(values), 2)]


def _mirrors_local(bucket: Bucket) -> bool:
    return bucket.device.type == "cpu" and bucket.numel >= MIRROR_LOCAL_MIN_MEAN_NUMEL * len(bucket.params)



def per_rank_path(path: str, rank: int, world_size: int) -> str:
    """``{rank}`` in ``path`` replaced by the rank; else ``.rank<r>`` added when world_size > 1."""
    if "{rank}" in path:
        return path.replace("{rank}", str(rank))
    if world_size == 1:
        return path
    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"


def _check_locally(optimizer, model, args):
    """Everything that can be checked without the other ranks; raises SapipeError."""
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"sapipe: optimizer must be a torch.optim.Optimizer instance; got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, DistributedOptimizer):
        raise ConfigurationError("sapipe: the optimizer is already a sapipe.DistributedOptimizer")
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"sapipe: model must be an nn.Module; got {type(model).__name__}")
    if isinstance(model, nn.parallel.DistributedDataParallel):
        raise ConfigurationError("sapipe: pass the plain model, not a DistributedDataParallel wrapper")
    rule = rule_for(optimizer)
    model_params = {id(p) for p in model.parameters()}
    params: List[nn.Parameter] = []
    seen = set()
    for group_index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in model_params:
                raise ConfigurationError(
                    f"sapipe: the optimizer's param group {group_index} holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a parameter of the model"
                )
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    if not params:
        raise ConfigurationError("sapipe: the optimizer holds no trainable parameters of the model")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ConfigurationError(
            f"sapipe: all trainable parameters must share one dtype and device; found {sorted(map(str, kinds))}"
        )
    recorder = LayerRecorder(model, params)
    settings = config.validate(num_layers=recorder.max_layers, **args)
    return rule, params, recorder, settings


def _describe_job(optimizer, model) -> Dict[str, Any]:
    """What must agree across ranks besides the arguments: optimizer and model shapes."""
    try:
        groups = [
            {k: v for k, v in g.items() if k != "params"} | {"shapes": [tuple(p.shape) for p in g["params"]]}
            for g in optimizer.param_groups
        ]
    except Exception:  # noqa: BLE001 - a broken optimizer is reported by local validation
        groups = []
    shapes = [(name, tuple(p.shape), str(p.dtype)) for name, p in model.named_parameters()] if isinstance(model, nn.Module) else []
    return {"optimizer": type(optimizer).__name__, "param_groups": groups, "model_parameters": shapes}


@torch.no_grad()
def _broadcast_from_first_rank(model: nn.Module, group) -> None:
    """Copy rank 0's parameters and buffers to every rank (one collective per dtype)."""
    src = dist.get_global_rank(group, 0)
    tensors = [t for t in list(model.parameters()) + list(model.buffers())]
    by_kind: Dict[tuple, List[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for same in by_kind.values():
        flat = torch.cat([t.detach().reshape(-1) for t in same])
        dist.broadcast(flat, src=src, group=group)
        offset = 0
        for t in same:
            t.copy_(flat[offset : offset + t.numel()].view_as(t))
            offset += t.numel()
