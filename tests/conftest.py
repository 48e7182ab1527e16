"""The suite's layout, markers and shared fixtures.

Folders (every one runs in ``make test``; markers let a developer select, e.g.
``pytest -m "not slow"`` or ``pytest -m unit``):

* ``unit/`` — no process group, fast: kernels, codec, scheduler, reference, code shape;
* ``distributed/`` — real multi-rank Gloo jobs (``support.dist_utils.run_ranks``);
* ``integrations/`` — training through the frameworks' own loops, with their real packages
  (Lightning, Accelerate, the ``transformers`` Trainer) on real Gloo ranks, and the examples;
* ``system/`` — whole jobs run as subprocesses: the launcher and its namespaces, packaging,
  exit and fault samples, soak, the memory benchmark, an emulated cluster, restarts, real
  training scripts;
* ``gpu/`` — CUDA tests that skip without a GPU (a CUDA case of a file elsewhere is marked
  ``gpu`` where it is: ``support.cuda``).

Each test is marked with its folder's name here (``unit``, ``distributed``,
``integrations``, ``system``, ``gpu``); ``slow`` (more than ~20 s alone) is written on the
tests themselves. The markers
are registered in pyproject.toml, which runs pytest with ``--strict-markers``.

Helpers live in the package ``support`` (``tests/`` is on ``sys.path``: pyproject.toml's
``pythonpath``), not here: the rank processes and job scripts import them too. Job scripts
run as subprocesses are in ``jobs/``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
FOLDERS = (
    "unit",
    "distributed",
    "integrations",
    "system",
    "gpu",
)  # each is also the marker of its tests


def pytest_collection_modifyitems(config, items):
    for item in items:
        try:
            folder = item.path.resolve().relative_to(TESTS).parts[0]
        except ValueError:  # a test outside tests/
            continue
        if folder in FOLDERS:
            item.add_marker(folder)


@pytest.fixture
def rank_checkpoint(tmp_path) -> str:
    """A checkpoint path for each rank in this test's ``tmp_path``: ``.../ckpt-{rank}.pt``
    (``sapipe.save_checkpoint`` fills in ``{rank}``)."""
    return str(tmp_path / "ckpt-{rank}.pt")
