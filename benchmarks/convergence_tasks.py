"""The convergence benchmark's tasks: data, model, optimizer, loss and test metric.

Every task's data is already on the machine (scikit-learn ships ``digits``; the Python
standard library ships its own source) or generated from a fixed seed, and its train/test
split is fixed. Each rank draws its own training mini-batches from a generator seeded by
(seed, rank), so a given seed sees the same batch sequence in every mode.

Tasks
-----
``digits``  CNN on scikit-learn's 8x8 handwritten digits (1797 images; a fixed stratified
            1437/360 train/test split, ``random_state=0``), SGD with momentum 0.9.
            Metric: test accuracy (%).
``lm``      byte-level Transformer language model (2 pre-LN blocks, width 64, context 64)
            on the source of the standard-library modules in ``STDLIB_FILES`` of
            ``examples/demo.py`` (read from ``sysconfig.get_paths()["stdlib"]``, concatenated
            in that order, first 90 % for training, last 10 % held out). Adam. Metric:
            held-out perplexity per byte.
``deepmlp`` the "staleness hurts" task: an 8-layer ReLU MLP (width 128) on the same digits
            split (flattened pixels), SGD with momentum 0.9 at a high learning rate, so a
            one-step-stale gradient sits near the edge of momentum SGD's stability region.
            Metric: test accuracy (%).
``units``   the "error feedback matters" task, in the compression study only: linear
            regression of 16 targets given in four units (x1000, x100, x10, x1, in turn) on 32
            standardised synthetic features, plain SGD on the raw (unscaled) targets. int8 sends
            each block of 64 consecutive gradient values (here two rows of the weight) as
            multiples of max|v| / 127; a x1 target's weights share their blocks with a x10
            target's, whose gradients are about 10x larger, so the x1 gradients are rounded to
            a few levels and their small entries to zero. Without error feedback that rounding
            is the same step after step and its error accumulates in the weights; error
            feedback keeps adding what was dropped until it is sent. Data and settings are not
            tuned beyond showing this. A single layer: every mode is ``sync``.
            Metric: test R² (%), the mean of the 16 targets' (each target counts equally,
            whatever its unit).

A task's "usual" hyper-parameters are the ones a synchronous run would use; they are not
tuned per mode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import harness
import torch
import torch.nn as nn
import torch.nn.functional as F

# The character-level LM task trains the demo's model on the demo's text (standard-library
# source, byte-level): one definition of both, in examples/demo.py.
_demo = harness.load_example("demo")
VOCAB, CharLM, load_stdlib_text = _demo.VOCAB, _demo.CharLM, _demo.load_text


def count_layers(model: nn.Module) -> int:
    """m as sapipe counts it: modules that directly own trainable parameters (no tied weights
    in these models, so this equals ``DistributedOptimizer.num_layers``)."""
    seen, m = set(), 0
    for mod in model.modules():
        own = [p for p in mod.parameters(recurse=False) if p.requires_grad and id(p) not in seen]
        if own:
            m += 1
            seen.update(id(p) for p in own)
    return m


# --------------------------------------------------------------------------- data

_DIGITS_CACHE: dict[str, torch.Tensor] = {}


def load_digits_split() -> dict[str, torch.Tensor]:
    """scikit-learn digits, pixels scaled to [0, 1], fixed stratified 80/20 split."""
    if not _DIGITS_CACHE:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split

        d = load_digits()
        x = torch.tensor(d.images, dtype=torch.float32) / 16.0  # (N, 8, 8)
        y = torch.tensor(d.target, dtype=torch.long)
        idx = torch.arange(len(y)).numpy()
        tr, te = train_test_split(idx, test_size=0.2, random_state=0, stratify=d.target)
        tr, te = torch.as_tensor(tr), torch.as_tensor(te)
        mean, std = x[tr].mean(), x[tr].std()
        x = (x - mean) / std
        _DIGITS_CACHE.update(x_train=x[tr], y_train=y[tr], x_test=x[te], y_test=y[te])
    return _DIGITS_CACHE


# --------------------------------------------------------------------------- models


class DigitsCNN(nn.Module):
    """conv(1->16) -> conv(16->32) -> pool -> fc(512->64) -> fc(64->10); m = 4 layers."""

    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1)
        self.fc1 = nn.Linear(32 * 4 * 4, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(self.conv1(x.unsqueeze(1)))
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return self.fc2(F.relu(self.fc1(x.flatten(1))))


class DeepMLP(nn.Module):
    """``depth`` Linear layers (ReLU between), 64 -> width -> ... -> 10; m = depth.

    He (Kaiming-normal) initialisation, zero biases: with PyTorch's default init an
    8-layer ReLU MLP barely trains (the signal shrinks layer by layer).
    """

    def __init__(self, depth=8, width=128):
        super().__init__()
        dims = [64] + [width] * (depth - 1) + [10]
        self.layers = nn.ModuleList(
            nn.Linear(a, b) for a, b in zip(dims[:-1], dims[1:], strict=True)
        )
        for layer in self.layers:
            nn.init.kaiming_normal_(layer.weight, nonlinearity="relu")
            nn.init.zeros_(layer.bias)

    def forward(self, x):
        x = x.flatten(1)
        for i, layer in enumerate(self.layers):
            x = layer(x)
            if i < len(self.layers) - 1:
                x = F.relu(x)
        return x


# --------------------------------------------------------------------------- tasks


@dataclass
class Task:
    name: str
    title: str
    metric: str  # name of the test metric
    higher_is_better: bool
    steps: int  # training steps per mode (default run)
    quick_steps: int  # training steps per mode (--quick)
    eval_every: int
    batch: int  # per rank
    lr: float
    optimizer: str  # human-readable description for the report
    build_model: Callable[[], nn.Module]
    build_optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    load: Callable[[], None]
    sample: Callable[[torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    evaluate: Callable[[nn.Module], dict[str, float]]  # {"metric": ..., "loss": ...}
    # The task's best sapipe mode (by mean final metric in the 3-seed main run reported in
    # benchmarks/results/convergence.md): the compression study runs it compressed.
    best_mode: str
    notes: str = ""
    # The studies of benchmarks/convergence.py that run the task ("main", "compression").
    studies: tuple[str, ...] = ("main", "compression")
    extra: dict = field(default_factory=dict)


def _classifier_task(
    name,
    title,
    build_model,
    *,
    lr,
    momentum,
    steps,
    quick_steps,
    eval_every,
    batch,
    best_mode,
    notes,
):
    def sample(gen):
        d = load_digits_split()
        i = torch.randint(0, d["y_train"].numel(), (batch,), generator=gen)
        return d["x_train"][i], d["y_train"][i]

    def loss(model, x, y):
        return F.cross_entropy(model(x), y)

    @torch.no_grad()
    def evaluate(model):
        d = load_digits_split()
        logits = model(d["x_test"])
        return {
            "metric": 100.0 * (logits.argmax(1) == d["y_test"]).float().mean().item(),
            "loss": F.cross_entropy(logits, d["y_test"]).item(),
        }

    return Task(
        name=name,
        title=title,
        metric="test accuracy (%)",
        higher_is_better=True,
        steps=steps,
        quick_steps=quick_steps,
        eval_every=eval_every,
        batch=batch,
        lr=lr,
        optimizer=f"SGD(lr={lr}, momentum={momentum}, fused=True)",
        build_model=build_model,
        build_optimizer=lambda m: torch.optim.SGD(
            m.parameters(), lr=lr, momentum=momentum, fused=True
        ),
        load=load_digits_split,
        sample=sample,
        loss=loss,
        evaluate=evaluate,
        best_mode=best_mode,
        notes=notes,
    )


def _lm_task(
    *, lr=3e-3, steps=300, quick_steps=20, eval_every=25, batch=16, context=64, eval_windows=128
):
    text: dict[str, torch.Tensor] = {}

    def load():
        if not text:
            train, test = load_stdlib_text()
            # Fixed held-out set: eval_windows evenly spaced windows of the held-out text.
            starts = torch.linspace(0, test.numel() - context - 2, eval_windows).long()
            text.update(
                train=train,
                x_test=torch.stack([test[s : s + context] for s in starts.tolist()]),
                y_test=torch.stack([test[s + 1 : s + context + 1] for s in starts.tolist()]),
            )

    def sample(gen):
        load()
        data = text["train"]
        starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=gen).tolist()
        return (
            torch.stack([data[s : s + context] for s in starts]),
            torch.stack([data[s + 1 : s + context + 1] for s in starts]),
        )

    def loss(model, x, y):
        return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))

    @torch.no_grad()
    def evaluate(model):
        load()
        ce = loss(model, text["x_test"], text["y_test"]).item()
        return {"metric": math.exp(ce) if ce < 50 else float("inf"), "loss": ce}

    return Task(
        name="lm",
        title="Transformer LM (stdlib source, bytes)",
        metric="test perplexity",
        higher_is_better=False,
        steps=steps,
        quick_steps=quick_steps,
        eval_every=eval_every,
        batch=batch,
        lr=lr,
        optimizer=f"Adam(lr={lr}, fused=True)",
        build_model=lambda: CharLM(context=context),
        build_optimizer=lambda m: torch.optim.Adam(m.parameters(), lr=lr, fused=True),
        load=load,
        sample=sample,
        loss=loss,
        evaluate=evaluate,
        best_mode="wp1",
        notes=(
            f"byte-level, context {context}, 2 blocks, width 64; held-out set = "
            f"{eval_windows} fixed windows of the last 10 % of the text"
        ),
    )


UNITS = (1e3, 1e2, 1e1, 1.0)  # the targets' units, in turn


def make_units_data(features=32, targets=16, n_train=4096, n_test=1024, noise=0.3, seed=0):
    """The ``units`` task's data, the same on every rank and in every run (its own seed).

    x ~ N(0, I) (standardised features); target t = (x · w_t + noise) · UNITS[t % 4] with
    w_t ~ N(0, I / features) and noise ~ N(0, noise²): each target's best R² is about
    1 / (1 + noise²) ≈ 0.92, in whatever unit it is given.
    """
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(features, targets, generator=gen) / math.sqrt(features)
    x = torch.randn(n_train + n_test, features, generator=gen)
    eps = noise * torch.randn(n_train + n_test, targets, generator=gen)
    unit = torch.tensor([UNITS[t % len(UNITS)] for t in range(targets)])
    y = (x @ w + eps) * unit
    return dict(x_train=x[:n_train], y_train=y[:n_train], x_test=x[n_train:], y_test=y[n_train:])


def r_squared(pred: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """R² of each column of ``pred`` against ``y``: 1 - MSE / variance of the target."""
    return 1.0 - ((pred - y) ** 2).mean(0) / y.var(0, unbiased=False)


def _units_task(
    *, features=32, targets=16, lr=0.5, steps=300, quick_steps=20, eval_every=25, batch=32
):
    data: dict[str, torch.Tensor] = {}

    def load():
        if not data:
            data.update(make_units_data(features, targets))

    def sample(gen):
        load()
        i = torch.randint(0, data["y_train"].shape[0], (batch,), generator=gen)
        return data["x_train"][i], data["y_train"][i]

    def loss(model, x, y):
        return F.mse_loss(model(x), y)  # on the raw targets, as given

    @torch.no_grad()
    def evaluate(model):
        """Mean R² (%) of the targets; also each unit's own (``r2_x1000`` ...), in the JSON only."""
        load()
        pred = model(data["x_test"])
        r2 = 100.0 * r_squared(pred, data["y_test"])
        by_unit = {f"r2_x{u:g}": r2[i :: len(UNITS)].mean().item() for i, u in enumerate(UNITS)}
        return {
            "metric": r2.mean().item(),
            "loss": F.mse_loss(pred, data["y_test"]).item(),
            **by_unit,
        }

    units = ", ".join(f"x{u:g}" for u in UNITS)
    return Task(
        name="units",
        title="Linear regression, targets in 4 units",
        metric="test R² (%)",
        higher_is_better=True,
        steps=steps,
        quick_steps=quick_steps,
        eval_every=eval_every,
        batch=batch,
        lr=lr,
        optimizer=f"SGD(lr={lr}, fused=True)",
        build_model=lambda: nn.Linear(features, targets),
        build_optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=lr, fused=True),
        load=load,
        sample=sample,
        loss=loss,
        evaluate=evaluate,
        best_mode="sync",
        studies=("compression",),
        notes=(
            f"Linear({features}, {targets}), synthetic (seed 0): {features} N(0, 1) features, "
            f"{targets} noisy linear targets in units {units} in turn, MSE on the raw targets, "
            "4096/1024 split; metric = the targets' mean R². Shows what error feedback is for: "
            "the x1 targets' gradients are ~1/10 of the x10 ones' in the same int8 blocks"
        ),
    )


def get_tasks() -> dict[str, Task]:
    tasks = [
        _classifier_task(
            "digits",
            "CNN on digits",
            DigitsCNN,
            lr=0.05,
            momentum=0.9,
            steps=300,
            quick_steps=20,
            eval_every=25,
            batch=32,
            best_mode="wp2",
            notes="2 conv + 2 fc, 1437/360 split",
        ),
        _lm_task(),
        _classifier_task(
            "deepmlp",
            "8-layer MLP on digits, high LR",
            lambda: DeepMLP(depth=8, width=128),
            lr=0.05,
            momentum=0.9,
            steps=300,
            quick_steps=20,
            eval_every=25,
            batch=32,
            best_mode="wp1",
            notes=(
                "8 Linear layers of width 128, ReLU, He init, same split as digits; "
                "LR 0.05 = the largest of {0.02, 0.05, 0.1} at which sync trains stably"
            ),
        ),
        _units_task(),
    ]
    return {t.name: t for t in tasks}
