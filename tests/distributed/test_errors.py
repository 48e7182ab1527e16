"""Bad input raises a clear error naming its cause, on every rank, never a hang."""

from __future__ import annotations

import os
import time

import pytest
import torch
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import make_optimizer

import sapipe
from sapipe.comm import BACKENDS, compression_refusal

# name -> (kwargs for DistributedOptimizer, expected exception class name, text in message)
BAD_ARGUMENTS = {
    "unknown mode": (
        {"compensation": "dcx"},
        "ConfigurationError",
        "compensation must be a sapipe.optim.compensation.Compensation or one of",
    ),
    "negative lambda": ({"dc_lambda": -0.1}, "ConfigurationError", "dc_lambda"),
    "nan lambda": ({"dc_lambda": float("nan")}, "ConfigurationError", "dc_lambda"),
    "k < 0": ({"stale_layers": -1}, "ConfigurationError", "stale_layers"),
    "k > m": ({"stale_layers": 4}, "ConfigurationError", "m=3"),
    "k not int": ({"stale_layers": 1.5}, "ConfigurationError", "stale_layers"),
    "staleness 0": ({"staleness": 0}, "ConfigurationError", "staleness must be an int >= 1"),
    "wp with s > 1": (
        {"compensation": "wp2", "staleness": 2, "stale_layers": 1},
        "ConfigurationError",
        "staleness 1 only",
    ),
    "bad dc form": ({"dc_form": "full"}, "ConfigurationError", "dc_form"),
    "negative warmup": ({"warmup_steps": -1}, "ConfigurationError", "warmup_steps"),
    "zero bucket": ({"bucket_cap_mb": 0}, "ConfigurationError", "bucket_cap_mb"),
    "negative timeout": ({"timeout": -5}, "ConfigurationError", "timeout"),
    "unknown backend": ({"backend": "mpi"}, "ConfigurationError", "backend must be one of"),
    "zero partition": (
        {"backend": "pushpull", "partition_mb": 0},
        "ConfigurationError",
        "partition_mb",
    ),
    "a bucket beyond int64 bytes": (
        {"bucket_cap_mb": 1e308},
        "ConfigurationError",
        "bucket_cap_mb must be a number of MiB",
    ),
    "a partition beyond int64 bytes": (
        {"backend": "pushpull", "partition_mb": 2.0**41},
        "ConfigurationError",
        "partition_mb must be a number of MiB > 0 and <= 2**40",
    ),
    "byteps missing": ({"backend": "byteps"}, "ConfigurationError", "byteps.torch"),
    "negative tune steps": (
        {"stale_layers": "auto", "tune_steps": -1},
        "ConfigurationError",
        "tune_steps must be an int >= 0",
    ),
    "budget not an int": (
        {"stale_layers": "auto", "auto_budget": 2.5},
        "ConfigurationError",
        "auto_budget must be None or an int >= 1",
    ),
    "budget inside the warm-up": (
        {"stale_layers": "auto", "auto_budget": 12, "profile_steps": 8},
        "ConfigurationError",
        "auto_budget=12 ends before the warm-up does (13 iterations",
    ),
    "zero profile steps": (
        {"stale_layers": "auto", "profile_steps": 0},
        "ConfigurationError",
        "profile_steps",
    ),
    "unknown compression": (
        {"compression": "fp8"},
        "ConfigurationError",
        "compression must be None, a sapipe.compression.Compression or one of",
    ),
    "error feedback without a compression": (
        {"error_feedback": True},
        "ConfigurationError",
        "error_feedback=True needs a compression",
    ),
    "error feedback not a bool": (
        {"compression": "int8", "error_feedback": "yes"},
        "ConfigurationError",
        "error_feedback must be None, True or False; got 'yes'",
    ),
    # byteps is refused by name before its missing library is reported (the settings' check
    # comes first)
    "compression the back-end cannot carry": (
        {"backend": "byteps", "compression": "int8"},
        "ConfigurationError",
        "backend='byteps' cannot carry compression='int8'",
    ),
}


def _optimizer(case, model, rank):
    """Plain SGD, or what the case is about (the optimizers sapipe refuses are built as such)."""
    if case == "ranks disagree on the learning rate":
        return make_optimizer("sgd", model.parameters(), lr=0.1 * (rank + 1))
    if case == "foreign parameter":
        params = list(model.parameters()) + [torch.nn.Parameter(torch.zeros(3))]
        return make_optimizer("sgd", params, lr=0.1)
    if case == "unsupported optimizer":
        return torch.optim.LBFGS(model.parameters(), lr=0.1)
    if case == "sparse optimizer":
        return torch.optim.SparseAdam(model.parameters())
    if case == "differentiable":
        return torch.optim.RMSprop(model.parameters(), differentiable=True)
    return make_optimizer("sgd", model.parameters(), lr=0.1)


def _model(case, rank):
    """The MLP; rank 1's differs where the case says the ranks' models do."""
    model = make_model("mlp")
    if rank == 1 and case == "ranks disagree on a buffer":
        model.register_buffer("steps_seen", torch.zeros(1))  # a buffer rank 0's model lacks
    if rank == 1 and case == "ranks disagree on which parameters train":
        next(model.parameters()).requires_grad_(False)
    return model


def _construct(rank, world_size, cases):
    results = {}
    for case, kwargs in cases.items():
        model = _model(case, rank)
        start = time.monotonic()
        try:
            sapipe.DistributedOptimizer(
                _optimizer(case, model, rank), model, **({"timeout": 20} | kwargs[rank])
            )
            results[case] = ("no error", "", 0.0)
        except sapipe.SapipeError as exc:
            results[case] = (type(exc).__name__, str(exc), time.monotonic() - start)
    return results


def _cases():
    """case name -> [kwargs of rank 0, kwargs of rank 1]."""
    cases = {name: [kw, kw] for name, (kw, _, _) in BAD_ARGUMENTS.items()}
    cases["foreign parameter"] = [{}, {}]
    cases["unsupported optimizer"] = [{}, {}]
    cases["sparse optimizer"] = [{}, {}]
    cases["differentiable"] = [{}, {}]
    cases["ranks disagree on k"] = [{"stale_layers": 0}, {"stale_layers": 1}]
    cases["ranks disagree on mode"] = [
        {"stale_layers": 1, "compensation": c} for c in ("dc", "wp1")
    ]
    cases["ranks disagree on compression"] = [{"compression": "bf16"}, {}]
    cases["ranks disagree on a buffer"] = [{}, {}]
    cases["ranks disagree on the learning rate"] = [{}, {}]
    cases["ranks disagree on which parameters train"] = [{}, {}]
    cases["one number written two ways"] = [
        {"bucket_cap_mb": 25, "timeout": 20},
        {"bucket_cap_mb": 25.0, "timeout": 20.0},
    ]
    cases["the default written out"] = [
        {"compression": "int8"},
        {"compression": "int8", "error_feedback": True},
    ]
    return cases


EXPECTED = {name: (cls, text) for name, (_, cls, text) in BAD_ARGUMENTS.items()} | {
    "foreign parameter": ("ConfigurationError", "not a parameter of the model"),
    "unsupported optimizer": ("UnsupportedOptimizerError", "LBFGS: its step() needs a closure"),
    "sparse optimizer": ("UnsupportedOptimizerError", "SparseAdam: it takes sparse gradients"),
    "differentiable": ("UnsupportedOptimizerError", "differentiable=True"),
    "ranks disagree on k": (
        "ConfigurationError",
        "rank 1 has stale_layers=1 but rank 0 has stale_layers=0",
    ),
    "ranks disagree on mode": ("ConfigurationError", "compensation="),
    "ranks disagree on compression": (
        "ConfigurationError",
        "rank 1 has compression=None but rank 0 has compression='bf16'",
    ),
    # rank 0's buffers are broadcast at construction, and the layout follows the trainable
    # parameters
    "ranks disagree on a buffer": ("ConfigurationError", "model_buffers"),
    "ranks disagree on which parameters train": (
        "ConfigurationError",
        "rank 1 has model_parameters[0]=('0.weight', (10, 6), 'torch.float32', False) "
        "but rank 0 has ('0.weight', (10, 6), 'torch.float32', True)",
    ),
    "ranks disagree on the learning rate": (
        "ConfigurationError",
        "rank 1 has param_groups[0].lr=0.2 but rank 0 has 0.1",
    ),
}


@pytest.fixture(scope="module")
def construction_results():
    return run_ranks(_construct, world_size=2, args=(_cases(),))


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_bad_configuration_is_refused_on_every_rank(construction_results, case):
    cls, text = EXPECTED[case]
    for rank, results in enumerate(construction_results):
        got_cls, message, elapsed = results[case]
        assert got_cls == cls, f"rank {rank}: expected {cls}, got {got_cls}: {message}"
        assert text in message, f"rank {rank}: message does not name the cause: {message}"
        assert message.startswith("sapipe"), message
        assert elapsed < 30, f"rank {rank}: took {elapsed:.1f}s"


@pytest.mark.parametrize("case", ["one number written two ways", "the default written out"])
def test_one_setting_written_two_ways_agrees(construction_results, case):
    """25 on one rank and 25.0 on another configure the same job, as do int8's error feedback
    left to its default (on) and written out."""
    for results in construction_results:
        assert results[case][0] == "no error", results[case]


@pytest.mark.parametrize("backend", BACKENDS)
def test_compression_is_refused_by_name_where_the_back_end_cannot_carry_it(backend):
    """Only byteps refuses: torch, pushpull and horovod carry every format (docs/design.md §5.9)."""
    for compression in ("fp16", "bf16", "int8"):
        refusal = compression_refusal(backend, compression)
        if backend == "byteps":
            assert (
                refusal is not None
                and f"backend='byteps' cannot carry compression={compression!r}" in refusal
            )
        else:
            assert refusal is None, refusal
    assert compression_refusal(backend, None) is None


def _construct_int8_with_block(rank, world_size, block_of_rank_1):
    """A DistributedOptimizer with int8 where rank 1 runs a sapipe whose int8 block differs."""
    import sapipe.compression.codec

    if rank == 1:
        sapipe.compression.codec.INT8_BLOCK = block_of_rank_1
    model = make_model("mlp")
    try:
        sapipe.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, compression="int8", timeout=20
        )
    except sapipe.ConfigurationError as exc:
        return str(exc)
    return "no error"


def test_ranks_whose_int8_blocks_differ_are_refused():
    """Two installs of sapipe with different int8 wire formats would misread each other's bytes."""
    messages = run_ranks(_construct_int8_with_block, world_size=2, args=(256,))
    for message in messages:
        assert "rank 1 has int8_block=256 but rank 0 has int8_block=64" in message, message


def test_requires_initialised_process_group():
    model = make_model("mlp")
    with pytest.raises(sapipe.ConfigurationError, match="init_process_group"):
        sapipe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model)


def _misuse(rank, world_size):
    found = {}
    model = make_model("mlp")
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, timeout=20
    )
    try:
        opt.step()
    except sapipe.UsageError as exc:
        found["step first"] = str(exc)
    x, y = make_batches("mlp", 1, world_size)[0][rank]
    loss = loss_fn_for("mlp")(model(x), y)
    loss.backward(retain_graph=True)
    try:
        loss.backward()
    except sapipe.UsageError as exc:
        found["two backwards"] = str(exc)
    return found


def test_misuse_is_explained():
    for found in run_ranks(_misuse, world_size=2):
        assert "before the model's first forward" in found["step first"]
        assert "no_sync" in found["two backwards"]


def _peer_failure(rank, world_size, how, backend):
    model = make_model("mlp")
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        stale_layers=1,
        timeout=4,
        backend=backend,
    )
    batches = make_batches("mlp", 10, world_size)
    for t in range(10):
        if rank == 1 and t == 3:
            if how == "dies":
                os._exit(1)
            time.sleep(60)  # hangs: never joins another collective
        start = time.monotonic()
        try:
            x, y = batches[t][rank]
            opt.zero_grad()
            loss_fn_for("mlp")(model(x), y).backward()
            opt.step()
            model(x)  # the next forward waits for this iteration's sync all-reduce
        except sapipe.CommunicationError as exc:
            return {"step": t, "error": str(exc), "elapsed": time.monotonic() - start}
    return {"step": None}


@pytest.mark.parametrize("backend", ["torch", "pushpull"])
@pytest.mark.parametrize("how", ["dies", "hangs"])
def test_surviving_rank_raises_when_a_peer_fails(how, backend):
    out = run_ranks(_peer_failure, world_size=2, args=(how, backend), allow_missing=[1], timeout=90)
    survivor = out[0]
    assert survivor["step"] == 3, survivor
    operation = {"torch": "all-reduce", "pushpull": "push-pull"}[backend]
    assert "peer rank" in survivor["error"] and operation in survivor["error"]
    assert survivor["elapsed"] < 20, f"took {survivor['elapsed']:.1f}s (timeout=4s)"


def _local_failure(rank, world_size):
    """Rank 0's compressed sum raises an ordinary Python error at iteration 3 (a bug on that
    rank, not a lost peer); both ranks must raise CommunicationError, each naming its cause."""
    model = make_model("mlp")
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1),
        model,
        stale_layers=1,
        timeout=4,
        compression="int8",
    )
    batches = make_batches("mlp", 6, world_size)
    for t in range(6):
        if rank == 0 and t == 3:

            def broken(*args, **kwargs):
                raise ValueError("the codec broke")

            sapipe.comm.compressed.sum_compressed = broken
        try:
            x, y = batches[t][rank]
            opt.zero_grad()
            loss_fn_for("mlp")(model(x), y).backward()
            opt.step()
            model(x)
        except sapipe.CommunicationError as exc:
            return {"step": t, "error": str(exc)}
    return {"step": None}


def test_an_error_on_this_rank_is_not_blamed_on_a_peer():
    here, peer = run_ranks(_local_failure, world_size=2, timeout=90)
    assert (
        here["step"] == 3 and "raised on this rank: ValueError: the codec broke" in here["error"]
    ), here
    assert "peer rank" not in here["error"]
    assert peer["step"] is not None and "peer rank" in peer["error"], peer


GRADIENT_CHANGES = {
    "clip_grad_norm_": lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3),
    "clip_grad_value_": lambda model: torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4),
    "assignment": lambda model: setattr(model[0].weight, "grad", torch.zeros_like(model[0].weight)),
    "read only (norm logging)": lambda model: torch.nn.utils.get_total_norm(
        [p.grad for p in model.parameters()]
    ),
}


def _change_gradients(rank, world_size):
    """With expose_gradients=False, each way of touching p.grad between backward and step, at
    k = 0 and k = 1: a change must raise (it could not reach the update), a read must not."""
    results = {}
    for k in (0, 1):
        for case, change in GRADIENT_CHANGES.items():
            model = make_model("mlp")
            opt = sapipe.DistributedOptimizer(
                torch.optim.SGD(model.parameters(), lr=0.1),
                model,
                stale_layers=k,
                timeout=20,
                expose_gradients=False,
            )
            x, y = make_batches("mlp", 1, world_size)[0][rank]
            loss_fn_for("mlp")(model(x), y).backward()
            change(model)
            try:
                opt.step()
                results[(k, case)] = "no error"
            except sapipe.UsageError as exc:
                results[(k, case)] = str(exc)
            opt.close()
    return results


def test_a_gradient_changed_between_backward_and_step_raises_when_not_exposed():
    for results in run_ranks(_change_gradients, world_size=2):
        for (k, case), outcome in results.items():
            if case.startswith("read only"):
                assert outcome == "no error", (k, case, outcome)
            else:
                assert "changed between backward() and step()" in outcome, (k, case, outcome)
                assert "expose_gradients=True" in outcome
