"""The ``transformers`` Trainer: :class:`SAPipeTrainer`, a ``Trainer`` without DDP.

A Trainer script changes in one place::

    trainer = SAPipeTrainer(model=model, args=TrainingArguments(...), train_dataset=...,
                            sapipe_settings=dict(stale_layers=2, compensation="dc"))
    trainer.train()

The Trainer builds its optimizer as usual (``optim``, ``optimizers=``,
``optimizer_cls_and_kwargs``); :class:`SAPipeTrainer` then hands model and optimizer to
:func:`sapipe.integrations.accelerate.prepare` (no ``DistributedDataParallel``: sapipe's
:class:`~sapipe.DistributedOptimizer` averages the gradients) before the Trainer's own
``accelerator.prepare``, which passes them through. The rest is the Trainer's loop:

* ``gradient_accumulation_steps``: the accumulating micro-batches run under
  ``accelerator.no_sync(model)``, which is sapipe's ``opt.no_sync()``;
* ``max_grad_norm`` (1.0 by default): ``accelerator.clip_grad_norm_`` acts on ``p.grad``, the
  averaged gradient the step applies;
* evaluation (``evaluate``, ``predict``, in training or after) and ``save_model`` see the real
  weights, not weight prediction's predicted ones;
* checkpoints (``save_steps``): every rank also writes its own sapipe state
  (``sapipe-rank<r>.pt``) to the checkpoint directory, and ``train(resume_from_checkpoint=...)``
  restores each rank from its own; ``optimizer.pt`` holds the plain ``torch.optim`` state of
  the real weights. A checkpoint of a plain ``Trainer`` (no sapipe files) resumes too;
* at the end of ``train()`` (before ``load_best_model_at_end`` loads a checkpoint),
  :meth:`DistributedOptimizer.finish` leaves the model holding the trained real weights.

Refused with a :class:`~sapipe.errors.ConfigurationError` on every rank when the Trainer is
built: DeepSpeed, FSDP, ``auto_find_batch_size``, an optimizer that is not a ``torch.optim``
one (``optim="adafactor"``, bitsandbytes, GaLore, LOMO, schedule-free, ...), and whatever
:func:`sapipe.integrations.accelerate.check_setup` refuses. One ``train()`` per trainer.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, cast

import transformers
from torch import nn
from transformers import Trainer

from sapipe.errors import UsageError
from sapipe.integrations.accelerate import (
    RANK_FILE,
    SAPipeAcceleratedOptimizer,
    agree,
    check_setup,
    prepare,
)
from sapipe.optimizer import DistributedOptimizer

#: The Trainer's methods SAPipeTrainer overrides that are not its public API: if a
#: transformers release renames one, importing this module fails rather than sapipe silently
#: doing nothing there.
_INTERNALS = (
    "_wrap_model",
    "_save_optimizer_and_scheduler",
    "_load_optimizer_and_scheduler",
    "_finalize_training",
)
_missing = [name for name in _INTERNALS if not hasattr(Trainer, name)]
if _missing:
    raise ImportError(
        f"sapipe's SAPipeTrainer overrides Trainer.{', Trainer.'.join(_missing)}, which "
        f"transformers {transformers.__version__} does not have"
    )


class SAPipeTrainer(Trainer):
    """A ``transformers.Trainer`` that trains with sapipe instead of DDP.

    Args:
        *args, **kwargs: the ``Trainer``'s (``model``, ``args``, ``train_dataset``, ...).
        sapipe_settings: keyword arguments of :class:`sapipe.DistributedOptimizer`
            (``stale_layers``, ``compensation``, ``compression``, ...); default: k = 0, which
            trains as the plain ``Trainer`` does. ``ddp_bucket_cap_mb`` and
            ``ddp_broadcast_buffers`` of ``TrainingArguments`` apply unless given here.

    Launch with ``torchrun`` (or ``accelerate launch``) as for DDP. ``trainer.sapipe`` is the
    :class:`~sapipe.DistributedOptimizer` once training starts.
    """

    def __init__(self, *args: Any, sapipe_settings: dict[str, Any] | None = None, **kwargs: Any):
        self.sapipe_settings: dict[str, Any] = dict(sapipe_settings or {})
        #: the sapipe optimizer, from the start of training on
        self.sapipe: DistributedOptimizer | None = None
        self._prepared: SAPipeAcceleratedOptimizer | None = None  # Accelerate's wrapper of it
        self._sapipe_model: nn.Module | None = None
        super().__init__(*args, **kwargs)
        agree(self._refusal())

    # ------------------------------------------------------------------ checks

    def _refusal(self) -> str | None:
        """Why sapipe cannot run this Trainer; None if it can."""
        args = self.args
        if args.deepspeed or self.is_deepspeed_enabled:
            return (
                "TrainingArguments(deepspeed=...) hands training to DeepSpeed; sapipe replaces DDP"
            )
        if args.fsdp or self.is_fsdp_enabled:
            return f"TrainingArguments(fsdp={args.fsdp!r}) shards the model; sapipe replaces DDP"
        if args.auto_find_batch_size:
            return (
                "TrainingArguments(auto_find_batch_size=True) rebuilds the optimizer when a batch "
                "does not fit; sapipe's cannot be rebuilt mid-run"
            )
        error = self._optimizer_refusal()
        if error is not None:
            return error
        return check_setup(
            self.accelerator, optimizer=self.optimizer, settings=self.sapipe_settings
        )

    def _optimizer_refusal(self) -> str | None:
        if self.optimizer is not None:
            cls, what = type(self.optimizer), "optimizers=(...)"
        elif self.optimizer_cls_and_kwargs is not None:
            cls, what = self.optimizer_cls_and_kwargs[0], "optimizer_cls_and_kwargs"
        else:
            optim = getattr(self.args.optim, "value", self.args.optim)  # an OptimizerNames
            what = f"TrainingArguments(optim={optim!r})"
            try:
                cls = self.get_optimizer_cls_and_kwargs(self.args, cast(Any, self.model))[0]
            except (ImportError, ValueError) as exc:
                return f"{what} is not a torch.optim optimizer ({exc})"
        if not isinstance(cls, type) or not cls.__module__.startswith("torch.optim"):
            name = getattr(cls, "__qualname__", repr(cls))
            return (
                f"{what} gives {getattr(cls, '__module__', '?')}.{name}, not a torch.optim "
                "optimizer: use optim='adamw_torch', 'adamw_torch_fused', 'sgd', 'adagrad', "
                "'rmsprop', or pass a torch.optim optimizer"
            )
        return None

    # ------------------------------------------------------------------ the optimizer

    def _training(self) -> SAPipeAcceleratedOptimizer | None:
        """The optimizer while sapipe trains (from the start of ``train()`` to its end)."""
        prepared = self._prepared
        return prepared if prepared is not None and not prepared.finished else None

    def create_optimizer(self, model: nn.Module | None = None) -> Any:
        """The Trainer's optimizer, wrapped: :func:`sapipe.integrations.accelerate.prepare`
        with the model (before the Trainer's ``accelerator.prepare``, which then leaves both
        as they are)."""
        prepared = self._prepared
        # the Trainer resets self.optimizer to None for a new model (model_init): then anew
        reused = prepared is not None and self.optimizer is prepared
        if prepared is not None and reused:
            if prepared.finished:
                raise UsageError(
                    "SAPipeTrainer trains once: its sapipe optimizer finished at the end of the "
                    "last train(); build a new trainer (resume_from_checkpoint= to continue)"
                )
            return prepared
        optimizer = super().create_optimizer(model)
        assert self.model is not None  # the Trainer refuses to train without one
        self._sapipe_model, self._prepared = prepare(
            self.accelerator, self.model, optimizer, **self.sapipe_settings
        )
        self.optimizer, self.sapipe = self._prepared, self._prepared.sapipe
        return self._prepared

    def _wrap_model(self, model: nn.Module, training: bool = True, dataloader: Any = None) -> Any:
        # sapipe's model, prepared already (compiled, where the Trainer compiles): the Trainer
        # trains it as is, not wrapped in DDP by accelerator.prepare
        if training and self._training() is not None:
            return self._sapipe_model
        return super()._wrap_model(model, training=training, dataloader=dataloader)

    @contextlib.contextmanager
    def _real_weights(self) -> Iterator[None]:
        prepared = self._training()
        with prepared.real_weights() if prepared is not None else contextlib.nullcontext():
            yield

    # ------------------------------------------------------------------ evaluation, saving

    def evaluate(self, *args: Any, **kwargs: Any) -> dict[str, float]:
        """``Trainer.evaluate`` on the real weights."""
        with self._real_weights():
            return super().evaluate(*args, **kwargs)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.predict`` on the real weights."""
        with self._real_weights():
            return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """``Trainer.save_model`` of the real weights."""
        with self._real_weights():
            super().save_model(output_dir, _internal_call=_internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        prepared = self._training()
        if prepared is not None and prepared.has_rank_state:
            prepared.save_rank_state(output_dir)  # every rank: RANK_FILE

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        prepared = self._training()
        if checkpoint is not None and prepared is not None:
            prepared.load_rank_state(checkpoint)  # before optimizer.pt's marker
        super()._load_optimizer_and_scheduler(checkpoint)

    def _finalize_training(self, *args: Any, **kwargs: Any) -> Any:
        self._finish()  # before load_best_model_at_end puts a checkpoint's weights in
        return super()._finalize_training(*args, **kwargs)

    def _finish(self) -> None:
        prepared = self._training()
        if prepared is not None:
            prepared.sapipe.finish()


__all__ = ["RANK_FILE", "SAPipeTrainer"]
