"""The plain training loop of the tests, and the reads of a model's weights.

A loop that does more than this one (a GradScaler, clipping, micro-batches, a poisoned loss,
a DDP twin stepped alongside, reads between steps) stays written out in its test: what it
does differently is what the test is about.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Callable


def train_steps(
    model,
    opt,
    batches,
    rank: int,
    steps: Iterable[int] | None = None,
    *,
    loss_fn: Callable,
    scheduler=None,
    forward: Callable | None = None,
    device=None,
) -> None:
    """For each step t (``steps``, by default every step of ``batches``): this rank's batch
    ``batches[t][rank]`` (moved to ``device`` when given), ``opt.zero_grad()``, the loss of
    ``forward`` (the model by default; a compiled or DDP-wrapped one) backward,
    ``opt.step()``, then ``scheduler.step()`` when given."""
    forward = model if forward is None else forward
    for t in range(len(batches)) if steps is None else steps:
        x, y = batches[t][rank]
        if device is not None:
            x, y = x.to(device), y.to(device)
        opt.zero_grad()
        loss_fn(forward(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()


def named_weights(model) -> dict:
    """A copy of the model's parameters, by name."""
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def held_and_real(model, opt) -> tuple[dict, dict]:
    """(held, real): the weights the model holds now (the predicted x̃ under weight
    prediction) and the real ones (``opt.real_weights()``). Nothing is synchronised first:
    the caller says when (``opt.synchronize()`` applies pending sync updates)."""
    held = named_weights(model)
    with opt.real_weights():
        return held, named_weights(model)


def bucket_layouts(opt, model) -> list[list[tuple[str, int]]]:
    """Each bucket's parameters as (name, numel), in bucket order (what the reference's
    compressed sums take)."""
    names = {id(p): n for n, p in model.named_parameters()}
    return [[(names[id(p)], p.numel()) for p in bucket.params] for bucket in opt.buckets]
