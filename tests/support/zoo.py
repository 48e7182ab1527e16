"""Small models shaped like the ones users compile, each built from many module types.

``gpt`` (its own LayerNorm, attention, MLP and block classes, as nanoGPT writes them),
``resnet`` (torchvision's ResNet layout: stem, bottlenecks with a downsample branch,
BatchNorm, pooling) and ``vit`` (patch embedding, class token and position embedding owned
by the root, ``nn.MultiheadAttention``). torchvision is not a dependency, so the ResNet is
written out here in its shape. Each keeps shapes small enough for a CPU test, and
:func:`module_types` counts the distinct classes a model is made of.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ------------------------------------------------------------------ GPT


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (nanoGPT's)."""

    def __init__(self, dim: int, bias: bool = True):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.dropout = nn.Dropout(0.0)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class FeedForward(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.out = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.out(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1 = LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = FeedForward(dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(
        self, vocab: int = 64, dim: int = 32, heads: int = 4, depth: int = 3, seq: int = 8
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(seq, dim)
        self.drop = nn.Dropout(0.0)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(depth))
        self.ln_f = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


# ------------------------------------------------------------------ ResNet


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample=None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.GroupNorm(2, planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + identity)


class ResNet(nn.Module):
    def __init__(self, widths=(4, 8), classes: int = 10):
        super().__init__()
        self.inplanes = 8
        self.conv1 = nn.Conv2d(3, 8, 3, 1, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(8)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(2)
        self.layers = nn.Sequential(
            *(self._stage(planes, stride=1 if i == 0 else 2) for i, planes in enumerate(widths))
        )
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.flatten = nn.Flatten()
        self.dropout = nn.Dropout(0.0)
        self.fc = nn.Linear(widths[-1] * Bottleneck.expansion, classes)

    def _stage(self, planes: int, stride: int) -> nn.Sequential:
        downsample = nn.Sequential(
            nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride, bias=False),
            nn.BatchNorm2d(planes * Bottleneck.expansion),
        )
        first = Bottleneck(self.inplanes, planes, stride, downsample)
        self.inplanes = planes * Bottleneck.expansion
        return nn.Sequential(first, Bottleneck(self.inplanes, planes))

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        return self.fc(self.dropout(self.flatten(self.avgpool(self.layers(x)))))


# ------------------------------------------------------------------ ViT


class PatchEmbed(nn.Module):
    def __init__(self, patch: int, dim: int):
        super().__init__()
        self.proj = nn.Conv2d(3, dim, patch, patch)

    def forward(self, x):
        return self.proj(x).flatten(2).transpose(1, 2)


class EncoderBlock(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = nn.MultiheadAttention(dim, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))

    def forward(self, x):
        h = self.norm1(x)
        x = x + self.attn(h, h, h, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class ViT(nn.Module):
    def __init__(self, image: int = 8, patch: int = 4, dim: int = 16, depth: int = 2):
        super().__init__()
        self.patch_embed = PatchEmbed(patch, dim)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim))
        self.pos_embed = nn.Parameter(torch.randn(1, (image // patch) ** 2 + 1, dim) * 0.02)
        self.blocks = nn.Sequential(*(EncoderBlock(dim, 2) for _ in range(depth)))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Sequential(nn.Dropout(0.0), nn.Linear(dim, 10), nn.Identity())

    def forward(self, x):
        x = self.patch_embed(x)
        x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1) + self.pos_embed
        return self.head(self.norm(self.blocks(x))[:, 0])


# ------------------------------------------------------------------ helpers

ZOO = {"gpt": GPT, "resnet": ResNet, "vit": ViT}


def make_zoo_model(name: str, seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return ZOO[name]()


def zoo_batch(name: str, rank: int, step: int, size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """(input, target) of rank ``rank`` at ``step``, the same in every run."""
    gen = torch.Generator().manual_seed(1000 * step + rank)
    if name == "gpt":
        tokens = torch.randint(0, 64, (size, 9), generator=gen)
        return tokens[:, :-1], tokens[:, 1:]
    return torch.randn(size, 3, 8, 8, generator=gen), torch.randint(0, 10, (size,), generator=gen)


def zoo_loss(name: str, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if name == "gpt":
        return F.cross_entropy(out.flatten(0, 1), target.flatten())
    return F.cross_entropy(out, target)


def module_types(model: nn.Module) -> set[type]:
    return {type(m) for m in model.modules()}
