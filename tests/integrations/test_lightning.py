"""Lightning's own training loop with ``strategy="sapipe"`` (sapipe/integrations/lightning.py), on
2 Gloo ranks with the real ``lightning`` package.

* k = 0 trains exactly as Lightning's ``DDPStrategy`` (within 1e-6): accumulation (2
  batches), clipping (a norm below the gradient's, so it acts at every step), in fp32,
  ``bf16-mixed`` and ``16-mixed`` (a GradScaler);
* k = 2 (``none``, ``wp1``) trains exactly as sapipe's own loop written out by hand with the
  same data, accumulation and clipping (itself held to the float64 reference in
  tests/distributed/test_modes.py), and validation inside ``fit`` sees the real weights;
* a ``ModelCheckpoint`` at the end of an epoch, resumed by a new Trainer, continues exactly
  as the uninterrupted run, each rank from its own state;
* ``stale_layers="auto"`` decides and trains; what sapipe cannot honour is refused on every
  rank, naming the cause.
"""

from __future__ import annotations

import os

import pytest
import torch
from support.dist_utils import as_torchrun, run_ranks

pytest.importorskip("lightning")

FEATURES, HIDDEN, OUT = 8, 16, 4
BATCH, ACCUMULATE, STEPS_PER_EPOCH = 4, 2, 3
MAX_NORM = 0.05


def _data(world_size: int, epochs: int = 1):
    """Inputs and targets for ``epochs`` epochs of STEPS_PER_EPOCH steps on every rank."""
    g = torch.Generator().manual_seed(1)
    n = world_size * BATCH * ACCUMULATE * STEPS_PER_EPOCH
    x = torch.randn(n, FEATURES, generator=g)
    y = torch.randn(n, OUT, generator=g)
    return x, y


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    nn = torch.nn
    return nn.Sequential(
        nn.Linear(FEATURES, HIDDEN),
        nn.LayerNorm(HIDDEN),
        nn.Tanh(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.ReLU(),
        nn.Linear(HIDDEN, HIDDEN),
        nn.GELU(),
        nn.Linear(HIDDEN, OUT),
    )


def _module_class():
    import lightning.pytorch as pl

    class Regression(pl.LightningModule):
        """training_step never calls self(): sapipe must see the step anyway."""

        def __init__(self, optimizers: int = 1, manual: bool = False):
            super().__init__()
            self.net = _net()
            self.optimizers_wanted = optimizers
            self.automatic_optimization = not manual
            self.seen_in_validation: list[torch.Tensor] | None = None

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x).float(), y)

        def validation_step(self, batch, batch_idx):
            if batch_idx == 0:
                self.seen_in_validation = [p.detach().clone() for p in self.net.parameters()]
            x, y = batch
            self.log("val_loss", torch.nn.functional.mse_loss(self.net(x).float(), y))

        def configure_optimizers(self):
            make = lambda: torch.optim.AdamW(self.net.parameters(), lr=0.01, weight_decay=0.1)  # noqa: E731
            return make() if self.optimizers_wanted == 1 else [make(), make()]

    return Regression


def _fit(
    rank,
    world_size,
    strategy,
    epochs=1,
    precision="32-true",
    plugins=None,
    ckpt_path=None,
    **trainer_args,
):
    """Fit a fresh Regression; (its parameters after fit, the module)."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    as_torchrun(rank, world_size)
    x, y = _data(world_size)
    module = _module_class()()
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_epochs=epochs,
        accumulate_grad_batches=ACCUMULATE,
        gradient_clip_val=MAX_NORM,
        precision=precision,
        plugins=plugins,
        logger=False,
        enable_checkpointing=trainer_args.pop("enable_checkpointing", False),
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        use_distributed_sampler=False,
        **trainer_args,
    )
    # each rank's shard in order (sapipe's loop below reads the same)
    loader = DataLoader(TensorDataset(x[rank::world_size], y[rank::world_size]), batch_size=BATCH)
    val_loader = _val_loader(world_size)
    trainer.fit(module, loader, val_loader, ckpt_path=ckpt_path)
    return [p.detach().clone() for p in module.net.parameters()], module, trainer


def _val_loader(world_size: int):
    from torch.utils.data import DataLoader, TensorDataset

    x, y = _data(world_size)
    return DataLoader(TensorDataset(x[:8], y[:8]), batch_size=BATCH)


def _hand_written(rank, world_size, k, compensation, epochs=1):
    """sapipe's own loop over the batches Lightning gives this rank (its shard, every
    world_size-th sample, in order), with Lightning's loss normalisation, accumulation and
    clipping; the real weights after each epoch, and at the end."""
    import sapipe

    x, y = _data(world_size)
    mine = torch.arange(rank, len(x), world_size)
    net = _net()
    opt = sapipe.DistributedOptimizer(
        torch.optim.AdamW(net.parameters(), lr=0.01, weight_decay=0.1),
        net,
        stale_layers=k,
        compensation=compensation,
        bucket_cap_mb=0.0005,
    )
    after_epoch = []
    for _ in range(epochs):
        for step in range(STEPS_PER_EPOCH):
            for micro in range(ACCUMULATE):
                batch = mine[(step * ACCUMULATE + micro) * BATCH :][:BATCH]
                last = micro == ACCUMULATE - 1
                with opt.no_sync() if not last else _nothing():
                    loss = torch.nn.functional.mse_loss(net(x[batch]), y[batch]) / ACCUMULATE
                    loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), MAX_NORM)
            opt.step()
            opt.zero_grad()
        with opt.real_weights():
            after_epoch.append([p.detach().clone() for p in net.parameters()])
    opt.finish()
    return [p.detach().clone() for p in net.parameters()], after_epoch


class _nothing:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False


def _max_difference(a, b) -> float:
    return max(float((u.double() - v.double()).abs().max()) for u, v in zip(a, b))


# ---------------------------------------------------------------------------- k = 0 vs DDP


def _against_ddp(rank, world_size):
    from lightning.pytorch.plugins.precision import MixedPrecision
    from lightning.pytorch.strategies import DDPStrategy

    from sapipe.integrations.lightning import SAPipeStrategy

    out = {}
    for precision in ("32-true", "bf16-mixed", "16-mixed"):

        def plugins(precision=precision):
            if precision != "16-mixed":  # Lightning turns 16-mixed into bf16 on a CPU
                return None
            return [
                MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=2.0**8))
            ]

        args = dict(precision=None if plugins() else precision)
        ddp, _, _ = _fit(rank, world_size, DDPStrategy(), plugins=plugins(), **args)
        # the registered name for one of them: after `import sapipe`, Trainer(strategy="sapipe")
        strategy = "sapipe" if precision == "32-true" else SAPipeStrategy(bucket_cap_mb=0.0005)
        mine, _, trainer = _fit(rank, world_size, strategy, plugins=plugins(), **args)
        out[precision] = {
            "difference": _max_difference(ddp, mine),
            "moved": _max_difference(ddp, list(_net().parameters())),
            "strategy": type(trainer.strategy).__name__,
        }
    return out


def test_k0_trains_as_lightnings_ddp_strategy():
    import sapipe  # noqa: F401 - registers "sapipe"

    for rank, result in enumerate(run_ranks(_against_ddp, world_size=2, timeout=240)):
        for precision, r in result.items():
            assert r["strategy"] == "SAPipeStrategy"
            assert r["moved"] > 1e-3, f"{precision}: training changed nothing"
            assert r["difference"] <= 1e-6, (
                f"rank {rank}, {precision}: {r['difference']:.2e} off DDP"
            )


# ---------------------------------------------------------------------------- k > 0


def _against_own_loop(rank, world_size):
    from sapipe.integrations.lightning import SAPipeStrategy

    out = {}
    for compensation in ("none", "wp1"):
        strategy = SAPipeStrategy(stale_layers=2, compensation=compensation, bucket_cap_mb=0.0005)
        mine, module, trainer = _fit(rank, world_size, strategy, epochs=2)
        in_fit = module.seen_in_validation  # validation after epoch 2, inside fit
        reference, after_epoch = _hand_written(rank, world_size, 2, compensation, epochs=2)
        trainer.validate(module, _val_loader(world_size), verbose=False)
        out[compensation] = {
            "difference": _max_difference(reference, mine),
            "validation in fit": _max_difference(after_epoch[-1], in_fit),
            "validate after fit": _max_difference(reference, module.seen_in_validation),
        }
    return out


def test_stale_layers_train_as_sapipes_own_loop_and_validate_on_real_weights():
    for rank, result in enumerate(run_ranks(_against_own_loop, world_size=2, timeout=240)):
        for compensation, r in result.items():
            assert r["difference"] <= 1e-6, f"rank {rank}, {compensation}: {r['difference']:.2e}"
            for when in ("validation in fit", "validate after fit"):
                assert r[when] <= 1e-6, f"rank {rank}, {compensation}: {when} saw other weights"


# ---------------------------------------------------------------------------- checkpoints


def _resume(rank, world_size, directory):
    from lightning.pytorch.callbacks import ModelCheckpoint

    from sapipe.integrations.lightning import SAPipeStrategy, rank_file

    def strategy():
        return SAPipeStrategy(stale_layers=2, compensation="wp1", bucket_cap_mb=0.0005)

    whole, _, _ = _fit(rank, world_size, strategy(), epochs=2)
    checkpoint = ModelCheckpoint(dirpath=directory, filename="first", save_top_k=-1)
    _fit(rank, world_size, strategy(), epochs=1, callbacks=[checkpoint], enable_checkpointing=True)
    path = os.path.join(directory, "first.ckpt")
    has_own = os.path.exists(rank_file(path, rank))
    resumed, _, _ = _fit(rank, world_size, strategy(), epochs=2, ckpt_path=path)
    return {"difference": _max_difference(whole, resumed), "has_own": has_own}


def test_a_checkpoint_resumes_exactly_with_every_ranks_own_state(tmp_path):
    for rank, result in enumerate(run_ranks(_resume, world_size=2, args=(str(tmp_path),))):
        assert result["has_own"], f"rank {rank} wrote no state of its own"
        assert result["difference"] == 0.0, f"rank {rank}: resumed {result['difference']:.2e} off"


# ---------------------------------------------------------------------------- auto


def _auto(rank, world_size):
    import lightning.pytorch as pl

    from sapipe.integrations.lightning import SAPipeStrategy

    class Decision(pl.Callback):
        def on_train_end(self, trainer, module):
            self.k = trainer.strategy.sapipe.stale_layers

    decision = Decision()
    weights, _, _ = _fit(
        rank,
        world_size,
        SAPipeStrategy(stale_layers="auto", compensation="wp1", bucket_cap_mb=0.0005),
        epochs=12,
        callbacks=[decision],
    )
    return {"k": decision.k, "finite": all(bool(torch.isfinite(w).all()) for w in weights)}


def test_auto_decides_and_trains():
    results = run_ranks(_auto, world_size=2, timeout=240)
    assert all(isinstance(r["k"], int) for r in results), results
    assert results[0]["k"] == results[1]["k"]
    assert all(r["finite"] for r in results)


# ---------------------------------------------------------------------------- refused


def _refused(rank, world_size, case):
    from sapipe.errors import ConfigurationError
    from sapipe.integrations.lightning import SAPipeStrategy

    module_args, strategy_args, trainer_args = {
        "manual": ({"manual": True}, {}, {"gradient_clip_val": None}),
        "unexposed clipping": ({}, {"expose_gradients": False}, {"gradient_clip_val": MAX_NORM}),
    }[case]
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    as_torchrun(rank, world_size)
    x, y = _data(world_size)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=world_size,
        strategy=SAPipeStrategy(**strategy_args),
        max_epochs=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **trainer_args,
    )
    try:
        trainer.fit(_module_class()(**module_args), DataLoader(TensorDataset(x, y), batch_size=4))
    except ConfigurationError as exc:
        return str(exc)
    return None


@pytest.mark.parametrize(
    "case,names",
    [("manual", "automatic_optimization=False"), ("unexposed clipping", "expose_gradients=False")],
)
def test_what_sapipe_cannot_honour_is_refused_on_every_rank(case, names):
    messages = run_ranks(_refused, world_size=2, args=(case,))
    assert all(m is not None and names in m for m in messages), messages


def test_unknown_arguments_are_refused_naming_them():
    from sapipe.errors import ConfigurationError
    from sapipe.integrations.lightning import SAPipeStrategy

    with pytest.raises(ConfigurationError, match="find_unused_parameters"):
        SAPipeStrategy(find_unused_parameters=True)


def test_the_strategy_is_registered_whichever_is_imported_first():
    """sapipe first (a fresh interpreter: registered as Lightning loads its strategies), and
    Lightning first (here, where both are imported by now)."""
    import subprocess
    import sys

    import lightning.pytorch  # noqa: F401
    from lightning.pytorch.strategies import StrategyRegistry

    import sapipe  # noqa: F401

    check = (
        "import sapipe, lightning.pytorch; "
        "from lightning.pytorch.strategies import StrategyRegistry as R; "
        "print(type(R.get('sapipe')).__name__)"
    )
    out = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "SAPipeStrategy", (out.stdout, out.stderr[-2000:])
    assert type(StrategyRegistry.get("sapipe")).__name__ == "SAPipeStrategy"
