"""Small, float-generic test models and deterministic batches for the sapipe test-suite.

Plain ``torch.nn`` only; nothing here imports sapipe.

* ``TiedResidualNet`` — embedding -> two residual MLP blocks -> output head whose weight
  IS the embedding weight (the same Parameter registered in two modules). Submodules are
  registered in an order different from their forward execution order on purpose, so
  that code which orders layers by registration (instead of by execution) is caught.
* ``MLP`` — Sequential of Linear+Tanh, regression output (MSE loss).
* ``make_batches(name, steps, world_size, ...)`` -> ``batches[t][r] = (inputs, targets)``.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = [
    "TiedResidualNet",
    "MLP",
    "tied_loss_fn",
    "mlp_loss_fn",
    "loss_fn_for",
    "make_model",
    "make_batches",
]


def tied_loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Cross entropy over the vocabulary; ``out`` is [B, T, V], ``target`` is [B, T]."""
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


def mlp_loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean squared error."""
    return F.mse_loss(out, target)


class _ResidualBlock(nn.Module):
    """x + fc2(tanh(fc1(norm(x)))). fc2 is registered BEFORE fc1 (and norm last) on purpose."""

    def __init__(self, dim: int, hidden: int, layer_norm: bool):
        super().__init__()
        self.fc2 = nn.Linear(hidden, dim)
        self.fc1 = nn.Linear(dim, hidden)
        self.norm = nn.LayerNorm(dim) if layer_norm else nn.Identity()

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(self.norm(x))))


class _TiedHead(nn.Module):
    """Output projection: directly owns the (tied) embedding weight and its own bias."""

    def __init__(self, embed: nn.Embedding):
        super().__init__()
        self.weight = embed.weight  # the SAME Parameter object as embed.weight
        self.bias = nn.Parameter(torch.zeros(embed.num_embeddings))

    def forward(self, h):
        return F.linear(h, self.weight, self.bias)


class TiedResidualNet(nn.Module):
    """Token ids [B, T] -> logits [B, T, vocab].

    Registration order: head, block_b, block_a, embed.
    Execution order:    embed, block_a.{norm, fc1, fc2}, block_b.{fc1, fc2}, head.
    The tied weight appears in ``named_parameters()`` as ``head.weight`` (first registered
    name) but belongs (by docs/design.md §2) to layer ``embed``, which executes first.
    """

    loss_fn = staticmethod(tied_loss_fn)

    def __init__(self, vocab: int = 16, dim: int = 8, hidden: int = 12):
        super().__init__()
        embed = nn.Embedding(vocab, dim)
        with torch.no_grad():
            embed.weight.mul_(0.5)  # keep initial logits moderate
        self.head = _TiedHead(embed)
        self.block_b = _ResidualBlock(dim, hidden, layer_norm=False)
        self.block_a = _ResidualBlock(dim, hidden, layer_norm=True)
        self.embed = embed

    def forward(self, tokens):
        h = self.embed(tokens)
        h = self.block_a(h)
        h = self.block_b(h)
        return self.head(h)


class MLP(nn.Sequential):
    """Linear+Tanh stack; the last Linear has no activation (regression output)."""

    loss_fn = staticmethod(mlp_loss_fn)

    def __init__(self, sizes=(6, 10, 8, 3)):
        layers = []
        for i in range(len(sizes) - 1):
            layers.append(nn.Linear(sizes[i], sizes[i + 1]))
            if i < len(sizes) - 2:
                layers.append(nn.Tanh())
        super().__init__(*layers)
        self.sizes = tuple(sizes)


_ALIASES = {"tied": "tied", "tiedresidualnet": "tied", "mlp": "mlp"}


def _canon(name: str) -> str:
    try:
        return _ALIASES[name.lower()]
    except KeyError:
        raise ValueError(f"unknown model name {name!r}; expected 'tied' or 'mlp'") from None


def loss_fn_for(model_name: str):
    return tied_loss_fn if _canon(model_name) == "tied" else mlp_loss_fn


def make_model(model_name: str, seed: int = 0, dtype: torch.dtype = torch.float32, **kwargs):
    """Build a model with deterministic initial weights (does not disturb the global RNG)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TiedResidualNet(**kwargs) if _canon(model_name) == "tied" else MLP(**kwargs)
    return model.to(dtype)


def make_batches(
    model_name: str,
    steps: int,
    world_size: int,
    batch: int = 4,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    *,
    vocab: int = 16,
    seq_len: int = 5,
    sizes=(6, 10, 8, 3),
):
    """``batches[t][r] = (inputs, targets)`` for t in range(steps), r in range(world_size).

    Deterministic from ``seed`` (a private torch.Generator). ``dtype`` applies to float
    tensors (MLP inputs/targets); token ids and class targets are int64.
    """
    g = torch.Generator().manual_seed(seed)
    kind = _canon(model_name)
    batches = []
    for _t in range(steps):
        per_rank = []
        for _r in range(world_size):
            if kind == "tied":
                x = torch.randint(0, vocab, (batch, seq_len), generator=g)
                y = torch.randint(0, vocab, (batch, seq_len), generator=g)
            else:
                x = torch.randn(batch, sizes[0], generator=g, dtype=torch.float64).to(dtype)
                y = torch.randn(batch, sizes[-1], generator=g, dtype=torch.float64).to(dtype)
            per_rank.append((x, y))
        batches.append(per_rank)
    return batches
