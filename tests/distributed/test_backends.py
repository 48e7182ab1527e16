"""Communication back-ends (``backend=``): same math as the default, and push-pull's ordering.

* ``pushpull`` and ``horovod`` runs are held to the same independent float64 reference as
  ``test_modes`` (rtol 1e-9), with partitions small and odd-sized so every bucket is
  split into many chunks, some of which need padding to split evenly over the ranks.
* Push-pull's worker must issue the same chunk sequence on every rank, whatever each
  rank's timing, and let a bucket started later with a smaller priority overtake the
  remaining chunks of an earlier one.
* Dead peers and bad arguments are covered in ``test_errors``.
"""

from __future__ import annotations

import functools
import random
import time

import numpy as np
import pytest
import torch
from support.dist_utils import horovod_missing, k_once_decided, run_ranks
from support.models import loss_fn_for, make_batches, make_model
from support.modes import CONFIGS, check_against_reference, config_id, train

# Synchronous only; stale with wp3 (prev-local gradients, Δx, peeks); Pipe-SGD with s = 2.
BACKEND_CONFIGS = [CONFIGS[0], CONFIGS[9], CONFIGS[16]]
PARTITION_MB = 13 * 8 / 2**20  # 13 float64 elements per chunk: odd, so tails get padded


@functools.cache
def _pushpull(kind: str):
    return run_ranks(
        train,
        world_size=2,
        args=(kind, BACKEND_CONFIGS, {"backend": "pushpull", "partition_mb": PARTITION_MB}),
        timeout=300,
    )


@pytest.mark.parametrize("kind", ["sgd", "adam"])
@pytest.mark.parametrize("config", BACKEND_CONFIGS, ids=config_id)
def test_pushpull_matches_reference(kind, config):
    per_rank = _pushpull(kind)
    check_against_reference(
        kind, config, [per_rank[r][BACKEND_CONFIGS.index(config)] for r in range(2)]
    )


# --------------------------------------------------------------------------- ordering


def _chunk_order(rank, world_size, seed):
    """Start buckets with rank-dependent timing; log the chunk sequence the worker issues."""
    import torch.distributed as dist

    from sapipe.comm import BackendRequest, create
    from sapipe.comm.pushpull import PushPull
    from sapipe.tracing.tracer import Tracer

    backend = create(
        "pushpull",
        BackendRequest(dist.group.WORLD, "sync", None, Tracer(False), partition_bytes=64),
    )
    assert isinstance(backend, PushPull)
    issued = []
    exchange = backend.run_unit

    def logged(job, index):
        issued.append((job.sequence, index))
        exchange(job, index)

    backend.run_unit = logged
    results = {}

    # 1. Overtaking: bucket 0 (priority 5) has 200 chunks of 16 floats. Rank 0 starts bucket 1
    #    (priority 0) only once two chunks of bucket 0 are through; rank 1 at once. Bucket 1
    #    must then go before the rest of bucket 0, on both ranks alike.
    big = torch.arange(3200, dtype=torch.float32) * (rank + 1)
    small = torch.full((40,), float(rank + 1))
    first = backend.start(big, "bucket 0", priority=5)
    if rank == 0:
        while len(issued) < 2:
            time.sleep(0.0005)
    second = backend.start(small, "bucket 1", priority=0)
    results["big"] = first.wait().clone()
    results["small"] = second.wait().clone()
    results["order"] = list(issued)

    # 2. Random timing on each rank: the sums must be right and the sequences identical.
    issued.clear()
    rng = random.Random(seed * 100 + rank)
    sizes = [random.Random(seed + i).choice([1, 7, 33, 100, 257]) for i in range(12)]
    tensors = [torch.arange(n, dtype=torch.float32) + rank * 1000 + i for i, n in enumerate(sizes)]
    handles = []
    for i, t in enumerate(tensors):
        time.sleep(rng.random() * 0.004)
        handles.append(
            backend.start(t, f"random bucket {i}", priority=random.Random(seed - i).randrange(4))
        )
    results["random"] = [h.wait().clone() for h in handles]
    results["random order"] = list(issued)
    backend.close()
    return results


def test_pushpull_issues_chunks_in_agreed_priority_order():
    out = run_ranks(_chunk_order, world_size=2, args=(7,), timeout=120)
    # every back-end delivers the mean over the ranks (here of ×1 and ×2)
    expected_big = torch.arange(3200, dtype=torch.float32) * 3 / 2
    for rank in range(2):
        torch.testing.assert_close(torch.as_tensor(out[rank]["big"]), expected_big, rtol=0, atol=0)
        torch.testing.assert_close(
            torch.as_tensor(out[rank]["small"]), torch.full((40,), 1.5), rtol=0, atol=0
        )
    order = [tuple(x) for x in out[0]["order"]]
    assert order == [tuple(x) for x in out[1]["order"]], "ranks issued different chunk sequences"
    assert sorted(order) == [(0, i) for i in range(200)] + [(1, i) for i in range(3)]
    small_at = [n for n, (job, _) in enumerate(order) if job == 1]
    assert small_at == list(range(small_at[0], small_at[0] + 3)), (
        f"bucket 1's chunks interleaved: {order}"
    )
    assert 2 <= small_at[0] < 190, (
        f"bucket 1 did not overtake bucket 0: its chunks were at {small_at}"
    )
    assert [i for job, i in order if job == 0] == list(range(200)), (
        "a bucket's chunks went out of order"
    )

    assert out[0]["random order"] == out[1]["random order"], (
        "ranks issued different chunk sequences"
    )
    sizes = [len(t) for t in out[0]["random"]]
    for i, n in enumerate(sizes):
        want = torch.arange(n, dtype=torch.float32) + 500 + i  # the mean over the two ranks
        for rank in range(2):
            torch.testing.assert_close(
                torch.as_tensor(out[rank]["random"][i]), want, rtol=0, atol=0
            )


# --------------------------------------------------------------------------- horovod


def _train_on_horovod(rank, world_size, kind, configs):
    from sapipe.comm.horovod_backend import init_horovod_for_torch_job

    hvd = init_horovod_for_torch_job()
    try:
        return train(rank, world_size, kind, configs, {"backend": "horovod"})
    finally:
        hvd.shutdown()


@pytest.mark.skipif(bool(horovod_missing()), reason=horovod_missing() or "available")
@pytest.mark.parametrize("kind", ["adam"])
def test_horovod_matches_reference(kind):
    per_rank = run_ranks(_train_on_horovod, world_size=2, args=(kind, BACKEND_CONFIGS), timeout=300)
    for index, config in enumerate(BACKEND_CONFIGS):
        check_against_reference(kind, config, [per_rank[r][index] for r in range(2)])


def test_buffer_names_start_afresh_with_each_layout():
    """Names by which Horovod and BytePS match buffers across ranks (``comm.base.StableNames``).
    After a new layout, rank A's first new buffer sits where an old one was and rank B's
    elsewhere (each allocator decides): both must name their buffers alike, by start order,
    and never as an old buffer."""
    from sapipe.comm.base import StableNames

    memory = torch.empty(400)
    old, elsewhere = [memory[0:100], memory[100:200]], [memory[200:300], memory[300:400]]
    per_rank = []
    for new in ([old[1], elsewhere[0]], [elsewhere[1], old[0]]):  # rank A, rank B
        names = StableNames("sapipe1.sync")
        before = [names(t) for t in old]
        names.renew()
        after = [names(t) for t in new] + [names(t) for t in new]  # and again at the next step
        assert not set(after) & set(before), (before, after)
        per_rank.append(after)
    assert per_rank[0] == per_rank[1]


def _auto_on_horovod(rank, world_size):
    """Horovod matches operations by name. auto's restarts lay the buckets out anew and free
    the old ones; rank 0 keeps allocations of a bucket's size between steps, so the two
    ranks' new buffers land at different addresses."""
    import sapipe
    from sapipe.comm.horovod_backend import init_horovod_for_torch_job

    hvd = init_horovod_for_torch_job()
    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model,
        stale_layers="auto",
        profile_steps=2,
        backend="horovod",
        bucket_cap_mb=0.0008,
        timeout=20,
    )
    batches, kept = make_batches("tied", 8, world_size), []
    try:
        for step in range(300):
            x, y = batches[step % len(batches)][rank]
            opt.zero_grad()
            loss_fn_for("tied")(model(x), y).backward()
            opt.step()
            if rank == 0:
                kept += [
                    torch.zeros(opt._runtime.pipeline.gradients(bucket).buffer.wire[0].numel())
                    for bucket in opt.buckets
                ]
            if opt.stale_layers != "auto" and step > 40:
                break
        opt.synchronize()
        with opt.real_weights():
            weights = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt.close()
        return {"k": opt.stale_layers, "weights": weights}
    finally:
        hvd.shutdown()


@pytest.mark.skipif(bool(horovod_missing()), reason=horovod_missing() or "available")
def test_auto_on_horovod_names_buckets_alike_on_every_rank_after_its_restarts():
    first, second = run_ranks(_auto_on_horovod, world_size=2, timeout=240)
    assert first["k"] == second["k"] and isinstance(first["k"], int)
    for name, value in first["weights"].items():
        assert np.array_equal(value, second["weights"][name]), name


def _auto_on_pushpull(rank, world_size):
    """The scheduler's link probes run on the main thread while push-pull's worker is busy."""
    import sapipe

    model = make_model("tied", seed=0)
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.05),
        model,
        stale_layers="auto",
        profile_steps=2,
        backend="pushpull",
        partition_mb=0.001,
        timeout=30,
    )
    batches = make_batches("tied", 8, world_size)

    # warm-up, then the measured search (pipeline restarts drain push-pull's handles)
    def one_step(iteration):
        x, y = batches[iteration % len(batches)][rank]
        opt.zero_grad()
        loss_fn_for("tied")(model(x), y).backward()
        opt.step()

    return k_once_decided(opt, one_step)


def test_auto_schedule_works_on_pushpull():
    ks = run_ranks(_auto_on_pushpull, world_size=2, timeout=120)
    assert ks[0] == ks[1] and isinstance(ks[0], int), ks
