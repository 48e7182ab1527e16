"""Runtime properties on real Gloo ranks: overlap, collective order, no per-step allocation."""

from __future__ import annotations

import time

import numpy as np
import torch
from support.dist_utils import run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.training import named_weights, train_steps

STEPS = 6
SLOW_ITERATION = 3


def _train_with_a_slow_rank(model, opt, rank, world_size, steps, slow_iteration, sleep):
    """Train the "mlp" model; rank 1 sleeps in the first layer's backward of ``slow_iteration``,
    so the all-reduce of that layer's bucket starts ``sleep`` seconds late on every rank."""
    iteration = {"t": 0}

    def slow_backward(module, args, output):
        if rank == 1 and iteration["t"] == slow_iteration:
            output.register_hook(lambda grad: time.sleep(sleep))

    model[0].register_forward_hook(slow_backward)
    batches = make_batches("mlp", steps, world_size)
    for t in range(1, steps + 1):
        iteration["t"] = t
        x, y = batches[t - 1][rank]
        opt.zero_grad()
        loss_fn_for("mlp")(model(x), y).backward()
        opt.step()


def _overlap(rank, world_size):
    """Rank 1 sleeps inside the stale layer's backward of iteration 3.

    Rank 0 has already issued its stale all-reduce of iteration 3, so that collective
    cannot complete until rank 1 wakes up. Rank 0 must meanwhile leave step() and start
    the forward of iteration 4: the stale all-reduce overlaps the next forward. (Under
    DDP, or with this layer synchronous, rank 0 would block before that forward.)
    """
    import sapipe

    model = make_model("mlp", seed=0)
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model,
        stale_layers=1,
        trace=True,
        bucket_cap_mb=0.0001,
    )
    _train_with_a_slow_rank(
        model, opt, rank, world_size, STEPS, slow_iteration=SLOW_ITERATION, sleep=0.6
    )
    opt.synchronize()
    return {
        "events": [(ts, kind, dict(fields)) for ts, kind, fields in opt.tracer.events()],
        "buckets": [b.describe() for b in opt.buckets],
        "waited": opt.communication_wait,
    }


def test_stale_allreduce_overlaps_next_forward():
    out = run_ranks(_overlap, world_size=2)
    events = out[0]["events"]

    def when(kind, **match):
        hits = [
            ts for ts, k, f in events if k == kind and all(f.get(a) == b for a, b in match.items())
        ]
        assert len(hits) == 1, f"expected one {kind} {match}, found {len(hits)}"
        return hits[0]

    stale = [b for b in out[0]["buckets"] if b.startswith("stale")]
    assert len(stale) == 1
    what = f"{stale[0]} of iteration {SLOW_ITERATION}"
    started = when("comm_start", what=what)
    next_forward = when("forward_start", iteration=SLOW_ITERATION + 1)
    done = when("comm_done", what=what)
    assert started < next_forward < done, (
        "the stale all-reduce of iteration 3 must still be running when the forward of "
        f"iteration 4 starts: start={started}, forward={next_forward}, done={done}"
    )
    # ... and it is waited for once the backward of iteration 4 ends (p.grad then holds it), not
    # earlier.
    waited = when("comm_wait", what=what)
    step4 = when("step_start", iteration=SLOW_ITERATION + 1)
    assert next_forward < waited <= step4
    # That wait is what communication_wait reports: rank 0 blocked for most of rank 1's
    # 0.6 s sleep; rank 1, whose peers were all ahead of it, hardly blocked at all.
    assert out[0]["waited"] > 0.3, out[0]["waited"]
    assert out[1]["waited"] < 0.2, out[1]["waited"]


def test_collectives_issued_in_the_same_order_on_every_rank():
    out = run_ranks(_overlap, world_size=2)
    orders = [
        [(f["stream"], f["what"]) for _, kind, f in r["events"] if kind == "comm_start"]
        for r in out
    ]
    assert orders[0] == orders[1]
    # Within an iteration, buckets start in index order (reverse forward order).
    per_iteration = {}
    for _stream, what in orders[0]:
        iteration = int(what.rsplit(" ", 1)[1])
        per_iteration.setdefault(iteration, []).append(int(what.split(" ")[2]))
    assert len(per_iteration) == STEPS
    for indices in per_iteration.values():
        assert indices == sorted(indices) and len(indices) == len(out[0]["buckets"])


def _buffers(rank, world_size, mode):
    import sapipe

    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(
        torch.optim.Adam(model.parameters(), lr=1e-3),
        model,
        stale_layers=4,
        compensation=mode,
        bucket_cap_mb=0.001,
    )
    batches = make_batches("tied", 12, world_size)
    seen = []
    for t in range(12):
        x, y = batches[t][rank]
        opt.zero_grad()
        loss_fn_for("tied")(model(x), y).backward()
        opt.step()
        ptrs = set()
        for b in opt.buckets:
            ptrs |= {s.data_ptr() for s in opt._runtime.pipeline.gradients(b).buffer.slots}
            gradients, weights = opt._runtime.pipeline.gradients(b), opt._runtime.updater.weights(b)
            kept = (gradients.local, gradients.prev_local, weights.weights, weights.real)
            ptrs |= {t.data_ptr() for t in kept if t is not None}
            ptrs |= {p.data_ptr() for p in b.params}
        seen.append(ptrs)
    stale = [b for b in opt.buckets if b.stale]
    return {
        "ptr_sets": [sorted(s) for s in seen],
        "depths": [opt._runtime.pipeline.gradients(b).buffer.depth for b in stale],
    }


def test_staleness_buffer_allocated_once():
    for mode in ("none", "wp3"):
        out = run_ranks(_buffers, world_size=2, args=(mode,))
        sets = out[0]["ptr_sets"]
        assert all(s == sets[1] for s in sets[1:]), f"{mode}: buffers were reallocated after step 1"
        assert out[0]["depths"] and all(d == 2 for d in out[0]["depths"]), (
            "staleness 1 needs a double buffer"
        )


def _close(rank, world_size):
    import sapipe

    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model,
        stale_layers=3,
        compensation="wp3",
        bucket_cap_mb=0.001,
    )
    batches = make_batches("tied", 4, world_size)
    train_steps(model, opt, batches, rank, loss_fn=loss_fn_for("tied"))
    x, y = batches[-1][rank]
    in_flight = sum(
        h is not None
        for b in opt.buckets
        for h in opt._runtime.pipeline.gradients(b).buffer.in_flight
    )
    opt.close()
    opt.close()  # idempotent
    after = sum(
        h is not None
        for b in opt.buckets
        for h in opt._runtime.pipeline.gradients(b).buffer.in_flight
    )
    before = [p.detach().clone() for p in model.parameters()]
    loss_fn_for("tied")(model(x), y).backward()  # hooks are gone: no sapipe work, no error
    unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    return {"in_flight": in_flight, "after": after, "unchanged": unchanged}


def test_close_drains_collectives_and_detaches():
    for r in run_ranks(_close, world_size=2):
        assert r["in_flight"] > 0 and r["after"] == 0 and r["unchanged"]


def _wait_for_communication(rank, world_size):
    """Rank 1 sleeps in the stale layer's backward of the last iteration, so its stale
    all-reduce starts late; rank 0's wait_for_communication() after step() must block
    until then, and leave the result pending for the step that consumes it."""
    import sapipe

    model = make_model("mlp", seed=0)
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05), model, stale_layers=1, bucket_cap_mb=0.0001
    )
    _train_with_a_slow_rank(model, opt, rank, world_size, 3, slow_iteration=3, sleep=0.5)
    start = time.perf_counter()
    opt.wait_for_communication()
    blocked = time.perf_counter() - start
    pending = sum(
        h is not None
        for b in opt.buckets
        for h in opt._runtime.pipeline.gradients(b).buffer.in_flight
    )
    opt.close()
    return {"blocked": blocked, "pending": pending}


def test_wait_for_communication_blocks_until_in_flight_all_reduces_arrive():
    out = run_ranks(_wait_for_communication, world_size=2)
    assert out[0]["blocked"] > 0.3, out  # rank 0 waited for rank 1's late stale all-reduce
    assert out[1]["blocked"] < 0.3, out
    assert (
        out[0]["pending"] > 0 and out[1]["pending"] > 0
    )  # nothing consumed: still the step's to apply


# ops that read a tensor's value on the host: on CUDA each one waits for the device
_HOST_READS = ("aten._local_scalar_dense", "aten.is_nonzero", "aten.item")


def _host_reads(rank, world_size, compensation, k, compression):
    from torch.utils._python_dispatch import TorchDispatchMode

    import sapipe

    class HostReads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.reads = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if str(func).startswith(_HOST_READS):
                self.reads.append(str(func))
            return func(*args, **(kwargs or {}))

    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-3),
        model,
        stale_layers=k,
        compensation=compensation,
        compression=compression,
        bucket_cap_mb=0.001,
    )
    batches = make_batches("tied", 10, world_size)
    watch = HostReads()
    for t in range(10):
        x, y = batches[t][rank]
        if t == 6:  # the pipeline is full from here on
            watch.__enter__()
        opt.zero_grad()
        loss_fn_for("tied")(model(x), y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
        opt.step()
    watch.__exit__(None, None, None)
    return watch.reads


def test_steady_state_steps_read_nothing_back_to_the_host():
    """A step of sapipe's, its pipeline full, reads no tensor value on the host (no ``item()``,
    no ``bool(tensor)``): on a GPU each such read would stall the host until the device caught
    up, and the next kernels could not be queued ahead. Seen on the training thread's
    dispatcher, here on the CPU; the script's own clipping (no host read with ``foreach``)
    runs between backward and step as in a user's loop."""
    for compensation, k, compression in (
        ("none", 0, None),
        ("wp1", 3, None),
        ("dc", 3, "int8"),
        ("wp3", 3, "bf16"),
    ):
        for reads in run_ranks(_host_reads, world_size=2, args=(compensation, k, compression)):
            assert reads == [], (
                f"{compensation}, k={k}, {compression}: host reads {sorted(set(reads))}"
            )


STRAY_CASES = [(1, "dc", None), (1, "dc", "int8"), (0, "none", None)]


def _stray_steps(rank, world_size, stray):
    """Each case trained for STEPS; with ``stray``, rank 1 alone also runs a forward without
    backward and a step() without gradients after iteration 3, as a script that skips a
    batch's backward but not its step would. The real weights after the run, per case."""
    import sapipe

    batches = make_batches("mlp", STEPS, world_size)
    out = []
    for k, mode, compression in STRAY_CASES:
        model = make_model("mlp", seed=0)
        opt = sapipe.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            model,
            stale_layers=k,
            compensation=mode,
            compression=compression,
            bucket_cap_mb=0.0001,
            timeout=30,
        )
        for t, step in enumerate(batches, start=1):
            x, y = step[rank]
            opt.zero_grad()
            loss_fn_for("mlp")(model(x), y).backward()
            opt.step()
            if stray and rank == 1 and t == 3:
                opt.zero_grad()
                model(x)
                opt.step()
        opt.synchronize()
        with opt.real_weights():
            out.append(named_weights(model))
        opt.close()
    return out


def test_one_ranks_step_without_gradients_changes_nothing():
    """A step() with no backward since the last and no p.grad held does nothing, as torch.optim's
    (and DDP's, which sends nothing then): called on one rank only, it must not pair with
    the other rank's next collective. Every rank ends with the weights of the run without it."""
    clean = run_ranks(_stray_steps, world_size=2, args=(False,))
    stray = run_ranks(_stray_steps, world_size=2, args=(True,))
    for case in range(len(STRAY_CASES)):
        for rank in range(2):
            for name, value in clean[0][case].items():
                assert np.array_equal(stray[rank][case][name], value), (
                    STRAY_CASES[case],
                    rank,
                    name,
                )
