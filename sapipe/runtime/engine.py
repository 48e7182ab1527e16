"""The runtime as one object: the gradient pipeline and the updates over the current layout.

:class:`Runtime` is what :class:`sapipe.DistributedOptimizer` drives at each ``step()`` and
what the scheduler's controller changes between iterations (``relayout``, ``restart``).
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from sapipe import comm
from sapipe.comm import hierarchical
from sapipe.comm.topology import Topology
from sapipe.config import Settings
from sapipe.errors import ConfigurationError, UsageError
from sapipe.layout.buckets import Bucket
from sapipe.layout.layers import Layer
from sapipe.optim import compensation
from sapipe.optim.fused import OptimizerRule
from sapipe.runtime.exposure import GradientExposure
from sapipe.runtime.gradients import CompressedSums, GradientBuffers
from sapipe.runtime.layout import Layout
from sapipe.runtime.nonfinite import NonFiniteGradients
from sapipe.runtime.pipeline import GradientPipeline
from sapipe.runtime.scaling import LossScaling
from sapipe.runtime.step_guards import require_scaler_in_step, require_shared_groups
from sapipe.runtime.updates import Updater
from sapipe.tracing.tracer import Tracer


class Runtime:
    """Buckets, their communication and their updates, for ``k`` stale layers at a time."""

    def __init__(
        self,
        settings: Settings,
        rule: OptimizerRule,
        group,
        world_size: int,
        tracer: Tracer,
        group_of: dict[int, int],
        topology: Topology | None = None,
    ):
        self._settings = settings
        self._group_of = group_of
        self.job_topology = topology  # which ranks share a node (None: not learnt)
        #: the nodes a hierarchical sum spans (None: flat sums); raises when hierarchical=True
        #: cannot be met
        self.topology = (
            topology
            if topology is not None
            and hierarchical.resolve(settings.hierarchical, settings.backend, topology)
            else None
        )
        compression = settings.wire_compression
        #: how buckets are compressed (None: they are not); the scheduler times the same codec
        self.compression = (
            None
            if compression is None
            else CompressedSums(
                compression,
                world_size,
                comm.compression_partition(settings.backend, settings.partition_bytes),
                node_size=self.topology.local_size if self.topology is not None else 1,
            )
        )
        #: NaN or inf in a rank's own gradient, reported once (nonfinite_gradients=)
        self.nonfinite = NonFiniteGradients(
            settings.nonfinite_gradients, dist.get_rank(group), world_size
        )
        chosen = compensation.resolve(settings.compensation).for_staleness(settings.staleness)
        buffers = GradientBuffers(
            settings.staleness,
            keep_local=chosen.needs_local,
            keep_prev_local=chosen.needs_prev_local,
            compression=self.compression,
            verdicts=self.nonfinite.verdicts,
        )
        self.pipeline = GradientPipeline(
            settings,
            group,
            world_size,
            tracer,
            buffers,
            before_reuse=self.apply_deferred,
            topology=self.topology,
            nonfinite=self.nonfinite if self.nonfinite.verdicts else None,
        )
        #: the GradScaler's verdicts, agreed over the ranks
        self.scaling = LossScaling(settings.staleness)
        self.exposure = (
            GradientExposure(
                self.pipeline, settings.staleness, self.scaling, apply_pending=self.apply_deferred
            )
            if settings.expose_gradients
            else None
        )
        self.updater = Updater(
            rule, chosen, settings, world_size, self.pipeline, self.scaling, self.exposure
        )
        self._layout: Layout | None = None
        #: (iteration, hyper-parameters, k: None for the current one) of a restart a resized
        #: resume owes (synchronize)
        self._restart_owed: tuple[int, list[dict[str, Any]], int | None] | None = None
        #: a checkpoint was restored since the last forward: that forward applies every pending
        #: update before the model runs, since it cannot know yet whether the model is compiled
        self.restored = False

    @property
    def laid_out(self) -> bool:
        """Whether the layers are known and laid out (the first forward has run)."""
        return self._layout is not None

    @property
    def layout(self) -> Layout:
        assert self._layout is not None, "the layout is built at the first forward"
        return self._layout

    @property
    def buckets(self) -> list[Bucket]:
        return self._layout.buckets if self._layout is not None else []

    def lay_out(self, layers: list[Layer], k: int) -> None:
        """The first layout, once the layer order is known."""
        self._use(Layout(layers, k, self._settings.bucket_cap_bytes, self._group_of))
        self.nonfinite.start(layers[0].params[0].device)

    def _use(self, layout: Layout, allocate: bool = False) -> None:
        """``layout`` becomes the job's: each part moves its per-bucket state over to it (the
        updater's once it exists, from the first ``step()`` on, or when ``allocate``)."""
        self.pipeline.lay_out(layout)
        if allocate or self.updater.allocated:
            self.updater.lay_out(layout)
        self._layout = layout

    def allocate(self) -> None:
        """The first ``step()``: flat weights and optimizer state for the current layout."""
        self.updater.lay_out(self.layout)

    def apply_deferred(self, bucket: Bucket) -> float:
        """The bucket's pending synchronous update, if any; seconds waited for its all-reduce."""
        return self.updater.apply_deferred(bucket)

    def synchronize(self) -> None:
        """Every pending update applied (a restart owed to a resized resume first)."""
        self.settle_restart()
        for bucket in self.buckets:
            self.apply_deferred(bucket)

    def settle_restart(self) -> None:
        """The restart a resized resume owes, if any (:meth:`restart_before_next_forward`)."""
        if self._restart_owed is not None:
            iteration, hyperparams, k = self._restart_owed
            self._restart_owed = None
            self.restart(self.layout.k if k is None else k, iteration, hyperparams)

    def restart_before_next_forward(
        self, iteration: int, hyperparams: list[dict[str, Any]], k: int | None = None
    ) -> None:
        """A checkpoint of another world size was restored: the pipeline restarts after
        ``iteration`` (:meth:`restart`), with ``k`` stale layers (None: as many as now), before
        the next forward or :meth:`synchronize`, once the script has loaded the model's
        weights too, in whichever order."""
        self._restart_owed = (iteration, hyperparams, k)

    def nothing_to_step(self) -> bool:
        """Whether ``step()`` has nothing to sum or apply on this rank: no backward since the
        last one, and no parameter holds a gradient (a step then starts no collective)."""
        return not self.pipeline.in_backward and all(
            p.grad is None for b in self.buckets for p in b.params
        )

    def take_gradients(self, iteration: int, grad_scaler, optimizer, control) -> None:
        """``step()``'s first part: every gradient of ``iteration`` on its way, and what the step
        applies settled: as ``p.grad`` holds it (exposed), or as backward handed it over. Then
        the first non-finite gradient of an earlier iteration is reported (or raised), once."""
        require_shared_groups(optimizer)
        if grad_scaler is None:
            require_scaler_in_step(optimizer)
        if self.exposure is None:
            self.pipeline.check_gradients_untouched()
            self.pipeline.flush(iteration)
            if grad_scaler is not None:
                self.scaling.agree_on_scaling(iteration, grad_scaler, optimizer, control)
        else:
            self.exposure.expose(iteration)  # done already when backward ended
            if grad_scaler is not None:
                self.exposure.scaler = grad_scaler
                self.scaling.judge_exposed(
                    iteration, grad_scaler, optimizer, control, self.exposure.prepared
                )
            self.exposure.collect()
        self.nonfinite.check(iteration, grad_scaler is not None, self.scaling.verdicts, control)

    def check_exposed(self, iteration: int, what: str) -> None:
        """Raise unless ``p.grad`` holds the averaged gradients of ``iteration`` (its backward
        ended)."""
        if self.exposure is None:
            raise UsageError(
                f"{what} needs p.grad to hold the averaged gradient; construct the "
                "optimizer with expose_gradients=True (the default)"
            )
        self.exposure.check_exposed(iteration, what)

    def end_step(self, iteration: int, hyperparams: list[dict[str, Any]], control=None) -> None:
        """``step()``'s updates: stale buckets now; sync buckets deferred to their next forward,
        unless the script read their exposed ``p.grad`` (its all-reduce has arrived: applied
        now). With ``compensation="auto"``, the probe's agreement over ``control`` when due."""
        pipeline_step = iteration - self.pipeline.origin
        exposure = self.exposure
        for bucket in self.buckets:
            if bucket.stale and pipeline_step >= 1:
                self.updater.stale_update(bucket, pipeline_step, hyperparams, iteration)
                self.pipeline.gradients(bucket).rotate_local()  # l_t read: it becomes l_{t-1}
            else:
                self.updater.defer(bucket, hyperparams, iteration)
                if exposure is not None and not exposure.defers(bucket):
                    self.apply_deferred(bucket)
        if exposure is not None:
            exposure.end_step()
        choice = self.updater.choice
        if choice is not None and control is not None and pipeline_step >= 1:
            choice.end_step(control)

    @property
    def syncs_at_step(self) -> bool:
        """Whether the sync updates ran in the last ``step()`` (its script read ``p.grad``), not
        at their next forward: the timeline the scheduler must model."""
        return self.exposure is not None and self.exposure.read_before_step

    def relayout(self, k: int) -> None:
        """Buckets and optimizer state for ``k`` stale layers; every pending update applied
        first."""
        self.synchronize()  # every pending update uses the old layout's buffers
        if self.exposure is not None:
            self.exposure.reset()  # nothing exposed refers to the new buckets
        self._use(self.layout.relaid(k))

    def restart(self, k: int, iteration: int, hyperparams: list[dict[str, Any]]) -> None:
        """Back to the synchronous state after ``iteration``, then the pipeline anew with k stale
        layers.

        The stale gradients still in flight are applied now, oldest first, as plain updates,
        and the weights the model holds become the real ones: the state at the end of
        warm-up, from which the pipeline starts exactly as it did then.
        """
        origin = self.pipeline.origin
        for bucket in self.buckets:
            if self.pipeline.in_pipeline(bucket, iteration):
                self.updater.drain_stale(bucket, iteration - origin, hyperparams, origin)
        self.pipeline.origin = iteration
        self.relayout(k)

    def close(self) -> None:
        """Wait for what is in flight and release the back-ends (raising the first failure
        after); the deferred updates are dropped with their gradients."""
        try:
            self.pipeline.close()
        finally:
            self.updater.discard_pending()
            if self.exposure is not None:  # a p.grad read later waits for nothing
                self.exposure.reset()

    def checkpoint(self) -> dict[str, Any]:
        """The runtime's part of a checkpoint: k, the pipeline's start, the layer order, every
        bucket (in-flight gradients waited for), the GradScaler agreements."""
        layers = self.layout.layers
        return {
            "k": self.layout.k,
            "pipeline_origin": self.pipeline.origin,
            "order": [layer.name for layer in layers if layer.executed],
            "layers": [layer.name for layer in layers],
            "buckets": [
                {
                    "layers": [layer.name for layer in bucket.layers],
                    "stale": bucket.stale,
                    **self.pipeline.gradients(bucket).state_dict(),
                    **self.updater.state_dict(bucket),
                }
                for bucket in self.buckets
            ],
            "scaling": self.scaling.state_dict(),
            **(
                {"prediction_choice": self.updater.choice.state_dict()}
                if self.updater.choice is not None
                else {}
            ),
        }

    def restore(self, state: dict[str, Any]) -> None:
        """What :meth:`checkpoint` saved, into this layout (its layers already in the saved order).
        Where this job has stepped already, its optimizer state moves over before the
        checkpoint's overwrites it (a checkpoint may be loaded mid-training)."""
        layout = self._checked_layout(state)
        self.pipeline.origin = state["pipeline_origin"]
        self.scaling.load_state_dict(state["scaling"])
        self._restore_buckets(layout, state["buckets"])
        if self.updater.choice is not None and "prediction_choice" in state:
            self.updater.choice.load_state_dict(state["prediction_choice"])
        self.nonfinite.start(layout.layers[0].params[0].device, next_check=state["iteration"] + 1)
        self.pipeline.end_iteration()
        if self.exposure is not None:
            self.exposure.reset()
        self.restored = (
            True  # the next forward applies every pending update first (runtime/forward.py)
        )

    def _checked_layout(self, state: dict[str, Any]) -> Layout:
        """This job's layers laid out for the checkpoint's k, once every saved bucket is known to
        fit it (layers, param groups, update path, residuals); else an error naming why, before
        anything of this job has changed."""
        if [layer.name for layer in self.layout.layers] != state["layers"]:
            raise ConfigurationError("the checkpoint's layer order differs from this model's")
        layout = self.layout.relaid(state["k"])
        if [[layer.name for layer in b.layers] for b in layout.buckets] != [
            b["layers"] for b in state["buckets"]
        ]:
            raise ConfigurationError(
                "the checkpoint's bucket layout differs (bucket_cap_mb or model changed)"
            )
        for bucket, saved in zip(layout.buckets, state["buckets"]):
            self.updater.check_state_dict(bucket, saved)
            self.pipeline.check_state_dict(bucket, saved)
        return layout

    def _restore_buckets(self, layout: Layout, saved_buckets: list[dict[str, Any]]) -> None:
        """A checkpoint's buckets (see :meth:`checkpoint`) into ``layout``, which becomes the
        job's."""
        self._use(layout, allocate=True)
        for bucket, saved in zip(layout.buckets, saved_buckets):
            self.pipeline.gradients(bucket).load_state_dict(saved)
            self.updater.load_state_dict(bucket, saved)


__all__ = ["Runtime"]
