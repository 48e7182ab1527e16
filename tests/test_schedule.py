"""The scheduler (sapipe.schedule): closed form, simulator, choice of k, Chrome traces.

All pure Python and fast; no process group is needed.
"""
from __future__ import annotations

import json
from typing import List, Tuple

import numpy as np
import pytest

from sapipe.schedule import (
    LayerProfile,
    brute_force_k,
    build_bucket_layout,
    choose_k,
    closed_form_k,
    events_from_tracer,
    simulate,
    write_chrome_trace,
)


def random_profiles(rng: np.random.Generator, m: int, comm_ratio: float) -> Tuple[List[LayerProfile], List[int], float]:
    """m layers, backward ≈ 2× forward, total comm ≈ ``comm_ratio`` × compute.

    Returns the profiles (comm = beta × bytes), bytes per layer and beta.
    """
    u = rng.uniform(0.1, 1.0, m)
    b = u * rng.uniform(1.0, 3.0, m)
    numel = rng.integers(1, 10_000, m)
    nbytes = [int(4 * n) for n in numel]
    beta = comm_ratio * float(u.sum() + b.sum()) / sum(nbytes)
    profiles = [LayerProfile(f"layer{i + 1}", float(u[i]), float(b[i]), beta * nbytes[i], int(numel[i]))
                for i in range(m)]
    return profiles, nbytes, beta


def per_layer(profiles, k, nbytes, beta, **kw):
    """Simulate in the closed form's setting: one layer per bucket, α = 0."""
    return simulate(profiles, k, bucket_cap_bytes=0, alpha=0.0, beta=beta, bytes_per_layer=nbytes, **kw)


# --------------------------------------------------------------------------- closed form


def test_closed_form_hand_example():
    # u = b = 1, v = (0.5, 2, 2): (1) 4.5 <= 6; (2) k=0: 4.5 > 2; k=1: 4 > 3; k=2: 2 <= 4.
    profiles = [LayerProfile(f"l{i}", 1.0, 1.0, v) for i, v in enumerate([0.5, 2.0, 2.0])]
    assert closed_form_k(profiles) == 2
    assert brute_force_k(profiles) == 2
    # Total communication above total compute: infeasible (communication-bound).
    assert closed_form_k([LayerProfile("l", 1.0, 1.0, 2.5)]) is None
    assert closed_form_k([]) == 0


def test_closed_form_matches_brute_force():
    rng = np.random.default_rng(0)
    seen = set()
    for _ in range(300):
        m = int(rng.integers(1, 30))
        profiles, _, _ = random_profiles(rng, m, comm_ratio=float(rng.uniform(0.05, 1.5)))
        k = closed_form_k(profiles)
        assert k == brute_force_k(profiles)
        seen.add("none" if k is None else "zero" if k == 0 else "some")
    assert seen == {"none", "zero", "some"}  # the random cases cover every outcome


# --------------------------------------------------------------------------- buckets


def test_bucket_layout_mirrors_runtime():
    """The simulator packs buckets exactly like sapipe.buckets.build_buckets."""
    torch = pytest.importorskip("torch")
    from sapipe.buckets import build_buckets
    from sapipe.layers import Layer

    rng = np.random.default_rng(1)
    for _ in range(30):
        m = int(rng.integers(1, 12))
        sizes = [int(s) for s in rng.integers(1, 50, m)]
        layers = [Layer(i, f"l{i}", torch.nn.Identity(), [torch.nn.Parameter(torch.zeros(s))])
                  for i, s in enumerate(sizes)]
        group_of = {id(layer.params[0]): 0 for layer in layers}
        cap = int(rng.integers(1, 400))
        for k in range(m + 1):
            runtime = [[layer.index for layer in bucket.layers] for bucket in build_buckets(layers, k, cap, group_of)]
            assert build_bucket_layout([4 * s for s in sizes], k, cap) == runtime


# --------------------------------------------------------------------------- simulator


@pytest.mark.parametrize("priority", [False, True])
def test_no_communication_costs_nothing(priority):
    rng = np.random.default_rng(2)
    profiles, nbytes, _ = random_profiles(rng, 8, 1.0)
    for k in (0, 3, 8):
        r = simulate(profiles, k, bucket_cap_bytes=10_000, alpha=0.0, beta=0.0, bytes_per_layer=nbytes,
                     priority=priority)
        assert r.iteration_time == pytest.approx(r.compute_time, rel=1e-12)
        assert r.stall == pytest.approx(0.0, abs=1e-12)
        assert r.compute_time == pytest.approx(sum(p.forward + p.backward for p in profiles))
        assert r.converged


def test_huge_bandwidth_chooses_k0():
    rng = np.random.default_rng(3)
    profiles, nbytes, beta = random_profiles(rng, 10, 1e-6)
    d = choose_k(profiles, bucket_cap_bytes=4096, alpha=1e-9, beta=beta, bytes_per_layer=nbytes)
    assert d.k == 0 and d.kappa == 0.0 and not d.comm_bound
    assert d.iteration_time == pytest.approx(d.compute_time, rel=1e-3)
    assert "k=0 of 10" in d.summary()


@pytest.mark.parametrize("priority", [False, True])
def test_communication_bound(priority):
    rng = np.random.default_rng(4)
    profiles, nbytes, beta = random_profiles(rng, 10, 2.0)
    d = choose_k(profiles, bucket_cap_bytes=0, alpha=0.0, beta=beta, bytes_per_layer=nbytes, priority=priority)
    total_comm = sum(p.comm for p in profiles)
    assert d.comm_bound
    assert d.iteration_time_all_stale == pytest.approx(total_comm, rel=1e-6)  # the link never idles
    assert d.iteration_time == pytest.approx(total_comm, rel=0.02)
    assert d.iteration_time_sync > d.iteration_time
    assert "COMMUNICATION-BOUND" in d.summary()
    assert closed_form_k(profiles) is None


def test_stale_traffic_overlaps_next_iteration():
    """Layer 1's gradient is ready only at the very end of backward: as sync it stalls the
    next forward by its whole all-reduce; as stale it runs across the next forward."""
    profiles = [LayerProfile("l1", 1.0, 1.0, 0.1, numel=1), LayerProfile("l2", 1.0, 1.0, 0.1, numel=1)]
    sync = simulate(profiles, 0, bucket_cap_bytes=0, alpha=None, beta=None)
    assert sync.stall == pytest.approx(0.1) and sync.forward_wait == pytest.approx(0.1)
    stale = simulate(profiles, 1, bucket_cap_bytes=0, alpha=None, beta=None)
    assert stale.stall == pytest.approx(0.0, abs=1e-12)
    carried = [e for e in stale.events if e.category == "comm" and e.args["iteration"] == -1]
    assert carried and carried[0].args["stale"] and carried[0].start <= 0 < carried[0].end
    assert not [e for e in stale.events if e.category == "wait"]


def test_step_waits_for_previous_stale_all_reduce():
    """A stale all-reduce longer than a whole iteration holds up step() of the next one."""
    profiles = [LayerProfile("l1", 1.0, 1.0, 3.0, numel=1), LayerProfile("l2", 1.0, 1.0, 0.5, numel=1)]
    r = simulate(profiles, 1, bucket_cap_bytes=0, alpha=None, beta=None)
    # The link carries 3.5 per iteration against 4 of compute, but l1's 3.0 starts at the end
    # of backward and must end by the next end of backward: it fits, no stall.
    assert r.stall == pytest.approx(0.0, abs=1e-12)
    r = simulate([LayerProfile("l1", 1.0, 1.0, 4.5, numel=1), LayerProfile("l2", 1.0, 1.0, 0.5, numel=1)], 2,
                 bucket_cap_bytes=0, alpha=None, beta=None)
    assert r.iteration_time == pytest.approx(5.0)  # comm-bound: the link's 5.0 per iteration
    assert r.step_wait > 0


def test_simulated_k_is_never_below_closed_form():
    """Closed form vs simulator, in the closed form's own setting.

    Assumptions of the closed form: every layer's all-reduce is its own (one layer per
    bucket, i.e. a tiny bucket cap), costs exactly v_i (α = 0), and can start as soon as that
    layer's backward is done; one link, FIFO. Here the simulator models exactly that.

    The brief's conjecture was "the simulator's k is never larger than the closed form's".
    It is false: the closed form's constraints are *necessary* for a stall-free pipeline
    ((1): the link must carry one iteration's traffic per iteration; (2): the sync layers'
    traffic, which cannot start before layer m's backward ends, must be over before layer
    k+1's next forward) but not sufficient, because (2) lets a sync layer's all-reduce start
    before its own gradient exists. So the relation that holds is the reverse one:
    simulated k >= closed-form k, and the closed form is infeasible exactly when even k = m
    stalls (communication-bound). See test_closed_form_is_not_sufficient for a counterexample.
    """
    rng = np.random.default_rng(5)
    larger = 0
    for trial in range(120):
        m = int(rng.integers(1, 12))
        profiles, nbytes, beta = random_profiles(rng, m, comm_ratio=float(rng.uniform(0.05, 1.4)))
        cf = closed_form_k(profiles)
        for priority in (False, True):
            d = choose_k(profiles, bucket_cap_bytes=0, alpha=0.0, beta=beta, bytes_per_layer=nbytes,
                         priority=priority, tolerance=1e-9)
            assert d.comm_bound == (cf is None), (trial, priority, cf, d.summary())
            if cf is not None:
                assert d.k >= cf, (trial, priority, cf, d.summary())
                larger += d.k > cf
    assert larger > 0


def test_closed_form_is_not_sufficient():
    """With k = 0, layer 1's gradient is ready at the very end of backward and needed at the
    very start of the next forward: any v_1 > 0 stalls, yet the closed form accepts k = 0."""
    profiles = [LayerProfile("l1", 1.0, 1.0, 0.1, numel=1), LayerProfile("l2", 1.0, 1.0, 0.1, numel=1)]
    assert closed_form_k(profiles) == 0
    d = choose_k(profiles, bucket_cap_bytes=0, tolerance=1e-9)
    assert d.k == 1 and d.stalls[0] == pytest.approx(0.1)


@pytest.mark.parametrize("priority", [False, True])
def test_chosen_k_is_the_smallest_without_stall(priority):
    """Stall at every k below the chosen one, none (within tolerance) at it; bucketed, α > 0."""
    rng = np.random.default_rng(6)
    checked = 0
    for _ in range(40):
        m = int(rng.integers(2, 16))
        profiles, nbytes, beta = random_profiles(rng, m, comm_ratio=float(rng.uniform(0.2, 0.95)))
        alpha = 0.002 * sum(p.forward for p in profiles)
        cap = int(rng.choice([0, 8_000, 40_000]))
        kw = dict(bucket_cap_bytes=cap, alpha=alpha, beta=beta, bytes_per_layer=nbytes, priority=priority)
        d = choose_k(profiles, tolerance=0.01, **kw)
        if d.comm_bound:
            continue
        checked += 1
        assert simulate(profiles, d.k, **kw).stall <= d.tolerance
        assert d.tolerance == pytest.approx(0.01 * d.compute_time)
        assert d.stall <= d.tolerance
        for k in range(d.k):
            assert simulate(profiles, k, **kw).stall > d.tolerance
        stale_numel = sum(p.numel for p in profiles[: d.k])
        assert d.kappa == pytest.approx(stale_numel / sum(p.numel for p in profiles))
    assert checked >= 20


def test_priority_never_beats_fifo():
    """Sync-before-stale priority cannot help in this model: a stale all-reduce that a sync
    one could overtake belongs to the previous iteration, and its deadline (this iteration's
    step()) comes before the sync one's (a forward of the next iteration)."""
    rng = np.random.default_rng(7)
    for _ in range(60):
        m = int(rng.integers(1, 10))
        profiles, nbytes, beta = random_profiles(rng, m, comm_ratio=float(rng.uniform(0.1, 1.5)))
        for k in range(m + 1):
            fifo = per_layer(profiles, k, nbytes, beta)
            prio = per_layer(profiles, k, nbytes, beta, priority=True)
            assert prio.iteration_time >= fifo.iteration_time * (1 - 1e-9)


# --------------------------------------------------------------------------- chrome trace


def test_chrome_trace_of_simulation(tmp_path):
    rng = np.random.default_rng(8)
    profiles, nbytes, beta = random_profiles(rng, 6, 1.2)
    r = simulate(profiles, 2, bucket_cap_bytes=0, alpha=0.0, beta=beta, bytes_per_layer=nbytes)
    path = tmp_path / "sim.json"
    write_chrome_trace(path, r.events, process_name="simulated k=2", pid=3)
    trace = json.loads(path.read_text())
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(slices) == len(r.events)
    for e in slices:
        assert {"name", "cat", "ph", "ts", "dur", "pid", "tid", "args"} <= set(e)
        assert e["pid"] == 3 and e["ts"] >= 0 and e["dur"] >= 0
    assert {e["cat"] for e in slices} >= {"forward", "backward", "comm"}
    meta = {e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "comm"} <= set(meta)
    assert all(e["tid"] == meta["compute"] for e in slices if e["cat"] in ("forward", "backward"))
    process = [e for e in trace["traceEvents"] if e.get("name") == "process_name"]
    assert process[0]["args"]["name"] == "simulated k=2"
    fwd = [e for e in slices if e["cat"] == "forward"]
    assert sum(e["dur"] for e in fwd) == pytest.approx(1e6 * sum(p.forward for p in profiles))


def test_events_from_tracer(tmp_path):
    ms = 1_000_000
    log = [
        (10 * ms, "forward_start", {"iteration": 1}),
        (10 * ms, "layer_forward_start", {"layer": "fc1", "iteration": 1}),
        (12 * ms, "layer_forward_end", {"layer": "fc1", "iteration": 1}),
        (13 * ms, "layer_backward_start", {"layer": "fc1", "iteration": 1}),
        (16 * ms, "layer_backward_end", {"layer": "fc1", "iteration": 1}),
        (16 * ms, "comm_start", {"what": "bucket 0", "stream": "sync"}),
        (17 * ms, "comm_start", {"what": "bucket 1", "stream": "sync"}),
        (17 * ms, "something_new", {"x": 1}),
        (18 * ms, "step_start", {"iteration": 1}),
        (19 * ms, "step_end", {"iteration": 1}),
        (20 * ms, "comm_done", {"what": "bucket 0", "stream": "sync"}),
        (21 * ms, "comm_wait", {"what": "bucket 0", "stream": "sync"}),
        (22 * ms, "comm_done", {"what": "bucket 1", "stream": "sync"}),
        (23 * ms, "comm_start", {"what": "bucket 2", "stream": "stale"}),  # never completes: dropped
    ]
    events = events_from_tracer(log)
    by = {(e.category, e.name): e for e in events}
    assert set(by) == {("iteration", "iteration 1"), ("forward", "fc1"), ("backward", "fc1"), ("comm", "bucket 0"),
                       ("comm", "bucket 1"), ("step", "step"), ("wait", "wait bucket 0")}
    assert by[("forward", "fc1")][2:4] == pytest.approx((0.0, 0.002))
    assert by[("comm", "bucket 0")][2:4] == pytest.approx((0.006, 0.010))
    assert by[("comm", "bucket 1")].args["stream"] == "sync"
    assert by[("iteration", "iteration 1")][2:4] == pytest.approx((0.0, 0.009))
    wait = by[("wait", "wait bucket 0")]
    assert wait.start == wait.end == pytest.approx(0.011)

    path = tmp_path / "run.json"
    write_chrome_trace(path, events, process_name="rank 0")
    trace = json.loads(path.read_text())
    comm_tids = {e["tid"] for e in trace["traceEvents"] if e.get("cat") == "comm"}
    assert len(comm_tids) == 2  # the two overlapping all-reduces need two lanes
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "comm", "comm #2", "wait", "iteration"} <= names
    assert events_from_tracer([]) == []
