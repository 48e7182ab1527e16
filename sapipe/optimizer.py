"""``DistributedOptimizer``: staleness-aware data-parallel training behind an optimizer.

The user keeps their model and ``torch.optim`` optimizer, drops DDP, and wraps the
optimizer. From then on (docs/design.md §3, §5):

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

This class is the facade: the public API, the hooks, the order of things in ``step()`` and
the checkpoint. The work is done by its parts: :mod:`sapipe.rendezvous` (agreement between
ranks), :mod:`sapipe.runtime.layout` (layers and buckets), :mod:`sapipe.runtime.pipeline`
(gradients in, all-reduces out), :mod:`sapipe.runtime.updates` (the update rules) and
:mod:`sapipe.auto.controller` (``stale_layers="auto"``).
"""

from __future__ import annotations

import atexit
import contextlib
import warnings
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from sapipe import config, rendezvous
from sapipe.auto import AutoController
from sapipe.comm import failures
from sapipe.errors import ConfigurationError, SapipeError, UsageError
from sapipe.layout.buckets import Bucket
from sapipe.layout.layers import Layer, LayerRecorder
from sapipe.runtime import ForwardHooks, Runtime
from sapipe.runtime.buffers import BufferBroadcast
from sapipe.runtime.progress import Progress
from sapipe.runtime.shutdown import close_at_exit
from sapipe.schedule import solver
from sapipe.state import torch_state
from sapipe.state.resume import CHECKPOINT_FORMAT, check_resumable, resized
from sapipe.tracing.timeline import BackwardSpans, TraceFiles, trace_argument
from sapipe.tracing.tracer import Tracer


class DistributedOptimizer(torch.optim.Optimizer):
    """Wrap ``optimizer`` for partial-staleness data-parallel training of ``model``.

    Args:
        optimizer: any ``torch.optim.Optimizer`` over ``model``'s parameters, state kept (design
        §3.10).
            Its ``param_groups`` are shared with this object (LR schedulers keep working);
            every update uses the hyper-parameters of the step it belongs to.
        model: the plain ``nn.Module`` (not DDP); its first forward defines the layers. It may be
            compiled (``torch.compile(model)``; ``fullgraph=True`` works): sapipe's hooks on the
            compiled module run outside the graph and the layers are named as in ``model``.
            Compiling after wrapping works too (design §5.8).
        process_group: the group to train over (default: the world).
        trace: ``True`` records runtime events in ``opt.tracer``; a path also writes them at
            exit as Chrome traces, ``{rank}`` replaced by the rank (else ``.rank<r>`` added).
            Default: ``$SAPIPE_TRACE`` (1/true: record; a path: also write).

    The other keyword arguments are sapipe's settings (:class:`sapipe.config.Settings`), listed
    below.

    Construction is collective: every rank of ``process_group`` must call it. It checks that
    all ranks were configured identically (else raises on every rank, naming the
    difference) and broadcasts rank 0's parameters and buffers, as DDP does.
    """

    def __init__(
        self,
        optimizer: torch.optim.Optimizer,
        model: nn.Module,
        *,
        stale_layers: int | str = 0,
        compensation: str = "none",
        dc_lambda: float = 0.2,
        dc_form: str = "outer",
        staleness: int = 1,
        warmup_steps: int = 0,
        bucket_cap_mb: float = 25,
        process_group: dist.ProcessGroup | None = None,
        timeout: None | float | timedelta = None,
        lr_ramp_steps: int = 0,
        profile_steps: int = 5,
        backend: str = "torch",
        partition_mb: float = 4.0,
        compression: str | None = None,
        error_feedback: bool | None = None,
        hierarchical: bool | None = None,
        tune_steps: int = 4,
        auto_budget: int | None = 30,
        broadcast_buffers: bool = True,
        expose_gradients: bool = True,
        nonfinite_gradients: str = "warn",
        trace: None | bool | str = None,
    ) -> None:
        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigurationError(
                "torch.distributed is not initialised; call "
                "torch.distributed.init_process_group() (e.g. under torchrun) first"
            )
        arguments = {
            name: value for name, value in locals().items() if name in config.Settings.names()
        }
        group = process_group if process_group is not None else dist.group.WORLD
        rule = params = recorder = settings = local_error = None
        try:
            rule, params, recorder, settings = rendezvous.check_locally(
                optimizer, model, arguments, DistributedOptimizer
            )
        except SapipeError as exc:
            local_error = (
                exc  # reported after the ranks compared notes: raising alone would hang them
            )
        topology = rendezvous.agree(group, arguments, optimizer, model, local_error)
        # agree() raised on every rank unless every rank's local checks passed
        assert rule is not None and params is not None and recorder is not None
        assert settings is not None

        super().__init__(optimizer.param_groups, optimizer.defaults)
        self.param_groups = optimizer.param_groups  # shared, so schedulers see one truth
        self.optimizer = optimizer
        self.model = model
        self.settings: config.Settings = settings
        self._group, self._rank, self._world_size = (
            group,
            dist.get_rank(group),
            dist.get_world_size(group),
        )
        trace = trace_argument(trace)
        self.tracer = Tracer(enabled=bool(trace))
        self._spans = BackwardSpans(self.tracer) if trace else None
        group_of = {id(p): i for i, g in enumerate(optimizer.param_groups) for p in g["params"]}
        self._runtime = Runtime(
            settings, rule, group, self._world_size, self.tracer, group_of, topology
        )
        self._pipeline, self._updater = self._runtime.pipeline, self._runtime.updater
        self._control = rendezvous.ControlChannel(group, settings.timeout, params[0].device)
        self.auto: AutoController | None = (
            AutoController(settings, self._control, self._pipeline, self._runtime, self._rank)
            if settings.auto
            else None
        )
        self._trace_files = TraceFiles(
            self.tracer,
            self._rank,
            self._world_size,
            trace if isinstance(trace, str) else None,
            self.auto,
        )
        if self._trace_files.path:
            atexit.register(self._trace_files.write_files)  # holds the events, not the optimizer
        rendezvous.broadcast_from_first_rank(model, group)
        self._recorder: LayerRecorder | None = recorder
        self._progress = Progress()  # completed step() calls; inside no_sync() or not
        self._closed = False
        self._forward = ForwardHooks(
            self._runtime,
            self.tracer,
            self._spans,
            self._progress,
            self.auto.profiles if self.auto is not None else None,
            BufferBroadcast.of(settings, model, self._control, self._progress),
        )
        self._hooks = [
            model.register_forward_pre_hook(self._forward.before_model),
            model.register_forward_hook(self._after_model_forward),
        ]
        exposure = self._runtime.exposure
        self._pipeline.hook(  # sapipe.runtime.intake: in C++ where the kernels are built
            params,
            self._on_gradient,
            iteration=lambda: self._progress.next_iteration,
            backward_began=exposure.arm if exposure is not None else None,
            per_gradient=self._spans is not None,
        )
        recorder.start()
        close_at_exit(self)  # a job that never calls close() still exits cleanly (design §5.4)
        # an uncaught exception on this rank is named to its peers (sapipe/comm/failures.py)
        failures.install()

    # ------------------------------------------------------------------ public API

    @property
    def laid_out(self) -> bool:
        """Whether the layers are known (the model's first forward has run, or a checkpoint
        was loaded): before, there is nothing pending and no weight is predicted."""
        return self._runtime.laid_out

    @property
    def has_stepped(self) -> bool:
        """Whether ``step()`` has run (:meth:`state_dict` needs one)."""
        return self._progress.completed > 0

    @property
    def stale_layers(self) -> int | str:
        """k: the leading layers (forward order) on stale gradients; "auto" until decided."""
        if self.auto is not None and not self.auto.decided:
            return config.AUTO
        return self._k

    @property
    def _k(self) -> int:
        if self._runtime.laid_out:
            return self._runtime.layout.k
        k = self.settings.stale_layers
        return k if isinstance(k, int) else 0  # "auto" trains synchronously until it decides

    @property
    def num_layers(self) -> int:
        """m: layers (modules owning trainable parameters); exact after the first forward."""
        if self._runtime.laid_out:
            return len(self._runtime.layout.layers)
        assert self._recorder is not None
        return self._recorder.max_layers

    @property
    def layers(self) -> list[Layer]:
        """The layers in forward-execution order (available after the first forward)."""
        if not self._runtime.laid_out:
            raise UsageError("the layer order is known only after the model's first forward")
        return list(self._runtime.layout.layers)

    @property
    def buckets(self) -> list[Bucket]:
        """Communication buckets in launch order (reverse forward order)."""
        return list(self._runtime.buckets)

    @property
    def communication_wait(self) -> float:
        """Seconds this rank has spent blocked on gradient all-reduces since construction.

        This is the communication the pipeline did not hide, as the host saw it: sample it
        around a span of iterations to tell a step that waits for the network from one whose
        compute ran slow. On CUDA with NCCL the host does not block (the device does), so
        there it counts only what ``wait()`` blocked on the host.
        """
        return self._pipeline.waited_total

    @property
    def decision(self) -> solver.Decision | None:
        """With ``"auto"``: the scheduler's decision (its prediction for the chosen k), once
        made."""
        return self.auto.decision if self.auto is not None else None

    @property
    def compensation_choice(self) -> dict[str, Any] | None:
        """With ``compensation="auto"``: whether the probe has decided and, per stale bucket
        (named by its layers), the prediction it runs and each candidate's summed squared
        prediction error relative to ``none``'s (below 1: it predicted the next real weights
        better than the current ones did). None for a fixed compensation."""
        choice = self._runtime.updater.choice
        if choice is None:
            return None
        names = {
            bucket.index: "+".join(layer.name for layer in bucket.layers)
            for bucket in (self._runtime.buckets if self._runtime.laid_out else [])
        }
        return choice.report(names)

    def save_profile(self, path: str) -> None:
        """With ``stale_layers="auto"``, once k is decided: write what the scheduler measured and
        chose
        (JSON), for ``python -m sapipe.schedule.predict`` at other scales
        (:mod:`sapipe.schedule.saved_profile`)."""
        if self.auto is None:
            raise UsageError("save_profile() needs stale_layers='auto': a fixed k profiles nothing")
        self.auto.saved_profile().save(path)

    @property
    def rank(self) -> int:
        """This process's rank in :attr:`process_group`."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The number of ranks in :attr:`process_group`."""
        return self._world_size

    @property
    def process_group(self) -> dist.ProcessGroup | None:
        """The group this optimizer trains over (None after :meth:`close`)."""
        return self._group

    @property
    def update_path(self) -> str:
        """ "fused" (sapipe's kernels) or "generic" (the wrapped optimizer's own step()); design
        §3.10."""
        return self._updater.rule.path

    _step_supports_amp_scaling = (
        True  # GradScaler hands itself to step() instead of unscaling p.grad
    )

    def step(self, closure: Callable[[], Any] | None = None, grad_scaler: Any = None) -> Any:
        """End the iteration: stale layers update now, sync layers before their next forward.

        With a ``closure`` (as ``torch.optim`` defines it, and as Lightning calls it), the
        closure runs first, with gradients enabled: it computes the loss and calls
        ``backward()`` (after ``zero_grad()``, if it wants one), and its loss is returned. The
        step is then the same as after a loop's own forward and backward. The closure is
        evaluated once: optimizers that evaluate it several times per step (LBFGS) are refused
        at construction.

        With ``torch.amp.GradScaler``, call ``scaler.step(opt)`` as usual: the scaler passes
        itself here. Whether this iteration's gradients are finite is decided over *all*
        ranks (and written back into the scaler, so every rank's scale evolves alike); the
        iteration's gradients are later unscaled with its own scale, or, if not finite,
        dropped wherever they would be used — now, at a deferred update, or one
        ``staleness`` later — without disturbing the staleness pipeline.

        With no backward since the last step and no ``p.grad`` held it does nothing, as
        ``torch.optim``'s
        step does (DDP's sends nothing): one rank's extra step leaves every rank's collectives in
        line.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._step(grad_scaler)
        return loss

    @torch.no_grad()
    def _step(self, grad_scaler: Any) -> None:
        if not self._runtime.laid_out:
            raise UsageError("step() was called before the model's first forward and backward")
        if self._runtime.nothing_to_step():
            return
        iteration = self._progress.next_iteration
        hyperparams = [self._updater.rule.hyperparams(g) for g in self.param_groups]
        if not self._updater.allocated:
            self._runtime.allocate()
        self.tracer.record("step_start", iteration=iteration)
        self._runtime.take_gradients(iteration, grad_scaler, self, self._control)
        self._runtime.end_step(iteration, hyperparams, self._control)
        self._progress.completed = iteration
        # What an LR scheduler built on the wrapped optimizer checks to tell that its step()
        # ran (torch.optim.lr_scheduler warns otherwise). torch has no public API for it: its
        # own wrapper of step() sets this attribute; tests/unit/test_torch_internals.py fails
        # loudly if torch stops reading it.
        setattr(self.optimizer, "_opt_called", True)  # noqa: B010 - not an attribute of Optimizer's type
        if self.auto is not None:
            self.auto.end_step(iteration, hyperparams, self._forward.forward_start)
            # a compiled model is profiled layer by layer in eager iterations
            self._forward.run_eagerly(self.auto.profiles(iteration + 1))
        self._pipeline.end_iteration()
        self._forward.forward_start = None
        self.tracer.record("step_end", iteration=iteration)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """As ``torch.optim.Optimizer.zero_grad``. With ``set_to_none=False`` the gradients stay
        the views of sapipe's buckets that ``p.grad`` shows, zeroed, and backward accumulates
        into them in place, with no copy (DDP's ``gradient_as_bucket_view``); a synchronous
        layer's deferred update is applied first, since zeroing overwrites the gradient it
        applies."""
        if not set_to_none and self._runtime.exposure is not None:
            self._runtime.exposure.settle_pending()
        super().zero_grad(set_to_none)

    @torch.no_grad()
    def synchronize(self) -> None:
        """Apply every pending (deferred) synchronous update now.

        Use before evaluating or saving the model outside the training loop. Stale
        gradients still in flight stay pending: applying them is the next ``step()``'s job.
        """
        self._runtime.synchronize()

    def wait_for_communication(self) -> None:
        """Block until every all-reduce this optimizer has in flight has arrived.

        Nothing is applied: each result stays pending for the step (or the deferred update)
        that consumes it. Useful before timing something else on the same link.
        """
        self._pipeline.wait_for_communication()

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient this step applies, all of ``p.grad`` as one vector, to ``max_norm``;
        return its total norm before clipping (FSDP's convention). Between backward and step();
        equals ``torch.nn.utils.clip_grad_norm_`` over the model's parameters (design §3.11)."""
        self._runtime.check_exposed(self._progress.next_iteration, "opt.clip_grad_norm_()")
        params = [p for group in self.param_groups for p in group["params"]]
        return torch.nn.utils.clip_grad_norm_(params, max_norm, norm_type)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Gradient accumulation, as with DDP: backward passes inside the block only
        accumulate into ``p.grad``; the first backward outside it communicates the sum.

        ``for micro in batches[:-1]: with opt.no_sync(): loss(micro).backward()`` then
        ``loss(batches[-1]).backward(); opt.step()``.
        """
        intake = self._pipeline.intake
        assert intake is not None
        previous, self._progress.accumulating = self._progress.accumulating, True
        intake.paused = True  # its hooks do nothing: p.grad accumulates
        try:
            yield
        finally:
            self._progress.accumulating = intake.paused = previous

    @contextlib.contextmanager
    def real_weights(self) -> Iterator[nn.Module]:
        """Within the block, the model holds the real weights x (not WP's predicted x̃).

        Pending synchronous updates are applied first, so the model is exactly x_t.
        """
        self.synchronize()
        predicted = self._updater.swap_in_real_weights()
        try:
            yield self.model
        finally:
            self._updater.swap_back(predicted)

    def finish(self) -> None:
        """End training and leave the model as training made it, then :meth:`close`: every
        pending synchronous update applied, and under weight prediction the real weights (not
        the predicted ones) put in the model for good. The stale gradients still in flight are
        not applied, as with :meth:`close`. For framework integrations and scripts that keep
        using the model after training (evaluation, export). Collective; idempotent."""
        if self._closed:
            return
        if self._runtime.laid_out:
            self.synchronize()
            self._updater.swap_in_real_weights()  # kept: the model holds x from now on
        self.close()

    def close(self) -> None:
        """Finish cleanly: wait for every collective in flight (the last stale all-reduce is never
        consumed), remove sapipe's hooks and destroy the process groups sapipe created. The model
        keeps
        its weights (under weight prediction the predicted ones: close outside ``real_weights()``).
        Collective: every rank calls it. Idempotent; run at exit if the job did not (design
        §5.4)."""
        if self._closed:
            return
        self._closed = True
        self._forward.run_eagerly(False)
        try:
            # raises, after releasing everything, if a wait failed (a dead peer)
            self._runtime.close()
        finally:
            for hook in self._hooks:
                hook.remove()
            self._hooks.clear()
            self._pipeline.unhook()
            if self._recorder is not None:
                self._recorder.finish()
                self._recorder = None
            self._control.close()
            # The job's own group too: held here, one the job destroyed would keep its Gloo threads
            # until this object is collected, typically during finalisation (design §5.4).
            self._group = None

    def write_trace(self, path: str, predicted: bool = False) -> None:
        """Write the recorded events (or, ``predicted=True``, the scheduler's simulated
        iteration at the chosen k) as a Chrome trace JSON, viewable in Perfetto."""
        self._trace_files.write(path, predicted)

    def write_trace_files(self) -> None:
        """Write this rank's trace (and auto's prediction) to the ``trace`` path given at
        construction; done at exit by itself."""
        self._trace_files.write_files()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Refused once wrapped (:class:`~sapipe.errors.UsageError`): the buckets are laid out over
        the param groups given at construction; add groups to the optimizer before wrapping it."""
        if hasattr(self, "_updater"):  # construction done: buckets are laid out
            raise UsageError("add param groups to the optimizer before wrapping it")
        super().add_param_group(param_group)

    def __repr__(self) -> str:
        return (
            f"sapipe.DistributedOptimizer({type(self.optimizer).__name__}, "
            f"stale_layers={self.stale_layers!r}, "
            f"compensation={self.settings.compensation!r}, staleness={self.settings.staleness}, "
            f"world_size={self._world_size})"
        )

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue bit-exactly: in-flight and pending gradients (their
        all-reduces are waited for), optimizer state, real vs predicted weights, Δx history,
        step counters and the scheduler's k. Save it with ``model.state_dict()``, per rank
        (see :func:`sapipe.save_checkpoint`), between ``step()`` and the next forward.
        """
        if self._progress.completed == 0:
            raise UsageError("nothing to checkpoint before the first step()")
        if self._pipeline.in_backward:
            raise UsageError("checkpoint between step() and the next forward, not during backward")
        auto = (
            self.auto.state_dict() if self.auto is not None else {"decided": False, "search": None}
        )
        return {
            "format": CHECKPOINT_FORMAT,
            "rank": self._rank,
            "world_size": self._world_size,
            "settings": self._settings_fingerprint(),
            "iteration": self._progress.completed,
            **auto,
            **self._runtime.checkpoint(),
            "param_groups": [
                {k: v for k, v in g.items() if k != "params"} for g in self.param_groups
            ],
        }

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (this rank's) into a freshly constructed optimizer.

        Refuses, naming the difference, a checkpoint of another rank or configuration. A
        checkpoint of a job of another world size (an elastic restart) is continued from the
        real weights and the optimizer state: the averaged stale gradients in flight are applied
        as plain updates and the pipeline starts anew, with a warning. Load before the first
        forward of the resumed job (or any time between ``step()`` and the next forward).
        """
        if (
            "format" not in state_dict and "param_groups" in state_dict
        ):  # a plain torch.optim state dict
            self._updater.rule = torch_state.load(
                self.optimizer, state_dict, stepped=self._progress.completed > 0
            )
            return
        state = state_dict
        other_world = check_resumable(
            state, self._rank, self._world_size, self._settings_fingerprint()
        )
        if other_world:
            state = resized(state)
        if self._pipeline.in_backward:
            raise UsageError(
                "load a checkpoint between step() and the next forward, not during backward"
            )
        if not self._runtime.laid_out:
            self._build_layout(state["order"], k=state["k"])
        self._runtime.restore(state)  # refuses before changing anything
        if self.auto is not None:
            self.auto.load_state_dict({"decided": state["decided"], "search": state["search"]})
        for group, saved in zip(self.param_groups, state["param_groups"]):
            group.update(saved)
        self._progress.completed = state["iteration"]
        if other_world:
            self._restart_for(state["world_size"])

    def _restart_for(self, saved_world: int) -> None:
        """After loading a checkpoint of ``saved_world`` ranks into this job of another size:
        the averaged stale gradients in flight are applied as plain updates, the real weights
        put in the model, and the pipeline starts anew from here (a pipeline restart,
        docs/design.md §3.7), before the next forward."""
        iteration = self._progress.completed
        hyperparams = [self._updater.rule.hyperparams(g) for g in self.param_groups]
        # "auto" mid-search: the trials timed the other job; k is the best they measured
        k = self.auto.end_search_for_resize(iteration) if self.auto is not None else None
        # at the next forward (or synchronize()): the script may load the model's weights
        # after this, and the restart must start from them
        self._runtime.restart_before_next_forward(iteration, hyperparams, k)
        warnings.warn(
            f"sapipe: resumed a checkpoint of a job of {saved_world} ranks on {self._world_size}: "
            f"the stale gradients in flight at iteration {iteration} were applied as plain "
            "updates and the pipeline starts anew, as at the end of warm-up; this rank's "
            "error-feedback residuals were dropped",
            stacklevel=3,
        )

    def torch_state_dict(self) -> dict[str, Any]:
        """The wrapped optimizer's plain ``state_dict()`` of the real weights, for it under DDP
        (pending sync
        updates applied first; stale gradients in flight are not in it). Reverse:
        :meth:`load_state_dict`."""
        self.synchronize()
        fused: dict = {}
        for bucket in self._runtime.buckets:
            fused.update(self._updater.export_state(bucket))
        return torch_state.export(self.optimizer, fused)

    def _settings_fingerprint(self) -> dict[str, str]:
        return dict(
            self.settings.resume_fingerprint(),
            **config.describe({"optimizer": type(self.optimizer).__name__}),
        )

    # ------------------------------------------------------------------ hooks

    # eagerly under torch.compile, as the other forward hooks (runtime/forward.py)
    @torch.compiler.disable
    def _after_model_forward(self, module: nn.Module, args, output) -> None:
        if not self._runtime.laid_out:
            self._build_layout()
        self._forward.after_model()

    def _build_layout(self, order: list[str] | None = None, k: int | None = None) -> None:
        """After the first forward (rank 0's order, so a layer unused on some rank cannot split the
        layouts) or from a checkpoint's ``order``: fix the layer order, hook the layers, lay out
        buckets."""
        assert self._recorder is not None
        layers = self._recorder.finish(
            order or self._control.from_first_rank(self._recorder.executed(), "layer order")
        )
        k = self._k if k is None else k
        if k > len(layers):
            raise ConfigurationError(
                f"stale_layers={k} exceeds the model's {len(layers)} layers "
                "(modules owning trainable parameters not tied to an earlier layer)"
            )
        self._forward.compiled = self._recorder.compiled
        self._recorder = None
        self._hooks += self._forward.hook_layers(layers)
        self._runtime.lay_out(layers, k)
        if self.auto is not None:
            self.auto.start_profiling(layers)

    def _on_gradient(self, param: torch.Tensor) -> None:
        if self._progress.accumulating:
            return  # gradient accumulation: p.grad keeps the running sum
        if not self._runtime.laid_out:
            raise UsageError(
                "backward ran before the wrapped model's forward; call model(...) "
                "(the module given to DistributedOptimizer) for the forward pass"
            )
        layout = self._runtime.layout
        iteration = self._progress.next_iteration
        self._pipeline.take(param, iteration)
        if self._runtime.exposure is not None:
            self._runtime.exposure.arm(iteration)
        if self._spans is not None:
            self._spans.gradient_arrived(layout.layers[layout.layer_of[id(param)]], iteration)


DistributedOptimizer.__doc__ = (DistributedOptimizer.__doc__ or "") + config.settings_help(indent=4)

__all__ = ["CHECKPOINT_FORMAT", "DistributedOptimizer"]
