"""Model families for the throughput benchmark, with the paper's parameter distributions.

Each family comes in two sizes:

* ``small`` — sized so that one training step takes a few hundred milliseconds on one
  CPU core, while keeping the *shape* of the parameter distribution over layers in forward
  order, which is what decides how much communication partial staleness can hide;
* ``full`` — the paper's model (VGG-16, ResNet-50, GPT-2 small, Transformer-base) for GPUs.

The shape of each family's parameter distribution, in forward order:

* ``vgg16``: 13 small 3x3 convolutions, then three large fully connected layers (~75-90 % of
  the parameters) last;
* ``resnet50``: stem, bottleneck stages [3, 4, 6, 3] growing in width (most parameters in the
  last stage), a small classifier; GroupNorm;
* ``gpt2``: tied token embedding first — the largest layer, ~30 % of the parameters, executed
  first, its gradient ready last — then uniform decoder blocks;
* ``transformer``: encoder-decoder; one shared embedding (source, target, output projection)
  first, then encoder and decoder layers.

Normalisation: ResNet uses GroupNorm, which has no running statistics. sapipe broadcasts
buffers only at construction (README, known limitations), so BatchNorm's running stats
would drift apart between ranks in every mode alike; GroupNorm keeps all modes comparable.

``build(name, size)`` returns a :class:`ModelSpec` whose ``make_model()`` creates a fresh,
deterministically initialised model (the same on every call), and ``make_batch`` synthetic
inputs and targets. Plain ``torch.nn`` only; nothing here imports sapipe.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["ModelSpec", "FAMILIES", "SIZES", "build", "describe_layers"]

SIZES = ("tiny", "small", "full")


@dataclass
class ModelSpec:
    name: str
    size: str
    make_model: Callable[[], nn.Module]
    make_batch: Callable[[int, torch.device, torch.Generator], tuple[torch.Tensor, torch.Tensor]]
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch_size: int  # per rank
    optimizer: str  # "sgd" or "adam"
    lr: float
    notes: dict[str, object] = field(default_factory=dict)

    def make_optimizer(self, params) -> torch.optim.Optimizer:
        """torch's ``fused=True`` implementation (CPU and CUDA): the baselines step with the
        fastest update torch has, as their best users would; sapipe takes it as it is."""
        if self.optimizer == "sgd":
            return torch.optim.SGD(params, lr=self.lr, momentum=0.9, weight_decay=1e-4, fused=True)
        return torch.optim.Adam(params, lr=self.lr, fused=True)


# ----------------------------------------------------------------------------- VGG-16


class VGG(nn.Module):
    """VGG-16 layout: 13 conv3x3 (+ReLU, 5 max-pools), then FC-FC-FC."""

    def __init__(self, widths, pool_to: int, hidden: int, classes: int):
        super().__init__()
        layers = []
        c_in = 3
        for w in widths:
            if w == "M":
                layers.append(nn.MaxPool2d(2))
            else:
                layers += [nn.Conv2d(c_in, w, 3, padding=1), nn.ReLU(inplace=True)]
                c_in = w
        self.features = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(pool_to)
        self.classifier = nn.Sequential(
            nn.Linear(c_in * pool_to * pool_to, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, hidden),
            nn.ReLU(inplace=True),
            nn.Linear(hidden, classes),
        )

    def forward(self, x):
        return self.classifier(torch.flatten(self.pool(self.features(x)), 1))


def _vgg_widths(base: int):
    b = base
    return [
        b,
        b,
        "M",
        2 * b,
        2 * b,
        "M",
        4 * b,
        4 * b,
        4 * b,
        "M",
        8 * b,
        8 * b,
        8 * b,
        "M",
        8 * b,
        8 * b,
        8 * b,
        "M",
    ]


# ----------------------------------------------------------------------------- ResNet-50


class Bottleneck(nn.Module):
    def __init__(self, c_in: int, width: int, stride: int, groups: int):
        super().__init__()
        c_out = 4 * width
        self.conv1 = nn.Conv2d(c_in, width, 1, bias=False)
        self.n1 = nn.GroupNorm(min(groups, width), width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.n2 = nn.GroupNorm(min(groups, width), width)
        self.conv3 = nn.Conv2d(width, c_out, 1, bias=False)
        self.n3 = nn.GroupNorm(min(groups, c_out), c_out)
        self.down = None
        if stride != 1 or c_in != c_out:
            self.down = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False),
                nn.GroupNorm(min(groups, c_out), c_out),
            )

    def forward(self, x):
        identity = x if self.down is None else self.down(x)
        out = F.relu(self.n1(self.conv1(x)))
        out = F.relu(self.n2(self.conv2(out)))
        out = self.n3(self.conv3(out))
        return F.relu(out + identity)


class ResNet(nn.Module):
    """ResNet-50 layout: stem, bottleneck stages [3, 4, 6, 3], global pool, FC."""

    def __init__(
        self, base: int, classes: int, imagenet_stem: bool, groups: int = 8, blocks=(3, 4, 6, 3)
    ):
        super().__init__()
        if imagenet_stem:
            self.stem = nn.Sequential(
                nn.Conv2d(3, base, 7, 2, 3, bias=False),
                nn.GroupNorm(min(groups, base), base),
                nn.ReLU(inplace=True),
                nn.MaxPool2d(3, 2, 1),
            )
        else:
            self.stem = nn.Sequential(
                nn.Conv2d(3, base, 3, 1, 1, bias=False),
                nn.GroupNorm(min(groups, base), base),
                nn.ReLU(inplace=True),
            )
        stages = []
        c_in = base
        for i, n in enumerate(blocks):
            width = base * 2**i
            for j in range(n):
                stages.append(Bottleneck(c_in, width, 2 if (j == 0 and i > 0) else 1, groups))
                c_in = 4 * width
        self.stages = nn.Sequential(*stages)
        self.fc = nn.Linear(c_in, classes)

    def forward(self, x):
        x = self.stages(self.stem(x))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


# ----------------------------------------------------------------------------- GPT-2


class CausalSelfAttention(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, d))


class GPTBlock(nn.Module):
    def __init__(self, d: int, heads: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class GPT2(nn.Module):
    """GPT-2 layout: token embedding (tied with the LM head) + positions, pre-LN blocks."""

    def __init__(self, vocab: int, context: int, d: int, layers: int, heads: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.Sequential(*[GPTBlock(d, heads) for _ in range(layers)])
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied: the embedding owns it (it runs first)
        nn.init.normal_(self.tok.weight, std=0.02)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.tok(idx) + self.pos(pos)
        return self.head(self.ln_f(self.blocks(x)))


# ----------------------------------------------------------------------------- Transformer


class Seq2Seq(nn.Module):
    """Encoder-decoder Transformer (pre-LN); one embedding shared by source, target and output."""

    def __init__(self, vocab: int, context: int, d: int, enc: int, dec: int, heads: int, ff: int):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.encoder = nn.ModuleList(
            [
                nn.TransformerEncoderLayer(
                    d, heads, ff, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(enc)
            ]
        )
        self.enc_ln = nn.LayerNorm(d)
        self.decoder = nn.ModuleList(
            [
                nn.TransformerDecoderLayer(
                    d, heads, ff, dropout=0.0, batch_first=True, norm_first=True
                )
                for _ in range(dec)
            ]
        )
        self.dec_ln = nn.LayerNorm(d)
        self.scale = math.sqrt(d)
        nn.init.normal_(self.embed.weight, std=d**-0.5)

    def forward(self, src_tgt):
        src, tgt = src_tgt[:, 0], src_tgt[:, 1]
        t = src.shape[1]
        memory = self.embed(src) * self.scale  # the shared embedding runs first
        pos = self.pos(torch.arange(t, device=src.device))
        memory = memory + pos
        for layer in self.encoder:
            memory = layer(memory)
        memory = self.enc_ln(memory)
        x = self.embed(tgt) * self.scale + pos
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=src.device)
        for layer in self.decoder:
            x = layer(x, memory, tgt_mask=mask, tgt_is_causal=True)
        return F.linear(self.dec_ln(x), self.embed.weight)


# ----------------------------------------------------------------------------- registry


def _images(shape, classes):
    def make(batch, device, gen):
        x = torch.randn((batch,) + shape, generator=gen).to(device)
        y = torch.randint(0, classes, (batch,), generator=gen).to(device)
        return x, y

    return make


def _tokens(vocab, context, pairs=False):
    def make(batch, device, gen):
        if pairs:  # source and target sequences; target is predicted shifted by one
            seq = torch.randint(0, vocab, (batch, 2, context + 1), generator=gen)
            return seq[:, :, :-1].contiguous().to(device), seq[:, 1, 1:].contiguous().to(device)
        seq = torch.randint(0, vocab, (batch, context + 1), generator=gen)
        return seq[:, :-1].contiguous().to(device), seq[:, 1:].contiguous().to(device)

    return make


def _lm_loss(out, target):
    return F.cross_entropy(out.reshape(-1, out.shape[-1]), target.reshape(-1))


# Per family and size: constructor kwargs, batch per rank, data shape.
_CONFIGS = {
    "vgg16": {
        "tiny": dict(base=4, image=32, pool_to=2, hidden=256, classes=10, batch=8),
        "small": dict(base=16, image=32, pool_to=4, hidden=1024, classes=100, batch=16),
        "full": dict(base=64, image=224, pool_to=7, hidden=4096, classes=1000, batch=32),
    },
    "resnet50": {
        "tiny": dict(base=4, image=16, classes=10, batch=4, imagenet_stem=False),
        "small": dict(base=16, image=32, classes=100, batch=6, imagenet_stem=False),
        "full": dict(base=64, image=224, classes=1000, batch=32, imagenet_stem=True),
    },
    "gpt2": {
        "tiny": dict(vocab=1024, context=16, d=64, layers=2, heads=2, batch=4),
        "small": dict(vocab=4096, context=64, d=192, layers=4, heads=4, batch=4),
        "full": dict(vocab=50257, context=1024, d=768, layers=12, heads=12, batch=8),
    },
    "transformer": {
        "tiny": dict(vocab=1024, context=16, d=64, enc=1, dec=1, heads=2, ff=128, batch=4),
        "small": dict(vocab=4096, context=32, d=192, enc=2, dec=2, heads=4, ff=768, batch=5),
        "full": dict(vocab=32000, context=128, d=512, enc=6, dec=6, heads=8, ff=2048, batch=32),
    },
}

FAMILIES = tuple(_CONFIGS)


def build(name: str, size: str = "small", batch_size: int = 0) -> ModelSpec:
    """The :class:`ModelSpec` of family ``name`` at ``size`` (batch per rank overridable)."""
    if name not in _CONFIGS:
        raise ValueError(f"unknown model {name!r}; choose from {list(_CONFIGS)}")
    if size not in _CONFIGS[name]:
        raise ValueError(f"unknown size {size!r}; choose from {list(SIZES)}")
    c = dict(_CONFIGS[name][size])
    batch = batch_size or c.pop("batch")
    c.pop("batch", None)

    def seeded(ctor):
        def make():
            torch.manual_seed(1234)
            return ctor()

        return make

    if name == "vgg16":
        model = seeded(lambda: VGG(_vgg_widths(c["base"]), c["pool_to"], c["hidden"], c["classes"]))
        return ModelSpec(
            name,
            size,
            model,
            _images((3, c["image"], c["image"]), c["classes"]),
            F.cross_entropy,
            batch,
            "sgd",
            0.01,
        )
    if name == "resnet50":
        model = seeded(lambda: ResNet(c["base"], c["classes"], c["imagenet_stem"]))
        return ModelSpec(
            name,
            size,
            model,
            _images((3, c["image"], c["image"]), c["classes"]),
            F.cross_entropy,
            batch,
            "sgd",
            0.1,
        )
    if name == "gpt2":
        model = seeded(lambda: GPT2(c["vocab"], c["context"], c["d"], c["layers"], c["heads"]))
        return ModelSpec(
            name, size, model, _tokens(c["vocab"], c["context"]), _lm_loss, batch, "adam", 3e-4
        )
    model = seeded(
        lambda: Seq2Seq(c["vocab"], c["context"], c["d"], c["enc"], c["dec"], c["heads"], c["ff"])
    )
    return ModelSpec(
        name,
        size,
        model,
        _tokens(c["vocab"], c["context"], pairs=True),
        _lm_loss,
        batch,
        "adam",
        3e-4,
    )


def describe_layers(model: nn.Module, example_input) -> list:
    """(name, numel) of every parameter-owning module in forward-execution order.

    The same rule as sapipe's layer recorder (docs/design.md §2), for printing the parameter
    distribution without sapipe: tied parameters count for the first module that runs.
    """
    order, handles = [], []
    owners = [
        (n, m) for n, m in model.named_modules() if any(True for _ in m.parameters(recurse=False))
    ]
    for n, m in owners:
        handles.append(
            m.register_forward_pre_hook(
                lambda mod, args, n=n: order.append(n) if n not in order else None
            )
        )
    with torch.no_grad():
        model(example_input)
    for h in handles:
        h.remove()
    mods = dict(owners)
    out, seen = [], set()
    for n in order + [n for n, _ in owners if n not in order]:
        numel = sum(p.numel() for p in mods[n].parameters(recurse=False) if id(p) not in seen)
        seen.update(id(p) for p in mods[n].parameters(recurse=False))
        if numel:
            out.append((n, numel))
    return out


if __name__ == "__main__":  # python benchmarks/bench_models.py [size]: sizes and step times
    import argparse
    import time

    parser = argparse.ArgumentParser(description="Each family's size, layers and step time.")
    parser.add_argument("size", nargs="?", default="small", choices=SIZES)
    size = parser.parse_args().size
    torch.set_num_threads(1)
    for fam in FAMILIES:
        spec = build(fam, size)
        model = spec.make_model()
        gen = torch.Generator().manual_seed(0)
        x, y = spec.make_batch(spec.batch_size, torch.device("cpu"), gen)
        layers = describe_layers(model, x)
        total = sum(n for _, n in layers)
        opt = spec.make_optimizer(model.parameters())
        times = []
        for _ in range(6):
            t0 = time.perf_counter()
            opt.zero_grad()
            spec.loss_fn(model(x), y).backward()
            opt.step()
            times.append(time.perf_counter() - t0)
        top = sorted(range(len(layers)), key=lambda i: -layers[i][1])[:3]
        print(
            f"{fam:12s} {size}: {total / 1e6:7.2f} M params, m={len(layers):3d}, batch "
            f"{spec.batch_size}, "
            f"step {1e3 * sorted(times[1:])[len(times[1:]) // 2]:7.1f} ms; largest layers (forward "
            "index, share): "
            + ", ".join(f"#{i + 1} {layers[i][0]} {layers[i][1] / total:.0%}" for i in top)
        )
