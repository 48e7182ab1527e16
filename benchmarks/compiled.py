"""The compiled path: a nanoGPT-style training step, eager and under torch.compile, with
sapipe (k = 0, k = m/2 with wp3, "auto" with wp3) beside torch's DDP compiled as its users
compile it (``torch.compile(DDP(model))``).

The model is built from a dozen module classes (its own LayerNorm, attention, MLP and block,
torch's Embedding, LayerNorm, RMSNorm, Linear, GELU, Dropout and containers), as real
scripts are: a hook that dynamo traced once per module type would pass its recompile limit
on it. The step is a user's: fused AdamW, ``clip_grad_norm_``, bf16 autocast on a GPU. One
process (a Gloo group on the CPU, NCCL on a GPU): this measures what each wrapper costs the
step, not communication. Per case: the median step of the last half of ``--steps`` (the
median over ``--rounds`` rounds), and dynamo's counts over the whole run (graphs compiled,
graph breaks), so a recompile or a break shows beside the time it costs.

    python -m benchmarks compiled [--steps 60] [--rounds 3] [--backend inductor]
        [--size small] [--device cuda]
"""

from __future__ import annotations

import statistics
import time

import harness
import torch
import torch.nn.functional as F
from torch import nn

SIZES = {  # dim, heads, blocks, context, vocab, batch
    "tiny": (64, 2, 2, 32, 512, 4),
    "small": (256, 4, 6, 128, 4096, 8),
    "full": (768, 12, 12, 1024, 50304, 8),
}


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias, as nanoGPT writes it."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.drop = nn.Dropout(0.0)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.heads, c // self.heads).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class MLP(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.fc = nn.Linear(dim, 4 * dim)
        self.act = nn.GELU()
        self.proj = nn.Linear(4 * dim, dim)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln_1 = LayerNorm(dim)
        self.attn = CausalSelfAttention(dim, heads)
        self.ln_2 = nn.LayerNorm(dim)
        self.mlp = MLP(dim)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, dim: int, heads: int, blocks: int, context: int, vocab: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(context, dim)
        self.drop = nn.Dropout(0.0)
        self.blocks = nn.ModuleList(Block(dim, heads) for _ in range(blocks))
        self.ln_f = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens):
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        x = self.drop(self.tok(tokens) + self.pos(positions))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _layers(model: nn.Module) -> int:
    return sum(any(True for _ in m.parameters(recurse=False)) for m in model.modules())


def _case(label, args, device, make, batch, steps):
    """One case: (median step of the last half, graphs compiled, graph breaks, k at the end)."""
    import torch._dynamo
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    import sapipe

    torch._dynamo.reset()
    counters.clear()
    model = make()
    base = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
    wrapper, compiled, options = label
    if wrapper == "ddp":
        forward, opt = DDP(model), base
    else:
        opt = sapipe.DistributedOptimizer(base, model, **options)
        forward = model
    if compiled:
        forward = torch.compile(forward, backend=args.backend)
    autocast = torch.autocast("cuda", torch.bfloat16, enabled=device.type == "cuda")
    tokens, targets = batch
    times = []
    for _ in range(steps):
        harness.synchronize(device)
        start = time.perf_counter()
        with autocast:
            logits = forward(tokens)
        F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        harness.synchronize(device)
        times.append(time.perf_counter() - start)
    k = opt.stale_layers if wrapper == "sapipe" else "-"
    if wrapper == "sapipe":
        opt.close()
    graphs = counters["stats"]["unique_graphs"]
    return statistics.median(times[steps // 2 :]), graphs, sum(counters["graph_break"].values()), k


def main() -> None:
    p = harness.Parser(
        __doc__,
        quick=dict(steps=24, rounds=1, size="tiny", backend="aot_eager"),
        device=("cpu", "cuda"),
        size="small",
        out=False,
    )
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--backend", default="inductor", help="torch.compile's backend")
    args = p.parse_args()
    if args.size not in SIZES:
        p.error(f"--size: one of {', '.join(SIZES)}")
    device = torch.device(args.device)
    torch.set_num_threads(1) if device.type == "cpu" else None
    harness.init_one_rank_group(device)
    dim, heads, blocks, context, vocab, batch_size = SIZES[args.size]

    def make():
        torch.manual_seed(0)
        return GPT(dim, heads, blocks, context, vocab).to(device)

    gen = torch.Generator().manual_seed(0)
    data = torch.randint(0, vocab, (batch_size, context + 1), generator=gen).to(device)
    batch = (data[:, :-1], data[:, 1:])
    model = make()
    m = _layers(model)
    types = len({type(module) for module in model.modules()})
    cases = [
        ("DDP", ("ddp", False, {})),
        ("DDP compiled", ("ddp", True, {})),
        ("sapipe k = 0", ("sapipe", False, {"stale_layers": 0})),
        ("sapipe k = 0 compiled", ("sapipe", True, {"stale_layers": 0})),
        ("sapipe k = m/2 wp3", ("sapipe", False, {"stale_layers": m // 2, "compensation": "wp3"})),
        (
            "sapipe k = m/2 wp3 compiled",
            ("sapipe", True, {"stale_layers": m // 2, "compensation": "wp3"}),
        ),
        (
            "sapipe auto wp3 compiled",
            ("sapipe", True, {"stale_layers": "auto", "compensation": "wp3"}),
        ),
    ]
    results = {name: [] for name, _ in cases}
    for _ in range(args.rounds):
        for name, label in cases:
            results[name].append(_case(label, args, device, make, batch, args.steps))
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, one thread"
    params = sum(p.numel() for p in model.parameters()) / 1e6
    print(f"$ {harness.command()}")
    print(
        f"torch {torch.__version__}, {where}; GPT {args.size}: {params:.1f} M parameters, "
        f"{m} layers, {types} module classes; backend {args.backend}; {args.rounds} round(s) of "
        f"{args.steps} steps, median of the last half"
    )
    ddp = statistics.median(r[0] for r in results["DDP compiled"])
    k0 = statistics.median(r[0] for r in results["sapipe k = 0 compiled"])
    print("| case | ms per step | ÷ DDP compiled | ÷ sapipe k = 0 compiled | graphs | breaks | k |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for name, runs in results.items():
        t = statistics.median(r[0] for r in runs)
        graphs, breaks, k = runs[-1][1:]
        print(
            f"| {name} | {t * 1e3:.2f} | {t / ddp:.3f} | {t / k0:.3f} | {graphs} | {breaks} | {k} |"
        )


if __name__ == "__main__":
    main()
