"""The runtime as one object: the gradient pipeline and the updates over the current layout.

:class:`Runtime` is what :class:`sapipe.DistributedOptimizer` drives at each ``step()`` and
what the scheduler's controller changes between iterations (``relayout``, ``restart``).
"""
from __future__ import annotations

from typing import Any, Dict, List

import torch

from ..buckets import Bucket
from ..compensation import MODES
from ..config import Settings
from ..errors import ConfigurationError
from ..layers import Layer
from ..optim_math import OptimizerRule
from ..trace import Tracer
from .layout import Layout
from .pipeline import GradientPipeline
from .updates import Updater


class Runtime:
    """Buckets, their communication and their updates, for ``k`` stale layers at a time."""

    def __init__(self, settings: Settings, rule: OptimizerRule, group, world_size: int, tracer: Tracer,
                 group_of: Dict[int, int]):
        self._settings = settings
        self._group_of = group_of
        self.pipeline = GradientPipeline(settings, group, tracer, before_reuse=self.apply_deferred)
        self.updater = Updater(rule, MODES[settings.compensation](settings.staleness), settings,
                               world_size, self.pipeline)

    @property
    def layout(self) -> Layout:
        assert self.pipeline.layout is not None, "the layout is built at the first forward"
        return self.pipeline.layout

    def lay_out(self, layers: List[Layer], k: int) -> None:
        """The first layout, once the layer order is known."""
        s = self._settings
        self.pipeline.layout = Layout(layers, k, s.bucket_cap_bytes, self._group_of, s.staleness,
                                      self.updater.compensation)

    def apply_deferred(self, bucket: Bucket) -> float:
        """The bucket's pending synchronous update, if any; seconds waited for its all-reduce."""
        return self.updater.apply_deferred(bucket)

    def synchronize(self) -> None:
        for bucket in self.pipeline.buckets:
            self.apply_deferred(bucket)

    def end_step(self, iteration: int, hyperparams: List[Dict[str, Any]]) -> None:
        """``step()``'s updates: stale buckets now, sync buckets deferred to their next forward."""
        pipeline_step = iteration - self.pipeline.origin
        for bucket in self.pipeline.buckets:
            if bucket.stale and pipeline_step >= 1:
                self.updater.stale_update(bucket, pipeline_step, hyperparams, iteration)
            else:
                bucket.pending_update = (hyperparams, iteration)

    def relayout(self, k: int) -> None:
        """Buckets and optimizer state for ``k`` stale layers; every pending update applied first."""
        self.synchronize()  # every pending update uses the old layout's buffers
        previous = self.layout
        self.pipeline.layout = previous.relaid(k)
        self.pipeline.layout.allocate_state(self.updater.rule, previous)

    def restart(self, k: int, iteration: int, hyperparams: List[Dict[str, Any]]) -> None:
        """Back to the synchronous state after ``iteration``, then the pipeline anew with k stale layers.

        The stale gradients still in flight are applied now, oldest first, as plain updates,
        and the weights the model holds become the real ones: the state at the end of
        warm-up, from which the pipeline starts exactly as it did then.
        """
        origin = self.pipeline.origin
        for bucket in self.pipeline.buckets:
            if self.pipeline.in_pipeline(bucket, iteration):
                self.updater.drain_stale(bucket, iteration - origin, hyperparams, origin)
        self.pipeline.origin = iteration
        self.relayout(k)

    def restore(self, k: int, saved_buckets: List[Dict[str, Any]], state_allocated: bool) -> None:
        """A checkpoint's buckets (see ``Bucket.state_dict``), laid out for its ``k``.

        ``state_allocated``: this job has stepped already, so its optimizer state moves over
        before the checkpoint's overwrites it (a checkpoint may be loaded mid-training).
        """
        previous = self.layout if state_allocated else None
        self.pipeline.layout = self.layout.relaid(k)
        self.layout.allocate_state(self.updater.rule, previous)
        if [[layer.name for layer in b.layers] for b in self.layout.buckets] != [b["layers"] for b in saved_buckets]:
            raise ConfigurationError("sapipe: the checkpoint's bucket layout differs (bucket_cap_mb or model changed)")
        for bucket, saved in zip(self.layout.buckets, saved_buckets):
            bucket.load_state_dict(saved)

    @torch.no_grad()
    def swap_in_real_weights(self) -> List[tuple]:
        """Under weight prediction, put the real weights into the model; what to swap back."""
        predicted = [(b, b.weights.clone()) for b in self.pipeline.buckets if b.real is not None and b.real is not b.weights]
        for bucket, _ in predicted:
            bucket.weights.copy_(bucket.real)
        return predicted

    @staticmethod
    @torch.no_grad()
    def swap_back(predicted: List[tuple]) -> None:
        for bucket, saved in predicted:
            bucket.weights.copy_(saved)


__all__ = ["Runtime"]
