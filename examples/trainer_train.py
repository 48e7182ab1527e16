"""sapipe with the ``transformers`` Trainer: ``SAPipeTrainer`` in place of ``Trainer``.

Run on 2 ranks (CPU ranks use Gloo; on GPUs the Trainer picks NCCL):

    torchrun --standalone --nproc_per_node=2 examples/trainer_train.py
    torchrun --standalone --nproc_per_node=2 examples/trainer_train.py --stale-layers auto

The model is a small causal language model written as a ``transformers`` model is called
(keyword inputs, a dict with the loss); the data are synthetic token sequences whose next
token follows from the current one, so nothing is downloaded. Everything else is the
Trainer's: ``gradient_accumulation_steps``, ``max_grad_norm``, the LR schedule, evaluation,
``save_steps`` checkpoints and ``--resume`` (``train(resume_from_checkpoint=True)``). The
main process prints the Trainer's logs and, at the end, the evaluation loss on the real
weights.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn
from transformers import TrainingArguments

from sapipe.integrations.transformers import SAPipeTrainer

VOCAB, SEQ, DIM = 64, 16, 32


class TinyLM(nn.Module):
    """Token and position embeddings, two pre-norm MLP blocks, a final norm and a head."""

    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList(
            nn.Sequential(
                nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM)
            )
            for _ in range(2)
        )
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        x = self.tok(input_ids) + self.pos(
            torch.arange(input_ids.shape[1], device=input_ids.device)
        )
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(self.norm(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return out


class Sequences(torch.utils.data.Dataset):
    """Token sequences in which each token is a fixed function of the previous one (learnable)."""

    def __init__(self, samples: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        successor = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(0))
        tokens = torch.empty(samples, SEQ + 1, dtype=torch.long)
        tokens[:, 0] = torch.randint(0, VOCAB, (samples,), generator=generator)
        for t in range(SEQ):
            tokens[:, t + 1] = successor[tokens[:, t]]
        self.tokens = tokens

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.tokens[i, :-1], "labels": self.tokens[i, 1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps")
    parser.add_argument("--stale-layers", default="2", help="k, or 'auto'")
    parser.add_argument("--compensation", default="wp1", help="none, dc, wp1, wp2, wp3")
    parser.add_argument("--accumulate", type=int, default=2, help="gradient_accumulation_steps")
    parser.add_argument("--output-dir", default="sapipe-trainer-example")
    parser.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps")
    parser.add_argument("--resume", action="store_true", help="from the newest checkpoint")
    args = parser.parse_args()
    stale_layers = args.stale_layers if args.stale_layers == "auto" else int(args.stale_layers)

    torch.manual_seed(0)
    training = TrainingArguments(
        output_dir=args.output_dir,
        use_cpu=not torch.cuda.is_available(),
        max_steps=args.steps,
        per_device_train_batch_size=16,
        per_device_eval_batch_size=32,
        gradient_accumulation_steps=args.accumulate,
        learning_rate=3e-3,
        weight_decay=0.01,
        logging_steps=10,
        eval_strategy="no",
        save_strategy="steps" if args.save_steps else "no",
        save_steps=args.save_steps or 500,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = SAPipeTrainer(
        model=TinyLM(),
        args=training,
        train_dataset=Sequences(args.steps * args.accumulate * 16 * training.world_size, seed=1),
        eval_dataset=Sequences(256, seed=2),
        sapipe_settings=dict(stale_layers=stale_layers, compensation=args.compensation),
    )
    result = trainer.train(resume_from_checkpoint=True if args.resume else None)
    metrics = trainer.evaluate()  # after train(): the model holds the real weights
    if trainer.is_world_process_zero():
        print(
            f"done: {result.global_step} steps, stale_layers={trainer.sapipe.stale_layers}, "
            f"compensation={args.compensation}, train loss {result.training_loss:.4f}, "
            f"eval loss {metrics['eval_loss']:.4f}"
        )


if __name__ == "__main__":
    main()
