"""The repository's folders, and the environment a job run as a subprocess gets."""

from __future__ import annotations

import os
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
ROOT = TESTS.parent
JOBS = TESTS / "jobs"
BENCHMARKS = ROOT / "benchmarks"
DOCS = ROOT / "docs"
CSRC = ROOT / "csrc"


def job_env(drop: tuple[str, ...] = (), **overrides: str) -> dict[str, str]:
    """This process's environment for a job run as a subprocess: one OpenMP thread per
    process (ranks share the host's cores), ``tests/`` on ``PYTHONPATH`` (so that code the
    job runs can import ``support``), ``overrides``, and without the variables whose names
    start with one of ``drop`` (a launcher's own, which would mislead the job's)."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONPATH=os.pathsep.join(filter(None, [str(TESTS), os.environ.get("PYTHONPATH")])),
        **overrides,
    )
    return {k: v for k, v in env.items() if not (drop and k.startswith(drop))}
