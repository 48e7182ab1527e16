"""A rank dies mid-training; ``torchrun --max-restarts=1`` restarts the workers, the job
resumes from sapipe's checkpoint and finishes with exactly the weights of a run that was
never interrupted (tests/jobs/restart_job.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
from support.paths import JOBS, job_env

JOB = str(JOBS / "restart_job.py")
TORCHRUN = os.path.join(os.path.dirname(sys.executable), "torchrun")
TIMEOUT_S = 180  # per job; both together take well under a minute on an idle machine

pytestmark = pytest.mark.slow  # the module's two torchrun jobs


def _run(tmp, name, *extra):
    workdir = tmp / name
    workdir.mkdir()
    out = workdir / "final.pt"
    cmd = [
        TORCHRUN,
        "--standalone",
        "--nproc_per_node=2",
        "--max-restarts=1",
        "--monitor-interval=0.2",
        JOB,
        "--ckpt",
        str(workdir / "ckpt-{step}-{rank}.pt"),
        "--out",
        str(out),
        *extra,
    ]
    # a fresh rendezvous store per attempt: with torchrun's shared store the restarted
    # workers can read the dead attempt's Gloo addresses (pytorch/pytorch#135712)
    env = job_env(drop=("PET_", "TORCHELASTIC_"), TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"{name} job hung (> {TIMEOUT_S} s):\n{exc.stdout}\n{exc.stderr}")
    log_path = workdir / "events.log"
    events = log_path.read_text().splitlines() if log_path.exists() else []
    assert proc.returncode == 0, f"{name} job failed:\n{proc.stdout}\n{proc.stderr}\n" + "\n".join(
        events
    )
    return torch.load(out, weights_only=True), events


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    if not os.path.exists(TORCHRUN):
        pytest.skip(f"no torchrun beside {sys.executable}")
    tmp = tmp_path_factory.mktemp("restart")
    killed = _run(tmp, "killed", "--kill-step", "7")
    clean = _run(tmp, "clean")
    return killed, clean


def test_killed_rank_is_restarted_and_resumes_from_checkpoint(runs):
    (_, events), _ = runs
    assert "attempt=0 rank=1 killed step=7" in events, events
    for rank in (0, 1):
        assert f"attempt=0 rank={rank} start=0" in events, events
        assert f"attempt=1 rank={rank} start=6" in events, events  # the step-6 checkpoint
        assert f"attempt=1 rank={rank} done" in events, events
    # the survivor either saw the dead peer (sapipe.CommunicationError) or was torn down
    # by torchrun first; it never finished the first attempt
    assert "attempt=0 rank=0 done" not in events, events
    assert not any(e.startswith("attempt=2") for e in events), events


def test_only_the_last_two_checkpoints_are_kept(runs, tmp_path_factory):
    # the two jobs' folders only (other tests of the session write checkpoints of their own)
    workdirs = {p.parent for p in tmp_path_factory.getbasetemp().glob("restart[0-9]*/*/ckpt-*.pt")}
    assert len(workdirs) == 2, workdirs
    for workdir in workdirs:
        kept = sorted(p.name for p in workdir.glob("ckpt-*.pt"))
        assert kept == ["ckpt-12-0.pt", "ckpt-12-1.pt", "ckpt-9-0.pt", "ckpt-9-1.pt"], (
            workdir,
            kept,
        )


def test_resumed_job_equals_uninterrupted_job_bit_for_bit(runs):
    (resumed, _), (clean, clean_events) = runs
    assert sorted(clean_events) == [
        "attempt=0 rank=0 done",
        "attempt=0 rank=0 start=0",
        "attempt=0 rank=1 done",
        "attempt=0 rank=1 start=0",
    ]
    assert resumed.keys() == clean.keys() and resumed
    for name in clean:
        assert torch.equal(resumed[name], clean[name]), f"{name} differs after restart"
