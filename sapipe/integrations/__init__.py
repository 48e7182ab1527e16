"""sapipe inside the training frameworks: Lightning (:mod:`sapipe.integrations.lightning`),
Accelerate (:mod:`sapipe.integrations.accelerate`) and the ``transformers`` Trainer
(:mod:`sapipe.integrations.transformers`).

Each module imports its framework; ``import sapipe`` imports none of them. It only arranges
for ``Trainer(strategy="sapipe")`` to work: Lightning looks strategies up by name in a
registry it fills as ``lightning.pytorch.strategies`` is imported and offers no entry point
for outside ones, so sapipe's strategy is registered then — at once if Lightning is already
imported, else right after Lightning's own import of that module.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Callable
from importlib.abc import MetaPathFinder
from types import ModuleType

#: The module whose import fills Lightning's strategy registry.
LIGHTNING_STRATEGIES = "lightning.pytorch.strategies"


def _new_lightning_strategy(**init_params):  # noqa: ANN202 - a SAPipeStrategy
    """What Lightning's registry calls for ``strategy="sapipe"``: the strategy's module is
    imported only then, once Lightning is whole (not while it imports its strategies)."""
    from sapipe.integrations.lightning import SAPipeStrategy

    return SAPipeStrategy(**init_params)


def _register_lightning_strategy(strategies: ModuleType) -> None:
    registry = strategies.StrategyRegistry
    if "sapipe" not in registry:
        registry.register(
            "sapipe",
            _new_lightning_strategy,
            description="sapipe: partial-staleness data parallelism (sapipe.DistributedOptimizer)",
        )


class _AfterImport(MetaPathFinder):
    """Runs ``callback(module)`` once the module ``name`` has been executed by its own loader.

    It finds the module's spec as the other finders would and wraps only that loader's
    ``exec_module``, so the module is loaded exactly as without it."""

    def __init__(self, name: str, callback: Callable[[ModuleType], None]):
        self._name = name
        self._callback = callback
        self._finding = False

    def find_spec(self, fullname, path=None, target=None):  # noqa: ANN001 - importlib's protocol
        if fullname != self._name or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        sys.meta_path.remove(self)  # once
        loader = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module, callback = loader.exec_module, self._callback

        def exec_then_call_back(module: ModuleType) -> None:
            exec_module(module)
            callback(module)

        loader.exec_module = exec_then_call_back
        return spec


def register_with_frameworks() -> None:
    """Register sapipe's Lightning strategy (``"sapipe"``) now or as soon as Lightning loads
    its strategies; nothing if Lightning is not installed. Called by ``import sapipe``."""
    if LIGHTNING_STRATEGIES in sys.modules:
        _register_lightning_strategy(sys.modules[LIGHTNING_STRATEGIES])
        return
    try:
        installed = importlib.util.find_spec("lightning") is not None
    except (ImportError, ValueError):
        installed = False
    if installed and not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(LIGHTNING_STRATEGIES, _register_lightning_strategy))


__all__ = ["LIGHTNING_STRATEGIES", "register_with_frameworks"]
