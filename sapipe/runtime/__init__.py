"""The runtime under :class:`sapipe.DistributedOptimizer`: layout, gradient pipeline, updates."""
from .engine import Runtime
from .forward import ForwardHooks
from .layout import Layout
from .pipeline import GradientPipeline
from .updates import Updater

__all__ = ["ForwardHooks", "Layout", "GradientPipeline", "Runtime", "Updater"]
