"""sapipe: staleness-aware pipelined data-parallel training for PyTorch (SAPipe, NeurIPS 2022).

Wrap your optimizer; the first ``stale_layers`` layers take one-step-stale gradients so
their all-reduce hides behind the next forward, every other layer stays exactly
synchronous, and staleness compensation (``dc``, ``wp1``-``wp3``) keeps accuracy.
"""

from sapipe.checkpoint import Checkpointer, checkpoint_exists, load_checkpoint, save_checkpoint
from sapipe.ddp_hook import StaleHook, stale_hook
from sapipe.elastic import ElasticAveraging
from sapipe.errors import (
    CommunicationError,
    ConfigurationError,
    NonFiniteGradientError,
    SapipeError,
    UnsupportedOptimizerError,
    UsageError,
)
from sapipe.integrations import register_with_frameworks
from sapipe.kernels import ops
from sapipe.optim.compensation import MODES as COMPENSATION_MODES
from sapipe.optimizer import DistributedOptimizer

__version__ = "0.1.0"

register_with_frameworks()  # Trainer(strategy="sapipe") (sapipe/integrations/__init__.py)

__all__ = [
    "DistributedOptimizer",
    "ElasticAveraging",
    "save_checkpoint",
    "load_checkpoint",
    "checkpoint_exists",
    "Checkpointer",
    "StaleHook",
    "stale_hook",
    "COMPENSATION_MODES",
    "SapipeError",
    "ConfigurationError",
    "UnsupportedOptimizerError",
    "CommunicationError",
    "UsageError",
    "NonFiniteGradientError",
    "ops",
    "__version__",
]
