"""Helpers shared by sapipe's tests, jobs and rank processes (importable as ``support``).

pytest puts ``tests/`` on ``sys.path`` (``pythonpath`` in pyproject.toml), and so does each
job script in ``tests/jobs/``; the rank processes of ``dist_utils.run_ranks`` inherit it.
Nothing here imports sapipe at module level: a rank imports sapipe only once the environment
it was given is in place.

* ``paths`` — the repository's folders, and the environment of a job run as a subprocess.
* ``dist_utils`` — ``run_ranks`` (a function on N real Gloo ranks), comparisons of results.
* ``models`` — the small test models and their deterministic batches.
* ``optimizers`` — ``make_optimizer``, the suite's one optimizer factory, and ``GENERIC``,
  the optimizers driven through sapipe's generic update path.
* ``training`` — the plain training loop and the reads of a model's weights.
* ``reference`` — the independent float64 reference of docs/design.md §3 (the ground truth).
* ``modes``, ``compressed`` — the staleness-mode and compressed-sum suites that several test
  files (CPU back-ends, CUDA) hold to the reference.
* ``cuda`` — CUDA cases of a CPU test file (marked ``gpu``, skipped without a device).
"""
