"""sapipe under the ``transformers`` Trainer (``sapipe.integrations.transformers.SAPipeTrainer``),
with the real package on 2 Gloo ranks (``use_cpu=True``): a small language model
(embeddings, two LayerNorm kinds, MLP blocks, RMSNorm, head) whose forward returns
``{"loss", "logits"}``, 2 micro-batches a step (``gradient_accumulation_steps=2``),
``max_grad_norm`` below the gradient's norm (the clip acts), AdamW (the default
``adamw_torch_fused``) with weight decay (two param groups), the default linear LR decay.

* k = 0 trains (and evaluates) as the plain ``Trainer`` (DDP), and each resumes from the
  other's checkpoint;
* k = 2 (``none``, ``wp1``) trains as sapipe's plain loop doing what the Trainer does, with
  evaluation every 2 steps on the real weights and checkpoints every 2 steps, neither of
  which changes training; every rank writes its own state, ``model.safetensors`` holds the
  real weights, and ``resume_from_checkpoint`` continues bit-exactly;
* ``stale_layers="auto"`` decides and trains;
* what sapipe cannot honour is refused on every rank, naming the cause.
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import torch.nn.functional as F
from support.dist_utils import as_torchrun, assert_close_dicts, run_ranks
from support.training import named_weights
from support.zoo import FeedForward, LayerNorm
from torch import nn

VOCAB, SEQ, BATCH = 32, 8, 4
ACCUMULATE, STEPS = 2, 4
MAX_NORM = 0.05  # below the gradient's norm: the clip acts at every step


class TinyLM(nn.Module):
    """A small language model as the Trainer expects one: keyword inputs, a dict with the
    loss. No attention: Adam turns the key bias's zero gradient (softmax ignores it) into
    rounding noise no two all-reduce orders agree on."""

    def __init__(self, dim=16):
        super().__init__()
        self.tok = nn.Embedding(VOCAB, dim)
        self.pos = nn.Embedding(SEQ, dim)
        self.blocks = nn.ModuleList(
            nn.Sequential(LayerNorm(dim), FeedForward(dim)) for _ in range(2)
        )
        self.norm = nn.RMSNorm(dim)
        self.head = nn.Linear(dim, VOCAB, bias=False)

    def forward(self, input_ids, labels=None):
        x = self.tok(input_ids) + self.pos(torch.arange(input_ids.shape[1]))
        for block in self.blocks:
            x = x + block(x)
        logits = self.head(self.norm(x))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))
        return out


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
        self.labels = torch.randint(0, VOCAB, (n, SEQ), generator=g)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def _model():
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return TinyLM()


def _environment(rank, world_size):
    as_torchrun(rank, world_size)
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()


def _arguments(output_dir, **overrides):
    from transformers import TrainingArguments

    settings = dict(
        output_dir=output_dir,
        use_cpu=True,
        per_device_train_batch_size=BATCH,
        per_device_eval_batch_size=BATCH,
        gradient_accumulation_steps=ACCUMULATE,
        max_steps=STEPS,
        learning_rate=0.01,
        weight_decay=0.1,
        max_grad_norm=MAX_NORM,
        train_sampling_strategy="sequential",  # the plain loop below takes the same batches
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        seed=0,
    )
    settings.update(overrides)
    return TrainingArguments(**settings)


def _train_data(world_size):
    return Tokens(STEPS * ACCUMULATE * BATCH * world_size, seed=1)


def _eval_data(world_size):
    return Tokens(2 * BATCH * world_size, seed=2)


class _Weights:
    """A callback that keeps the held and the real weights after the last step (before the
    end of ``train()`` finishes sapipe's optimizer)."""

    def __new__(cls, trainer):
        from transformers import TrainerCallback

        class Keep(TrainerCallback):
            def on_step_end(self, args, state, control, model=None, **kwargs):
                if state.global_step == state.max_steps:
                    self.held = named_weights(model)
                    with trainer.optimizer.real_weights():
                        self.real = named_weights(model)

        keep = Keep()
        trainer.add_callback(keep)
        return keep


def _sapipe_trainer(rank, world_size, output_dir, settings, resume=None, **arguments):
    from sapipe.integrations.transformers import SAPipeTrainer

    _environment(rank, world_size)
    trainer = SAPipeTrainer(
        model=_model(),
        args=_arguments(output_dir, **arguments),
        train_dataset=_train_data(world_size),
        eval_dataset=_eval_data(world_size),
        sapipe_settings=settings,
    )
    weights = _Weights(trainer)
    trainer.train(resume_from_checkpoint=resume)
    evaluations = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e]
    return {"held": weights.held, "real": weights.real, "evaluations": evaluations}


def _plain_loop(rank, world_size, settings, evaluate_every=None):
    """sapipe's own loop doing what the Trainer does: its param groups and optimizer, its LR
    schedule, the micro-batches it hands each rank (consecutive batches of the dataset, one to
    each rank in turn), the loss divided by their number, the clip, and evaluation on the real
    weights (the mean loss over the evaluation set's batches)."""
    from transformers import Trainer, get_scheduler

    import sapipe

    args = _arguments("unused")
    model = _model()
    decay = Trainer.get_decay_parameter_names(None, model)
    groups = [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": 0.1},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0},
    ]
    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args, model)
    optimizer = cls(groups, **kwargs)
    opt = sapipe.DistributedOptimizer(optimizer, model, **settings)
    scheduler = get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=STEPS)
    data, evaluation = _train_data(world_size), _eval_data(world_size)

    def batch(dataset, index):
        return dataset[slice(index * BATCH, (index + 1) * BATCH)]

    def mean_loss():
        with torch.no_grad():
            n = len(evaluation) // BATCH
            return float(sum(model(**batch(evaluation, i))["loss"] for i in range(n)) / n)

    evaluations, on_held = [], []
    for step in range(STEPS):
        for i in range(ACCUMULATE):
            micro = (step * ACCUMULATE + i) * world_size + rank
            with contextlib.nullcontext() if i == ACCUMULATE - 1 else opt.no_sync():
                (model(**batch(data, micro))["loss"] / ACCUMULATE).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
        scheduler.step()
        model.zero_grad()
        if evaluate_every and (step + 1) % evaluate_every == 0:
            on_held.append(mean_loss())
            with opt.real_weights():
                evaluations.append(mean_loss())
    held = named_weights(model)
    with opt.real_weights():
        real = named_weights(model)
    opt.close()
    return {"held": held, "real": real, "evaluations": evaluations, "on_held": on_held}


# ---------------------------------------------------------------------------- k = 0


def _k0_against_trainer(rank, world_size, directory):
    """Each trained uninterrupted (a checkpoint at step 2), then each resumed from the other's
    checkpoint: the plain Trainer from sapipe's, sapipe from the plain Trainer's."""
    from transformers import Trainer

    from sapipe.integrations.transformers import SAPipeTrainer

    def train(name, resume=None):
        _environment(rank, world_size)
        kwargs = dict(
            model=_model(),
            args=_arguments(os.path.join(directory, name), save_strategy="steps", save_steps=2),
            train_dataset=_train_data(world_size),
            eval_dataset=_eval_data(world_size),
        )
        if name.startswith("ddp"):
            trainer = Trainer(**kwargs)
        else:
            trainer = SAPipeTrainer(**kwargs, sapipe_settings=dict(stale_layers=0))
        trainer.train(resume_from_checkpoint=resume)
        return {
            "weights": named_weights(trainer.model),
            "eval_loss": trainer.evaluate()["eval_loss"],
            "wrapped": type(trainer.model_wrapped).__name__,
        }

    results = {"ddp": train("ddp"), "sapipe": train("sapipe")}
    results["ddp from sapipe"] = train("ddp2", os.path.join(directory, "sapipe", "checkpoint-2"))
    results["sapipe from ddp"] = train("sapipe2", os.path.join(directory, "ddp", "checkpoint-2"))
    return results


def test_k0_trains_as_the_plain_trainer_and_resumes_its_checkpoints(tmp_path):
    for rank, result in enumerate(run_ranks(_k0_against_trainer, args=(str(tmp_path),))):
        ddp = result["ddp"]
        assert ddp["wrapped"] == "DistributedDataParallel"
        for run in ("sapipe", "ddp from sapipe", "sapipe from ddp"):
            ours = result[run]
            assert ours["wrapped"] == ("TinyLM" if run.startswith("sapipe") else ddp["wrapped"])
            assert_close_dicts(ours["weights"], ddp["weights"], 1e-6, 1e-6, f"rank {rank}, {run}")
            assert abs(ours["eval_loss"] - ddp["eval_loss"]) <= 1e-6 * abs(ddp["eval_loss"])


# ---------------------------------------------------------------------------- k > 0


def _k2(rank, world_size, directory):
    from safetensors.torch import load_file

    results = {}
    for compensation in ("none", "wp1"):
        settings = dict(stale_layers=2, compensation=compensation)
        out = os.path.join(directory, compensation)
        results[compensation] = {
            "plain": _plain_loop(rank, world_size, settings, evaluate_every=2),
            # evaluation and checkpoints every 2 steps
            "trainer": _sapipe_trainer(
                rank,
                world_size,
                out,
                settings,
                eval_strategy="steps",
                eval_steps=2,
                save_strategy="steps",
                save_steps=2,
            ),
        }
    # the wp1 run's checkpoints: every rank's own state; the model (rank 0's) on real weights
    checkpoint = os.path.join(directory, "wp1", "checkpoint-2")
    results["rank files"] = sorted(f for f in os.listdir(checkpoint) if f.startswith("sapipe"))
    last = os.path.join(directory, "wp1", f"checkpoint-{STEPS}", "model.safetensors")
    results["saved model"] = load_file(last)
    # the wp1 run, resumed from its checkpoint of step 2 by a new trainer
    results["resumed"] = _sapipe_trainer(
        rank,
        world_size,
        os.path.join(directory, "resumed"),
        dict(stale_layers=2, compensation="wp1"),
        resume=checkpoint,
    )
    return results


def test_stale_layers_train_as_sapipes_plain_loop_and_resume_bit_exactly(tmp_path):
    for rank, result in enumerate(run_ranks(_k2, args=(str(tmp_path),), timeout=240)):
        for compensation in ("none", "wp1"):
            plain, trainer = result[compensation]["plain"], result[compensation]["trainer"]
            what = f"rank {rank}, {compensation}"
            for weights in ("held", "real"):
                assert_close_dicts(
                    trainer[weights], plain[weights], 1e-6, 1e-6, f"{what} {weights}"
                )
            # evaluation at steps 2 and 4, on the real weights
            np.testing.assert_allclose(trainer["evaluations"], plain["evaluations"], rtol=1e-6)
        wp1 = result["wp1"]["plain"]
        assert any(abs(a - b) > 5e-6 * a for a, b in zip(wp1["evaluations"], wp1["on_held"])), (
            "wp1's predicted weights evaluate as the real ones: the check proves nothing"
        )
        assert result["rank files"] == ["sapipe-rank0.pt", "sapipe-rank1.pt"]
        if rank == 0:
            saved, real = result["saved model"], result["wp1"]["trainer"]["real"]
            assert all(np.array_equal(saved[n], w) for n, w in real.items()), (
                "the checkpoint's model.safetensors does not hold rank 0's real weights"
            )
        whole, resumed = result["wp1"]["trainer"], result["resumed"]
        for weights in ("held", "real"):
            for name, value in whole[weights].items():
                assert np.array_equal(resumed[weights][name], value), (
                    f"rank {rank}: {weights} {name} differs after resume_from_checkpoint"
                )


# ---------------------------------------------------------------------------- auto


def _auto(rank, world_size, directory):
    from sapipe.integrations.transformers import SAPipeTrainer

    _environment(rank, world_size)
    trainer = SAPipeTrainer(
        model=_model(),
        args=_arguments(directory, gradient_accumulation_steps=1, max_steps=14),
        train_dataset=Tokens(14 * BATCH * world_size, seed=1),
        sapipe_settings=dict(stale_layers="auto", profile_steps=1, tune_steps=0),
    )
    trainer.train()
    finite = all(bool(torch.isfinite(p).all()) for p in trainer.model.parameters())
    return {"k": trainer.sapipe.stale_layers, "finite": finite}


def test_auto_decides_and_trains(tmp_path):
    results = run_ranks(_auto, args=(str(tmp_path),))
    assert all(isinstance(r["k"], int) for r in results), results
    assert results[0]["k"] == results[1]["k"]
    assert all(r["finite"] for r in results)


# ---------------------------------------------------------------------------- refused


def _refused(rank, world_size, directory):
    from sapipe.errors import ConfigurationError, UsageError
    from sapipe.integrations.transformers import SAPipeTrainer

    _environment(rank, world_size)
    cases = {
        "adafactor": ({"optim": "adafactor"}, {}, None),
        "auto batch size": ({"auto_find_batch_size": True}, {}, None),
        "deepspeed": ({}, {}, {"deepspeed": "ds_config.json"}),  # not installed: set after
        "fsdp": ({}, {}, {"fsdp": ["full_shard"], "fsdp_config": {}}),  # needs GPUs: set after
        "sync each batch": (
            {"accelerator_config": {"gradient_accumulation_kwargs": {"sync_each_batch": True}}},
            {},
            None,
        ),
        "unknown setting": ({}, {"stale_layer": 2}, None),
        "trained twice": ({}, {}, None),
    }
    messages = {}
    for case, (arguments, settings, after) in cases.items():
        args = _arguments(directory, **arguments)
        for name, value in (after or {}).items():
            setattr(args, name, value)
        try:
            trainer = SAPipeTrainer(
                model=_model(),
                args=args,
                train_dataset=_train_data(world_size),
                sapipe_settings=settings,
            )
            trainer.train()
            trainer.train()
        except (ConfigurationError, UsageError) as exc:
            messages[case] = f"{type(exc).__name__}: {exc}"
    return messages


EXPECTED = {
    "adafactor": "ConfigurationError: sapipe: TrainingArguments(optim='adafactor') gives "
    "transformers.optimization.Adafactor, not a torch.optim optimizer",
    "auto batch size": "ConfigurationError: sapipe: TrainingArguments(auto_find_batch_size=True)",
    "deepspeed": "ConfigurationError: sapipe: TrainingArguments(deepspeed=...)",
    "fsdp": "ConfigurationError: sapipe: TrainingArguments(fsdp=['full_shard'])",
    "sync each batch": "ConfigurationError: sapipe: sync_each_batch=True",
    "unknown setting": "ConfigurationError: sapipe: unknown settings ['stale_layer']",
    "trained twice": "UsageError: sapipe: SAPipeTrainer trains once",
}


def test_what_sapipe_cannot_honour_is_refused_on_every_rank(tmp_path):
    for rank, messages in enumerate(run_ranks(_refused, args=(str(tmp_path),))):
        for case, start in EXPECTED.items():
            assert messages.get(case, "").startswith(start), (rank, case, messages.get(case))
