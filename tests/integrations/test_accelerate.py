"""sapipe under Hugging Face Accelerate (``sapipe.integrations.accelerate.prepare``), with the
real package on 2 Gloo ranks (``Accelerator(cpu=True)``), trained by Accelerate's own loop:
``accelerator.accumulate`` (2 micro-batches a step), ``accelerator.backward`` and
``accelerator.clip_grad_norm_`` with a bound below the gradient's norm, so the clip acts.

* k = 0 trains as Accelerate's own DDP path (``accelerator.prepare(model, optimizer)``), and
  each continues exactly from the other's ``save_state``;
* k = 2 (``none``; ``wp1`` under bf16 autocast) trains as sapipe's plain loop with the same
  settings, micro-batches and clipping (that loop is held to a float64 reference elsewhere);
* ``stale_layers="auto"`` decides and trains;
* ``save_state``/``load_state`` at k = 2 (wp1) resumes bit-exactly, each rank from its own
  state; ``model.safetensors`` holds the real weights; a save before the first step is plain;
* what sapipe cannot honour is refused on every rank, naming the cause.
"""

from __future__ import annotations

import contextlib
import os
from unittest import mock

import numpy as np
import torch
from support.dist_utils import as_torchrun, assert_close_dicts, run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.training import held_and_real, named_weights

ACCUMULATE = 2
STEPS = 4  # optimizer steps, of ACCUMULATE micro-batches each
MAX_NORM = 0.05  # below the gradient's norm: the clip acts at every step
SETTINGS = dict(bucket_cap_mb=0.0008)  # several buckets on the small model


def _accelerator(rank, world_size, **kwargs):
    """A fresh multi-process CPU ``Accelerator`` on the rank's Gloo group (Accelerate's
    singletons reset, so that each run in a rank function can configure its own)."""
    as_torchrun(rank, world_size)
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    if "gradient_accumulation_plugin" not in kwargs:
        kwargs.setdefault("gradient_accumulation_steps", ACCUMULATE)
    return Accelerator(cpu=True, **kwargs)


def _model_and_optimizer(rank):
    model = make_model("tied", seed=rank)  # ranks start apart: sapipe and DDP broadcast rank 0's
    return model, torch.optim.AdamW(model.parameters(), lr=0.01, weight_decay=0.1)


def _accelerate_loop(accelerator, model, optimizer, batches, rank, micro_steps, scheduler=None):
    """Accelerate's documented loop over the micro-batches ``micro_steps``."""
    loss_fn = loss_fn_for("tied")
    for t in micro_steps:
        x, y = batches[t][rank]
        with accelerator.accumulate(model):
            accelerator.backward(loss_fn(model(x), y))
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), MAX_NORM)
            optimizer.step()
            if scheduler is not None:
                scheduler.step()
            optimizer.zero_grad()


def _through_accelerate(rank, world_size, batches, k, compensation="none", precision="no"):
    from sapipe.integrations.accelerate import prepare

    accelerator = _accelerator(rank, world_size, mixed_precision=precision)
    model, optimizer = _model_and_optimizer(rank)
    model, optimizer = prepare(
        accelerator, model, optimizer, stale_layers=k, compensation=compensation, **SETTINGS
    )
    _accelerate_loop(accelerator, model, optimizer, batches, rank, range(len(batches)))
    held, real = held_and_real(model, optimizer.sapipe)
    optimizer.sapipe.finish()
    final = named_weights(model)
    assert all(torch.equal(final[n], w) for n, w in real.items()), "finish() left other weights"
    return {"held": held, "real": real}


def _plain_loop(rank, world_size, batches, k, compensation="none", precision="no"):
    """sapipe's own loop doing what Accelerate's does: micro-batches under ``opt.no_sync()``,
    the loss divided by their number, the forward autocast as Accelerate wraps it."""
    import sapipe

    model, optimizer = _model_and_optimizer(rank)
    opt = sapipe.DistributedOptimizer(
        optimizer, model, stale_layers=k, compensation=compensation, **SETTINGS
    )
    if precision == "bf16":
        model.forward = torch.autocast("cpu", dtype=torch.bfloat16)(model.forward)
    loss_fn = loss_fn_for("tied")
    for step in range(len(batches) // ACCUMULATE):
        for i in range(ACCUMULATE):
            x, y = batches[step * ACCUMULATE + i][rank]
            last = i == ACCUMULATE - 1
            with contextlib.nullcontext() if last else opt.no_sync():
                (loss_fn(model(x).float(), y) / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
    held, real = held_and_real(model, opt)
    opt.close()
    return {"held": held, "real": real}


# ---------------------------------------------------------------------------- k = 0: DDP


def _k0_against_ddp(rank, world_size, directory):
    """Accelerate's DDP and sapipe at k = 0, each trained uninterrupted (its state saved
    half-way), then each resumed from the other's state."""
    from sapipe.integrations.accelerate import prepare

    batches = make_batches("tied", STEPS * ACCUMULATE, world_size)
    half = len(batches) // 2

    def train(name, resume=None):
        accelerator = _accelerator(rank, world_size)
        model, optimizer = _model_and_optimizer(rank)
        if name.startswith("sapipe"):
            model, optimizer = prepare(accelerator, model, optimizer, stale_layers=0, **SETTINGS)
        else:
            model, optimizer = accelerator.prepare(model, optimizer)  # Accelerate's DDP
        if resume is not None:
            accelerator.load_state(os.path.join(directory, resume))
        for t in range(half if resume else 0, len(batches)):
            _accelerate_loop(accelerator, model, optimizer, batches, rank, [t])
            if t + 1 == half and resume is None:
                accelerator.save_state(os.path.join(directory, name))
        weights = named_weights(accelerator.unwrap_model(model))
        if name.startswith("sapipe"):
            optimizer.sapipe.finish()
        return weights

    return {
        "ddp": train("ddp"),
        "sapipe": train("sapipe"),
        "ddp from sapipe": train("ddp, resumed", resume="sapipe"),
        "sapipe from ddp": train("sapipe, resumed", resume="ddp"),
    }


def test_k0_trains_as_accelerates_ddp_and_resumes_its_state(tmp_path):
    for rank, result in enumerate(run_ranks(_k0_against_ddp, args=(str(tmp_path),))):
        for run in ("sapipe", "ddp from sapipe", "sapipe from ddp"):
            assert_close_dicts(result[run], result["ddp"], 1e-6, 1e-6, f"rank {rank}, {run}")


# ---------------------------------------------------------------------------- k > 0


CASES = [("none", "no"), ("wp1", "bf16")]


def _k2_against_plain_loop(rank, world_size):
    batches = make_batches("tied", STEPS * ACCUMULATE, world_size)
    return [
        (
            _through_accelerate(rank, world_size, batches, 2, compensation, precision),
            _plain_loop(rank, world_size, batches, 2, compensation, precision),
        )
        for compensation, precision in CASES
    ]


def test_stale_layers_train_as_sapipes_plain_loop():
    for rank, cases in enumerate(run_ranks(_k2_against_plain_loop, world_size=2)):
        for (compensation, precision), (accelerate, plain) in zip(CASES, cases):
            for what in ("held", "real"):
                assert_close_dicts(
                    accelerate[what],
                    plain[what],
                    1e-6,
                    1e-6,
                    f"rank {rank}, {compensation}, {precision}: {what}",
                )


# ---------------------------------------------------------------------------- auto


def _auto(rank, world_size):
    from sapipe.integrations.accelerate import prepare

    accelerator = _accelerator(rank, world_size)
    model, optimizer = _model_and_optimizer(rank)
    model, optimizer = prepare(
        accelerator, model, optimizer, stale_layers="auto", profile_steps=1, tune_steps=0
    )
    batches = make_batches("tied", 40, world_size)
    t = 0
    while optimizer.sapipe.stale_layers == "auto" and t < len(batches):
        _accelerate_loop(accelerator, model, optimizer, batches, rank, range(t, t + ACCUMULATE))
        t += ACCUMULATE
    k = optimizer.sapipe.stale_layers
    _accelerate_loop(accelerator, model, optimizer, batches, rank, range(t, t + 2 * ACCUMULATE))
    optimizer.sapipe.finish()
    return {"k": k, "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters())}


def test_auto_decides_and_trains():
    results = run_ranks(_auto, world_size=2)
    assert all(isinstance(r["k"], int) for r in results), results
    assert results[0]["k"] == results[1]["k"]
    assert all(r["finite"] for r in results)


# ---------------------------------------------------------------------------- checkpoints


def _resume(rank, world_size, directory):
    """Uninterrupted vs saved after 2 steps, rebuilt from scratch, loaded and continued: k = 2
    with wp1 (each rank's predicted weights and gradients its own), an LR schedule."""
    from safetensors.torch import load_file

    from sapipe.integrations.accelerate import prepare, rank_file

    batches = make_batches("tied", STEPS * ACCUMULATE, world_size)
    half = STEPS // 2 * ACCUMULATE

    def start():
        accelerator = _accelerator(rank, world_size)
        model, optimizer = _model_and_optimizer(rank)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
        model, optimizer = prepare(
            accelerator, model, optimizer, stale_layers=2, compensation="wp1", **SETTINGS
        )
        return accelerator, model, optimizer, accelerator.prepare(scheduler)

    accelerator, model, optimizer, scheduler = start()
    _accelerate_loop(accelerator, model, optimizer, batches, rank, range(len(batches)), scheduler)
    whole = held_and_real(model, optimizer.sapipe)
    optimizer.sapipe.finish()

    accelerator, model, optimizer, scheduler = start()
    before = os.path.join(directory, "before")
    accelerator.save_state(before)  # before any step: nothing per rank yet, the plain state
    _accelerate_loop(accelerator, model, optimizer, batches, rank, range(half), scheduler)
    accelerator.save_state(directory)
    real_at_save = held_and_real(model, optimizer.sapipe)[1]
    # rank 0 writes it (and no barrier follows save_state)
    saved = load_file(os.path.join(directory, "model.safetensors")) if rank == 0 else {}
    optimizer.sapipe.finish()

    accelerator, model, optimizer, scheduler = start()
    accelerator.load_state(directory)
    _accelerate_loop(
        accelerator, model, optimizer, batches, rank, range(half, len(batches)), scheduler
    )
    resumed = held_and_real(model, optimizer.sapipe)
    optimizer.sapipe.finish()
    return {
        "whole": whole,
        "resumed": resumed,
        "own_file": os.path.exists(rank_file(directory, rank)),
        "before": sorted(os.listdir(before)),
        "saved_real": rank != 0 or all(torch.equal(saved[n], w) for n, w in real_at_save.items()),
        "predicted": any(not torch.equal(whole[0][n], w) for n, w in whole[1].items()),
    }


def test_save_state_and_load_state_resume_bit_exactly(tmp_path):
    results = run_ranks(_resume, world_size=2, args=(str(tmp_path),))
    for rank, result in enumerate(results):
        assert result["own_file"], f"rank {rank} wrote no sapipe state of its own"
        if rank == 0:  # the writer (save_state ends without a barrier)
            assert "optimizer.bin" in result["before"], result["before"]
        assert not any(f.startswith("sapipe") for f in result["before"]), result["before"]
        assert result["predicted"], "wp1 held no predicted weights: the test proves nothing"
        for i, what in enumerate(("held", "real")):
            for name, value in result["whole"][i].items():
                assert np.array_equal(result["resumed"][i][name], value), (
                    f"rank {rank}: {what} {name} differs after the resume"
                )
    assert results[0]["saved_real"], "model.safetensors does not hold rank 0's real weights"
    # the ranks' predicted weights differ: each resumed from its own state, not rank 0's
    held = [r["whole"][0] for r in results]
    assert any(not np.array_equal(held[0][n], held[1][n]) for n in held[0])


# ---------------------------------------------------------------------------- refused


def _refused(rank, world_size):
    from accelerate import Accelerator
    from accelerate.utils import (
        DDPCommunicationHookType,
        DistributedDataParallelKwargs,
        DistributedType,
        GradientAccumulationPlugin,
    )

    from sapipe.errors import ConfigurationError
    from sapipe.integrations.accelerate import prepare

    def attempt(accelerator, model=None, optimizer=None, **settings):
        if model is None:
            model, optimizer = _model_and_optimizer(rank)
        try:
            prepare(accelerator, model, optimizer, **settings)
        except ConfigurationError as exc:
            return str(exc)
        return None

    def patched(name, value):
        return mock.patch.object(
            Accelerator, name, new_callable=mock.PropertyMock, return_value=value
        )

    messages = {}
    accelerator = _accelerator(rank, world_size)
    model, optimizer = _model_and_optimizer(rank)
    ddp, prepared = accelerator.prepare(model, optimizer)
    messages["ddp model"] = attempt(accelerator, ddp, torch.optim.SGD(model.parameters(), lr=0.1))
    messages["prepared before"] = attempt(
        accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1)
    )
    other, _ = _model_and_optimizer(rank)
    messages["prepared optimizer"] = attempt(accelerator, other, prepared)
    messages["unknown setting"] = attempt(accelerator, stale_layer=2)
    for kind in (DistributedType.DEEPSPEED, DistributedType.FSDP):
        with patched("distributed_type", kind):  # neither runs on CPU ranks: Accelerate's view
            messages[str(kind)] = attempt(accelerator)
    with patched("use_distributed", False):
        messages["one process"] = attempt(accelerator)
    hook = DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)
    messages["comm hook"] = attempt(_accelerator(rank, world_size, kwargs_handlers=[hook]))
    plugin = GradientAccumulationPlugin(num_steps=2, sync_each_batch=True)
    messages["sync_each_batch"] = attempt(
        _accelerator(rank, world_size, gradient_accumulation_plugin=plugin)
    )
    accelerator = _accelerator(rank, world_size)
    model, optimizer = _model_and_optimizer(rank)
    model, optimizer = prepare(accelerator, model, optimizer)
    messages["prepared twice"] = attempt(
        accelerator, model, torch.optim.SGD(model.parameters(), lr=0.1)
    )
    batches = make_batches("tied", ACCUMULATE, world_size)
    _accelerate_loop(accelerator, model, optimizer, batches, rank, range(ACCUMULATE))
    try:  # rank 0's optimizer.bin holds only a marker of the per-rank files
        optimizer.load_state_dict(optimizer.state_dict())
    except ConfigurationError as exc:
        messages["marker"] = str(exc)
    optimizer.sapipe.finish()
    return messages


EXPECTED = {
    "ddp model": "already wrapped in DistributedDataParallel",
    "prepared before": "already wrapped in DistributedDataParallel",
    "prepared optimizer": "optimizer is already wrapped (AcceleratedOptimizer)",
    "unknown setting": "unknown settings ['stale_layer']",
    "DistributedType.DEEPSPEED": "DeepSpeed",
    "DistributedType.FSDP": "FSDP",
    "one process": "single process",
    "comm hook": "communication hook",
    "sync_each_batch": "sync_each_batch=True (Accelerate's GradientAccumulationPlugin",
    "prepared twice": "prepared for sapipe already",
    "marker": "load the directory with accelerator.load_state()",
}


def test_what_sapipe_cannot_honour_is_refused_on_every_rank():
    for rank, messages in enumerate(run_ranks(_refused, world_size=2)):
        for case, cause in EXPECTED.items():
            message = messages.get(case)
            assert message is not None, f"rank {rank}: {case} was not refused"
            assert message.startswith("sapipe: ") and cause in message, (rank, case, message)
