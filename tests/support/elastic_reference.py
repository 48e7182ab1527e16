"""Independent float64 reference of ``sapipe.ElasticAveraging`` (sapipe/elastic/averaging.py).

One process simulates every rank of the job from the same data, with the real ``torch.optim``
optimizers on float64 copies of the model; it shares no code with sapipe. The rule, written
out literally (n ranks, moving rate α, period τ; steps k = 1, 2, ...):

* every step, each rank takes its optimizer's own step on its own batch (unless ``skip``
  names that (rank, step): a GradScaler that found an overflow on that rank);
* at every k = pτ, with x_i the rank's averaged vector (trainable parameters, then
  floating-point buffers when ``average_buffers``) just after its local step and x̄ the centre
  (x̄ = x_0 at the start):

      d_i = x_i − x̄ ;   x_i ← x_i − α·d_i (the exact d_i) ;   x̄ ← x̄ + α·S

  with S = Σ_i d_i, or, compressed, S = q(Σ_i q(d_i)) (q: cast to the 16-bit type and back;
  the inner sum in rank order, in float64).

The centre is updated at once: the overlapped form claims to give this very trajectory (its
sum is needed only at the next sync point), which is what the tests hold it to.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

WIRE = {"bf16": torch.bfloat16, "fp16": torch.float16}


class BatchNormNet(nn.Module):
    """Linear → BatchNorm1d → tanh → Linear: a model with floating-point buffers
    (running mean and variance) and an integer one (num_batches_tracked). The first Linear
    has no bias: BatchNorm would cancel it, leave its gradient pure rounding noise, and Adam
    would turn that noise into full-size steps that no two processes round alike."""

    def __init__(self, sizes: tuple[int, int, int] = (6, 10, 3)):
        super().__init__()
        self.fc1 = nn.Linear(sizes[0], sizes[1], bias=False)
        self.norm = nn.BatchNorm1d(sizes[1])
        self.fc2 = nn.Linear(sizes[1], sizes[2])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(torch.tanh(self.norm(self.fc1(x))))


def make_net(seed: int = 0, dtype: torch.dtype = torch.float32) -> BatchNormNet:
    """A :class:`BatchNormNet` with deterministic initial weights (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = BatchNormNet()
    return model.to(dtype)


def make_data(
    steps: int, world_size: int, batch: int = 8, seed: int = 0, dtype: torch.dtype = torch.float32
) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """``data[k][r] = (x, y)``: rank r's batch of step k + 1, from a private generator. Each
    rank's inputs are shifted by its rank, so the ranks' models drift apart between syncs."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for _ in range(steps):
        per_rank = []
        for r in range(world_size):
            x = torch.randn(batch, 6, generator=g, dtype=torch.float64) + 0.5 * r
            y = torch.randn(batch, 3, generator=g, dtype=torch.float64)
            per_rank.append((x.to(dtype), y.to(dtype)))
        data.append(per_rank)
    return data


def loss_fn(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, y)


def optimizer_factory(name: str) -> Callable[[list[nn.Parameter]], torch.optim.Optimizer]:
    """The tests' optimizers: ``sgd`` (momentum, Nesterov, weight decay) or ``adamw``."""
    if name == "sgd":
        return lambda params: torch.optim.SGD(
            params, lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01
        )
    if name == "adamw":
        return lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.1)
    raise ValueError(name)


def averaged(model: nn.Module, average_buffers: bool = True) -> list[tuple[str, torch.Tensor]]:
    """(name, tensor) of what the rule averages, in order: trainable parameters, then
    floating-point buffers."""
    out = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if average_buffers:
        out += [(n, b) for n, b in model.named_buffers() if b.is_floating_point()]
    return out


def _q(t: torch.Tensor, compression: str | None) -> torch.Tensor:
    return t if compression is None else t.to(WIRE[compression]).to(torch.float64)


def simulate(
    data: list[list[tuple[torch.Tensor, torch.Tensor]]],
    *,
    optimizer: str,
    period: int,
    alpha: float,
    compression: str | None = None,
    average_buffers: bool = True,
    skip: frozenset[tuple[int, int]] = frozenset(),
    seed: int = 0,
) -> dict:
    """Run the rule on every rank in float64; returns ``{"ranks": [state per rank], "centre":
    {name: array}, "centres": [centre after each sync]}``, a rank's state being its
    ``model.state_dict()`` as float64 numpy arrays."""
    n = len(data[0])
    models = [make_net(seed, torch.float64) for _ in range(n)]
    optimizers = [optimizer_factory(optimizer)(list(m.parameters())) for m in models]
    centre = {name: t.detach().clone() for name, t in averaged(models[0], average_buffers)}
    centres = []
    for k, batches in enumerate(data, start=1):
        for r, (model, opt, (x, y)) in enumerate(zip(models, optimizers, batches)):
            opt.zero_grad()
            loss_fn(model(x.to(torch.float64)), y.to(torch.float64)).backward()
            if (r, k) not in skip:
                opt.step()
        if k % period:
            continue
        with torch.no_grad():
            differences = [
                {name: t - centre[name] for name, t in averaged(m, average_buffers)} for m in models
            ]
            total = {name: torch.zeros_like(c) for name, c in centre.items()}
            for d in differences:  # rank order
                for name in total:
                    total[name] += _q(d[name], compression)
            for model, d in zip(models, differences):
                for name, t in averaged(model, average_buffers):
                    t -= alpha * d[name]
            for name in centre:
                centre[name] += alpha * _q(total[name], compression)
        centres.append({name: c.numpy().copy() for name, c in centre.items()})
    return {
        "ranks": [
            {k: v.detach().numpy().copy() for k, v in m.state_dict().items()} for m in models
        ],
        "centre": {name: c.numpy().copy() for name, c in centre.items()},
        "centres": centres,
    }


__all__ = [
    "BatchNormNet",
    "make_net",
    "make_data",
    "loss_fn",
    "optimizer_factory",
    "averaged",
    "simulate",
]
