"""benchmarks/soak.py in small: a few hundred steps of "auto" + wp1 + int8 on 2 Gloo ranks,
with relayouts mid-run (checkpoints of another k loaded and undone), must come out flat and
bit-identical, and every verdict must be computed from what the ranks recorded.

The step-time verdict (no step over 10x the median, wall clock) is the one a busy host can
fail on its own: on this project's shared 2-core host a step now and then waits half a second
or more for a core. Where it fails, the test still requires that sapipe's own work was not
the cause: the training thread's CPU time in every step within 10x its median, and the
slowest step preempted by the kernel (a warning says so)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import warnings

import pytest
from support.paths import BENCHMARKS

# detours at steps 25, 75, 125 and 175 (each 5 + 20 + 5 steps); warm-up 120; samples every 20:
# 6 of them after warm-up, the two edges' medians of 3 each
ARGS = [
    "--steps",
    "240",
    "--warmup",
    "120",
    "--sample-every",
    "20",
    "--relayout-every",
    "50",
    "--replay",
    "5",
    "--detour",
    "20",
    "--timeout",
    "170",
]


@pytest.mark.slow
def test_a_short_soak_stays_flat_and_its_relayouts_leave_no_trace():
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / "soak.py"), *ARGS, "--json"],
        check=False,
        capture_output=True,
        text=True,
        timeout=200,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode in (0, 1), proc.stdout[-3000:] + proc.stderr[-3000:]
    out = json.loads(proc.stdout)
    v, ranks = out["verdicts"], out["ranks"]
    assert len(ranks) == 2
    for rank in ranks:
        assert [s["step"] for s in rank["samples"]] == list(range(20, 241, 20))
        assert all(s["rss_mib"] > 0 and s["threads"] > 1 for s in rank["samples"])
        assert len(rank["times_ms"]) == 240
        assert isinstance(rank["decided_k"], int) and rank["decided_k"] > 0  # "auto" staled layers
    for name in ("rss_flat", "threads_flat"):
        assert all(g is not None and math.isfinite(g) for g in v[name]["growth"]), v[name]
    assert all(r["median_ms"] > 0 and math.isfinite(r["ratio"]) for r in v["step_time"]["ranks"])
    assert v["relayout"]["after_warmup"][0] > 0 and len(v["relayout"]["k_seen"]) > 1
    assert v["equal_after_relayout"]["detours"] == [4, 4]
    assert all(
        d["compared"] > 50 for d in ranks[0]["detours"]
    )  # weights, real weights, the optimizer's state
    failed = {
        name: v[name]
        for name in ("rss_flat", "threads_flat", "relayout", "equal_after_relayout")
        if not v[name]["passed"]
    }
    assert not failed, failed
    steps = v["step_time"]
    if not steps["passed"]:  # a step waited for a core: sapipe's own work must not explain it
        assert all(
            r["cpu_ratio"] <= 10 and r["slowest"][0]["preempted"] > 0 for r in steps["ranks"]
        ), steps
        warnings.warn(
            f"soak: a step over 10x the median on a busy host: {steps['ranks']}", stacklevel=1
        )
    assert v["passed"] == steps["passed"] and proc.returncode == (0 if steps["passed"] else 1)
