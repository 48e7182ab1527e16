"""What happens in forward: deferred sync updates just before each layer, and its timing.

A sync bucket's update is applied in the forward pre-hook of the bucket's first layer, so
the bucket's all-reduce had the rest of backward and the forward of every earlier layer
to arrive (docs/design.md §5). The same hooks feed the scheduler's profiler and the tracer.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from sapipe.errors import UsageError
from sapipe.layout.layers import Layer
from sapipe.runtime.buffers import BufferBroadcast
from sapipe.runtime.engine import Runtime
from sapipe.runtime.progress import Progress
from sapipe.tracing.timeline import BackwardSpans
from sapipe.tracing.tracer import Tracer


class ForwardHooks:
    """The bodies of the model- and layer-level forward hooks the optimizer registers.

    ``progress`` gives the iteration the forward belongs to; ``profiling(iteration)`` whether
    the scheduler times it (None: nothing profiles); ``buffers``: rank 0's buffers before a
    forward, or None.
    """

    def __init__(
        self,
        runtime: Runtime,
        tracer: Tracer,
        spans: BackwardSpans | None,
        progress: Progress,
        profiling: Callable[[int], bool] | None,
        buffers: BufferBroadcast | None = None,
    ):
        self._runtime = runtime
        self._buffers = buffers
        self._tracer = tracer
        self._spans = spans
        self._progress = progress
        self._profiling = profiling
        self.forward_start: float | None = None  # this iteration's first forward began
        #: some layer ran inside a torch.compile'd region, whose pre-hooks apply nothing at run time
        self.compiled = False
        self._compiled_before = False  # as the current forward began
        self._root_wait = self._root_update = 0.0  # deferred work before the first layer
        self._eager: Any = None  # the "force_eager" stance while it is set (run_eagerly)

    # Under torch.compile (docs/design.md §5.8) dynamo would trace these hooks into the model's
    # graph and guard on sapipe's counters (a recompile every step): the model-level hooks run
    # eagerly (a graph break at each end of the forward), the per-layer ones only when they
    # have work at run time (before_layer).
    @torch.compiler.disable
    def before_model(self, module: nn.Module, args) -> None:
        iteration = self._progress.next_iteration
        if self.forward_start is None:
            self.forward_start = time.perf_counter()
        self._tracer.record("forward_start", iteration=iteration)
        if self._buffers is not None:
            self._buffers.before_forward()
        timer = self._runtime.pipeline.timer
        if timer is not None and self._profiling is not None and self._profiling(iteration):
            timer.begin_iteration()
        if not self._runtime.laid_out:
            return
        self._runtime.settle_restart()  # a resized resume's, now that the model is loaded
        clock = self._runtime.pipeline.clock
        start = clock()
        # A compiled forward runs no per-layer hook (before_layer): every pending update now. So
        # does the first forward after a restore (a new process has seen no compiled forward yet).
        self._compiled_before = self.compiled
        layout = self._runtime.layout
        buckets = layout.buckets if self.compiled or self._runtime.restored else layout.eager
        self._runtime.restored = False
        waited = sum(self._runtime.apply_deferred(bucket) for bucket in buckets)
        # before the first layer, for the profiler: a stall, and update compute that followed it
        self._root_wait, self._root_update = waited, clock() - start - waited
        exposure = self._runtime.exposure
        if exposure is not None:  # waits for all-reduces because the script read p.grad
            self._root_wait, exposure.waited = self._root_wait + exposure.waited, 0.0

    @torch.compiler.disable
    def after_model(self) -> None:
        if self.compiled and not self._compiled_before:
            self._check_first_compiled_forward()
        if self._buffers is not None:
            self._buffers.after_forward()
        if self._runtime.pipeline.timer is not None:
            self._runtime.pipeline.timer.forward_end()
        if self._spans is not None:
            self._spans.forward_ended()

    def hook_layers(self, layers: list[Layer]) -> list[RemovableHandle]:
        """Install the per-layer hooks; the handles, to remove them at ``close()``."""
        handles = []
        for layer in layers:
            # A layer that never runs its own forward is updated when its host starts.
            target = layer.module if layer.executed else layer.host
            if target is not None:
                handles.append(target.register_forward_pre_hook(self.before_layer(layer)))
            if self._tracer.enabled and layer.executed:
                handles.append(layer.module.register_forward_hook(self.after_layer(layer)))
        return handles

    def before_layer(self, layer: Layer) -> Callable[[nn.Module, tuple], None]:
        """The pre-hook of ``layer`` (or of its host, for a layer that never runs its own
        forward)."""
        index = layer.index

        def hook(module: nn.Module, args) -> None:
            if torch.compiler.is_compiling():
                # dynamo traces this branch alone, with no guard on the module or on sapipe's
                # state: the compiled forward goes on through the layer. The flag is a side
                # effect dynamo replays each time the compiled code runs.
                self.compiled = True
                return
            work(module, args)  # eager: every layer, every step

        def work(module: nn.Module, args) -> None:
            bucket = self._runtime.layout.bucket_of_layer.get(index)
            waited = updated = 0.0
            if bucket is not None and self._runtime.updater.pending(bucket):
                clock = self._runtime.pipeline.clock
                start = clock()
                waited = self._runtime.apply_deferred(bucket)
                updated = clock() - start - waited
            timer = self._runtime.pipeline.timer
            if timer is not None:
                if index == 0:
                    waited += self._root_wait
                    updated += self._root_update
                timer.layer_forward(index, waited, updated)
            if self._tracer.enabled:
                self._tracer.record(
                    "layer_forward_start", layer=layer.name, iteration=self._progress.next_iteration
                )

        return hook

    def run_eagerly(self, eager: bool) -> None:
        """Whether the forwards (and backwards) from now on run eagerly, not compiled: while the
        scheduler profiles a compiled model layer by layer, which a compiled forward does not
        time (torch.compile's stance ``"force_eager"`` for that long, process-wide)."""
        if eager and self.compiled and self._eager is None:
            self._eager = torch.compiler.set_stance("force_eager")
        elif not eager and self._eager is not None:
            self._eager.__exit__(None, None, None)  # the stance before it
            self._eager = None

    def _check_first_compiled_forward(self) -> None:
        """The first compiled forward ran after the first step: sync updates deferred to it may
        have been missed, and its result computed from weights that lack them."""
        missed = self._runtime.updater.pending_buckets()
        if missed:
            raise UsageError(
                f"this forward ran compiled layers (torch.compile) while {len(missed)} synchronous "
                "update(s) were still pending, so they used the weights before the last step(). "
                "Compile the "
                "model before the first step(), or call opt.synchronize() before the first "
                "compiled forward"
            )

    def after_layer(self, layer: Layer) -> Callable[[nn.Module, tuple, object], None]:
        def hook(module: nn.Module, args, output) -> None:
            if torch.compiler.is_compiling():
                return  # a compiled forward records its ends only (before_model, after_model)
            self._tracer.record(
                "layer_forward_end", layer=layer.name, iteration=self._progress.next_iteration
            )

        return hook


__all__ = ["ForwardHooks"]
