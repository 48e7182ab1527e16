"""stale_layers="auto": the switch after profiling is exact, and k follows the network.

1. Exactness: the solver's answer is pinned to a given k (its input is timing, so a test
   of the *switch* must not depend on timing), and the run must equal the float64
   reference with that k and the effective warm-up: the re-layout of buckets and the
   migration of optimizer state (momentum, Adam moments, step counts) lose nothing.
   Likewise the measured search for k (its path scripted): every pipeline restart must
   equal the reference's drain-and-restart, k going up and down, for staleness 1 and 2.
2. Decisions on real networks (k = 0 on loopback, k > 0 on a slow link) are whole jobs:
   tests/system/test_auto_network.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from support.dist_utils import assert_close_dicts, k_once_decided, run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import recipe
from support.reference import run_reference
from support.training import held_and_real, named_weights, train_steps

from sapipe.auto.controller import FIRST_TRIAL_HEAD
from sapipe.config import UNPROFILED_STEPS

STEPS = 13
PROFILE_STEPS = 2  # warm-up lasts PROFILE_STEPS + UNPROFILED_STEPS = 7 iterations
OPTIMIZERS = {
    "sgd": recipe("sgd-momentum", lr=0.05, weight_decay=1e-3),
    "adam": recipe("adam", lr=0.01),
}


class _ScriptedTuner:
    """A stand-in for ``sapipe.auto.search.Tuner`` that walks a fixed path of k."""

    path = ()  # the k of the trials after the first; the last one is final

    def __init__(self, first_k, m, tolerance, suggest=None):
        self.first_k, self.trials = first_k, []
        self.todo = list(self.path)
        self.trial, self.final = first_k, None
        self.suggest = suggest

    def record(self, iteration_time, waits):
        from sapipe.auto.search import Trial

        assert iteration_time > 0 and waits >= 0
        self.trials.append(Trial(self.trial, iteration_time, waits))
        if len(self.todo) == 1:
            self.trial, self.final = None, self.todo[0]
        else:
            self.trial = self.todo.pop(0)

    def stop(self):
        """Out of budget: the last k measured is final."""
        self.trial, self.final = None, self.trials[-1].k

    def summary(self):
        return f"scripted {[t.k for t in self.trials]} -> {self.final}"

    def state_dict(self):
        state = dict(vars(self), trials=[dataclasses.astuple(t) for t in self.trials])
        del state["suggest"]  # the controller's model, set again on load
        return state

    @classmethod
    def from_state(cls, state):
        from sapipe.auto.search import Trial

        tuner = cls.__new__(cls)
        vars(tuner).update(state, trials=[Trial(*t) for t in state["trials"]])
        return tuner


def _pin_search(k: int, path: tuple[int, ...], comm_bound: bool = False) -> None:
    """In this rank's process: the solver's k pinned to ``k`` (its input is timing), the
    measured search scripted to walk ``path`` (:class:`_ScriptedTuner`), trials of exactly
    ``tune_steps`` (restarts at known iterations)."""
    import sapipe
    from sapipe.auto import search as tuner
    from sapipe.schedule import solver

    real_choose = solver.choose_k
    solver.choose_k = lambda *a, **kw: dataclasses.replace(
        real_choose(*a, **kw),
        k=kw["only_k"] if kw.get("only_k") is not None else k,
        comm_bound=comm_bound,
    )
    _ScriptedTuner.path = path
    tuner.Tuner = _ScriptedTuner
    sapipe.auto.controller.TRIAL_MAX_ROUNDS = 1


def _pinned(
    rank,
    world_size,
    kind,
    mode,
    k,
    staleness=1,
    path=(),
    tune_steps=0,
    steps=STEPS,
    budget=30,
    comm_bound=False,
):
    import sapipe

    _pin_search(k, path, comm_bound)
    model = make_model("tied", seed=rank, dtype=torch.float64)
    opt = sapipe.DistributedOptimizer(
        OPTIMIZERS[kind](model.parameters()),
        model,
        stale_layers="auto",
        compensation=mode,
        profile_steps=PROFILE_STEPS,
        bucket_cap_mb=0.0008,
        timeout=60,
        staleness=staleness,
        tune_steps=tune_steps,
        auto_budget=budget,
    )
    batches = make_batches("tied", steps, world_size, dtype=torch.float64)
    seen = []
    for t in range(steps):
        x, y = batches[t][rank]
        opt.zero_grad()
        loss_fn_for("tied")(model(x), y).backward()
        opt.step()
        seen.append(opt.stale_layers)
    opt.synchronize()
    held, real = held_and_real(model, opt)
    return {
        "seen": seen,
        "held": held,
        "real": real,
        "k": opt.decision.k,
        "decided_at": opt.auto.decided_at,
    }


@pytest.mark.parametrize("kind,mode,k", [("sgd", "dc", 3), ("adam", "wp3", 5), ("sgd", "none", 7)])
def test_switch_after_profiling_is_exact(kind, mode, k):
    out = run_ranks(_pinned, world_size=2, args=(kind, mode, k))
    warmup = PROFILE_STEPS + UNPROFILED_STEPS
    assert out[0]["seen"] == ["auto"] * (warmup - 1) + [k] * (STEPS - warmup + 1)
    ref = run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        OPTIMIZERS[kind],
        make_batches("tied", STEPS, 2, dtype=torch.float64),
        loss_fn_for("tied"),
        stale_layers=k,
        compensation=mode,
        warmup_steps=warmup,
    )
    for rank in range(2):
        assert_close_dicts(
            out[rank]["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} real"
        )
        assert_close_dicts(
            out[rank]["held"], ref.held[-1][rank], rtol=1e-9, atol=1e-11, what=f"rank {rank} held"
        )


@pytest.mark.parametrize(
    "kind,mode,staleness", [("sgd", "dc", 2), ("adam", "wp3", 1), ("sgd", "wp1", 1)]
)
def test_measured_search_restarts_the_pipeline_exactly(kind, mode, staleness):
    """Trials of tune_steps=2 (after s unmeasured, and the first after FIRST_TRIAL_HEAD more)
    iterations at k = 3 (the model's) and 7; then 5, final."""
    steps, tune = 20, 2
    out = run_ranks(_pinned, world_size=2, args=(kind, mode, 3, staleness, (7, 5), tune, steps))
    warmup = PROFILE_STEPS + UNPROFILED_STEPS
    first = warmup + FIRST_TRIAL_HEAD + staleness + tune  # restarts after these
    second = first + staleness + tune
    assert out[0]["seen"] == ["auto"] * (second - 1) + [5] * (steps - second + 1)
    assert out[0]["k"] == 5
    ref = run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        OPTIMIZERS[kind],
        make_batches("tied", steps, 2, dtype=torch.float64),
        loss_fn_for("tied"),
        stale_layers=3,
        compensation=mode,
        warmup_steps=warmup,
        staleness=staleness,
        restarts=[(first, 7), (second, 5)],
    )
    for rank in range(2):
        assert_close_dicts(
            out[rank]["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} real"
        )
        assert_close_dicts(
            out[rank]["held"], ref.held[-1][rank], rtol=1e-9, atol=1e-11, what=f"rank {rank} held"
        )


def test_the_search_stops_within_its_budget_with_the_last_good_k():
    """auto_budget=18: trials of 1 + 2 iterations (the first 2 more) at k = 3 (the model's), 7
    and 5 end at 12, 15 and 18; a fourth would end at 21, so the search stops at 18 and keeps
    5, exactly as a drain-and-restart at each trial."""
    steps, tune, budget = 20, 2, 18
    out = run_ranks(
        _pinned, world_size=2, args=("adam", "wp1", 3, 1, (7, 5, 6, 4), tune, steps, budget)
    )
    warmup = PROFILE_STEPS + UNPROFILED_STEPS
    assert out[0]["decided_at"] == budget == warmup + FIRST_TRIAL_HEAD + 3 * (1 + tune)
    assert (
        out[0]["seen"] == ["auto"] * (budget - 1) + [5] * (steps - budget + 1) and out[0]["k"] == 5
    )
    ref = run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        OPTIMIZERS["adam"],
        make_batches("tied", steps, 2, dtype=torch.float64),
        loss_fn_for("tied"),
        stale_layers=3,
        compensation="wp1",
        warmup_steps=warmup,
        restarts=[(warmup + FIRST_TRIAL_HEAD + 3, 7), (warmup + FIRST_TRIAL_HEAD + 6, 5)],
    )
    for rank in range(2):
        assert_close_dicts(
            out[rank]["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank} real"
        )


@pytest.mark.parametrize("budget", [30, None])
def test_a_communication_bound_k_is_kept_unmeasured_within_a_budget(budget):
    """The model finds k = 3 communication-bound: within a budget k is final at the end of
    warm-up; without one the search still measures (here 7, then 5)."""
    out = run_ranks(_pinned, world_size=2, args=("sgd", "none", 3, 1, (7, 5), 2, 20, budget, True))
    warmup = PROFILE_STEPS + UNPROFILED_STEPS
    if budget is None:
        assert out[0]["k"] == 5 and out[0]["decided_at"] > warmup
    else:
        assert out[0]["k"] == 3 and out[0]["decided_at"] == warmup
        assert out[0]["seen"] == ["auto"] * (warmup - 1) + [3] * (20 - warmup + 1)


def _search_resumed(rank, world_size, path, split, steps=18):
    """The scripted search (3, then 7, then 5), uninterrupted vs checkpointed at ``split`` and
    resumed."""
    import sapipe

    _pin_search(3, (7, 5))
    batches = make_batches("tied", steps, world_size, dtype=torch.float64)

    def new(seed):
        model = make_model("tied", seed=seed, dtype=torch.float64)
        opt = sapipe.DistributedOptimizer(
            OPTIMIZERS["adam"](model.parameters()),
            model,
            stale_layers="auto",
            compensation="wp3",
            profile_steps=PROFILE_STEPS,
            bucket_cap_mb=0.0008,
            timeout=60,
            tune_steps=2,
        )
        return model, opt

    def train(model, opt, its):
        for t in its:
            x, y = batches[t][rank]
            opt.zero_grad()
            loss_fn_for("tied")(model(x), y).backward()
            # reads p.grad: the model's sync_at_step
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e6)
            opt.step()

    results = []
    for stop in (None, split):
        model, opt = new(seed=0)
        train(model, opt, range(steps if stop is None else stop))
        if stop is not None:
            sapipe.save_checkpoint(path, model, opt)
            opt.close()
            model, opt = new(seed=rank + 5)
            sapipe.load_checkpoint(path, model, opt)
            assert opt.stale_layers == "auto" and opt.auto.tuner is not None  # still searching
            train(model, opt, range(stop, steps))
        with opt.real_weights():
            results.append(named_weights(model))
        # what the warm-up measured, resumed too
        opt.save_profile(path.format(rank=rank) + ".profile.json")
        results.append(
            (
                opt.stale_layers,
                opt.auto.sync_at_step,
                json.loads(open(path.format(rank=rank) + ".profile.json").read())["sync_at_step"],
            )
        )
        opt.close()
    return results


def test_a_checkpoint_during_the_search_resumes_it(rank_checkpoint):
    """Saved in the middle of the second trial: the resumed job finishes the same trial and
    search, knows the script reads p.grad (the model's sync_at_step) and saves its profile."""
    out = run_ranks(
        _search_resumed,
        world_size=2,
        args=(
            rank_checkpoint,
            PROFILE_STEPS + UNPROFILED_STEPS + FIRST_TRIAL_HEAD + 4,
        ),
    )
    for rank in range(2):
        uninterrupted, decided_a, resumed, decided_b = out[rank]
        assert decided_a == decided_b == (5, True, True), (decided_a, decided_b)
        assert_close_dicts(resumed, uninterrupted, rtol=0, atol=0, what=f"rank {rank}")


def _search_resized(rank, world_size, path, resume):
    """The scripted search (3, then 7, then 5) saved by a 3-rank job in the middle of its
    second trial (k = 7), and that checkpoint resumed by a 2-rank job."""
    import warnings

    import sapipe

    _pin_search(3, (7, 5))
    split = PROFILE_STEPS + UNPROFILED_STEPS + FIRST_TRIAL_HEAD + 4
    batches = make_batches("tied", split + 6, world_size)
    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(
        OPTIMIZERS["adam"](model.parameters()),
        model,
        stale_layers="auto",
        profile_steps=PROFILE_STEPS,
        bucket_cap_mb=0.0008,
        timeout=60,
        tune_steps=2,
    )
    checkpoints = sapipe.Checkpointer(path, model, opt)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = checkpoints.resume()[0] if resume else 0
    end = split + 6 if resume else split
    train_steps(model, opt, batches, rank, range(start, end), loss_fn=loss_fn_for("tied"))
    if not resume:
        checkpoints.save(split)
    result = {
        "start": start,
        "searching": opt.auto.tuner is not None and opt.auto.tuner.trial is not None,
        "decided": opt.auto.decided,
        "stale_layers": opt.stale_layers,
        "layout_k": opt._runtime.layout.k,
        "warnings": [str(w.message) for w in caught if "sapipe" in str(w.message)],
        "finite": all(torch.isfinite(p).all() for p in model.parameters()),
    }
    opt.close()
    return result


def test_a_resized_resume_mid_search_ends_the_search_with_the_best_k_measured(tmp_path):
    """The 3-rank job's trials timed its own iterations: the 2-rank job resuming it mid-search
    ends the search as a spent budget would (the scripted tuner's ``stop``: the last k
    measured, 3) and restarts the pipeline at that k, rather than finishing the trial at k = 7
    with times from two jobs."""
    path = str(tmp_path / "ckpt-{rank}-{step}.pt")
    saved = run_ranks(_search_resized, world_size=3, args=(path, False))
    assert all(r["searching"] and r["layout_k"] == 7 for r in saved), saved
    resumed = run_ranks(_search_resized, world_size=2, args=(path, True))
    for r in resumed:
        assert r["start"] == PROFILE_STEPS + UNPROFILED_STEPS + FIRST_TRIAL_HEAD + 4
        assert any("of 3 ranks on 2" in w for w in r["warnings"]), r["warnings"]
        assert (r["decided"], r["searching"], r["stale_layers"], r["layout_k"]) == (
            True,
            False,
            3,
            3,
        ), r
        assert r["finite"]


def _warmup_checkpoint_into_a_decided_job(rank, world_size, path):
    """A checkpoint of the warm-up loaded into a live job that has decided since."""
    import sapipe

    batches = make_batches("tied", 40, world_size)
    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(
        OPTIMIZERS["sgd"](model.parameters()),
        model,
        stale_layers="auto",
        profile_steps=PROFILE_STEPS,
        tune_steps=2,
    )

    def train(its):
        train_steps(model, opt, batches, rank, its, loss_fn=loss_fn_for("tied"))

    train(range(3))
    sapipe.save_checkpoint(path, model, opt)
    train(range(3, 40))
    first = opt.stale_layers
    sapipe.load_checkpoint(path, model, opt)
    undecided = opt.stale_layers
    train(range(3, 40))
    second = opt.stale_layers
    opt.close()
    return first, undecided, second, opt.auto.decided_at


def test_a_warmup_checkpoint_loaded_into_a_decided_job_decides_again(rank_checkpoint):
    """The job is back in its warm-up: it profiles the warm-up's last iterations again and
    decides k anew (it stayed undecided at k = 0 while profiling was never restarted)."""
    out = run_ranks(_warmup_checkpoint_into_a_decided_job, world_size=2, args=(rank_checkpoint,))
    for first, undecided, second, decided_at in out:
        assert isinstance(first, int) and undecided == "auto", (first, undecided)
        assert isinstance(second, int), (
            f"undecided after the load and 37 more iterations: {second!r}"
        )
        assert decided_at is not None and decided_at <= 30


def _traced(rank, world_size, path):
    import sapipe

    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model,
        stale_layers="auto",
        profile_steps=2,
        bucket_cap_mb=0.001,
        trace=path,
    )
    steps = 2 + UNPROFILED_STEPS + 1  # past the decision
    batches = make_batches("tied", steps, world_size)
    train_steps(model, opt, batches, rank, loss_fn=loss_fn_for("tied"))
    opt.write_trace_files()  # what atexit does; called here to inspect the files now
    return [layer.name for layer in opt.layers]


def test_trace_files_hold_measured_and_predicted_timelines(tmp_path):
    layers = run_ranks(_traced, world_size=2, args=(str(tmp_path / "job-{rank}.json"),))[0]
    for rank in range(2):
        measured = json.loads((tmp_path / f"job-{rank}.json").read_text())["traceEvents"]
        predicted = json.loads((tmp_path / f"job-{rank}.predicted.json").read_text())["traceEvents"]
        for events, kinds in (
            (measured, {"forward", "backward", "comm", "wait", "step"}),
            (predicted, {"forward", "backward", "comm"}),
        ):
            spans = [e for e in events if e.get("ph") == "X"]
            assert kinds <= {e["cat"] for e in spans}
            assert all(e["dur"] >= 0 for e in spans)
        forward_layers = {e["name"] for e in measured if e.get("cat") == "forward"}
        assert set(layers) <= forward_layers  # every layer's forward is on the timeline


def _attention(rank, world_size):
    import sapipe

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16),
        torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True),
        torch.nn.Linear(16, 1),
    )
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), model, stale_layers="auto", profile_steps=3
    )
    for _ in range(400):  # warm-up, then the measured search, if any (at most ~5 trials of 41)
        opt.zero_grad()
        model(torch.randn(4, 5, 8)).sum().backward()
        opt.step()
        if opt.stale_layers != "auto":
            break
    never_ran = [layer.name for layer in opt.layers if not layer.executed]
    return {"k": opt.stale_layers, "never_ran": never_ran}


def test_auto_profiles_layers_that_never_run_their_own_forward():
    """nn.MultiheadAttention uses out_proj's parameters without calling out_proj."""
    out = run_ranks(_attention, world_size=2)
    assert out[0]["never_ran"] == ["1.self_attn.out_proj"]
    assert isinstance(out[0]["k"], int) and out[0]["k"] == out[1]["k"]


@pytest.mark.parametrize(
    "value, expected",
    [
        ("", False),
        ("0", False),
        ("off", False),
        ("1", True),
        ("TRUE", True),
        ("/tmp/job-{rank}.json", "/tmp/job-{rank}.json"),
    ],
)
def test_sapipe_trace_from_the_environment(monkeypatch, value, expected):
    """$SAPIPE_TRACE=1 records without a file called "1"; a path records and writes there."""
    from sapipe.tracing.timeline import trace_argument

    monkeypatch.setenv("SAPIPE_TRACE", value)
    assert trace_argument(None) == expected
    assert trace_argument(False) is False and trace_argument("given.json") == "given.json"


class _WithAnExpert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.expert, self.b = (
            torch.nn.Linear(8, 8),
            torch.nn.Linear(8, 8),
            torch.nn.Linear(8, 1),
        )

    def forward(self, x, use_expert=True):
        h = torch.relu(self.a(x))
        return self.b(h + self.expert(h) if use_expert else h)


def _an_expert_one_rank_stops_reaching(rank, world_size):
    import sapipe

    torch.manual_seed(0)
    model = _WithAnExpert()
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model,
        stale_layers="auto",
        profile_steps=3,
        timeout=20,
    )

    def one_step(iteration):
        opt.zero_grad()
        model(torch.randn(4, 8), use_expert=not (rank == 1 and iteration > 1)).pow(
            2
        ).mean().backward()
        opt.step()

    return k_once_decided(opt, one_step)


def test_a_layer_one_rank_stops_running_is_profiled_as_taking_no_time():
    """Rank 1's batches stop reaching the expert after its first iteration (a data-dependent
    branch): its profiled iterations count the expert as taking no time, and every rank
    decides alike, instead of rank 1 alone finding nothing to measure and raising."""
    ks = run_ranks(_an_expert_one_rank_stops_reaching, world_size=2, timeout=120)
    assert ks[0] == ks[1] and isinstance(ks[0], int), ks
