"""The runtime under :class:`sapipe.DistributedOptimizer`: layout, gradient pipeline, updates."""

from sapipe.runtime.engine import Runtime
from sapipe.runtime.forward import ForwardHooks
from sapipe.runtime.layout import Layout
from sapipe.runtime.pipeline import GradientPipeline
from sapipe.runtime.updates import Updater

__all__ = ["ForwardHooks", "Layout", "GradientPipeline", "Runtime", "Updater"]
