"""The fault matrix: how a sapipe job behaves when one rank fails or slows down, each case
with its expected outcome (docs/design.md §5.4, *Faults*).

=====================================  ==========================================================
fault                                  expected outcome
=====================================  ==========================================================
an exception in one rank's forward     every other rank raises ``CommunicationError`` within
or backward (2 and 3 ranks)            ``timeout`` naming the bucket *and* the cause: ``rank R
                                       failed first: ValueError: ...``
                                       (sapipe/comm/failures.py); every process exits with the
                                       exception's status 1, the failing rank's own exit
                                       bounded by ``timeout`` too
the same under ``torchrun``            the agent's store carries the cause to the survivor
a rank SIGKILLed in the decision of    the survivors raise ``CommunicationError`` within
``"auto"``, in its relayout, in a      ``timeout`` naming what failed (a bucket, or the
trial restart, or in the middle of     scheduler's profile), blame no rank (a signal publishes
an int8 compressed sum                 nothing, and a survivor's own error is a symptom), and
                                       exit with status 1, not a signal
rank 0, hosting the store (no          the survivor's lookup of the cause never holds it up: a
torchrun), fails                       dead store answers at once (nothing named), a live one
                                       names the cause
a straggler (one rank 3x slower or     no timeout although the straggle adds up to 2.5x
more for 20 steps)                     ``timeout``; the final weights equal the run without it bit
                                       for bit; the fast rank's ``communication_wait`` grows by
                                       the straggler's extra time, and its traced waits lengthen
                                       in exactly those steps
a lossy link (1%, 5% of packets        the job completes with weights bit-identical to the clean
dropped)                               link (TCP hides the loss; only time changes):
                                       benchmarks/lossy_link.py, run here for a few steps
=====================================  ==========================================================

The failure jobs are tests/jobs/fault_job.py: one process imports torch once, forks the
ranks and hosts the job's store as torchrun's agent does (the store outlives every rank);
each rank's exception leaves through ``sys.excepthook``, ``atexit`` and finalisation, as a
script's does. Every job is killed at a deadline, so a hang fails the test instead of
hanging it.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import time

import pytest
import torch
from support.dist_utils import run_ranks
from support.paths import BENCHMARKS, JOBS, job_env

import sapipe
from sapipe.comm import failures

JOB = str(JOBS / "fault_job.py")
LOSSY = str(BENCHMARKS / "lossy_link.py")

TIMEOUT = 4.0  # sapipe's timeout= in the failure jobs
RAISE_MARGIN = 2.0  # a survivor raises within TIMEOUT + this after the failure
# every process is gone within TIMEOUT + this (finalising torch takes 1-5 s on a loaded 2-core
# host)
EXIT_MARGIN = 10.0
DEADLINE = 45.0  # seconds into a job, every rank still alive is killed (a hang fails the test)


def _env():
    return job_env()


EXCEPTIONS = [("forward", 2, 1), ("forward", 3, 0), ("backward", 2, 0), ("backward", 3, 2)]
# case, world, killed rank, what the survivors' error names, the iterations it may come in
KILLS = [
    ("decide", 2, 1, "sapipe: profiling the warm-up for stale_layers='auto'", {7}),
    # after the relayout the survivors wait for a sync bucket (before a forward) or, once k > 0,
    # a stale one (in step()): whichever their timing reaches first
    ("relayout", 3, 1, " all-reduce of ", {8, 9}),
    # after the restart to k = m every layer is stale: the survivor trains iteration 13 on, and
    # fails at the stale wait in 14's step(), unless its restart in 12 failed already: the
    # drain of a stale bucket, or the wait for 12's sync all-reduce, which the killed rank may
    # have left unfinished
    ("restart", 2, 1, " all-reduce of ", {12, 13, 14}),
    ("compressed", 2, 1, "compressed sum of", {4, 5}),  # the sync or the stale back-end's worker
]


RANK0_STORE = [
    "decide:2:0::rank0-store",
    "forward:2:0:4:rank0-store",
]  # rank 0 hosts the store and fails


@pytest.fixture(scope="module")
def jobs():
    """Every failure job, run by one launcher (one import of torch): spec -> ranks."""
    specs = [f"{case}:{world}:{failing}" for case, world, failing in EXCEPTIONS]
    specs += [f"{case}:{world}:{failing}" for case, world, failing, _, _ in KILLS] + RANK0_STORE
    limit = len(specs) * (DEADLINE + 30)
    try:
        proc = subprocess.run(
            [
                sys.executable,
                JOB,
                "--jobs",
                ",".join(specs),
                "--timeout",
                str(TIMEOUT),
                "--deadline",
                str(DEADLINE),
            ],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=limit,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"the jobs' launcher did not finish within {limit:.0f}s: {exc.stderr}")
    assert proc.returncode == 0, proc.stderr
    return {job["spec"]: job["ranks"] for job in json.loads(proc.stdout)["jobs"]}


def _the(kind, rank):
    found = [e for e in rank["events"] if e["kind"] == kind]
    assert len(found) == 1, f"expected one {kind!r} event, got {found}\n{rank['output']}"
    return found[0]


def _exited_cleanly(rank, failed_at, name):
    """Exit status 1 (the uncaught exception), within the bound, no abort, not killed."""
    assert not rank["killed"], f"{name} hung: killed at the deadline\n{rank['output']}"
    assert rank["exit"] == 1, f"{name} exited with {rank['exit']}\n{rank['output']}"
    assert rank["exited"] - failed_at < TIMEOUT + EXIT_MARGIN, (
        f"{name} exited {rank['exited'] - failed_at:.1f}s later"
    )
    assert (
        "terminate called" not in rank["output"] and "Fatal Python error" not in rank["output"]
    ), rank["output"]


def _survivors_raised(ranks, failed, failed_at, must_contain, step):
    """Every rank but ``failed`` raised CommunicationError in iteration ``step`` (a set), its
    message holding each of ``must_contain``, within the bound, and exited cleanly."""
    for r, rank in enumerate(ranks):
        if r == failed:
            continue
        raised = _the("raised", rank)
        assert raised["type"] == "CommunicationError", (r, raised)
        for text in must_contain:
            assert text in raised["message"], (r, text, raised["message"])
        assert raised["message"].startswith("sapipe: "), raised["message"]
        assert raised["step"] in step, (r, raised["step"], step)
        assert raised["time"] - failed_at < TIMEOUT + RAISE_MARGIN, (
            f"rank {r} raised {raised['time'] - failed_at:.1f}s later"
        )
        _exited_cleanly(rank, failed_at, f"rank {r}")
        yield raised


# ------------------------------------------------------------------ an exception on one rank


@pytest.mark.parametrize("case,world,failing", EXCEPTIONS)
def test_an_exception_on_one_rank_is_named_by_every_other(jobs, case, world, failing):
    """Rank ``failing`` raises ValueError in iteration 4's forward (or backward, from a hook on a
    hidden activation's gradient, after the buckets above it started their all-reduces)."""
    ranks = jobs[f"{case}:{world}:{failing}"]
    failed_at = _the("failing", ranks[failing])["time"]
    own = _the("raised", ranks[failing])
    assert own["type"] == "ValueError" and own["step"] == 4, own
    _exited_cleanly(ranks[failing], failed_at, "the failing rank")
    cause = (
        f"rank {failing} failed first: "
        f"ValueError: boom in {case} at iteration 4 on rank {failing}. "
    )
    seen = list(
        _survivors_raised(ranks, failing, failed_at, ["all-reduce of sync bucket", cause], {4, 5})
    )
    assert len(seen) == world - 1


def test_under_torchrun_the_agents_store_names_the_failing_rank():
    """The same under torchrun, whose agent hosts the store (the default store's server): the
    survivor's error names rank 1's exception. (torchrun then stops the survivor with SIGTERM
    a monitor interval after rank 1 exits: its own policy, not sapipe's.)"""
    torchrun = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        "2",
    ]
    try:
        proc = subprocess.run(
            torchrun + [JOB, "--worker", "--case", "forward", "--timeout", str(TIMEOUT)],
            capture_output=True,
            text=True,
            env=_env(),
            timeout=DEADLINE + 60,
        )
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"torchrun did not finish: {exc.stdout}\n{exc.stderr}")
    events = [
        json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("EVENT ")
    ]
    failing = [e for e in events if e["kind"] == "failing" and e["rank"] == 1]
    raised = [e for e in events if e["kind"] == "raised" and e["rank"] == 0]
    assert proc.returncode == 1 and len(failing) == 1 and len(raised) == 1, (
        proc.stdout + proc.stderr
    )
    assert raised[0]["type"] == "CommunicationError", raised
    assert (
        "rank 1 failed first: ValueError: boom in forward at iteration 4 on rank 1. "
        in raised[0]["message"]
    )
    assert raised[0]["time"] - failing[0]["time"] < TIMEOUT + RAISE_MARGIN


# -------------------------------------------------------------- a rank killed at a delicate moment


@pytest.mark.parametrize("case,world,failing,text,step", KILLS)
def test_a_rank_killed_mid_operation_fails_the_others_cleanly(
    jobs, case, world, failing, text, step
):
    """Rank ``failing`` SIGKILLs itself before the step that decides ``"auto"``'s k, inside the
    relayout at the end of warm-up, inside the measured search's pipeline restart, or on the
    worker thread in the middle of an int8 compressed sum (tests/jobs/fault_job.py). Nothing
    is published by a signal, so no survivor names a rank (the 3-rank case: the first
    survivor's CommunicationError is a symptom, not published as a cause for the second)."""
    ranks = jobs[f"{case}:{world}:{failing}"]
    killed = ranks[failing]
    failed_at = _the("failing", killed)["time"]
    assert killed["exit"] == -9 and not killed["killed"], killed
    for raised in _survivors_raised(ranks, failing, failed_at, [text, "Connection"], step):
        assert "failed first" not in raised["message"], raised["message"]


def test_a_store_gone_with_the_failing_rank_never_holds_the_others_up(jobs):
    """Without torchrun's agent rank 0 hosts the store. Killed, it takes the store along: the
    survivor's lookup of the cause fails at once, and it raises and exits as it would
    otherwise. Failing of an exception, rank 0 publishes first and its store lives until its
    exit, after the survivor raised: the cause is named then (or, on a slow host, not)."""
    ranks = jobs["decide:2:0::rank0-store"]
    failed_at = _the("failing", ranks[0])["time"]
    for raised in _survivors_raised(
        ranks, 0, failed_at, ["sapipe: profiling the warm-up", "Connection"], {7}
    ):
        assert "failed first" not in raised["message"], raised["message"]
    ranks = jobs["forward:2:0:4:rank0-store"]
    failed_at = _the("failing", ranks[0])["time"]
    _exited_cleanly(ranks[0], failed_at, "the failing rank")
    for raised in _survivors_raised(ranks, 0, failed_at, ["all-reduce of sync bucket"], {4, 5}):
        named = re.search(r"; (rank \d+ failed first: [^.]*)\.", raised["message"])
        assert (
            named is None
            or named.group(1)
            == "rank 0 failed first: ValueError: boom in forward at iteration 4 on rank 0"
        ), raised


# ------------------------------------------------------------------ a straggler

STRAGGLE = range(10, 30)  # the steps in which rank 1 is at least 3x slower
STEPS = 36
# the straggler's extra time per step at least (timeout 2 s at least: no host hiccup trips it)
MIN_SLEEP = 0.25


def _wide_mlp():
    torch.manual_seed(0)
    layers = []
    for _ in range(4):
        layers += [torch.nn.Linear(384, 384), torch.nn.Tanh()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(384, 8))


def _train(rank, timeout, sleep):
    """STEPS iterations at k = 2; rank 1 sleeps ``sleep`` before each STRAGGLE step. Returns the
    final weights, rank 1's step times, the communication wait after each step, the start of
    each step and the traced waits (perf_counter_ns)."""
    model = _wide_mlp()
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        model,
        stale_layers=2,
        timeout=timeout,
        bucket_cap_mb=0.6,
        trace=True,
    )
    data = torch.Generator().manual_seed(rank)
    steps, waits, starts = [], [], []
    for t in range(STEPS):
        x, y = torch.randn(256, 384, generator=data), torch.randn(256, 8, generator=data)
        if sleep and rank == 1 and t in STRAGGLE:
            time.sleep(sleep)
        starts.append(time.perf_counter_ns())
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        steps.append((time.perf_counter_ns() - starts[-1]) / 1e9)
        waits.append(opt.communication_wait)
    opt.synchronize()
    weights = {name: p.detach().clone() for name, p in model.named_parameters()}
    events = [
        (at, kind, fields["what"])
        for at, kind, fields in opt.tracer.events()
        if kind in ("comm_wait_start", "comm_wait")
    ]
    opt.close()
    return {"weights": weights, "steps": steps, "waits": waits, "starts": starts, "events": events}


def _straggler(rank, world_size):
    """The run without a straggler, then with one (rank 1 sleeping twice its median step time,
    MIN_SLEEP at least, in each STRAGGLE step: at least 3x slower), ``timeout`` 1/2.5 of the
    straggle's total but 8 times one step's extra wait: a limit on anything longer than one
    collective (the waits of a span of steps, a stale all-reduce's life across iterations
    measured from the fast rank's start) would trip."""
    import torch.distributed as dist

    clean = _train(rank, 60, 0.0)
    box = [max(2 * statistics.median(clean["steps"][2:]), MIN_SLEEP)]
    dist.broadcast_object_list(box, src=1)
    sleep = box[0]
    timeout = (
        len(STRAGGLE) * sleep / 2.5
    )  # the straggle adds len(STRAGGLE) * sleep: 2.5x timeout, 8 sleeps
    slow = _train(rank, timeout, sleep)
    return {"clean": clean, "slow": slow, "sleep": sleep, "timeout": timeout}


def _traced_wait_per_step(run):
    """Seconds of traced communication waits in each step (by where each wait started)."""
    per_step = [0.0] * STEPS
    open_waits = {}
    for at, kind, what in run["events"]:
        if kind == "comm_wait_start":
            open_waits[what] = at
        elif what in open_waits:
            start = open_waits.pop(what)
            step = (
                max(i for i, s in enumerate(run["starts"]) if s <= start)
                if start >= run["starts"][0]
                else 0
            )
            per_step[step] += (at - start) / 1e9
    return per_step


def test_a_straggler_slows_the_job_without_a_timeout_or_a_change_of_numbers():
    out = run_ranks(_straggler, world_size=2, timeout=240)
    sleep, timeout = out[0]["sleep"], out[0]["timeout"]
    assert len(STRAGGLE) * sleep > 2 * timeout > 8 * sleep, (sleep, timeout)
    for (
        rank
    ) in out:  # no timeout (run_ranks would have raised), and the numbers are the clean run's
        for name, value in rank["clean"]["weights"].items():
            assert value.tobytes() == rank["slow"]["weights"][name].tobytes(), (
                f"{name} differs with the straggler"
            )
    fast = out[0]["slow"]
    waits = fast["waits"]
    per_step = [waits[0]] + [b - a for a, b in zip(waits, waits[1:])]
    first, last = STRAGGLE.start, STRAGGLE.stop
    usual = statistics.median(
        per_step[2:first] + per_step[last + 2 :]
    )  # the wait of a step without the straggler
    grew = sum(per_step[first : last + 1]) - usual * (
        last + 1 - first
    )  # (the wait may come a step late)
    extra = len(STRAGGLE) * sleep
    assert abs(grew - extra) < 0.25 * extra, (
        f"the fast rank's wait grew by {grew:.2f}s, the straggler added {extra:.2f}s"
    )
    traced = _traced_wait_per_step(fast)
    inside = statistics.median(traced[first + 1 : last])
    outside = statistics.median(traced[2:first] + traced[last + 2 :])
    assert inside > 0.6 * sleep and outside < 0.2 * sleep, (sleep, inside, outside, traced)


# ------------------------------------------------------------------ a lossy link


def test_a_lossy_link_changes_only_time():
    """benchmarks/lossy_link.py for a few steps at 0% and 5% drop: bit-identical weights.
    Needs root, network namespaces and nft or iptables; skips with the reason otherwise."""
    if not os.path.exists(LOSSY):
        pytest.skip("benchmarks/lossy_link.py is missing")
    check = subprocess.run(
        [sys.executable, LOSSY, "--check"], capture_output=True, text=True, env=_env(), timeout=120
    )
    if check.returncode != 0:
        pytest.skip(check.stdout.strip() or check.stderr.strip())
    proc = subprocess.run(
        [sys.executable, LOSSY, "--steps", "6", "--drops", "0,0.05", "--json"],
        capture_output=True,
        text=True,
        env=_env(),
        timeout=400,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    runs = json.loads(proc.stdout.splitlines()[-1])
    assert [r["drop"] for r in runs] == [0.0, 0.05]
    assert all(r["identical_to_clean"] for r in runs), runs
    assert runs[1]["dropped_packets"] > 0, runs  # the rule did drop packets


# ---------------------------------------------------------- the mechanism (sapipe/comm/failures.py)


class _Store:
    """A store that behaves like a TCPStore's clone: compare_set, check, get; optionally slow."""

    def __init__(self, delay=0.0, broken=False):
        self.values, self.delay, self.broken = {}, delay, broken

    def _call(self):
        time.sleep(self.delay)
        if self.broken:
            raise RuntimeError("Connection refused")

    def compare_set(self, key, expected, value):
        self._call()
        if key not in self.values and expected == "":
            self.values[key] = value.encode()
        return self.values.get(key, b"")

    def check(self, keys):
        self._call()
        return all(k in self.values for k in keys)

    def get(self, key):
        self._call()
        return self.values[key]


@pytest.fixture
def state(monkeypatch):
    fresh = failures._State()
    fresh.rank, fresh.store = 3, _Store()
    monkeypatch.setattr(failures, "_state", fresh)
    return fresh


def test_the_first_published_failure_wins_and_symptoms_are_not_published(state):
    assert failures.first_failure() is None
    lost = failures.symptom(sapipe.CommunicationError("sapipe: sync all-reduce of bucket 0 failed"))
    assert not failures.publish(lost)
    assert not failures.publish(
        RuntimeError("[../third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error")
    )
    try:
        try:
            raise torch.distributed.DistBackendError("NCCL error: remote process exited")
        except RuntimeError as exc:
            raise ValueError("training failed") from exc
    except ValueError as consequence:
        assert not failures.publish(consequence)  # raised because of a lost peer
    assert failures.publish(
        OSError("a bad batch\nsecond line")
    )  # not a transport's (no gloo/transport)
    state.rank = 5
    assert not failures.publish(ValueError("later"))
    assert failures.first_failure() == "rank 3 failed first: OSError: a bad batch"
    assert (
        failures.with_first_failure("sapipe: x failed")
        == "sapipe: x failed; rank 3 failed first: OSError: a bad batch"
    )
    assert len(failures.describe(ValueError("x" * 1000))) == failures.MAX_CHARS


def test_a_frozen_or_dead_store_never_holds_the_error_up(state, monkeypatch):
    monkeypatch.setattr(failures, "STORE_SECONDS", 0.2)
    state.store = _Store(broken=True)
    start = time.monotonic()
    assert failures.first_failure() is None and not failures.publish(ValueError("x"))
    assert time.monotonic() - start < 0.2
    state.store = _Store(delay=5.0)  # frozen: abandoned after the bound, never asked again
    start = time.monotonic()
    assert failures.first_failure() is None
    assert failures.first_failure() is None and not failures.publish(ValueError("x"))
    assert time.monotonic() - start < 0.6 and state.unresponsive


def test_the_hook_chains_and_never_raises(state, monkeypatch):
    seen = []
    state.previous_hook = lambda *args: seen.append(args[1])
    state.store = _Store(broken=True)
    error = ValueError("boom")
    failures._excepthook(ValueError, error, None)
    state.store = _Store()
    failures._excepthook(ValueError, error, None)
    assert (
        seen == [error, error]
        and failures.first_failure() == "rank 3 failed first: ValueError: boom"
    )


def test_a_forked_child_never_uses_its_parents_connection(state):
    """A DataLoader worker forked from a rank shares the rank's connection to the store: it
    neither publishes nor reads (its bytes would interleave with the parent's)."""
    state.store.values[state.key] = b"1:ValueError: boom"
    state.pid += 1
    assert not failures.publish(ValueError("in a worker")) and failures.first_failure() is None


def test_the_key_is_scoped_to_the_torchrun_attempt(monkeypatch):
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    assert failures.scoped_key() == "sapipe/first_failure"
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job7")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    assert failures.scoped_key() == "sapipe/first_failure/job7/2"
