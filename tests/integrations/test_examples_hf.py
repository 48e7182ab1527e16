"""The Hugging Face examples run as documented: ``torchrun --standalone --nproc_per_node=2``,
2 CPU ranks, a few steps on their synthetic data, exit 0 and print their summary line.

``examples/accelerate_train.py`` also saves its state (``--checkpoint``) and is run a second
time, resuming from it; ``examples/trainer_train.py`` writes ``save_steps`` checkpoints with
every rank's sapipe state.
"""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from support.paths import ROOT, job_env

TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]


def _run(script: str, *args: str, cwd) -> str:
    done = subprocess.run(
        [*TORCHRUN, str(ROOT / "examples" / script), *args],
        cwd=cwd,
        env=job_env(),
        capture_output=True,
        text=True,
        timeout=180,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, f"{script} {' '.join(args)} exited {done.returncode}:\n{output}"
    return output


@pytest.mark.slow  # two launches of 2 ranks: ~20-35 s
def test_accelerate_example_trains_saves_and_resumes(tmp_path):
    args = ("--steps", "4", "--log-every", "2", "--checkpoint", str(tmp_path / "state"))
    first = _run("accelerate_train.py", *args, cwd=tmp_path)
    assert "step 4: loss" in first
    assert re.search(r"done: 4 steps, stale_layers=2, compensation=dc, eval loss \d", first)
    assert (tmp_path / "state" / "sapipe-rank1.pt").exists()
    second = _run("accelerate_train.py", *args, cwd=tmp_path)
    assert "resumed from" in second and "done: 4 steps" in second


@pytest.mark.slow  # one launch of 2 ranks importing transformers: ~15-22 s
def test_trainer_example_trains_and_checkpoints(tmp_path):
    output = _run(
        "trainer_train.py",
        *("--steps", "4", "--save-steps", "2", "--output-dir", str(tmp_path / "out")),
        cwd=tmp_path,
    )
    assert re.search(r"done: 4 steps, stale_layers=2, compensation=wp1, .*eval loss \d", output)
    for step in (2, 4):
        assert (tmp_path / "out" / f"checkpoint-{step}" / "sapipe-rank1.pt").exists()
