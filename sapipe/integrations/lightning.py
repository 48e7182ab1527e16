"""PyTorch Lightning: ``Trainer(strategy="sapipe")``, or ``SAPipeStrategy(...)`` for settings.

The strategy is Lightning's :class:`~lightning.pytorch.strategies.DDPStrategy` (launch,
process group, samplers, ``reduce``/``barrier``, the precision plugins) with the model left
unwrapped and the one optimizer wrapped in :class:`sapipe.DistributedOptimizer`. Lightning's
own loop then drives sapipe as a script would:

* **the step**: Lightning calls ``optimizer.step(closure)`` (or ``scaler.step(optimizer)``
  after running the closure, under ``precision="16-mixed"``); sapipe runs the closure's
  forward and backward, then its step;
* **the forward**: each ``training_step`` goes through a thin module (:class:`StepModule`)
  that sapipe wraps as the model, so its hooks see one forward per training step whatever
  the LightningModule calls inside;
* **accumulation**: ``accumulate_grad_batches`` runs the accumulating batches under
  ``opt.no_sync()``, as DDP's strategy runs them under ``ddp.no_sync()``;
* **clipping**: ``gradient_clip_val`` with either ``gradient_clip_algorithm`` acts on
  ``p.grad``, which sapipe points at the averaged gradient the step applies
  (``expose_gradients=True``, the default), exactly as under DDP;
* **evaluation and checkpoints** see the real weights: every pending synchronous update
  applied, and under weight prediction (``wp1``-``wp3``) the real weights rather than the
  predicted ones. Validation inside ``fit`` runs on them, and so does what ``ModelCheckpoint``
  saves;
* **per-rank state**: Lightning writes a checkpoint from rank 0 alone, but sapipe's
  optimizer state is per rank (this rank's own gradient under ``wp1``/``wp3``, error-feedback
  residuals, in-flight gradients). Every rank writes its own next to the checkpoint,
  ``<checkpoint>.sapipe-rank<r>``, and reads it back on resume; a job resumed at another
  world size uses rank 0's where it has none (sapipe's elastic restart, with a warning);
* **the end of fit**: :meth:`DistributedOptimizer.finish` leaves the model holding the
  trained real weights for ``trainer.validate``/``test``/``predict`` and for saving.

Not supported, refused at setup with a :class:`~sapipe.errors.ConfigurationError`: manual
optimisation, more than one optimizer, gradient clipping with ``expose_gradients=False``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Generator
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.strategies.strategy import _ForwardRedirection
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import nn

from sapipe import config
from sapipe.errors import ConfigurationError
from sapipe.optimizer import DistributedOptimizer

#: The strategy's name in Lightning's registry: ``Trainer(strategy="sapipe")``.
STRATEGY_NAME = "sapipe"


class StepModule(nn.Module):
    """The model as sapipe sees it under Lightning: one forward per training step.

    Lightning reroutes ``training_step`` through the strategy's model (its forward
    redirection, as for DDP), so sapipe's model-level hooks fire once per step on this
    module, however often (or never) the LightningModule calls its own ``forward``.
    """

    def __init__(self, module: pl.LightningModule):
        super().__init__()
        self.module = module

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)


class SAPipeMixedPrecision(MixedPrecision):
    """Lightning's ``16-mixed`` precision with sapipe's optimizer.

    sapipe's step takes the ``GradScaler`` itself (``_step_supports_amp_scaling``), so that
    whether a step is finite is decided over all ranks; Lightning takes such an optimizer
    for one that unscales inside its step and refuses gradient clipping. sapipe accepts
    gradients the script unscaled first (as ``scaler.unscale_(opt)`` before clipping), so
    here they are always unscaled after the closure, and clipping works as for any optimizer.
    """

    def optimizer_step(  # type: ignore[override]
        self,
        optimizer: torch.optim.Optimizer,
        model: pl.LightningModule,
        closure: Any,
        **kwargs: Any,
    ) -> Any:
        if self.scaler is None:
            return super().optimizer_step(optimizer, model=model, closure=closure, **kwargs)
        closure_result = closure()
        skipped = closure_result is None and model.automatic_optimization
        if not skipped:
            self.scaler.unscale_(optimizer)  # for clipping; sapipe's step sees it was done
        self._after_closure(model, optimizer)
        if skipped:
            return closure_result
        step_output = self.scaler.step(optimizer, **kwargs)
        self.scaler.update()
        return step_output

    def clip_gradients(
        self,
        optimizer: torch.optim.Optimizer,
        clip_val: int | float = 0.0,
        gradient_clip_algorithm: GradClipAlgorithmType = GradClipAlgorithmType.NORM,
    ) -> None:
        """Clip ``p.grad`` (unscaled by :meth:`optimizer_step`) as for any optimizer."""
        Precision.clip_gradients(self, optimizer, clip_val, gradient_clip_algorithm)


class SAPipeStrategy(DDPStrategy):
    """Lightning's DDP strategy with sapipe in place of ``DistributedDataParallel``.

    Args:
        stale_layers, compensation, compression: sapipe's main settings
            (:class:`sapipe.DistributedOptimizer`).
        **settings: any other setting of :class:`sapipe.DistributedOptimizer` (``staleness``,
            ``bucket_cap_mb``, ``dc_lambda``, ``warmup_steps``, ...), and the arguments of
            Lightning's strategies: ``accelerator``, ``parallel_devices``,
            ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``,
            ``process_group_backend``, ``timeout``, ``start_method``.

    ``Trainer(strategy="sapipe")`` is ``SAPipeStrategy()``: k = 0, every layer synchronous,
    training equal to ``strategy="ddp"``. See the module's docstring for how Lightning's
    features map onto sapipe's.
    """

    strategy_name = STRATEGY_NAME

    def __init__(
        self,
        stale_layers: int | str = 0,
        compensation: str = "none",
        compression: Any = None,
        *,
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: str = "popen",
        **settings: Any,
    ) -> None:
        unknown = sorted(set(settings) - set(config.Settings.names()))
        if unknown:
            raise ConfigurationError(
                f"SAPipeStrategy got unknown arguments {unknown}: they are neither sapipe's "
                "settings (sapipe.DistributedOptimizer) nor Lightning's strategy arguments; "
                "DDP's own arguments (find_unused_parameters, static_graph, ddp_comm_hook, ...) "
                "have no meaning without DDP"
            )
        if "process_group" in settings:
            raise ConfigurationError("SAPipeStrategy trains over Lightning's world group")
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
            process_group_backend=process_group_backend,
            timeout=timeout,
            start_method=start_method,  # type: ignore[arg-type]
        )
        self._forward_redirection = _ForwardRedirection()
        self.settings: dict[str, Any] = dict(
            stale_layers=stale_layers,
            compensation=compensation,
            compression=compression,
            **settings,
        )
        #: the wrapped optimizer while fitting (None before setup and after teardown)
        self.sapipe: DistributedOptimizer | None = None
        self._real_weights = contextlib.ExitStack()  # held while evaluating inside fit
        self._failed = False

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        """Register ``"sapipe"`` (and not DDP's names, which the base class registers)."""
        strategy_registry.register(
            STRATEGY_NAME,
            cls,
            description="sapipe: partial-staleness data parallelism (sapipe.DistributedOptimizer)",
            override=True,
        )

    # ------------------------------------------------------------------ setup

    def setup(self, trainer: pl.Trainer) -> None:
        plugin = self.precision_plugin
        if type(plugin) is MixedPrecision:  # 16-mixed or bf16-mixed
            self.precision_plugin = SAPipeMixedPrecision(
                plugin.precision,  # type: ignore[arg-type]
                plugin.device,
                plugin.scaler,
            )
        super().setup(trainer)

    def configure_ddp(self) -> None:
        """Instead of wrapping the model in DDP: check what sapipe can honour, and make the
        model sapipe wraps (:class:`StepModule`)."""
        module = self.lightning_module
        assert module is not None and module.trainer is not None
        if not module.automatic_optimization:
            raise ConfigurationError(
                "SAPipeStrategy supports Lightning's automatic optimisation only: with "
                "automatic_optimization=False the LightningModule steps its optimizers itself; "
                "wrap its optimizer in sapipe.DistributedOptimizer in a plain loop instead"
            )
        trainer = module.trainer
        if trainer.gradient_clip_val and not self.settings.get("expose_gradients", True):
            raise ConfigurationError(
                "gradient_clip_val needs p.grad to hold the averaged gradient the step applies: "
                "SAPipeStrategy(expose_gradients=False) cannot clip it"
            )
        self.model = StepModule(self.model)  # type: ignore[arg-type]

    def setup_optimizers(self, trainer: pl.Trainer) -> None:
        """Lightning's optimizer (exactly one) wrapped in :class:`sapipe.DistributedOptimizer`;
        LR schedulers keep working on it (they share its param groups)."""
        super().setup_optimizers(trainer)
        if len(self.optimizers) != 1:
            raise ConfigurationError(
                f"SAPipeStrategy trains with exactly one optimizer; configure_optimizers returned "
                f"{len(self.optimizers)}"
            )
        (optimizer,) = self.optimizers
        assert self.model is not None
        self.sapipe = DistributedOptimizer(optimizer, self.model, **self.settings)
        self.optimizers = [self.sapipe]

    # ------------------------------------------------------------------ training

    @contextlib.contextmanager
    def block_backward_sync(self) -> Generator[None, None, None]:
        """Lightning's accumulating batches run in sapipe's ``no_sync()`` (DDP's in DDP's)."""
        if self.sapipe is None:
            yield
            return
        with self.sapipe.no_sync():
            yield

    def optimizer_state(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's sapipe state (before the first step: the wrapped optimizer's own)."""
        opt = getattr(optimizer, "_optimizer", optimizer)  # LightningOptimizer's
        if isinstance(opt, DistributedOptimizer) and not opt.has_stepped:
            return opt.optimizer.state_dict()
        return opt.state_dict()

    # ------------------------------------------------------------------ evaluation

    def _evaluate_on_real_weights(self) -> None:
        if self.sapipe is not None and self.sapipe.laid_out:
            self._real_weights.enter_context(self.sapipe.real_weights())

    def on_validation_start(self) -> None:
        super().on_validation_start()
        self._evaluate_on_real_weights()

    def on_validation_end(self) -> None:
        self._real_weights.close()
        super().on_validation_end()

    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        # straight to the LightningModule: an evaluation forward is none of sapipe's steps
        assert self.lightning_module is not None
        with self.precision_plugin.val_step_context():
            return self.lightning_module.validation_step(*args, **kwargs)

    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        with self.precision_plugin.test_step_context():
            return self.lightning_module.test_step(*args, **kwargs)

    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        assert self.lightning_module is not None
        with self.precision_plugin.predict_step_context():
            return self.lightning_module.predict_step(*args, **kwargs)

    # ------------------------------------------------------------------ checkpoints

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """The real weights x_t: pending synchronous updates applied, not WP's prediction."""
        if self.sapipe is None or not self.sapipe.laid_out:
            return super().lightning_module_state_dict()
        with self.sapipe.real_weights():
            return {k: v.clone() for k, v in super().lightning_module_state_dict().items()}

    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None
    ) -> None:
        """Rank 0 writes Lightning's checkpoint; every rank writes its sapipe state beside it."""
        states = checkpoint.get("optimizer_states")
        if self.sapipe is not None and states:
            self.checkpoint_io.save_checkpoint(
                {"sapipe": states[0]}, rank_file(filepath, self.global_rank)
            )
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        own = rank_file(filepath, self.global_rank)
        if os.path.exists(own):
            self.checkpoint_io.remove_checkpoint(own)
        super().remove_checkpoint(filepath)

    def load_checkpoint(
        self, checkpoint_path: Any, weights_only: bool | None = None
    ) -> dict[str, Any]:
        """Lightning's checkpoint, with this rank's own sapipe state in place of rank 0's.

        Without a file of this rank's: at the world size that saved it, an error (resuming from
        rank 0's state would be silently wrong under wp1/wp3 or error feedback); at another
        world size, rank 0's, which sapipe resumes as an elastic restart."""
        checkpoint = super().load_checkpoint(checkpoint_path, weights_only=weights_only)
        own = rank_file(os.path.realpath(checkpoint_path), self.global_rank)
        states = checkpoint.get("optimizer_states") or []
        if os.path.exists(own):
            checkpoint["optimizer_states"] = [self.checkpoint_io.load_checkpoint(own)["sapipe"]]
        elif states and states[0].get("format") is not None and self.global_rank != 0:
            saved_world = states[0].get("world_size")
            if saved_world == self.world_size:
                raise ConfigurationError(
                    f"rank {self.global_rank} found no sapipe state of its own beside "
                    f"{checkpoint_path} ({own}), saved by a job of the same world size: copy the "
                    "checkpoint's *.sapipe-rank<r> files with it"
                )
        return checkpoint

    # ------------------------------------------------------------------ the end

    def on_exception(self, exception: BaseException) -> None:
        self._failed = True
        super().on_exception(exception)

    def teardown(self) -> None:
        """The model keeps the trained real weights (``opt.finish()``), unwrapped."""
        self._real_weights.close()
        opt, self.sapipe = self.sapipe, None
        if opt is not None:
            if self._failed:
                opt.close()
            else:
                opt.finish()
        if isinstance(self.model, StepModule):
            self.model = self.lightning_module
        super().teardown()


def rank_file(checkpoint_path: Any, rank: int) -> str:
    """Where rank ``rank`` keeps its sapipe state of Lightning's checkpoint ``checkpoint_path``."""
    return f"{os.fspath(checkpoint_path)}.sapipe-rank{rank}"


__all__ = ["STRATEGY_NAME", "SAPipeMixedPrecision", "SAPipeStrategy", "StepModule", "rank_file"]
