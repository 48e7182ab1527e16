#!/usr/bin/env python
"""sapipe throughput benchmark: samples/s of sapipe vs DDP (and Horovod) under an emulated network.

The entry point (``make bench``, and the script torchrun runs on every rank); the benchmark
itself is the package ``benchmarks/throughput_bench/`` (its docstring describes the modes and
the report). ``python benchmarks/throughput.py --help`` lists the options.
"""

import sys

from throughput_bench.cli import main

if __name__ == "__main__":
    sys.exit(main())
