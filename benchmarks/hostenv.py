"""The environment benchmark worker processes run in.

glibc's malloc serves large blocks (a layer's activations, its gradients) with mmap and
returns them on free, and it raises that threshold only as it sees such blocks freed. A
CPU training step therefore page-faults its big tensors afresh for an unpredictable number
of iterations, or for good. Measured on this project's 2-core host (one process, one
thread, `small` models): vgg16 36 → 28 ms per step and gpt2 60 → 57 ms once the threshold
is fixed, and the job's early iterations stop running at a different speed from its later
ones. Fixing the threshold (which also turns off glibc's adjustment) and not trimming the
heap makes every mode, and every phase of a job, run on the same allocator footing -- what
PyTorch's CPU performance guides get by preloading jemalloc or tcmalloc. sapipe itself
sets nothing: this is the benchmarks' host hygiene, not the library's business.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

STEADY_MALLOC = {
    "MALLOC_MMAP_THRESHOLD_": str(
        32 * 1024 * 1024
    ),  # glibc's largest: blocks below it come from the heap
    "MALLOC_TRIM_THRESHOLD_": str(
        1024 * 1024 * 1024
    ),  # keep freed heap memory instead of giving it back
}


def worker_env(**extra: str) -> dict[str, str]:
    """``os.environ`` plus the allocator settings above (unless the caller set its own) and ``extra``."""
    env = dict(os.environ)
    for key, value in STEADY_MALLOC.items():
        env.setdefault(key, value)
    env.update(extra)
    return env


def run_job(name: str, cmd: list[str], env: dict[str, str], timeout: float, result: str) -> Any:
    """Run a benchmark's job (``cmd``, e.g. a torchrun line, in a process group of its own,
    killed whole past ``timeout`` seconds) and return the JSON it wrote to ``result``; exit
    with the job's output on a failure or a timeout."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        sys.exit(f"{name}: the job ran past --timeout {timeout} s and was killed\n{output[-3000:]}")
    if proc.returncode != 0:
        sys.exit(f"{name}: the job failed (exit {proc.returncode}):\n{output[-5000:]}")
    with open(result) as f:
        return json.load(f)
