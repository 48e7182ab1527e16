"""``torch.compile`` and autocast on 2 Gloo ranks (docs/design.md §5.8).

sapipe sees a compiled or autocast model only through its hooks: module forward hooks (the
layer order, buffers) and each parameter's post-accumulate-grad hook, which autograd's
``AccumulateGrad`` fires whether AOTAutograd compiled the backward or not. So:

* **compile** — the model compiled after wrapping it (``torch.compile(model)``), the
  compiled module passed in (``DistributedOptimizer(opt, torch.compile(model))``) and
  ``model.compile()`` all train exactly as eager sapipe: in float64 they match the float64
  reference of docs/design.md §3 (``tests/support/reference.py``) to rtol 1e-9 at k = 0 and k > 0
  (``none``, ``wp1``, ``dc``), and in float32 at k = 0 they equal DDP + ``torch.compile``
  to 1e-6 (the tolerance of ``test_ddp.py``: both run the same float32 graph, only the
  order of the optimizer's float32 operations may differ; observed 3e-8).
* the compiled forward is compiled for the first forward (which records the layer order)
  and the second (hooked per layer), then never again: sapipe's hooks put none of its
  counters or bucket state into dynamo's guards; a compiled module passed in may use
  ``fullgraph=True`` (sapipe's per-layer hooks break no graph).
* **overlap at k > 0** — with the compiled model every gradient hook still fires during
  backward (a graph's gradients all come out together, after its backward), every bucket
  is launched before ``step()``, and a stale bucket's all-reduce of iteration t is waited
  for only after the forward of t + 1 has begun.
* **autocast** (parameters and gradients stay float32) — bf16, and fp16 with
  ``torch.amp.GradScaler``: at k = 0 equal to DDP under the same autocast (and scaler) to
  1e-6, as both compute the same low-precision forward; at k > 0 equal to a float32
  simulation of both ranks (each rank's gradient under the same autocast, their mean,
  applied one step late to the stale layers by ``torch.optim.AdamW``) to 1e-5 (observed
  ≤ 1.2e-7), far below what staleness changes (~1e-2 here).

The compile tests use ``backend="aot_eager"`` (AOTAutograd's forward and backward graphs,
no code generation: fast, and it is what decides how hooks and gradients behave); one test
uses inductor and skips where inductor cannot compile. ``tests/distributed/test_amp.py`` covers the
GradScaler's rules (skipped steps, agreement over ranks) without autocast.
"""

from __future__ import annotations

import contextlib
import functools

import numpy as np
import pytest
import torch
from support.dist_utils import assert_close_dicts, run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import recipe
from support.reference import layer_order, run_reference
from support.training import held_and_real, named_weights, train_steps

STEPS = 6
ORDER = [
    "embed",
    "block_a.norm",
    "block_a.fc1",
    "block_a.fc2",
    "block_b.fc1",
    "block_b.fc2",
    "head",
]
LR = 0.01
AUTOCAST = {
    None: None,
    "bf16": torch.bfloat16,
    "fp16": torch.float16,
}  # fp16 comes with a GradScaler
loss_fn = loss_fn_for("tied")


def _lr_factor(epoch: int) -> float:
    return 1.0 / (1.0 + 0.15 * epoch)


_optimizer = recipe("adamw", lr=LR, weight_decay=0.05)


def _autocast(amp):
    return torch.autocast("cpu", dtype=AUTOCAST[amp]) if amp else contextlib.nullcontext()


def _scaler(amp, growth_interval):
    """fp16's GradScaler: a power-of-two scale (exact unscaling), doubled every
    ``growth_interval`` steps."""
    return torch.amp.GradScaler(
        "cpu", init_scale=2.0**10, growth_interval=growth_interval, enabled=amp == "fp16"
    )


def _graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def _prepare(model, how: str, backend: str):
    """(what the script calls, what it hands to DistributedOptimizer) for ``how``: ``eager``;
    ``compile-after``: ``torch.compile(model)`` after wrapping ``model`` (``compile-later``: the
    same from the second iteration on, after ``opt.synchronize()``; made by the caller);
    ``compile-first``: the compiled module passed in (``fullgraph-first``: compiled with
    ``fullgraph=True``, which raises at any graph break); ``module.compile``:
    ``model.compile()``."""
    if how in ("compile-first", "fullgraph-first"):
        compiled = torch.compile(model, backend=backend, fullgraph=how == "fullgraph-first")
        return compiled, compiled
    if how == "module.compile":
        model.compile(backend=backend)
    return model, model


def _train_sapipe(
    rank, how, backend, k, mode, dtype, batches, *, amp=None, growth_interval=2, trace=False
):
    import torch._dynamo
    from torch._dynamo.utils import counters

    import sapipe

    torch._dynamo.reset()
    counters.clear()
    model = make_model("tied", seed=rank, dtype=dtype)  # construction broadcasts rank 0's
    call, given = _prepare(model, how, backend)
    opt = sapipe.DistributedOptimizer(
        _optimizer(model.parameters()),
        given,
        stale_layers=k,
        compensation=mode,
        bucket_cap_mb=0.0008,
        trace=trace,
        timeout=60,
    )
    if how in ("compile-after", "compile-later"):
        call = torch.compile(model, backend=backend)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor)
    scaler = _scaler(amp, growth_interval)
    graphs = []
    for i, (x, y) in enumerate(step[rank] for step in batches):
        opt.zero_grad()
        if how == "compile-later" and i == 1:
            # compiled after a step: the pending sync updates first (the error says so)
            opt.synchronize()
        with _autocast(amp):
            out = model(x) if how == "compile-later" and i == 0 else call(x)
        scaler.scale(loss_fn(out.to(dtype), y)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
        graphs.append(_graphs() if how != "eager" else 0)
    opt.synchronize()
    held, real = held_and_real(model, opt)
    result = {
        "real": real,
        "held": held,
        "graphs": graphs,
        "layers": [layer.name for layer in opt.layers],
        "buckets": [b.describe() for b in opt.buckets],
    }
    if trace:
        result["events"] = [(ts, kind, dict(fields)) for ts, kind, fields in opt.tracer.events()]
    opt.close()
    return result


def _max_diff(a, b) -> float:
    return max(float(np.max(np.abs(np.asarray(a[n]) - np.asarray(b[n])))) for n in b)


# ---------------------------------------------------------------- float64: the reference

CONFIGS = [  # (how, k, compensation)
    ("compile-after", 0, "none"),
    ("compile-after", 3, "none"),
    ("compile-after", 3, "wp1"),
    ("compile-first", 0, "none"),
    ("compile-first", 3, "wp1"),
    ("fullgraph-first", 3, "none"),
    ("module.compile", 2, "dc"),
]


def _float64(rank, world_size, backend):
    batches = make_batches("tied", STEPS, world_size, dtype=torch.float64)
    results = []
    for how, k, mode in CONFIGS:
        try:
            results.append(_train_sapipe(rank, how, backend, k, mode, torch.float64, batches))
        except Exception as exc:  # noqa: BLE001 - fails this configuration's tests only
            results.append({"error": f"{type(exc).__name__}: {exc}"})
    return results


def _float64_result(run, config):
    got = run["float64"][CONFIGS.index(config)]
    assert "error" not in got, got.get("error")
    return got


# ---------------------------------------------------------------- float32: DDP, autocast

VERSUS_DDP = [  # (how, amp) at k = 0
    ("compile-after", None),
    ("eager", "bf16"),
    ("compile-after", "bf16"),
    ("eager", "fp16"),
]
VERSUS_SIMULATION = [  # (how, amp, k) with compensation "none"
    ("eager", "bf16", 3),
    ("compile-after", "bf16", 3),
    ("compile-first", "bf16", 7),
    ("eager", "fp16", 3),
]


def _train_ddp(rank, how, amp, batches, backend):
    import torch._dynamo
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch._dynamo.reset()
    model = make_model("tied")
    ddp = DDP(model)
    call = torch.compile(ddp, backend=backend) if how != "eager" else ddp
    opt = _optimizer(model.parameters())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor)
    scaler = _scaler(amp, growth_interval=2)
    for x, y in (step[rank] for step in batches):
        opt.zero_grad()
        with _autocast(amp):
            out = call(x)
        scaler.scale(loss_fn(out.float(), y)).backward()
        scaler.step(opt)
        scaler.update()
        sched.step()
    return named_weights(model)


def _simulate_stale(k, amp, batches):
    """Both ranks in one process: each rank's gradient (its forward under ``amp``; for fp16
    of the loss times the fixed scale 2^10, then divided by it), their mean, applied now to
    layers k+1..m and one step later to layers 1..k (nothing at the first step) by
    torch.optim.AdamW: compensation ``none`` of docs/design.md §3.2 written out literally."""
    model = make_model("tied")
    order, layer_params = layer_order(model, batches[0][0][0])
    stale = {name for layer in order[:k] for name in layer_params[layer]}
    params = dict(model.named_parameters())
    opt = _optimizer(params.values())
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_factor)
    scale = 2.0**10 if amp == "fp16" else 1.0
    previous = None
    for step in batches:
        local = []
        for x, y in step:
            model.zero_grad(set_to_none=True)
            with _autocast(amp):
                out = model(x)
            (loss_fn(out.float(), y) * scale).backward()
            local.append({n: p.grad / scale for n, p in params.items()})
        mean = {n: sum(g[n] for g in local) / len(local) for n in params}
        for n, p in params.items():
            p.grad = (previous[n] if previous is not None else None) if n in stale else mean[n]
        opt.step()
        sched.step()
        previous = mean
    return {n: p.detach().clone() for n, p in params.items()}


def _float32(rank, world_size, backend):
    batches = make_batches("tied", STEPS, world_size)
    out = {}
    for how, amp in VERSUS_DDP:
        got = _train_sapipe(rank, how, backend, 0, "none", torch.float32, batches, amp=amp)
        out[(how, amp)] = {
            "sapipe": got["real"],
            "ddp": _train_ddp(rank, how, amp, batches, backend),
        }
    out["float32 ddp"] = _train_ddp(rank, "eager", None, batches, backend)
    for how, amp, k in VERSUS_SIMULATION:
        got = _train_sapipe(
            rank, how, backend, k, "none", torch.float32, batches, amp=amp, growth_interval=10**6
        )
        out[(how, amp, k)] = {"sapipe": got["real"], "simulated": _simulate_stale(k, amp, batches)}
    return out


def _overlap(rank, world_size, backend):
    batches = make_batches("tied", STEPS, world_size)
    return _train_sapipe(
        rank, "compile-first", backend, 3, "none", torch.float32, batches, trace=True
    )


def _aot_eager(rank, world_size):
    """Every aot_eager case in one job (starting a job costs more than most cases)."""
    return {
        "float64": _float64(rank, world_size, "aot_eager"),
        "float32": _float32(rank, world_size, "aot_eager"),
        "overlap": _overlap(rank, world_size, "aot_eager"),
    }


@functools.cache
def _runs():
    return run_ranks(_aot_eager, world_size=2, timeout=300)


def _config_id(config) -> str:
    return "-".join(str(v) for v in config)


# ---------------------------------------------------------------- tests


@pytest.mark.slow  # _runs(): one job for every aot_eager case, ~80 s, paid by the first test
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_compiled_model_matches_reference(config):
    """A compiled model trains by docs/design.md §3 exactly: real and held weights as the
    float64 reference's to rtol 1e-9; layers named as in the plain model."""
    how, k, mode = config
    ref = run_reference(
        make_model("tied", dtype=torch.float64),
        _optimizer,
        make_batches("tied", STEPS, 2, dtype=torch.float64),
        loss_fn,
        stale_layers=k,
        compensation=mode,
        lr_at=lambda it: LR * _lr_factor(it - 1),
    )
    initial = {n: p.detach() for n, p in make_model("tied", dtype=torch.float64).named_parameters()}
    assert _max_diff(ref.real[-1], initial) > 1e-2, "training must move the weights"
    for rank, run in enumerate(_runs()):
        got = _float64_result(run, config)
        assert got["layers"] == ORDER, got["layers"]
        assert len(got["buckets"]) >= 2, "the test should span several buckets"
        assert_close_dicts(
            got["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} real x"
        )
        assert_close_dicts(
            got["held"], ref.held[-1][rank], rtol=1e-9, atol=1e-11, what=f"rank {rank} held"
        )


@pytest.mark.slow  # _runs()
@pytest.mark.parametrize("config", CONFIGS, ids=_config_id)
def test_compiled_forward_is_not_recompiled_every_step(config):
    """The first forward (which records the layer order) and the second (hooked per layer)
    compile; later steps reuse the second's graphs."""
    for rank, run in enumerate(_runs()):
        graphs = _float64_result(run, config)["graphs"]
        assert graphs[1] >= 1 and graphs[-1] == graphs[1], (
            f"rank {rank}: graphs compiled by each step: {graphs}"
        )


@pytest.mark.slow  # _runs()
@pytest.mark.parametrize("how,amp", VERSUS_DDP, ids=[_config_id(c) for c in VERSUS_DDP])
def test_synchronous_equals_ddp_doing_the_same(how, amp):
    """k = 0, compiled and/or under autocast (fp16 with a GradScaler whose scale grows):
    the weights of DDP doing the same, to 1e-6."""
    for rank, run in enumerate(_runs()):
        r = run["float32"][(how, amp)]
        diff = _max_diff(r["sapipe"], r["ddp"])
        assert diff <= 1e-6, f"rank {rank}: max |sapipe - DDP| = {diff:.3e}"
        if amp:
            assert _max_diff(r["ddp"], run["float32"]["float32 ddp"]) > 1e-5, (
                "autocast must compute in low precision"
            )


@pytest.mark.slow  # _runs()
@pytest.mark.parametrize(
    "how,amp,k", VERSUS_SIMULATION, ids=[_config_id(c) for c in VERSUS_SIMULATION]
)
def test_autocast_stale_layers_match_simulation(how, amp, k):
    """Autocast at k > 0, eager and compiled: the float32 simulation's weights to 1e-5."""
    for rank, run in enumerate(_runs()):
        r = run["float32"][(how, amp, k)]
        diff = _max_diff(r["sapipe"], r["simulated"])
        assert diff <= 1e-5, f"rank {rank}: max |sapipe - simulation| = {diff:.3e}"
        synchronous = run["float32"][("eager", amp)]["ddp"]
        assert _max_diff(r["sapipe"], synchronous) > 1e-3, "staleness must make a difference"


def _event_time(events, rank, kind, **match):
    """The time of the one traced event ``kind`` whose fields include ``match``."""
    hits = [ts for ts, k, f in events if k == kind and all(f.get(a) == b for a, b in match.items())]
    assert len(hits) == 1, f"rank {rank}: expected one {kind} {match}, found {len(hits)}"
    return hits[0]


@pytest.mark.slow  # _runs()
def test_stale_allreduce_overlaps_next_forward_when_compiled():
    """With the compiled model, every layer's gradients reach sapipe during backward and
    every bucket is launched before step(); a stale bucket's all-reduce of iteration t is
    waited for only after the forward of t + 1 has begun (it runs behind that forward)."""
    for rank, run in enumerate(_runs()):
        r = run["overlap"]
        when = functools.partial(_event_time, r["events"], rank)

        stale = [b for b in r["buckets"] if b.startswith("stale")]
        assert stale and len(stale) < len(r["buckets"])
        for t in range(1, STEPS + 1):
            step = when("step_start", iteration=t)
            for layer in ORDER:
                assert when("layer_backward_end", layer=layer, iteration=t) < step, (rank, t, layer)
            for bucket in r["buckets"]:
                assert when("comm_start", what=f"{bucket} of iteration {t}") < step, (
                    rank,
                    t,
                    bucket,
                )
            if t < STEPS:
                next_forward = when("forward_start", iteration=t + 1)
                for bucket in stale:
                    assert (
                        step
                        < next_forward
                        < when("comm_wait_start", what=f"{bucket} of iteration {t}")
                    ), (rank, t)


def _inductor(rank, world_size):
    """k = 3 with wp1, eager and with inductor. The first iteration runs the plain model (it
    records the layer order) and later ones the compiled one, so inductor compiles one
    forward and one backward graph: compiling C++ dominates this test."""
    import torch._inductor.config

    torch._inductor.config.compile_threads = (
        1  # no pool of compile workers per rank on a small host
    )
    try:
        torch.compile(lambda x: torch.tanh(x) * 2, backend="inductor")(torch.ones(3))
    except Exception as exc:  # noqa: BLE001 - no C++ compiler, ...: the test skips
        return {"skip": f"inductor cannot compile here: {type(exc).__name__}: {str(exc)[:200]}"}
    batches = make_batches("tied", STEPS, world_size)
    eager = _train_sapipe(rank, "eager", None, 3, "wp1", torch.float32, batches)
    compiled = _train_sapipe(rank, "compile-later", "inductor", 3, "wp1", torch.float32, batches)
    return {"eager": eager["real"], "compiled": compiled["real"], "graphs": compiled["graphs"]}


@pytest.mark.slow  # inductor compiles C++
def test_inductor_compiled_model_equals_eager():
    """Inductor's generated code (fused, reordered float32 arithmetic): the eager run's
    weights to 1e-5 (observed ~1e-7), and no graph compiled after the first compiled step."""
    out = run_ranks(_inductor, world_size=2, timeout=300)
    if "skip" in out[0]:
        pytest.skip(out[0]["skip"])
    for rank, r in enumerate(out):
        diff = _max_diff(r["compiled"], r["eager"])
        assert diff <= 1e-5, f"rank {rank}: max |inductor - eager| = {diff:.3e}"
        assert r["graphs"][1] >= 1 and r["graphs"][-1] == r["graphs"][1], r["graphs"]


def _compiled_mid_training(rank, world_size):
    import sapipe

    model = make_model("tied", seed=rank, dtype=torch.float32)
    opt = sapipe.DistributedOptimizer(
        _optimizer(model.parameters()), model, stale_layers=0, bucket_cap_mb=0.0008, timeout=60
    )
    compiled = torch.compile(model, backend="eager")
    batches = make_batches("tied", 2, world_size)
    try:
        for i, (x, y) in enumerate(step[rank] for step in batches):
            opt.zero_grad()
            loss_fn((model if i == 0 else compiled)(x), y).backward()
            opt.step()
    except sapipe.UsageError as exc:
        return str(exc)
    finally:
        opt.close()
    return None


def test_compiling_after_the_first_step_without_synchronize_raises():
    """A forward compiled after the first step() would run without the sync updates deferred
    to it (a compiled region runs no per-layer hook): every rank raises, naming the remedy."""
    for rank, message in enumerate(run_ranks(_compiled_mid_training, world_size=2, timeout=120)):
        assert (
            message is not None and "torch.compile" in message and "opt.synchronize()" in message
        ), (rank, message)


def _compiled_resume(rank, world_size):
    """A compiled model (aot_eager) trained STEPS steps, and the same checkpointed after 3 and
    resumed in a fresh model and optimizer compiled before loading (as a restarted job is)."""
    import torch._dynamo

    import sapipe

    batches = make_batches("tied", STEPS, world_size)

    def new(seed):
        torch._dynamo.reset()
        model = make_model("tied", seed=seed)
        opt = sapipe.DistributedOptimizer(
            _optimizer(model.parameters()),
            torch.compile(model, backend="aot_eager"),
            stale_layers=3,
            compensation="dc",
            bucket_cap_mb=0.0008,
            timeout=60,
        )
        return model, opt

    def train(model, opt, steps):
        train_steps(model, opt, batches, rank, steps, loss_fn=loss_fn, forward=opt.model)

    model, opt = new(seed=0)
    train(model, opt, range(STEPS))
    opt.synchronize()
    expected = named_weights(model)
    opt.close()
    model, opt = new(seed=0)
    train(model, opt, range(3))
    saved = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
    }
    opt.close()
    model, opt = new(seed=rank + 7)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    train(model, opt, range(3, STEPS))
    opt.synchronize()
    resumed = named_weights(model)
    opt.close()
    return expected, resumed


def test_a_compiled_model_resumes_a_checkpoint_bit_identically():
    """The restarted process has seen no compiled forward yet when it loads: the checkpoint's
    pending sync updates are applied at the load (a compiled forward runs no per-layer hook
    that could), with the arithmetic the uninterrupted run applies at the next forward."""
    for rank, (expected, resumed) in enumerate(
        run_ranks(_compiled_resume, world_size=2, timeout=300)
    ):
        for name, value in expected.items():
            assert np.array_equal(resumed[name], value), (rank, name)
