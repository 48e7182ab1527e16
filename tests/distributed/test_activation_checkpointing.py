"""Activation checkpointing (``torch.utils.checkpoint``) under sapipe.

With ``use_reentrant=True`` the checkpointed segment's backward is a backward pass of its own,
run inside a node of the outer one. When the segment holds the model's last layers, the first
gradients of the iteration arrive inside that inner pass, and the rest (the layers before the
segment) only after it ends: ``p.grad`` must be exposed at the end of the outer pass, not of the
inner one. Checked on 2 ranks, with the script clipping (it reads ``p.grad`` between backward
and step()): at k = 0 each form equals DDP within 1e-6, and at k = 2 each equals sapipe's own run
without checkpointing within 1e-6.
"""

from __future__ import annotations

import functools

import pytest
import torch
from support.dist_utils import run_ranks
from torch import nn

STEPS = 5
FORMS = ("none", "reentrant", "non-reentrant")


class TailCheckpointed(nn.Module):
    """Four linear layers; with a checkpoint ``form``, the last three run as one checkpointed
    segment."""

    def __init__(self, form: str):
        super().__init__()
        torch.manual_seed(0)
        self.form = form
        self.a, self.b, self.c, self.d = (
            nn.Linear(8, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 16),
            nn.Linear(16, 4),
        )

    def tail(self, x):
        return self.d(torch.tanh(self.c(torch.tanh(self.b(x)))))

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint

        x = torch.tanh(self.a(x))
        if self.form == "none":
            return self.tail(x)
        return checkpoint(self.tail, x, use_reentrant=self.form == "reentrant")


def _train(rank, world_size):
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sapipe

    generator = torch.Generator().manual_seed(rank)
    batches = [
        (torch.randn(4, 8, generator=generator), torch.randn(4, 4, generator=generator))
        for _ in range(STEPS)
    ]
    out = {}
    for k in (0, 2):
        for form in FORMS:
            model = TailCheckpointed(form)
            opt = sapipe.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
                model,
                stale_layers=k,
                bucket_cap_mb=0.0001,  # a bucket per layer
            )
            runs = [(model, opt)]
            if k == 0:
                reference = TailCheckpointed(form)
                runs.append(
                    (DDP(reference), torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9))
                )
            for x, y in batches:
                for net, o in runs:
                    o.zero_grad()
                    x_in = x.requires_grad_() if form == "reentrant" else x
                    nn.functional.mse_loss(net(x_in), y).backward()
                    torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
                    o.step()
            opt.synchronize()
            out[(k, form)] = [p.detach().clone() for p in model.parameters()]
            if k == 0:
                out[("ddp", form)] = [p.detach().clone() for p in reference.parameters()]
            opt.close()
    return out


@functools.cache
def _results():
    return run_ranks(_train, world_size=2, timeout=120)


def _diff(a, b) -> float:
    return max(float(abs(x - y).max()) for x, y in zip(a, b))


@pytest.mark.parametrize("form", FORMS)
def test_checkpointed_layers_train_as_without_checkpointing(form):
    for per_rank in _results():
        assert _diff(per_rank[(0, form)], per_rank[("ddp", form)]) < 1e-6, form
        assert _diff(per_rank[(2, form)], per_rank[(2, "none")]) < 1e-6, form
        assert _diff(per_rank[(2, form)], per_rank[(0, form)]) > 1e-5, "k = 2 must be stale"
