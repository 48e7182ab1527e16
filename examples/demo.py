"""sapipe demo: the same small language model trained with sapipe and with DDP.

Run with 2 CPU ranks (Gloo):

    torchrun --standalone --nproc_per_node=2 examples/demo.py      # or: make demo

Model: a character-level (byte-level, vocab 256) Transformer language model,
2 blocks, width 64, context 64 -- about 0.13 M parameters.

Data: real text already on every machine -- the source code of a fixed selection
of Python standard-library modules (STDLIB_FILES below, read from
sysconfig.get_paths()["stdlib"]). The concatenated bytes are split 90/10 into a
training and a held-out part. Each rank draws its own training batches (generator
seeded by --seed and the rank); the held-out batch is fixed and identical on
every rank.

Both modes start from identical weights (same --seed), see the same batch
sequence per rank and use Adam with the same hyper-parameters:

* ddp    -- torch.nn.parallel.DistributedDataParallel
* sapipe -- the plain model, optimizer wrapped by sapipe.DistributedOptimizer
            (the first --stale-layers layers use 1-step-stale gradients with
            --compensation; all other layers are synchronous, exactly like DDP)

Rank 0 prints one line per mode: throughput (all ranks' samples per second,
steps after the first 5, including the final synchronize), training loss (mean of the last
10 steps, averaged over ranks) and the loss on the held-out batch, evaluated
after opt.synchronize() on the real (not weight-predicted) weights.
"""

import argparse
import math
import os
import sys
import sysconfig
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

# Fixed, documented training text: these stdlib modules' source, in this order.
STDLIB_FILES = [
    "os.py",
    "random.py",
    "functools.py",
    "argparse.py",
    "textwrap.py",
    "string.py",
    "heapq.py",
    "bisect.py",
    "json/encoder.py",
    "json/decoder.py",
    "collections/__init__.py",
    "pathlib.py",
    "shutil.py",
    "tempfile.py",
]
VOCAB = 256


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=100, help="training steps per mode")
    p.add_argument("--batch", type=int, default=32, help="sequences per rank per step")
    p.add_argument("--context", type=int, default=64, help="sequence length (bytes)")
    p.add_argument("--lr", type=float, default=3e-3, help="Adam learning rate")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--stale-layers",
        type=lambda v: v if v == "auto" else int(v),
        default="auto",
        help="sapipe: number of leading layers updated with stale gradients, or "
        "'auto' (default): the scheduler profiles the warm-up and picks k",
    )
    p.add_argument(
        "--compensation",
        default="wp1",
        choices=["none", "dc", "wp1", "wp2", "wp3"],
        help="sapipe: staleness compensation for the stale layers",
    )
    p.add_argument(
        "--modes", default="sapipe,ddp", help="comma-separated modes to run, in order (sapipe, ddp)"
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    return p.parse_args()


# ----------------------------------------------------------------------------- data
def load_text():
    root = sysconfig.get_paths()["stdlib"]
    chunks = []
    for name in STDLIB_FILES:
        with open(os.path.join(root, name), "rb") as f:
            chunks.append(f.read())
    data = torch.frombuffer(bytearray(b"\n\n".join(chunks)), dtype=torch.uint8).long()
    split = int(0.9 * data.numel())
    return data[:split], data[split:]


def sample_batch(data, batch, context, gen):
    starts = torch.randint(0, data.numel() - context - 1, (batch,), generator=gen)
    x = torch.stack([data[s : s + context] for s in starts.tolist()])
    y = torch.stack([data[s + 1 : s + context + 1] for s in starts.tolist()])
    return x, y


# ---------------------------------------------------------------------------- model
# Written with plain Linear/LayerNorm/Embedding modules that are all *called* in
# forward (no nn.MultiheadAttention, whose out_proj is used functionally), so
# every parameter-owning module shows up in forward execution order.
class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.fc1 = nn.Linear(d, 4 * d)
        self.fc2 = nn.Linear(4 * d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=-1)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, d))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class CharLM(nn.Module):
    def __init__(self, context=64, d=64, layers=2, heads=4):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, VOCAB)

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln_f(x))


def lm_loss(model, x, y):
    return F.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


# ------------------------------------------------------------------------- progress
class Progress:
    """A tiny progress bar on stderr (rank 0 only)."""

    def __init__(self, label, total, enabled, width=30):
        self.label, self.total, self.enabled, self.width = label, total, enabled, width
        self.tty = sys.stderr.isatty()

    def update(self, i, loss):
        if not self.enabled or (not self.tty and i != self.total):
            return
        filled = int(self.width * i / self.total)
        bar = "#" * filled + "." * (self.width - filled)
        sys.stderr.write(f"\r{self.label:>6} [{bar}] step {i}/{self.total} loss {loss:.3f}")
        if i == self.total:
            sys.stderr.write("\n")
        sys.stderr.flush()


# ---------------------------------------------------------------------------- modes
def setup_ddp(model, args):
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.Adam(ddp.parameters(), lr=args.lr)
    return ddp, opt, None


def setup_sapipe(model, args):
    try:
        import sapipe

        DistributedOptimizer = sapipe.DistributedOptimizer
    except (ImportError, AttributeError) as e:
        raise SystemExit(
            f"sapipe mode needs sapipe.DistributedOptimizer ({e}); run with --modes ddp to skip it"
        ) from e
    base = torch.optim.Adam(model.parameters(), lr=args.lr)
    opt = DistributedOptimizer(
        base, model, stale_layers=args.stale_layers, compensation=args.compensation
    )
    # A callable: with "auto", k is known only after the warm-up (and the measured search).
    info = lambda: f"{opt.stale_layers}/{opt.num_layers} stale, {args.compensation}"  # noqa: E731
    return model, opt, info


def finish_ddp(model, opt, x, y):
    with torch.no_grad():
        return lm_loss(model, x, y).item()


def finish_sapipe(model, opt, x, y):
    opt.synchronize()  # apply every pending deferred update
    with opt.real_weights(), torch.no_grad():
        return lm_loss(model, x, y).item()


MODES = {"ddp": (setup_ddp, finish_ddp), "sapipe": (setup_sapipe, finish_sapipe)}


def run_mode(mode, args, train, held_out, rank, world):
    setup, finish = MODES[mode]
    torch.manual_seed(args.seed)  # identical initial weights
    model = CharLM(context=args.context)
    net, opt, info = setup(model, args)
    gen = torch.Generator().manual_seed(args.seed * 1000 + rank)  # per-rank batches
    bar = Progress(mode, args.steps, enabled=(rank == 0))
    losses = []

    skip = min(5, args.steps - 1)  # untimed warm-up steps
    dist.barrier()
    t0 = time.perf_counter()
    for i in range(1, args.steps + 1):
        x, y = sample_batch(train, args.batch, args.context, gen)
        opt.zero_grad()
        loss = lm_loss(net, x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
        bar.update(i, losses[-1])
        if i == skip:
            t0 = time.perf_counter()
    final = finish(net, opt, *held_out)  # includes sapipe's synchronize()
    elapsed = torch.tensor(time.perf_counter() - t0)
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # slowest rank

    tail = losses[-10:]
    train_loss = torch.tensor(sum(tail) / len(tail))
    dist.all_reduce(train_loss)
    return {
        "mode": mode,
        "samples/s": (args.steps - skip) * args.batch * world / elapsed.item(),
        "train loss": train_loss.item() / world,
        "held-out loss": final,
        "stale layers": info() if callable(info) else (info or "-"),
    }


def main():
    args = parse_args()
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()

    train, val = load_text()
    held_out = sample_batch(val, 64, args.context, torch.Generator().manual_seed(12345))
    if rank == 0:
        print(
            f"world {world} (gloo), {train.numel() + val.numel()} bytes of stdlib source, "
            f"{args.steps} steps x {args.batch} seq x {args.context} bytes per rank; "
            f"initial loss ~ ln 256 = {math.log(VOCAB):.2f}",
            flush=True,
        )

    rows = [
        run_mode(m.strip(), args, train, held_out, rank, world)
        for m in args.modes.split(",")
        if m.strip()
    ]

    if rank == 0:
        cols = ["mode", "samples/s", "train loss", "held-out loss", "stale layers"]
        fmt = {"samples/s": "{:.0f}", "train loss": "{:.4f}", "held-out loss": "{:.4f}"}
        cells = [[fmt.get(c, "{}").format(r[c]) for c in cols] for r in rows]
        widths = [max(len(c), *(len(row[j]) for row in cells)) for j, c in enumerate(cols)]
        print("  ".join(c.ljust(w) for c, w in zip(cols, widths)).rstrip())
        print("  ".join("-" * w for w in widths))
        for row in cells:
            print("  ".join(v.ljust(w) for v, w in zip(row, widths)).rstrip())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
