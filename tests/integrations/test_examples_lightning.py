"""examples/lightning_train.py runs as its docstring says: Lightning launches the second rank
itself, sapipe trains (k = 2, wp1) and the script reports k and the final loss."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from support.paths import ROOT

pytest.importorskip("lightning")


def test_the_lightning_example_trains_on_two_ranks():
    command = [sys.executable, str(ROOT / "examples" / "lightning_train.py"), "--devices", "2"]
    command += ["--stale-layers", "2", "--max-steps", "8"]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT"):
        env.pop(name, None)
    out = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "sapipe: k = 2 of 26 layers stale" in out.stdout, out.stdout
    assert "strategy=sapipe steps=8 final train_loss=" in out.stdout, out.stdout
