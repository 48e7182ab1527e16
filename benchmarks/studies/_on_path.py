"""Imported first by every study: puts ``benchmarks/`` on ``sys.path``.

A study runs by path (``python benchmarks/studies/X.py``, under torchrun, or through
``python -m benchmarks X``), so Python puts ``studies/`` first on ``sys.path``; with
``benchmarks/`` after it, a study imports :mod:`harness`, :mod:`bench_models` and the
benchmarks by name, as the scripts of ``benchmarks/`` do.
"""

import os
import sys

BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if BENCH_DIR not in sys.path:
    sys.path.insert(1, BENCH_DIR)
