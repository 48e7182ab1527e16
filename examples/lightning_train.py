"""Train a small GPT-style language model with PyTorch Lightning and sapipe.

Lightning's own DDP example with one line changed: ``strategy="sapipe"`` (or
``SAPipeStrategy(...)`` for settings) in place of ``strategy="ddp"``. Lightning launches the
processes itself::

    python examples/lightning_train.py --devices 2                      # sapipe, k = "auto"
    python examples/lightning_train.py --devices 2 --strategy ddp       # the DDP baseline
    torchrun --nproc_per_node=2 examples/lightning_train.py --devices 2 # or under torchrun

The data is synthetic (a fixed random token stream), so the script needs no download.
"""

from __future__ import annotations

import argparse

import lightning.pytorch as pl
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import sapipe  # noqa: F401 - registers Trainer(strategy="sapipe")
from sapipe.integrations.lightning import SAPipeStrategy


class Block(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1 = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, heads, batch_first=True)
        self.norm2 = nn.LayerNorm(width)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[1]
        causal = torch.triu(torch.ones(n, n, dtype=torch.bool, device=x.device), diagonal=1)
        h = self.norm1(x)
        x = x + self.attention(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.mlp(self.norm2(x))


class LanguageModel(pl.LightningModule):
    def __init__(self, vocab: int = 256, width: int = 64, depth: int = 4, heads: int = 4):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.Sequential(*(Block(width, heads) for _ in range(depth)))
        self.head = nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.embed(tokens)))

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        logits = self(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        self.log("train_loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=3e-3, weight_decay=0.1)


class ReportStaleLayers(pl.Callback):
    """Prints the k sapipe trained with (``stale_layers="auto"`` chooses it while training)."""

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        opt = getattr(trainer.strategy, "sapipe", None)
        if opt is not None and trainer.is_global_zero:
            print(f"sapipe: k = {opt.stale_layers} of {opt.num_layers} layers stale")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--strategy", default="sapipe", choices=["sapipe", "ddp"])
    parser.add_argument("--stale-layers", default="auto", help='an integer k or "auto"')
    parser.add_argument("--compensation", default="wp1")
    parser.add_argument("--max-steps", type=int, default=60)
    parser.add_argument("--accumulate", type=int, default=1)
    parser.add_argument("--precision", default="32-true")
    args = parser.parse_args()

    pl.seed_everything(0)
    tokens = torch.randint(0, 256, (4096, 33), generator=torch.Generator().manual_seed(0))
    loader = DataLoader(TensorDataset(tokens), batch_size=16, shuffle=True)

    strategy = "ddp"
    if args.strategy == "sapipe":
        k = args.stale_layers if args.stale_layers == "auto" else int(args.stale_layers)
        strategy = SAPipeStrategy(stale_layers=k, compensation=args.compensation)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy=strategy,
        max_steps=args.max_steps,
        accumulate_grad_batches=args.accumulate,
        gradient_clip_val=1.0,
        precision=args.precision,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ReportStaleLayers()],
    )
    model = LanguageModel()
    trainer.fit(model, loader)
    if trainer.is_global_zero:
        loss = float(trainer.callback_metrics["train_loss"])
        print(f"strategy={args.strategy} steps={trainer.global_step} final train_loss={loss:.4f}")


if __name__ == "__main__":
    main()
