"""The scheduler (sapipe.schedule): closed form, simulator, choice of k, Chrome traces.

All pure Python and fast; no process group is needed.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from sapipe.layout.packing import bucket_layout
from sapipe.schedule import LayerProfile, brute_force_k, choose_k, closed_form_k, simulate
from sapipe.tracing.chrome_trace import events_from_tracer, write_chrome_trace


def random_profiles(
    rng: np.random.Generator, m: int, comm_ratio: float
) -> tuple[list[LayerProfile], list[int], float]:
    """m layers, backward ≈ 2× forward, total comm ≈ ``comm_ratio`` × compute.

    Returns the profiles (comm = beta × bytes), bytes per layer and beta.
    """
    u = rng.uniform(0.1, 1.0, m)
    b = u * rng.uniform(1.0, 3.0, m)
    numel = rng.integers(1, 10_000, m)
    nbytes = [int(4 * n) for n in numel]
    beta = comm_ratio * float(u.sum() + b.sum()) / sum(nbytes)
    profiles = [
        LayerProfile(f"layer{i + 1}", float(u[i]), float(b[i]), beta * nbytes[i], int(numel[i]))
        for i in range(m)
    ]
    return profiles, nbytes, beta


def per_layer(profiles, k, nbytes, beta, **kw):
    """Simulate in the closed form's setting: one layer per bucket, α = 0."""
    return simulate(
        profiles, k, bucket_cap_bytes=0, alpha=0.0, beta=beta, bytes_per_layer=nbytes, **kw
    )


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


def check_bucket_layout(nbytes: list[int], k: int, cap: float, buckets: list[list[int]]) -> None:
    """The layout rule, stated as properties of its result (docs/design.md §5)."""
    m = len(nbytes)
    where = (nbytes, k, cap, buckets)
    assert all(buckets), where  # no empty bucket
    flat = [i for bucket in buckets for i in bucket]
    assert sorted(flat) == list(range(m)), where  # every layer exactly once
    assert flat == list(reversed(range(m))), (
        where
    )  # buckets and their layers in reverse forward order
    for bucket in buckets:
        assert len({i < k for i in bucket}) == 1, where  # wholly stale or wholly sync
        assert sum(nbytes[i] for i in bucket) <= cap or len(bucket) == 1, (
            where
        )  # over the cap: alone
    for bucket, following in zip(buckets, buckets[1:]):
        nxt = following[0]  # greedy: the next layer could not have joined
        crosses = (bucket[-1] < k) != (nxt < k)
        assert crosses or sum(nbytes[i] for i in bucket) + nbytes[nxt] > cap, where


def test_bucket_layout_properties():
    rng = np.random.default_rng(1)
    closed_by_cap = closed_at_boundary = oversized = 0
    for _ in range(300):
        m = int(rng.integers(0, 14))
        nbytes = [
            int(x) * int(rng.choice([0, 1, 4])) for x in rng.integers(1, 60, m)
        ]  # some zero-size layers
        cap = float(rng.choice([0, int(rng.integers(1, 200)), 1e12]))
        for k in range(m + 1):
            buckets = bucket_layout(nbytes, k, cap)
            check_bucket_layout(nbytes, k, cap, buckets)
            closed_at_boundary += any(
                (a[-1] < k) != (b[0] < k) for a, b in zip(buckets, buckets[1:])
            )
            closed_by_cap += any(
                sum(nbytes[i] for i in a) + nbytes[b[0]] > cap and (a[-1] < k) == (b[0] < k)
                for a, b in zip(buckets, buckets[1:])
            )
            oversized += any(sum(nbytes[i] for i in b) > cap for b in buckets)
    assert (
        min(closed_by_cap, closed_at_boundary, oversized) > 0
    )  # the random cases reach every rule
    assert bucket_layout([], 0, 100) == []
    assert bucket_layout([8, 0, 8], 0, 8) == [[2, 1], [0]]  # a zero-size layer joins a full bucket
    assert bucket_layout([4, 4, 4, 4], 2, 1e9) == [[3, 2], [1, 0]]  # the S/N boundary always closes


def test_bucket_layout_property_check_can_fail():
    """The property check rejects layouts that break each rule."""
    for nbytes, k, cap, wrong in [
        ([4, 4], 0, 100, [[1]]),  # a layer missing
        ([4, 4], 0, 100, [[0, 1]]),  # forward order
        ([4, 4], 1, 100, [[1, 0]]),  # stale and sync mixed
        ([4, 4], 0, 4, [[1, 0]]),  # two layers over the cap
        ([4, 4], 0, 100, [[1], [0]]),  # closed although layer 0 fitted
    ]:
        with pytest.raises(AssertionError):
            check_bucket_layout(nbytes, k, cap, wrong)


def test_runtime_buckets_are_the_layout():
    """sapipe.layout.buckets.build_buckets builds exactly bucket_layout's buckets, with their
    stale flags."""
    torch = pytest.importorskip("torch")
    from sapipe.layout.buckets import build_buckets
    from sapipe.layout.layers import Layer

    rng = np.random.default_rng(2)
    dtypes = [torch.float32, torch.float64, torch.float16]
    for _ in range(30):
        m = int(rng.integers(1, 12))
        layers = [
            Layer(
                i,
                f"l{i}",
                torch.nn.Identity(),
                [
                    torch.nn.Parameter(torch.zeros(int(s), dtype=dtypes[int(rng.integers(0, 3))]))
                    for s in rng.integers(1, 50, int(rng.integers(1, 3)))
                ],
            )
            for i in range(m)
        ]
        nbytes = [sum(p.numel() * p.element_size() for p in layer.params) for layer in layers]
        group_of = {id(p): 0 for layer in layers for p in layer.params}
        cap = int(rng.integers(1, 400))
        for k in range(m + 1):
            expected = bucket_layout(nbytes, k, cap)
            check_bucket_layout(nbytes, k, cap, expected)
            runtime = build_buckets(layers, k, cap, group_of)
            assert [[layer.index for layer in bucket.layers] for bucket in runtime] == expected
            assert [bucket.stale for bucket in runtime] == [members[0] < k for members in expected]
            assert [bucket.index for bucket in runtime] == list(range(len(expected)))


# --------------------------------------------------------------------------- simulator


def test_no_communication_costs_nothing():
    rng = np.random.default_rng(2)
    profiles, nbytes, _ = random_profiles(rng, 8, 1.0)
    for k in (0, 3, 8):
        r = simulate(
            profiles, k, bucket_cap_bytes=10_000, alpha=0.0, beta=0.0, bytes_per_layer=nbytes
        )
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


def test_communication_bound():
    rng = np.random.default_rng(4)
    profiles, nbytes, beta = random_profiles(rng, 10, 2.0)
    d = choose_k(profiles, bucket_cap_bytes=0, alpha=0.0, beta=beta, bytes_per_layer=nbytes)
    total_comm = sum(p.comm for p in profiles)
    assert d.comm_bound
    assert d.iteration_time_all_stale == pytest.approx(total_comm, rel=1e-6)  # the link never idles
    assert d.iteration_time == pytest.approx(total_comm, rel=0.02)
    assert d.iteration_time_sync > d.iteration_time
    assert "COMMUNICATION-BOUND" in d.summary()
    assert closed_form_k(profiles) is None
    # the advice: elastic averaging with τ steps of compute for one all-reduce, 25% to spare
    ratio = d.comm_time / d.compute_time
    assert ratio > 1.5 and d.averaging_period == max(2, math.ceil(1.25 * ratio))
    assert f"ElasticAveraging(optimizer, model, period={d.averaging_period})" in d.summary()
    assert (
        choose_k(
            *random_profiles(rng, 10, 1e-6)[:1],
            bucket_cap_bytes=4096,
            alpha=0.0,
            beta=1e-12,
            bytes_per_layer=nbytes,
        ).advice
        is None
    )


def test_stale_traffic_overlaps_next_iteration():
    """Layer 1's gradient is ready only at the very end of backward: as sync it stalls the
    next forward by its whole all-reduce; as stale it runs across the next forward."""
    profiles = [
        LayerProfile("l1", 1.0, 1.0, 0.1, numel=1),
        LayerProfile("l2", 1.0, 1.0, 0.1, numel=1),
    ]
    sync = simulate(profiles, 0, bucket_cap_bytes=0, alpha=None, beta=None)
    assert sync.stall == pytest.approx(0.1) and sync.forward_wait == pytest.approx(0.1)
    stale = simulate(profiles, 1, bucket_cap_bytes=0, alpha=None, beta=None)
    assert stale.stall == pytest.approx(0.0, abs=1e-12)
    carried = [e for e in stale.events if e.category == "comm" and e.args["iteration"] == -1]
    assert carried and carried[0].args["stale"] and carried[0].start <= 0 < carried[0].end
    assert not [e for e in stale.events if e.category == "wait"]


def test_step_waits_for_previous_stale_all_reduce():
    """A stale all-reduce longer than a whole iteration holds up step() of the next one."""
    profiles = [
        LayerProfile("l1", 1.0, 1.0, 3.0, numel=1),
        LayerProfile("l2", 1.0, 1.0, 0.5, numel=1),
    ]
    r = simulate(profiles, 1, bucket_cap_bytes=0, alpha=None, beta=None)
    # The link carries 3.5 per iteration against 4 of compute, but l1's 3.0 starts at the end
    # of backward and must end by the next end of backward: it fits, no stall.
    assert r.stall == pytest.approx(0.0, abs=1e-12)
    r = simulate(
        [LayerProfile("l1", 1.0, 1.0, 4.5, numel=1), LayerProfile("l2", 1.0, 1.0, 0.5, numel=1)],
        2,
        bucket_cap_bytes=0,
        alpha=None,
        beta=None,
    )
    assert r.iteration_time == pytest.approx(5.0)  # comm-bound: the link's 5.0 per iteration
    assert r.step_wait > 0


def test_deferred_updates_follow_their_all_reduce():
    """One bucket of two layers (u = b = 1, 100 parameters each, comm 3, update 0.01 per
    parameter, step 0.5). Sync: the next forward waits for the all-reduce, then updates
    (2), so the update cannot hide under the comm: 3 + 2 + 2 + 2 = 9, the step hidden.
    All stale: step() updates after the (long done) stale all-reduce: 2 + 2 + 2 + 0.5."""
    profiles = [
        LayerProfile("l1", 1.0, 1.0, 1.5, numel=100),
        LayerProfile("l2", 1.0, 1.0, 1.5, numel=100),
    ]
    kw = dict(bucket_cap_bytes=1e9, alpha=None, beta=None, step_time=0.5, update_per_element=0.01)
    sync, stale = simulate(profiles, 0, **kw), simulate(profiles, 2, **kw)
    assert sync.iteration_time == pytest.approx(9.0) and stale.iteration_time == pytest.approx(6.5)
    assert sync.compute_time == pytest.approx(6.5) == stale.compute_time
    (update,) = [e for e in sync.events if e.category == "update"]
    (wait,) = [e for e in sync.events if e.category == "wait"]
    assert update.start == pytest.approx(wait.end) and update.end - update.start == pytest.approx(
        2.0
    )
    assert not [e for e in stale.events if e.category == "update"]
    old = simulate(profiles, 0, bucket_cap_bytes=1e9, alpha=None, beta=None, step_time=2.5)
    assert old.iteration_time == pytest.approx(
        7.0
    )  # the same work as step time: hidden under the comm
    with pytest.raises(ValueError, match="update_per_element"):
        simulate(profiles, 0, bucket_cap_bytes=1e9, alpha=None, beta=None, update_per_element=-1.0)


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
        d = choose_k(
            profiles,
            bucket_cap_bytes=0,
            alpha=0.0,
            beta=beta,
            bytes_per_layer=nbytes,
            tolerance=1e-9,
        )
        assert d.comm_bound == (cf is None), (trial, cf, d.summary())
        if cf is not None:
            assert d.k >= cf, (trial, cf, d.summary())
            larger += d.k > cf
    assert larger > 0


def test_closed_form_is_not_sufficient():
    """With k = 0, layer 1's gradient is ready at the very end of backward and needed at the
    very start of the next forward: any v_1 > 0 stalls, yet the closed form accepts k = 0."""
    profiles = [
        LayerProfile("l1", 1.0, 1.0, 0.1, numel=1),
        LayerProfile("l2", 1.0, 1.0, 0.1, numel=1),
    ]
    assert closed_form_k(profiles) == 0
    d = choose_k(profiles, bucket_cap_bytes=0, tolerance=1e-9)
    assert d.k == 1 and d.stalls[0] == pytest.approx(0.1)


def test_chosen_k_is_the_smallest_without_stall():
    """Stall at every k below the chosen one, none (within tolerance) at it; bucketed, α > 0."""
    rng = np.random.default_rng(6)
    checked = 0
    for _ in range(40):
        m = int(rng.integers(2, 16))
        profiles, nbytes, beta = random_profiles(rng, m, comm_ratio=float(rng.uniform(0.2, 0.95)))
        alpha = 0.002 * sum(p.forward for p in profiles)
        cap = int(rng.choice([0, 8_000, 40_000]))
        kw = dict(bucket_cap_bytes=cap, alpha=alpha, beta=beta, bytes_per_layer=nbytes)
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
    meta = {
        e["args"]["name"]: e["tid"] for e in trace["traceEvents"] if e.get("name") == "thread_name"
    }
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
        (
            23 * ms,
            "comm_start",
            {"what": "bucket 2", "stream": "stale"},
        ),  # never completes: dropped
    ]
    events = events_from_tracer(log)
    by = {(e.category, e.name): e for e in events}
    assert set(by) == {
        ("iteration", "iteration 1"),
        ("forward", "fc1"),
        ("backward", "fc1"),
        ("comm", "bucket 0"),
        ("comm", "bucket 1"),
        ("step", "step"),
        ("wait", "wait bucket 0"),
    }
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


# --------------------------------------------------------------------------- shared link, slow-down


def _transfer(t, index, stale, comm, issue):
    from sapipe.schedule.simulator import BucketPlan, Transfer

    return Transfer(t, BucketPlan(index, (index,), 4, stale, comm), issue)


def test_shared_link_splits_bandwidth_between_the_two_groups():
    from sapipe.schedule.simulator import SharedLink

    # Two equal transfers on the two groups, started together: each at half rate, both end at 2x.
    link = SharedLink()
    a, b = _transfer(0, 0, False, 1.0, 0.0), _transfer(0, 1, True, 1.0, 0.0)
    link.submit([a, b])
    assert (a.end, b.end) == pytest.approx((2.0, 2.0))
    # The same two on one group: one after the other, as on the one-at-a-time link.
    link = SharedLink()
    a, b = _transfer(0, 0, False, 1.0, 0.0), _transfer(0, 1, False, 1.0, 0.0)
    link.submit([a, b])
    assert (a.start, a.end, b.start, b.end) == pytest.approx((0.0, 1.0, 1.0, 2.0))
    # Staggered: the sync one runs alone for 0.5, then both share; it ends at 1.5, the stale at 2.
    link = SharedLink()
    a = _transfer(0, 0, False, 1.0, 0.0)
    link.submit([a])
    assert a.end == pytest.approx(1.0)  # projected, alone
    b = _transfer(0, 1, True, 1.0, 0.5)
    link.submit([b])
    assert (a.end, b.end) == pytest.approx((1.5, 2.0))
    assert link.busy_from(0.5) == [pytest.approx((0.5, 2.0))]


def test_shared_link_is_work_conserving():
    """Whatever the sharing, the link is busy exactly when the one-at-a-time link is."""
    from sapipe.schedule.simulator import Link, SharedLink

    rng = np.random.default_rng(11)
    for _ in range(50):
        issues = np.sort(rng.uniform(0, 5, int(rng.integers(1, 12))))
        spec = [(float(t), bool(rng.integers(0, 2)), float(rng.uniform(0.01, 1.5))) for t in issues]
        shared, serial = SharedLink(), Link()
        for link in (shared, serial):
            link.submit(
                [_transfer(0, i, stale, comm, t) for i, (t, stale, comm) in enumerate(spec)]
            )
        assert max(tr.end for tr in shared.placed) == pytest.approx(
            max(tr.end for tr in serial.placed)
        )
        for tr in shared.placed:  # no transfer ends before its own link time has passed
            assert tr.end >= tr.issue + tr.bucket.comm_time * (1 - 1e-9)


def test_shared_link_delays_sync_traffic_behind_concurrent_stale_traffic():
    """Layer 2's sync bucket goes out just before layer 1's stale one: on one FIFO link it
    runs alone, on two groups it shares the link, ends later and holds up the next forward."""
    profiles = [
        LayerProfile("l1", 1.0, 0.1, 1.0, numel=1),
        LayerProfile("l2", 0.1, 1.0, 1.0, numel=1),
    ]
    fifo = simulate(profiles, 1, bucket_cap_bytes=0, alpha=None, beta=None)
    shared = simulate(profiles, 1, bucket_cap_bytes=0, alpha=None, beta=None, shared_link=True)
    # FIFO: sync l2 ends 1.0 after its issue, 1.1 into the next iteration's... no wait needed
    # beyond it; shared: it ends 1.9 after issue (0.1 alone, then 0.9 at half rate).
    assert shared.iteration_time > fifo.iteration_time + 0.5
    assert shared.forward_wait > fifo.forward_wait
    assert shared.comm_time == pytest.approx(fifo.comm_time)


@pytest.mark.parametrize("shared", [False, True])
def test_vanishing_slowdown_reproduces_the_model_without(shared):
    """σ → 0 (transfers submitted one by one as they are issued) gives the σ = 0 timeline
    (transfers submitted per iteration), for every k, bucketing and link."""
    rng = np.random.default_rng(12)
    for _ in range(25):
        m = int(rng.integers(1, 10))
        profiles, nbytes, beta = random_profiles(rng, m, comm_ratio=float(rng.uniform(0.1, 1.5)))
        cap = int(rng.choice([0, 8_000, 40_000]))
        for k in range(m + 1):
            kw = dict(
                bucket_cap_bytes=cap,
                alpha=0.01,
                beta=beta,
                bytes_per_layer=nbytes,
                step_time=0.2,
                shared_link=shared,
            )
            exact = simulate(profiles, k, **kw)
            tiny = simulate(profiles, k, slowdown=1e-12, **kw)
            assert tiny.iteration_time == pytest.approx(exact.iteration_time, rel=1e-9, abs=1e-9)
            assert tiny.wait == pytest.approx(exact.stall, rel=1e-6, abs=1e-6)


def test_slowdown_charges_compute_that_overlaps_a_transfer():
    """k = m: the one stale all-reduce (c) runs across step() and the next forward; compute
    under it runs at 1/(1+σ), so in its c seconds it does c/(1+σ) of work and the iteration
    takes c·σ/(1+σ) longer; no transfer, no cost."""
    sigma, c = 0.5, 0.4
    profiles = [
        LayerProfile("l1", 1.0, 1.0, c, numel=1),
        LayerProfile("l2", 1.0, 1.0, 0.0, numel=1),
    ]
    base = simulate(profiles, 2, bucket_cap_bytes=1e9, alpha=None, beta=None, step_time=0.25)
    slowed = simulate(
        profiles, 2, bucket_cap_bytes=1e9, alpha=None, beta=None, step_time=0.25, slowdown=sigma
    )
    assert base.iteration_time == pytest.approx(base.compute_time)
    assert slowed.iteration_time == pytest.approx(base.compute_time + c * sigma / (1 + sigma))
    assert slowed.wait == pytest.approx(0.0, abs=1e-12)
    assert slowed.stall == pytest.approx(c * sigma / (1 + sigma))
    silent = [
        LayerProfile("l1", 1.0, 1.0, 0.0, numel=1),
        LayerProfile("l2", 1.0, 1.0, 0.0, numel=1),
    ]
    r = simulate(silent, 2, bucket_cap_bytes=1e9, alpha=None, beta=None, slowdown=sigma)
    assert r.iteration_time == pytest.approx(r.compute_time)
    with pytest.raises(ValueError):
        simulate(profiles, 1, bucket_cap_bytes=0, alpha=None, beta=None, slowdown=-0.1)


def test_choice_under_slowdown_is_the_smallest_k_near_the_best():
    """No k is stall-free when overlap costs compute: take the smallest k within tolerance of
    the best one; that is not communication-bound (nothing waits at k = m)."""
    rng = np.random.default_rng(13)
    checked = 0
    for _ in range(30):
        m = int(rng.integers(2, 10))
        profiles, nbytes, beta = random_profiles(rng, m, comm_ratio=float(rng.uniform(0.3, 0.7)))
        kw = dict(
            bucket_cap_bytes=0,
            alpha=0.0,
            beta=beta,
            bytes_per_layer=nbytes,
            slowdown=0.5,
            shared_link=True,
        )
        d = choose_k(profiles, tolerance=0.01, **kw)
        times = [simulate(profiles, k, **kw).iteration_time for k in range(m + 1)]
        if d.stalls[m] <= d.tolerance:
            continue
        checked += 1
        assert d.iteration_time <= min(times) + d.tolerance
        assert all(t > min(times) + d.tolerance for t in times[: d.k])
        assert not d.comm_bound
    assert checked >= 10


# ------------------------------------------------------------------- identification (profiler)


def _synthetic_raw(u, b, comm, step=0.1):
    """A LayerTimer.raw() of iterations with the given per-layer times (no noise).

    Each iteration: forward layers back to back from 0, backward from there, then one
    all-reduce record per entry of ``comm`` (issue, done) relative to the backward's end.
    """
    m = len(u)
    forward, backward, spans, comms = [], [], [], []
    for _ in range(3):
        fs, t = [], 0.0
        for x in u:
            fs.append((t, t + x))
            t += x
        bs = [None] * m
        for i in reversed(range(m)):
            bs[i] = (t, t + b[i])
            t += b[i]
        forward.append(list(u))
        backward.append(list(b))
        spans.append((fs, bs))
        comms.append([[0, 4000, t + lo, t + hi] for lo, hi in comm])
    return {
        "forward": forward,
        "backward": backward,
        "step_times": [step] * 2,
        "comm": comms,
        "spans": spans,
        "step_spans": [(0.0, step, [])] * 2,
    }


def test_medians_take_the_slowdown_out_of_overlapped_samples():
    from sapipe.schedule import profiler

    u, b = [1.0, 1.0], [2.0, 3.0]
    # backward runs layer 2 in [2, 5], then layer 1 in [5, 7]: the first all-reduce covers
    # the first 1.0 of layer 1's backward; the second one flies after compute ended.
    raw = _synthetic_raw(u, b, [(-2.0, -1.0), (5.0, 6.0)])
    timer = profiler.LayerTimer.from_raw(raw)
    assert timer.medians(0.0) == (pytest.approx(u), pytest.approx(b), pytest.approx(0.1))
    cu, cb, _ = timer.medians(1.0)  # σ = 1: an overlapped second took 2, so 0.5 s is taken out
    assert cu == pytest.approx(u)
    assert cb == pytest.approx([2.0 - 0.5, 3.0])


def test_observed_link_fit_uses_the_last_rank_to_arrive():
    from sapipe.schedule import profiler

    alpha, beta, nbytes = 1e-4, 2e-9, 10_000_000
    true = alpha + beta * nbytes
    skewed = [(true + 0.004, 1, nbytes), (true + 0.001, 1, nbytes), (true + 0.006, 1, nbytes)]
    clean = [(true, 1, nbytes), (true, 1, nbytes), (true + 0.002, 1, nbytes)]
    assert profiler.observed_beta(alpha, [skewed, clean]) == pytest.approx(beta)
    # ranks disagreeing on what they sent, or a missed completion: those iterations do not count
    odd = [(true * 10, 2, 2 * nbytes), (math.nan, 1, nbytes), (true, 1, nbytes)]
    assert profiler.observed_beta(alpha, [odd, clean]) == pytest.approx(
        beta
    )  # only the third counts
    assert math.isnan(profiler.observed_beta(alpha, [[(math.nan, 1, nbytes)], [(true, 1, nbytes)]]))
    assert profiler.busy_time([(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]) == pytest.approx(3.0)


def test_combined_profile_prefers_the_slower_link():
    from sapipe.schedule import profiler

    sizes = [4096, 1 << 20, 1 << 22]
    probe = [1e-4 + 1e-9 * s for s in sizes]
    rows = [[0.1, 0.2, 0.3, 0.4, 0.05] + probe, [0.2, 0.1, 0.3, 0.5, 0.04] + probe]
    link = [[(1e-4 + 3e-9 * (1 << 22), 1, 1 << 22)]] * 2
    p = profiler.combine(rows, 2, sizes, link, 0.25)
    assert (p.forward, p.backward, p.step_time) == ([0.2, 0.2], [0.3, 0.5], 0.05)
    assert (p.alpha, p.beta_isolated) == (pytest.approx(1e-4), pytest.approx(1e-9))
    assert (
        p.beta_observed == pytest.approx(3e-9) and p.beta == p.beta_observed and p.slowdown == 0.25
    )
    p = profiler.combine(rows, 2, sizes, [[(math.nan, 1, 1 << 22)]] * 2, 0.0)
    assert math.isnan(p.beta_observed) and p.beta == pytest.approx(1e-9)


def test_timer_times_all_reduces():
    """Driven like the optimizer drives it, with fake work objects whose futures we complete."""
    torch = pytest.importorskip("torch")
    from sapipe.schedule import profiler

    class Work:
        def __init__(self):
            self.future = torch.futures.Future()

        def get_future(self):
            return self.future

        def wait(self):
            return True

    timer = profiler.LayerTimer(2)
    for _ in range(2):
        timer.begin_iteration()
        timer.layer_forward(0)
        timer.layer_forward(1)
        timer.forward_end()
        timer.gradient_released(1)
        timer.gradient_released(0)
        work = Work()
        timer.comm_started(0, 4000, work)  # a raw work object...
        timer.end_iteration()
        work.future.set_result(None)  # completes after the iteration, like a real all-reduce
    timer.comm_started(0, 4000, Work())  # not profiling: ignored
    assert timer.samples == 2
    samples = timer.link_samples()
    assert [(c, n) for _, c, n in samples] == [(1, 4000), (1, 4000)]
    assert all(busy > 0 for busy, _, _ in samples)
    # A back-end handle without futures: the transfer is not timed, nothing else breaks.
    timer.begin_iteration()
    timer.comm_started(0, 4000, object())
    assert timer._iter_comm == []


def test_measure_gathers_only_the_profile(monkeypatch):
    """measure() on a one-rank fake process group: its collectives are the timed all-reduces
    and the three gathers of the profile (rows, sample count, link samples), nothing else;
    σ is not measured."""
    torch = pytest.importorskip("torch")
    from sapipe.schedule import profiler

    calls = []

    class FakeDist:
        def get_world_size(self, group):
            return 1

        def get_rank(self, group):
            return 0

        def all_gather(self, out, local, group):
            calls.append("all_gather")
            out[0].copy_(local)

        def __getattr__(self, name):  # any other collective is a failure
            raise AssertionError(f"measure() called torch.distributed.{name}")

    monkeypatch.setattr(profiler, "dist", FakeDist())
    monkeypatch.setattr(
        profiler,
        "time_allreduce",
        lambda group, nbytes, dtype, device, sum_now=None: 1e-4 + 1e-9 * nbytes,
    )
    timer = profiler.LayerTimer.from_raw(_synthetic_raw([1.0, 2.0], [3.0, 4.0], [(0.0, 0.5)]))
    profile = profiler.measure(timer, None, [1 << 20], torch.float32, torch.device("cpu"))
    assert calls == ["all_gather"] * 3
    assert profile.slowdown == 0.0 and "slowdown_sample" not in profile.raw
    assert profile.forward == pytest.approx([1.0, 2.0]) and profile.backward == pytest.approx(
        [3.0, 4.0]
    )
    assert (profile.alpha, profile.beta_isolated) == (pytest.approx(1e-4), pytest.approx(1e-9))


def test_timer_keeps_deferred_updates_apart(monkeypatch):
    """Waits and deferred updates before a layer are not the previous layer's compute (nor,
    before the first layer, the step's); the updates are summed per iteration."""
    from sapipe.schedule import profiler

    clock = [100.0]
    monkeypatch.setattr(profiler.time, "perf_counter", lambda: clock[0])
    timer = profiler.LayerTimer(2)
    for _ in range(3):
        timer.begin_iteration()
        clock[0] += 0.5 + 2.0  # before the first layer: a wait, then its bucket's update
        timer.layer_forward(0, waited=0.5, updated=2.0)
        clock[0] += 2.0 + 0.25 + 1.0  # layer 0's forward; layer 1's bucket: a wait, its update
        timer.layer_forward(1, waited=0.25, updated=1.0)
        clock[0] += 3.0
        timer.forward_end()
        clock[0] += 4.0
        timer.gradient_released(1)
        clock[0] += 5.0
        timer.gradient_released(0)
        timer.end_iteration()
        clock[0] += 1.5  # step(), zero_grad(), the next batch
    u, b, step = timer.medians()
    assert (
        u == pytest.approx([2.0, 3.0])
        and b == pytest.approx([5.0, 4.0])
        and step == pytest.approx(1.5)
    )
    assert timer.update_time() == pytest.approx(3.0)
    assert profiler.LayerTimer.from_raw(timer.raw()).update_time() == pytest.approx(3.0)
    rows = [
        u + b + [step] + [1e-3, 2e-3] + [timer.update_time()],
        u + b + [step] + [1e-3, 2e-3] + [3.5],
    ]
    assert profiler.combine(rows, 2, [4096, 8192], [[], []], 0.0).update_time == pytest.approx(3.5)


# -------------------------------------------------------------------- measured search (tuner)


def _search(times, first_k, tol=0.03, waits=None):
    """Run the tuner against measured iteration times ``times[k]``; return it."""
    from sapipe.auto.search import Tuner

    tuner = Tuner(first_k, len(times) - 1, tol)
    while tuner.trial is not None:
        k = tuner.trial
        tuner.record(times[k], (waits or {}).get(k, times[k] - min(times)))
    return tuner


def test_tuner_keeps_the_models_k_when_it_does_not_wait():
    times = [10.0, 9.0, 8.0, 8.0, 8.0]
    tuner = _search(times, 2, waits={2: 0.1})
    assert tuner.final == 2 and [t.k for t in tuner.trials] == [2]


def test_tuner_keeps_the_models_k_when_all_stale_is_no_faster():
    times = [10.0, 9.0, 8.5, 8.4, 8.4]  # k=2 waits, but k=4 (all stale) is only 1% faster
    tuner = _search(times, 2, waits={2: 1.0, 4: 0.0})
    assert tuner.final == 2 and [t.k for t in tuner.trials] == [2, 4]


@pytest.mark.parametrize("seed", range(40))
def test_tuner_finds_the_smallest_k_as_fast_as_all_stale(seed):
    """Monotone iteration times: bisection must find exactly what exhaustive search finds."""
    rng = np.random.default_rng(seed)
    m = int(rng.integers(2, 120))
    floor = float(rng.uniform(5, 50))
    drops = np.sort(rng.uniform(0, 1, m + 1))[::-1] * rng.uniform(0, 30)
    times = [
        floor + float(d) - float(drops[-1]) for d in drops
    ]  # non-increasing in k, times[m] = floor
    first_k = int(rng.integers(1, m))
    tol = 0.03
    tuner = _search(times, first_k, tol)
    if times[first_k] - floor <= tol * times[first_k]:
        assert tuner.final == first_k
    elif times[m] >= times[first_k] * (1 - tol):
        assert tuner.final == first_k
    else:
        expected = next(k for k in range(first_k + 1, m + 1) if times[k] <= times[m] * (1 + tol))
        assert tuner.final == expected
    assert len(tuner.trials) <= 2 + math.ceil(math.log2(max(m - first_k, 1)))
    assert len({t.k for t in tuner.trials}) == len(tuner.trials)  # no k measured twice


@pytest.mark.parametrize("seed", range(40))
def test_on_noisy_times_the_search_keeps_the_smallest_k_within_the_tolerance_of_the_best(seed):
    """Times that fall with k up to a floor, each measured with ±4% of noise (a noisy host, where
    k = m need not measure fastest): the k chosen is within the tolerance of the fastest time
    measured, and no smaller k measured past k₁ is."""
    rng = np.random.default_rng(100 + seed)
    m = int(rng.integers(4, 60))
    floor_at = int(rng.integers(1, m))
    times = [
        float(20.0 * (1 + 0.5 * max(floor_at - k, 0) / floor_at) * rng.uniform(0.96, 1.04))
        for k in range(m + 1)
    ]
    first_k, tol = 0, 0.03
    tuner = _search(times, first_k, tol, waits={0: 5.0})
    measured = tuner.measured
    if tuner.final == first_k:
        assert times[m] >= times[first_k] * (1 - tol)
        return
    best = min(t.iteration_time for t in tuner.trials)
    assert measured[tuner.final].iteration_time <= best * (1 + tol)
    assert all(
        t.iteration_time > best * (1 + tol) for t in tuner.trials if first_k < t.k < tuner.final
    )


def test_a_probe_faster_than_all_stale_becomes_the_reference():
    """k = m measured 5% slower than k = 4: k = 2, within 3% of T(m) but 8% slower than k = 4,
    is not chosen; k = 4 is."""
    times = [30.0, 25.0, 21.6, 21.0, 20.0, 20.6, 20.8, 20.9, 21.0]
    tuner = _search(times, 0, 0.03, waits={0: 5.0})
    assert [t.k for t in tuner.trials] == [0, 8, 4, 2, 3]
    assert tuner.final == 4


@pytest.mark.parametrize("seed", range(20))
def test_a_guided_search_finds_the_same_k_in_fewer_trials(seed):
    """A suggestion that is right ends the search with one probe (or none, when it points at
    the bracket's good end); one that is wrong still converges to the bisection's answer."""
    from sapipe.auto.search import Tuner

    rng = np.random.default_rng(seed)
    m = int(rng.integers(4, 120))
    drops = np.sort(rng.uniform(0, 1, m + 1))[::-1] * 30
    times = [20.0 + float(d) - float(drops[-1]) for d in drops]
    first_k, tol = 1, 0.03
    bisected = _search(times, first_k, tol)
    answer = bisected.final
    for suggest, most in (
        (lambda lo, hi: answer, 3),
        (lambda lo, hi: lo + 1, m + 2),
        (lambda lo, hi: hi, 2),
    ):
        tuner = Tuner(first_k, m, tol, suggest)
        while tuner.trial is not None:
            tuner.record(times[tuner.trial], times[tuner.trial] - min(times))
        if suggest(0, m) == m and answer not in (first_k, m):
            assert tuner.final == m  # told nothing short of m is fast enough: m, unprobed
        else:
            assert tuner.final == answer
        assert len(tuner.trials) <= most and len({t.k for t in tuner.trials}) == len(tuner.trials)


def test_a_stopped_search_keeps_the_best_k_it_measured():
    from sapipe.auto.search import Tuner

    times = [30.0, 25.0, 20.0, 15.0, 12.0, 10.0, 10.0, 10.0, 10.0]
    tuner = Tuner(2, 8, 0.03)
    tuner.record(times[2], 5.0)  # waits: m next
    assert tuner.trial == 8
    tuner.stop()
    assert (tuner.trial, tuner.final) == (None, 2)  # m never measured: the model's k
    tuner = Tuner(2, 8, 0.03)
    tuner.record(times[2], 5.0)
    tuner.record(times[8], 0.0)  # m is faster: the bracket (2, 8), probe 5
    assert tuner.trial == 5
    tuner.stop()
    assert tuner.final == 8
    with pytest.raises(RuntimeError, match="over already"):
        tuner.stop()


def test_slowdown_fit_recovers_the_sigma_behind_the_trials():
    """Trials measured on a link that slows compute (simulated with σ = 0.75) are best
    explained by σ = 0.75; trials the plain model already explains give σ = 0."""
    from sapipe.auto.search import Trial, fit_slowdown

    rng = np.random.default_rng(11)
    profiles, nbytes, beta = random_profiles(rng, 12, 0.6)

    def predict(k, sigma):
        return simulate(
            profiles,
            k,
            bucket_cap_bytes=4096,
            alpha=0.0,
            beta=beta,
            bytes_per_layer=nbytes,
            shared_link=True,
            slowdown=sigma,
            record_events=False,
        ).iteration_time

    trials = [Trial(k, predict(k, 0.75), 0.0) for k in (3, 12, 7)]
    assert predict(12, 0.75) > predict(12, 0.0) * 1.02  # the slow-down shows
    assert fit_slowdown(trials, predict) == 0.75
    assert fit_slowdown([Trial(k, predict(k, 0.0), 0.0) for k in (3, 12)], predict) == 0.0
    assert fit_slowdown([], predict) == 0.0


def test_tuner_refuses_input_after_the_end_and_bad_arguments():
    from sapipe.auto.search import Tuner

    tuner = _search([3.0, 2.0, 1.0], 1, waits={1: 0.0})
    with pytest.raises(RuntimeError, match="search is over"):
        tuner.record(1.0, 0.0)
    with pytest.raises(ValueError, match="outside"):
        Tuner(5, 3, 0.03)
    with pytest.raises(ValueError, match="tolerance"):
        Tuner(1, 3, 1.5)
    assert "k=1" in tuner.summary() and "-> k=1" in tuner.summary()


# ------------------------------------------------------- sync all-reduces waited for at step()


def _exposed_profiles():
    """Three layers (u = b = 1, 16 parameters each; update 1/64 per parameter: 0.25 a layer),
    one per bucket: l3's all-reduce (0.5) is issued at 4, l2's (2.0) at 5, l1's (0.5) at 6,
    when backward ends. So l2's ends at 7.0: after the end of backward and, under the old
    timeline, after the next iteration's start (6 + l1's stale update 0.25 + step 0.25)."""
    profiles = [
        LayerProfile("l1", 1.0, 1.0, 0.5, numel=16),
        LayerProfile("l2", 1.0, 1.0, 2.0, numel=16),
        LayerProfile("l3", 1.0, 1.0, 0.5, numel=16),
    ]
    return profiles, dict(
        bucket_cap_bytes=0, alpha=None, beta=None, step_time=0.25, update_per_element=1 / 64
    )


def test_sync_at_step_waits_at_the_end_of_backward_then_updates_in_step():
    """k = 0 with ``sync_at_step``: the end of backward waits for the last sync all-reduce,
    then step() runs every update and the step time: F + B + wait + updates + step."""
    profiles = [
        LayerProfile("l1", 1.0, 1.0, 0.5, numel=16),
        LayerProfile("l2", 1.0, 1.0, 2.5, numel=16),
    ]
    step_time, per_element = 0.5, 1 / 64
    r = simulate(
        profiles,
        0,
        bucket_cap_bytes=0,
        alpha=None,
        beta=None,
        step_time=step_time,
        update_per_element=per_element,
        sync_at_step=True,
    )
    forward, backward = sum(p.forward for p in profiles), sum(p.backward for p in profiles)
    # l2's bucket is issued after its backward (u1 + u2 + b2 = 3), l1's at the end of backward (4),
    # and the link takes them one after the other
    l2_end = forward + profiles[1].backward + profiles[1].comm
    last_end = max(forward + backward, l2_end) + profiles[0].comm
    updates = per_element * sum(p.numel for p in profiles)
    expected = forward + backward + max(0.0, last_end - (forward + backward)) + updates + step_time
    assert expected == 7.0
    assert abs(r.iteration_time - expected) <= 1e-12
    assert r.forward_wait == 0.0 and abs(r.step_wait - 2.0) <= 1e-12
    (wait,) = [e for e in r.events if e.category == "wait"]
    assert wait.name == "step: wait sync all-reduces"
    assert (wait.start, wait.end) == pytest.approx((4.0, 6.0), abs=1e-12)
    assert not [e for e in r.events if e.category == "update"]  # in step() now
    (step,) = [e for e in r.events if e.category == "step"]
    assert step.end - step.start == pytest.approx(updates + step_time, abs=1e-12)


@pytest.mark.parametrize("shared", [False, True])
def test_sync_at_step_changes_nothing_when_every_layer_is_stale(shared):
    rng = np.random.default_rng(21)
    for _ in range(10):
        m = int(rng.integers(1, 8))
        profiles, nbytes, beta = random_profiles(rng, m, comm_ratio=float(rng.uniform(0.2, 1.5)))
        for slowdown in (0.0, 0.5):
            kw = dict(
                bucket_cap_bytes=int(rng.choice([0, 8_000])),
                alpha=0.01,
                beta=beta,
                bytes_per_layer=nbytes,
                step_time=0.2,
                update_per_element=1e-5,
                slowdown=slowdown,
                shared_link=shared,
            )
            old, new = simulate(profiles, m, **kw), simulate(profiles, m, sync_at_step=True, **kw)
            assert new.iteration_time == old.iteration_time and new.step_wait == old.step_wait
            assert new.events == old.events


def test_sync_at_step_no_longer_hides_the_sync_tail_under_the_next_forward():
    """k = 1 (l1 stale). Old timeline: l2's all-reduce (ends at 7.0) runs on under step()
    and l1's next forward, and l2's forward (at 7.5) no longer waits: no stall, 7.0. With
    ``sync_at_step`` the end of backward (6) waits for it: 6 + 1.0 + updates 0.75 + step 0.25."""
    profiles, kw = _exposed_profiles()
    old, new = simulate(profiles, 1, **kw), simulate(profiles, 1, sync_at_step=True, **kw)
    forward, backward = sum(p.forward for p in profiles), sum(p.backward for p in profiles)
    assert (
        old.iteration_time == pytest.approx(old.compute_time, abs=1e-12) and old.compute_time == 7.0
    )
    l2_end = forward + profiles[2].backward + profiles[1].backward + profiles[1].comm  # issued at 5
    assert (
        l2_end > forward + backward + 16 / 64 + 0.25
    )  # past the next start under the old timeline
    expected = forward + backward + (l2_end - (forward + backward)) + 3 * 16 / 64 + 0.25
    assert expected == 8.0 and new.iteration_time > old.iteration_time
    assert abs(new.iteration_time - expected) <= 1e-12
    assert new.forward_wait == old.forward_wait == 0.0 and abs(new.step_wait - 1.0) <= 1e-12
    # the solver forwards the flag
    d = choose_k(profiles, only_k=1, sync_at_step=True, **kw)
    assert d.iteration_time == new.iteration_time


@pytest.mark.parametrize("shared", [False, True])
def test_sync_at_step_with_slowdown(shared):
    """With σ > 0 the new timeline runs, is no faster than with σ = 0 (on the hand-made
    profile; on one FIFO link for random ones), and σ → 0 (transfers submitted as issued)
    reproduces σ = 0 (submitted per iteration)."""
    profiles, kw = _exposed_profiles()
    for k in range(len(profiles) + 1):
        exact = simulate(profiles, k, sync_at_step=True, shared_link=shared, **kw)
        slowed = simulate(profiles, k, sync_at_step=True, shared_link=shared, slowdown=0.5, **kw)
        assert slowed.converged and slowed.iteration_time >= exact.iteration_time - 1e-12
    assert (
        simulate(
            profiles, 1, sync_at_step=True, slowdown=0.5, shared_link=shared, **kw
        ).iteration_time
        > 8.0
    )
    rng = np.random.default_rng(22)
    for _ in range(15):
        m = int(rng.integers(1, 8))
        profiles, nbytes, beta = random_profiles(rng, m, comm_ratio=float(rng.uniform(0.1, 1.5)))
        for k in range(m + 1):
            kw = dict(
                bucket_cap_bytes=int(rng.choice([0, 8_000, 40_000])),
                alpha=0.01,
                beta=beta,
                bytes_per_layer=nbytes,
                step_time=0.2,
                update_per_element=1e-5,
                shared_link=shared,
                sync_at_step=True,
            )
            exact = simulate(profiles, k, **kw)
            tiny = simulate(profiles, k, slowdown=1e-12, **kw)
            assert tiny.iteration_time == pytest.approx(exact.iteration_time, rel=1e-9, abs=1e-9)
            if (
                not shared
            ):  # shared, slower compute can issue a stale bucket later and so speed a sync one up
                assert (
                    simulate(profiles, k, slowdown=0.5, **kw).iteration_time
                    >= exact.iteration_time - 1e-12
                )


def test_the_margin_is_the_distance_to_the_threshold_of_each_trials_verdict():
    from sapipe.auto.search import Tuner

    tuner = Tuner(2, 8, 0.03)
    assert tuner.margin(100.0, 13.0) == pytest.approx(0.10)  # k1: waits 13 against 3% of 100
    tuner.record(100.0, 13.0)
    assert tuner.margin(90.0, 0.0) == pytest.approx(7.0 / 90.0)  # m: 90 against 97 = 100 (1 - 3%)
    tuner.record(90.0, 0.0)
    assert tuner.trial == 5
    assert tuner.margin(95.0, 0.0) == pytest.approx(
        2.3 / 95.0
    )  # a probe: 95 against 92.7 = 90 (1 + 3%)
    tuner.stop()
    with pytest.raises(RuntimeError, match="nothing to judge"):
        tuner.margin(1.0, 0.0)


def test_link_scale_fit_recovers_a_link_slower_than_profiled():
    """Trials simulated on a link 2.5x slower than the profile's are best explained by c = 2.5
    (their waits say it even where the times alone would not); the profile's own link by 1."""
    from sapipe.auto.search import Trial, fit_link_scale

    rng = np.random.default_rng(5)
    profiles, nbytes, beta = random_profiles(rng, 12, 0.6)

    def seen(k, scale):
        r = simulate(
            profiles,
            k,
            bucket_cap_bytes=4096,
            alpha=0.0,
            beta=beta * scale,
            bytes_per_layer=nbytes,
            shared_link=True,
            record_events=False,
        )
        return r.iteration_time, r.forward_wait + r.step_wait

    slow = [Trial(k, *seen(k, 2.5)) for k in (3, 12)]
    assert slow[0].waits > 0  # the slower link shows at k = 3
    assert fit_link_scale(slow, seen) == 2.5
    assert fit_link_scale([Trial(k, *seen(k, 1.0)) for k in (3, 12)], seen) == 1.0
    assert fit_link_scale([], seen) == 1.0


def test_a_bucket_pays_the_latency_once():
    """α is per collective, and a bucket is one collective however many layers it holds."""
    from sapipe.schedule.simulator import plan_buckets

    profiles = [LayerProfile(f"l{i}", 1.0, 1.0, 0.0) for i in range(4)]
    plans = plan_buckets(
        profiles, 0, bucket_cap_bytes=1e9, alpha=0.5, beta=1e-3, bytes_per_layer=[100] * 4
    )
    assert [len(plan.layers) for plan in plans] == [4]
    assert plans[0].comm_time == pytest.approx(0.5 + 1e-3 * 400, rel=1e-12)
