"""benchmarks/memory.py on a tiny model: its accounting against the formula it claims.

A tiny GPT-2 (float32, Adam) on 2 Gloo ranks. Counted from first principles (N values in P
parameter tensors, G = 4 N bytes): a sapipe slot is one bucket's gradient followed by one
flag per parameter (and at most one more value: a verdict behind the flags), so k = 0 holds
one slot per bucket, k = m with ``none`` two; with ``p.grad`` exposed it lives in a slot
(extra = slots - G), without it is this rank's own (extra = slots); DDP holds its buckets
beside ``p.grad`` (+G), or ``p.grad`` in them (+0); wp3 adds l_t, l_{t-1} and the real
weights. Nothing may be left unclassified, and every mode must match the benchmark's model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

from support.paths import BENCHMARKS

MODES = "ddp,ddp-view,k0,k0-noexpose,km-none,km-none-noexpose,km-wp3,km-t2"


def _extra(counts, grad_bytes):
    return (
        sum(v for k, v in counts.items() if k not in ("params", "optimizer state", "other paths"))
        - grad_bytes
    )


HEADER = 64  # bytes a slot may hold beyond its gradient and flags (a verdict, its own bookkeeping)


def _check_slots(row, n, p, depth, when="between"):
    """A slot per bucket and staleness step, each the bucket's gradient and one flag per
    parameter."""
    assert all(len(b["wire"]) == depth for b in row["buckets"]), row["buckets"]
    assert (
        sum(b["numel"] for b in row["buckets"]) == n
        and sum(b["params"] for b in row["buckets"]) == p
    )
    body, count, slots = depth * 4 * (n + p), depth * len(row["buckets"]), row[when]["slots"]
    assert body <= slots <= body + HEADER * count, (row["mode"], when, slots, body)
    return slots


def test_the_accounting_matches_its_formula():
    proc = subprocess.run(
        [
            sys.executable,
            str(BENCHMARKS / "memory.py"),
            "--models",
            "gpt2",
            "--size",
            "tiny",
            "--modes",
            MODES,
            "--steps",
            "3",
            "--device",
            "cpu",
            "--timeout",
            "170",
            "--json",
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=200,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (result,) = json.loads(proc.stdout)["results"]
    rows = {row["mode"]: row for row in result["rows"]}
    assert list(rows) == MODES.split(",")
    n, p, g = rows["k0"]["numel"], rows["k0"]["params"], rows["k0"]["grad_bytes"]
    assert g == 4 * n and n > 100_000 and p > 10
    for name, row in rows.items():
        between = row["between"]
        assert between["params"] == g, (
            name
        )  # the weights (sapipe: flat buffers, the parameters views of them)
        for counts in (between, row["backward"]):  # nothing of the model's size unclassified
            assert counts.get("other", 0) <= 1024, (name, counts["other paths"])
        assert abs(_extra(between, g) / g - row["model"]) <= 0.02, (name, between, row["model"])
        assert (
            abs(between["optimizer state"] - rows["ddp"]["between"]["optimizer state"]) <= 0.01 * g
        ), name

    # k = 0: one slot per bucket, every bucket sync; exposed p.grad is a view of it
    assert not any(b["stale"] for b in rows["k0"]["buckets"])
    slots = _check_slots(rows["k0"], n, p, depth=1)
    assert set(rows["k0"]["between"]) - {"other", "other paths"} == {
        "params",
        "optimizer state",
        "slots",
    }

    def extra(name, when="between"):  # less what is unclassified (small, checked above)
        return _extra(rows[name][when], g) - rows[name][when].get("other", 0)

    assert extra("k0") == slots - g
    assert extra("k0", "backward") == _check_slots(
        rows["k0"], n, p, 1, "backward"
    )  # autograd's gradients beside
    assert rows["k0-noexpose"]["between"]["own p.grad"] == g
    assert extra("k0-noexpose") == slots

    # k = m, none: two slots per bucket, every bucket stale
    km = rows["km-none"]
    assert all(b["stale"] for b in km["buckets"])
    km_slots = _check_slots(km, n, p, depth=2)
    assert extra("km-none") == km_slots - g
    assert extra("km-none", "backward") == _check_slots(km, n, p, 2, "backward")
    assert extra("km-none-noexpose") == km_slots

    # DDP: its buckets beside p.grad, or p.grad in them
    assert rows["ddp"]["between"]["DDP buckets"] == g and rows["ddp"]["between"]["own p.grad"] == g
    assert extra("ddp") == g
    assert (
        rows["ddp-view"]["between"]["DDP buckets"] == g
        and "own p.grad" not in rows["ddp-view"]["between"]
    )
    assert extra("ddp-view") == 0

    # wp3 at k = m: two slots, l_t and l_{t-1}, the real weights
    wp3 = rows["km-wp3"]["between"]
    assert (
        _check_slots(rows["km-wp3"], n, p, depth=2)
        and wp3["local"] == 2 * g
        and wp3["real weights"] == g
    )

    # t2 at k = m: two slots, the real weights and their velocity
    t2 = rows["km-t2"]["between"]
    assert (
        _check_slots(rows["km-t2"], n, p, depth=2)
        and t2["real weights"] == g
        and t2["velocity"] == g
        and "local" not in t2
    )
    assert extra("km-t2") == km_slots - g + 2 * g
