"""Hugging Face Accelerate: ``model, optimizer = prepare(accelerator, model, optimizer, ...)``.

In place of ``accelerator.prepare(model, optimizer)`` (data loaders and LR schedulers still go
through ``accelerator.prepare``)::

    accelerator = Accelerator(gradient_accumulation_steps=2, mixed_precision="bf16")
    model, optimizer = sapipe.integrations.accelerate.prepare(
        accelerator, model, optimizer, stale_layers=2, compensation="dc")
    loader, scheduler = accelerator.prepare(loader, scheduler)
    ...  # the Accelerate loop, unchanged
    optimizer.sapipe.finish()

The model goes through ``accelerator.prepare_model(model, evaluation_mode=True)``: device
placement, autocast and ``torch.compile`` as Accelerate configures them, but no
``DistributedDataParallel``; sapipe's :class:`~sapipe.DistributedOptimizer` does the gradient
averaging instead. Accelerate's loop then drives sapipe as a plain script would:

* **accumulation**: ``with accelerator.accumulate(model):`` (and ``accelerator.no_sync(model)``)
  call ``model.no_sync()``, which is set to sapipe's ``opt.no_sync()``; the returned optimizer
  steps and zeroes only when ``accelerator.sync_gradients``, as Accelerate's own does;
* **clipping**: ``accelerator.clip_grad_norm_(model.parameters(), ...)`` acts on ``p.grad``,
  which holds the averaged gradient the step applies (``expose_gradients=True``, the default);
* **mixed precision**: bf16 autocast as Accelerate sets it up; with fp16's ``GradScaler`` the
  step hands the scaler to sapipe, which decides a skip over all ranks;
* **checkpoints**: ``accelerator.save_state(dir)`` also writes every rank's own sapipe state
  (``sapipe-rank<r>.pt``: the model as this rank holds it and ``opt.state_dict()``), and
  ``model.safetensors`` gets the real weights (not weight prediction's predicted ones).
  ``accelerator.load_state(dir)`` restores each rank from its own file, never from rank 0's
  ``optimizer.bin`` (which holds the plain ``torch.optim`` state of the real weights, for a
  job without sapipe). A directory without sapipe files (a DDP job's) loads as Accelerate
  loads it, the optimizer from its plain state. A job of another world size resumes from
  rank 0's file (sapipe's elastic restart, with a warning).

Refused with a :class:`~sapipe.errors.ConfigurationError`, on every rank: a model already
wrapped in DDP (prepared before), an optimizer already prepared, DeepSpeed, FSDP,
Megatron-LM, XLA, tensor/context parallelism, fp8, a DDP communication hook, Accelerate's
``sync_each_batch``, a single-process run, and unknown settings.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DDPCommunicationHookType, DistributedType
from torch import nn

from sapipe import config
from sapipe.checkpoint import load_checkpoint, save_checkpoint
from sapipe.errors import ConfigurationError, SapipeError
from sapipe.optimizer import DistributedOptimizer

#: Each rank's sapipe state in a checkpoint directory (``{rank}`` filled in).
RANK_FILE = "sapipe-rank{rank}.pt"
#: The key of ``optimizer.bin``'s entry that says the state is in the rank files.
MARKER = "sapipe"

#: Accelerate setups in which something other than DDP averages (or shards) the gradients.
_UNSUPPORTED_TYPES = {
    DistributedType.DEEPSPEED: "DeepSpeed",
    DistributedType.FSDP: "FSDP",
    DistributedType.MEGATRON_LM: "Megatron-LM",
    DistributedType.XLA: "XLA",
}
#: DDP's arguments (``DistributedDataParallelKwargs``) that are sapipe settings too.
_DDP_SETTINGS = ("bucket_cap_mb", "broadcast_buffers")


def agree(error: str | None) -> None:
    """Raise :class:`ConfigurationError` on every rank if any rank found ``error`` (a
    collective: every rank calls it), naming the rank(s) whose message differs."""
    if not (dist.is_available() and dist.is_initialized()):
        if error is not None:
            raise ConfigurationError(error)
        return
    errors: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(errors, error)
    found = {rank: e for rank, e in enumerate(errors) if e is not None}
    if not found:
        return
    messages = set(found.values())
    if len(messages) == 1 and len(found) == len(errors):
        raise ConfigurationError(messages.pop())
    raise ConfigurationError("; ".join(f"rank {rank}: {e}" for rank, e in found.items()))


def rank_file(directory: str | os.PathLike[str], rank: int) -> str:
    """The file of ``rank``'s sapipe state in a checkpoint ``directory``."""
    return os.path.join(os.fspath(directory), RANK_FILE.format(rank=rank))


class SAPipeAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper around a :class:`~sapipe.DistributedOptimizer`.

    As Accelerate's: ``step()`` and ``zero_grad()`` act only when
    ``accelerator.sync_gradients``. Differs in three places: the ``GradScaler`` is handed to
    sapipe's step (whose signature Accelerate's own patching would hide from the scaler);
    ``state_dict()`` is the plain ``torch.optim`` state of the real weights plus a marker
    (each rank's full state goes to its own file); ``load_state_dict()`` takes a plain state,
    or the marker once this rank's own file has been loaded.
    """

    def __init__(self, optimizer: DistributedOptimizer, scaler: Any = None) -> None:
        super().__init__(optimizer, device_placement=False, scaler=scaler)
        #: set by the load-state hook once this rank's file is loaded; consumed by the marker
        self._restored = False

    @property
    def sapipe(self) -> DistributedOptimizer:
        """The :class:`~sapipe.DistributedOptimizer`: ``finish()``, ``real_weights()``, ..."""
        return self.optimizer

    @property
    def finished(self) -> bool:
        """Whether ``sapipe.finish()`` (or ``close()``) ended training."""
        return self.optimizer.process_group is None

    @property
    def has_rank_state(self) -> bool:
        """Whether each rank has state of its own to save: from the first step to the end of
        training (before, and after ``finish()``, the plain ``state_dict()`` is all)."""
        return not self.finished and self.optimizer.has_stepped

    @contextlib.contextmanager
    def real_weights(self) -> Iterator[None]:
        """Within the block the model holds the real weights (not weight prediction's
        predicted ones): for evaluation during training. After ``finish()`` it holds them
        anyway."""
        if self.finished:
            yield
            return
        with self.optimizer.real_weights():
            yield

    def save_rank_state(self, directory: str) -> None:
        """Write this rank's sapipe state (the model as this rank holds it, and
        ``sapipe.state_dict()``) to its file in ``directory``. Collective in effect: every
        rank writes its own."""
        save_checkpoint(os.path.join(directory, RANK_FILE), self.optimizer.model, self.optimizer)

    def load_rank_state(self, directory: str) -> bool:
        """Restore this rank's model and sapipe state from its file in ``directory`` (rank 0's
        where it has none: a job of another world size wrote them, sapipe's elastic restart);
        False if ``directory`` has no sapipe state. Collective: a rank that cannot load makes
        every rank raise :class:`ConfigurationError`."""
        opt = self.optimizer
        files = os.path.join(directory, RANK_FILE)
        error, loaded = None, False
        try:
            if os.path.exists(rank_file(directory, opt.rank)):
                load_checkpoint(files, opt.model, opt)
                loaded = True
            elif os.path.exists(rank_file(directory, 0)):
                load_checkpoint(files, opt.model, opt, rank=0)
                loaded = True
        except (SapipeError, OSError) as exc:
            error = f"cannot resume from {directory}: {exc}"
        agree(error)
        self._restored = loaded
        return loaded

    def step(self, closure: Any = None) -> None:
        if not self.gradient_state.sync_gradients:
            return
        if self.scaler is None:
            self.optimizer.step(closure)
            return
        scale = self.scaler.get_scale()
        self.scaler.step(self.optimizer, closure)  # sapipe's step() takes grad_scaler=
        self.scaler.update()
        self._is_overflow = self.scaler.get_scale() < scale  # a skipped step lowers the scale

    def state_dict(self) -> dict[str, Any]:
        state = self.optimizer.torch_state_dict()
        if self.has_rank_state:
            state[MARKER] = {"world_size": self.optimizer.world_size, "rank_files": RANK_FILE}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if MARKER not in state_dict:  # a plain torch.optim state (a DDP job's checkpoint)
            self.optimizer.load_state_dict(state_dict)
            return
        if not self._restored:
            raise ConfigurationError(
                "this optimizer state is a marker: sapipe's state is per rank, in the "
                f"{RANK_FILE.format(rank='<r>')} files of the checkpoint directory; load the "
                "directory with accelerator.load_state() (or the Trainer's "
                "resume_from_checkpoint), which reads this rank's own file"
            )
        self._restored = False


class _NoSync:
    """``model.no_sync`` for Accelerate, which calls it (as DDP's) to accumulate gradients:
    sapipe's ``opt.no_sync()``. A copy of the model (an EMA's ``deepcopy``) shares it, and a
    pickled model drops it."""

    def __init__(self, optimizer: DistributedOptimizer | None) -> None:
        self._optimizer = optimizer

    def __call__(self) -> contextlib.AbstractContextManager[None]:
        return (
            self._optimizer.no_sync() if self._optimizer is not None else contextlib.nullcontext()
        )

    def __deepcopy__(self, memo: dict[int, Any]) -> _NoSync:
        return self

    def __reduce__(self) -> tuple[type, tuple[None]]:
        return (_NoSync, (None,))


def check_setup(
    accelerator: Accelerator,
    model: nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    settings: dict[str, Any] | None = None,
) -> str | None:
    """Why sapipe cannot train with this accelerator (and model, optimizer, settings); None if
    it can. Local: :func:`agree` makes it every rank's error."""
    settings = settings or {}
    kind = accelerator.distributed_type
    if kind in _UNSUPPORTED_TYPES or getattr(accelerator, "is_fsdp2", False):
        name = _UNSUPPORTED_TYPES.get(kind, "FSDP")
        return (
            f"Accelerate is set up for {name} (distributed_type={kind}); sapipe replaces DDP and "
            "cannot run with sharded or engine-managed training: use plain multi-process "
            "data parallelism (MULTI_GPU / MULTI_CPU)"
        )
    parallelism = getattr(accelerator, "parallelism_config", None)
    if parallelism is not None and (
        getattr(parallelism, "tp_enabled", False) or getattr(parallelism, "cp_enabled", False)
    ):
        return (
            "Accelerate's parallelism_config enables tensor/context parallelism, which sapipe "
            "does not support"
        )
    if accelerator.mixed_precision == "fp8":
        return (
            "mixed_precision='fp8' rewrites the model and optimizer; sapipe supports 'no', "
            "'bf16' and 'fp16'"
        )
    if not accelerator.use_distributed or not (dist.is_available() and dist.is_initialized()):
        return (
            f"Accelerate runs a single process (distributed_type={kind}): launch with torchrun or "
            "accelerate launch on more than one process (Accelerator(cpu=True) for CPU ranks)"
        )
    handler = accelerator.ddp_handler
    if handler is not None and (
        handler.comm_hook != DDPCommunicationHookType.NO
        or handler.comm_wrapper != DDPCommunicationHookType.NO
    ):
        return (
            f"DistributedDataParallelKwargs(comm_hook={handler.comm_hook}, "
            f"comm_wrapper={handler.comm_wrapper}) configures a DDP communication hook, and "
            "sapipe does not use DDP: for 16-bit gradients pass compression='fp16' or 'bf16'"
        )
    if accelerator.gradient_state.plugin_kwargs.get("sync_each_batch", False):
        return (
            "sync_each_batch=True (Accelerate's GradientAccumulationPlugin, the Trainer's "
            "accelerator_config) averages every micro-batch; sapipe averages once per optimizer "
            "step (the accumulated sum)"
        )
    unknown = sorted(set(settings) - set(config.Settings.names()) - {"trace"})
    if unknown:
        return (
            f"unknown settings {unknown}: not arguments of sapipe.DistributedOptimizer "
            f"({', '.join(config.Settings.names())}, trace)"
        )
    if model is not None:
        error = _check_model(accelerator, model)
        if error is not None:
            return error
    if isinstance(optimizer, (AcceleratedOptimizer, DistributedOptimizer)):
        return (
            f"the optimizer is already wrapped ({type(optimizer).__name__}): pass the plain "
            "torch.optim optimizer, not one that accelerator.prepare() or sapipe returned"
        )
    return None


def _check_model(accelerator: Accelerator, model: nn.Module) -> str | None:
    inner = getattr(model, "_orig_mod", model)  # a compiled module's own
    # accelerator.prepare() lists the plain model and marks only its DDP wrapper as prepared
    wrapped = any(m is inner for m in accelerator._models) and not getattr(
        inner, "_is_accelerate_prepared", False
    )
    if wrapped or isinstance(inner, nn.parallel.DistributedDataParallel):
        return (
            "the model is already wrapped in DistributedDataParallel (accelerator.prepare() was "
            "called on it): pass the plain model to sapipe.integrations.accelerate.prepare() "
            "instead of accelerator.prepare()"
        )
    if type(inner).__module__.startswith("torch.distributed"):
        return f"the model is wrapped in {type(inner).__name__}; sapipe needs the plain module"
    if isinstance(getattr(model, "no_sync", None), _NoSync):
        return "the model was prepared for sapipe already: prepare() it once"
    return None


def prepare(
    accelerator: Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    *,
    stale_layers: int | str = 0,
    compensation: str = "none",
    compression: Any = None,
    **settings: Any,
) -> tuple[nn.Module, SAPipeAcceleratedOptimizer]:
    """Prepare ``model`` and ``optimizer`` for sapipe under ``accelerator``, in place of
    ``accelerator.prepare(model, optimizer)``; returns ``(model, optimizer)`` to train with.

    Args:
        accelerator: a multi-process :class:`accelerate.Accelerator` (``torchrun`` or
            ``accelerate launch``); its process group is the one sapipe trains over.
        model: the plain module (not prepared before).
        optimizer: its ``torch.optim`` optimizer (not prepared before).
        stale_layers, compensation, compression, **settings: sapipe's settings
            (:class:`sapipe.DistributedOptimizer`). ``bucket_cap_mb`` and
            ``broadcast_buffers`` default to those of the accelerator's
            ``DistributedDataParallelKwargs``.

    Collective: every rank calls it. The returned optimizer's ``.sapipe`` is the
    :class:`~sapipe.DistributedOptimizer`: call ``optimizer.sapipe.finish()`` at the end of
    training, and evaluate during training inside ``with optimizer.real_weights():``.
    """
    settings = dict(
        stale_layers=stale_layers, compensation=compensation, compression=compression, **settings
    )
    agree(check_setup(accelerator, model, optimizer, settings))
    handler = accelerator.ddp_handler
    if handler is not None:
        ddp = handler.to_kwargs()  # only what differs from DDP's defaults
        settings = {**{k: ddp[k] for k in _DDP_SETTINGS if k in ddp}, **settings}
    # placement, autocast, torch.compile: everything Accelerate does to a model but DDP
    model = accelerator.prepare_model(model, evaluation_mode=True)
    sapipe_optimizer = DistributedOptimizer(optimizer, model, **settings)
    # what accelerator.accumulate()/no_sync() call on the model, as on a DDP one
    setattr(model, "no_sync", _NoSync(sapipe_optimizer))  # noqa: B010 - not a Module attribute
    prepared = SAPipeAcceleratedOptimizer(sapipe_optimizer, scaler=accelerator.scaler)
    accelerator._optimizers.append(prepared)  # as accelerator.prepare_optimizer() does
    for obj in (model, prepared):
        obj._is_accelerate_prepared = True  # a later accelerator.prepare() passes them through
    accelerator.register_save_state_pre_hook(_SaveHook(accelerator, prepared))
    accelerator.register_load_state_pre_hook(_LoadHook(prepared))
    return model, prepared


class _SaveHook:
    """Before ``accelerator.save_state(dir)`` writes: this rank's sapipe state to its own
    file, and the real weights in place of the model's (predicted) ones in ``weights``."""

    def __init__(self, accelerator: Accelerator, optimizer: SAPipeAcceleratedOptimizer) -> None:
        self.accelerator, self.optimizer = accelerator, optimizer

    def __call__(self, models: list[nn.Module], weights: list[dict], output_dir: str) -> None:
        if not self.optimizer.has_rank_state:  # the model holds the real weights already
            return
        self.optimizer.save_rank_state(output_dir)
        model = self.optimizer.sapipe.model
        for i, candidate in enumerate(models[: len(weights)]):
            if candidate is model:
                with self.optimizer.real_weights():
                    weights[i] = _copy(self.accelerator.get_state_dict(model, unwrap=False))


def _copy(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A copy of a state dict in which tensors that share memory (tied weights) still do, as
    Accelerate's saving and loading expect (an ``OrderedDict``, which it dedups before
    writing safetensors)."""
    copies: dict[tuple, torch.Tensor] = {}
    out: dict[str, torch.Tensor] = OrderedDict()
    for name, tensor in state.items():
        where = (
            tensor.untyped_storage().data_ptr(),
            tensor.storage_offset(),
            tuple(tensor.shape),
            tuple(tensor.stride()),
            tensor.dtype,
        )
        out[name] = copies.setdefault(where, tensor.detach().clone())
    return out


class _LoadHook:
    """Before ``accelerator.load_state(dir)`` reads: this rank's sapipe state from its own
    file (model and optimizer), and the model taken off the list Accelerate loads
    ``model.safetensors`` into."""

    def __init__(self, optimizer: SAPipeAcceleratedOptimizer) -> None:
        self.optimizer = optimizer

    def __call__(self, models: list[nn.Module], input_dir: str) -> None:
        if self.optimizer.load_rank_state(input_dir):
            model = self.optimizer.sapipe.model
            models[:] = [m for m in models if m is not model]


__all__ = [
    "MARKER",
    "RANK_FILE",
    "SAPipeAcceleratedOptimizer",
    "check_setup",
    "prepare",
    "rank_file",
]
