"""torch.compile stays clean under sapipe: after warm-up no recompile and no graph break, at any
k, with every compensation, and with ``stale_layers="auto"`` through its profile, decision
and measured search (docs/design.md §5.8).

The models are built from 12 or more module classes each (tests/support/zoo.py: a GPT with
its own LayerNorm, attention and MLP classes, a torchvision-shaped ResNet, a ViT), so a hook
that dynamo traced once per module type would pass its recompile limit here. They are
compiled with ``fullgraph=True`` (any graph break raises) and passed to sapipe compiled, and
once compiled after wrapping without ``fullgraph`` (graph breaks then counted). Dynamo's
counters give the graphs compiled and the graph breaks; the compiled run must also train
exactly as the same job run eagerly.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from support.dist_utils import run_ranks
from support.zoo import make_zoo_model, module_types, zoo_batch, zoo_loss

from sapipe.optim.compensation import ChooseOnline

pytestmark = pytest.mark.slow  # every configuration compiles its model on two ranks

AUTO_STEPS = 28  # "auto": 5 unprofiled + profiled warm-up, decision, a trial of k = m, the final k
STEPS = 8  # a fixed k: the pipeline's start, its first stale updates and predictions, and more
BACKEND = "aot_eager"  # AOTAutograd's graphs without code generation


def _layers(model: torch.nn.Module) -> int:
    """m: the modules that own parameters directly (the model's layers)."""
    return sum(any(True for _ in m.parameters(recurse=False)) for m in model.modules())


def _pin_the_search(k: int) -> None:
    """``"auto"`` chooses ``k``, measures a trial of k = m, and settles on ``k``: a profile, a
    decision, two restarts of the pipeline, whatever the timing."""
    import sapipe.auto.controller as controller
    from sapipe.auto import search
    from sapipe.schedule import solver

    choose = solver.choose_k
    solver.choose_k = lambda *a, **kw: dataclasses.replace(
        choose(*a, **kw), k=kw["only_k"] if kw.get("only_k") is not None else k, comm_bound=False
    )
    controller.TRIAL_MAX_ROUNDS = 1

    class Path(search.Tuner):
        def _next(self):
            return self.m if len(self.trials) == 1 else self._finish(k)

    search.Tuner = Path


def _train(rank, name, options, compile_as):
    """Train ``name`` for STEPS (AUTO_STEPS with "auto") under sapipe; (weights, graphs
    compiled after each step, graph breaks at the end). ``compile_as``: None (eager),
    "wrapped" (compiled with fullgraph=True, then given to sapipe) or "after" (given to
    sapipe, then compiled)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    import sapipe

    torch._dynamo.reset()
    counters.clear()
    model = make_zoo_model(name)
    base = torch.optim.AdamW(model.parameters(), lr=1e-3)
    if compile_as == "wrapped":
        forward = torch.compile(model, backend=BACKEND, fullgraph=True)
        opt = sapipe.DistributedOptimizer(base, forward, **options)
    else:
        opt = sapipe.DistributedOptimizer(base, model, **options)
        forward = torch.compile(model, backend=BACKEND) if compile_as == "after" else model
    graphs = []
    for step in range(AUTO_STEPS if options["stale_layers"] == "auto" else STEPS):
        x, y = zoo_batch(name, rank, step)
        zoo_loss(name, forward(x), y).backward()
        opt.step()
        opt.zero_grad()
        graphs.append(counters["stats"]["unique_graphs"])
    chosen = opt.stale_layers
    with opt.real_weights():
        weights = [p.detach().clone() for p in model.parameters()]
    opt.close()
    return {
        "weights": weights,
        "graphs": graphs,
        "breaks": sum(counters["graph_break"].values()),
        "k": chosen,
    }


def _job(rank, world_size, name, configs):
    m = _layers(make_zoo_model(name))
    if any(options["stale_layers"] == "auto" for options, _ in configs):
        _pin_the_search(m // 2)
    out = []
    for options, compile_as in configs:
        options = dict(options)
        k = options["stale_layers"]
        options["stale_layers"] = {"half": m // 2, "all": m}.get(k, k)
        compiled = _train(rank, name, options, compile_as)
        eager = _train(rank, name, options, None)
        out.append((compiled, eager))
    return {"m": m, "types": len(module_types(make_zoo_model(name))), "runs": out}


def _configs(full: bool):
    modes = ("none", "dc", "wp1", "wp2", "wp3", "t2") if full else ("wp3",)
    configs = [({"stale_layers": "half", "compensation": mode}, "wrapped") for mode in modes]
    if full:
        configs += [
            ({"stale_layers": 0}, "wrapped"),
            ({"stale_layers": "all", "compensation": "wp1"}, "wrapped"),
            ({"stale_layers": "half", "compensation": "wp3"}, "after"),
            # "auto": probes 3 scored steps, decides at step 5, runs its choice after
            ({"stale_layers": "half", "compensation": ChooseOnline(probe_steps=3)}, "wrapped"),
        ]
    configs.append(({"stale_layers": "auto", "compensation": "wp3", "tune_steps": 4}, "wrapped"))
    return configs


@pytest.mark.parametrize("name,full", [("gpt", True), ("resnet", False), ("vit", False)])
def test_compiled_model_never_recompiles_or_breaks(name, full):
    configs = _configs(full)
    result = run_ranks(_job, world_size=2, args=(name, configs), timeout=600)[0]
    assert result["types"] >= 12, f"{name} is made of {result['types']} module classes"
    for (options, compile_as), (compiled, eager) in zip(configs, result["runs"]):
        what = f"{name} {options} compiled {compile_as}"
        graphs = compiled["graphs"]
        # the first forward compiles with the layer recorder's hooks, the second with the
        # layers' own; nothing after
        assert graphs[-1] == graphs[1], f"{what}: graphs compiled per step {graphs}"
        assert compiled["breaks"] == 0, f"{what}: {compiled['breaks']} graph breaks"
        if options["stale_layers"] == "auto":
            assert compiled["k"] == result["m"] // 2, f"{what}: auto settled on {compiled['k']}"
        for a, b in zip(compiled["weights"], eager["weights"], strict=True):
            torch.testing.assert_close(
                a, b, rtol=1e-5, atol=1e-6, msg=f"{what}: differs from eager"
            )
