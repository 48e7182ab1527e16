"""Hierarchical sums (sapipe/comm/hierarchical.py): the topology, when they are chosen, and
4 Gloo ranks told they sit on 2 nodes (torchrun's GROUP_RANK), which must train as the float64
reference does, flat or hierarchical. tests/system/test_emulated_cluster.py runs them across real
(emulated) nodes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from support.dist_utils import assert_close_dicts, run_ranks, same_state
from support.models import loss_fn_for, make_batches, make_model
from support.reference import compressed_mean, node_first_mean, run_reference
from support.training import bucket_layouts, named_weights, train_steps

from sapipe.comm.hierarchical import resolve
from sapipe.comm.topology import Topology
from sapipe.errors import ConfigurationError

TWO_BY_TWO = Topology.from_names(["a", "a", "b", "b"])


def test_the_topology_of_node_names():
    assert (
        TWO_BY_TWO.nodes == ((0, 1), (2, 3)) and TWO_BY_TWO.two_level and TWO_BY_TWO.local_size == 2
    )
    assert TWO_BY_TWO.peers_across(3) == (1, 3) and TWO_BY_TWO.local_index(2) == 0
    interleaved = Topology.from_names(["a", "b", "a", "b"])
    assert interleaved.nodes == ((0, 2), (1, 3)) and interleaved.peers_across(1) == (0, 1)
    assert not Topology.from_names(["a", "a", "b"]).two_level  # 2 + 1 ranks: not uniform
    assert not Topology.from_names(["a", "b"]).two_level  # one rank per node: nothing to do inside
    assert not Topology.from_names(["a", "a"]).two_level  # one node


def test_when_sums_go_node_first():
    one_node = Topology.from_names(["a", "a"])
    assert resolve(None, "torch", TWO_BY_TWO)
    assert not resolve(None, "pushpull", TWO_BY_TWO) and not resolve(False, "torch", TWO_BY_TWO)
    assert not resolve(None, "torch", one_node)
    with pytest.raises(ConfigurationError, match="needs several nodes.*1 node × 2"):
        resolve(True, "torch", one_node)
    with pytest.raises(ConfigurationError, match="runs on backend='torch'; got backend='pushpull'"):
        resolve(True, "pushpull", TWO_BY_TWO)


# (k, compensation, hierarchical=, compression=)
CASES = [
    (0, "none", None, None),
    (3, "wp1", None, None),
    (3, "dc", False, None),
    (0, "none", None, "int8"),
    (3, "wp1", None, "int8"),
    (3, "dc", None, "bf16"),
    (3, "none", None, "fp16"),
    (3, "wp1", False, "int8"),
]
NODES = ((0, 1), (2, 3))
STEPS = 5


def _train(rank, world_size, cases):
    import sapipe

    os.environ["GROUP_RANK"] = str(rank // 2)  # 2 "nodes" of 2 ranks, as torchrun would say
    out = []
    for k, mode, hierarchical, compression in cases:
        model = make_model("tied", seed=rank, dtype=torch.float64)
        opt = sapipe.DistributedOptimizer(
            torch.optim.AdamW(model.parameters(), lr=0.01),
            model,
            stale_layers=k,
            compensation=mode,
            hierarchical=hierarchical,
            compression=compression,
            bucket_cap_mb=0.0007,
            timeout=60,
        )
        real = _run_steps(
            model, opt, rank, make_batches("tied", STEPS, world_size, dtype=torch.float64)
        )
        out.append(
            {
                "real": real,
                "sum": type(opt._pipeline.sync_comm).__name__,
                "buckets": bucket_layouts(opt, model),
            }
        )
        opt.close()
    return out


def _run_steps(model, opt, rank, batches, task="tied"):
    """``batches`` trained on (this rank's share of each); the real weights after them."""
    train_steps(model, opt, batches, rank, loss_fn=loss_fn_for(task))
    opt.synchronize()
    with opt.real_weights():
        return named_weights(model)


@pytest.fixture(scope="module")
def two_nodes():
    return run_ranks(_train, world_size=4, args=(CASES,), timeout=300)


def _reference(k, mode, reduce):
    return run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        lambda params: torch.optim.AdamW(params, lr=0.01),
        make_batches("tied", STEPS, 4, dtype=torch.float64),
        loss_fn_for("tied"),
        stale_layers=k,
        compensation=mode,
        reduce=reduce,
    ).real[-1]


def _expected_sum(hierarchical, compression) -> str:
    if hierarchical is False:
        return "AllReduce" if compression is None else "CompressedSum"
    return "HierarchicalAllReduce" if compression is None else "HierarchicalCompressedSum"


@pytest.mark.parametrize(
    "index", range(len(CASES)), ids=[f"k{k}-{m}-h{h}-{c}" for k, m, h, c in CASES]
)
def test_two_nodes_of_two_train_as_the_reference(two_nodes, index):
    """Node first (the default on two nodes) or flat, every rank's weights are the float64
    reference's; uneven buckets go through the padded shards. Compressed node first, the
    reference averages each node exactly and sums the node means compressed, shard by
    shard (``reference.node_first_mean``); flat, it sums all four ranks compressed."""
    k, mode, hierarchical, compression = CASES[index]
    buckets = two_nodes[0][index]["buckets"]
    node_first = hierarchical is not False
    reduce = None
    if compression is not None:
        reduce = (
            node_first_mean(compression, buckets, NODES)
            if node_first
            else compressed_mean(compression, buckets)
        )
    ref = _reference(k, mode, reduce)
    for rank, results in enumerate(two_nodes):
        got = results[index]
        assert got["sum"] == _expected_sum(hierarchical, compression)
        assert len(got["buckets"]) >= 2
        assert_close_dicts(got["real"], ref, rtol=1e-9, atol=1e-11, what=f"rank {rank}")
    if (
        compression == "int8" and node_first
    ):  # not the flat compressed sum's weights, nor the uncompressed ones
        for other in (compressed_mean(compression, buckets), None):
            elsewhere = _reference(k, mode, other)
            moved = max((elsewhere[n] - ref[n]).abs().max().item() for n in ref)
            assert moved > 1e-7, f"node first moved the weights by only {moved:.1e}"


def _required_on_one_node(rank, world_size):
    import sapipe

    model = make_model("tied")
    try:
        sapipe.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.1), model, hierarchical=True
        )
    except ConfigurationError as exc:
        return str(exc)
    return None


def test_hierarchical_true_on_one_node_is_refused_on_every_rank():
    for message in run_ranks(_required_on_one_node, world_size=2):
        assert message is not None and "hierarchical=True needs several nodes" in message, message


def _auto_on_two_nodes(rank, world_size, compression):
    import sapipe

    os.environ["GROUP_RANK"] = str(rank // 2)
    model = make_model("tied", seed=rank)
    opt = sapipe.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        model,
        stale_layers="auto",
        profile_steps=3,
        tune_steps=0,
        compression=compression,
    )
    sync, probed = opt._pipeline.sync_comm, []
    own_sum = sync.sum_now
    sync.sum_now = lambda tensor: (probed.append(tensor.numel()), own_sum(tensor))
    train_steps(model, opt, make_batches("tied", 12, world_size), rank, loss_fn=loss_fn_for("tied"))
    raw = opt.auto.profile.raw
    result = (
        opt.auto.decided,
        opt.stale_layers,
        raw["probe_times"],
        len(probed),
        raw.get("wire_ratio"),
        raw.get("codec_share"),
    )
    opt.close()
    return result


@pytest.mark.parametrize("compression", [None, "int8"])
def test_auto_probes_the_two_level_sum_and_decides_alike(compression):
    """The scheduler times its link probes through the hierarchical sum itself
    (``CommBackend.sum_now``), and every rank decides the same k from them. Compressed, it
    scales the link to the bytes that cross between nodes: int8's 1 + 4/64 bytes per
    4-byte value (flags and padding aside)."""
    results = run_ranks(_auto_on_two_nodes, world_size=4, args=(compression,), timeout=300)
    decided, k, probes, probed, wire_ratio, codec_share = results[0]
    assert decided and all(r[:2] == (decided, k) for r in results)
    assert len(probes) >= 2 and all(t > 0 for t in probes)
    assert probed > len(probes), "every probe (and its warm-up) went through the back-end's own sum"
    if compression is None:
        assert wire_ratio is None
    else:
        assert 0.26 < wire_ratio < 0.4, wire_ratio
        # each rank compresses its shard of the largest bucket: the codec's time is per byte of
        # that shard (what a whole bucket costs, for predictions), its share of the link 1/L
        assert 0.5 <= codec_share < 0.52, codec_share


def _sums(rank, world_size, numel):
    from datetime import timedelta

    import torch.distributed as dist

    from sapipe.comm.hierarchical import HierarchicalAllReduce
    from sapipe.tracing.tracer import Tracer

    topology = Topology.from_names([f"node {r // 2}" for r in range(world_size)])
    backend = HierarchicalAllReduce.create(
        dist.group.WORLD, topology, "sync", timedelta(seconds=60), Tracer(False)
    )
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=gen, dtype=torch.float64)
    flat = x.clone()
    dist.all_reduce(flat)
    backend.wait(backend.start(x, "a bucket"))
    backend.close()
    return {"hierarchical": x, "flat": flat / world_size}  # a back-end delivers the mean


# 3 MiB of float64 in 3 pieces, uneven; one small piece
@pytest.mark.parametrize("numel", [3 * (1 << 17) + 5, 1001])
def test_a_pipelined_bucket_sums_as_a_flat_all_reduce(numel):
    """Cut into pieces whose steps overlap (each padded to the node's shards), a bucket comes
    out as the flat all-reduce's mean on every rank, identical across ranks."""
    results = run_ranks(_sums, world_size=4, args=(numel,), timeout=300)
    for r in results:
        assert torch.allclose(
            torch.as_tensor(r["hierarchical"]), torch.as_tensor(r["flat"]), rtol=1e-13, atol=1e-13
        )
        assert (r["hierarchical"] == results[0]["hierarchical"]).all()


RESUME_STEPS, SPLIT = 6, 3


def _node_first_int8(seed):
    import sapipe

    model = make_model("tied", seed=seed, dtype=torch.float64)
    opt = sapipe.DistributedOptimizer(
        torch.optim.AdamW(model.parameters(), lr=0.01),
        model,
        stale_layers=3,
        compensation="wp1",
        compression="int8",
        bucket_cap_mb=0.0007,
        timeout=60,
    )
    return model, opt


def _resume_node_first(rank, world_size):
    """Uninterrupted, and resumed from a checkpoint taken after SPLIT steps, node first with
    int8; then that checkpoint loaded by the same job seen as one node (flat sums)."""
    os.environ["GROUP_RANK"] = str(rank // 2)
    batches = make_batches("tied", RESUME_STEPS, world_size, dtype=torch.float64)
    model, opt = _node_first_int8(seed=0)
    expected = _run_steps(model, opt, rank, batches)
    opt.close()
    model, opt = _node_first_int8(seed=0)
    _run_steps(model, opt, rank, batches[:SPLIT])
    saved = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": opt.state_dict(),
    }
    residual = max(b["codec"]["residual"].abs().max().item() for b in saved["optimizer"]["buckets"])
    opt.close()
    model, opt = _node_first_int8(seed=rank + 7)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(saved["optimizer"])
    resumed = _run_steps(model, opt, rank, batches[SPLIT:])
    opt.close()
    os.environ["GROUP_RANK"] = "0"  # the same four ranks on one node: the sums go flat
    model, opt = _node_first_int8(seed=0)
    _run_steps(model, opt, rank, batches[:1])
    before = opt.state_dict()
    try:
        opt.load_state_dict(saved["optimizer"])
        refusal = None
    except ConfigurationError as exc:
        refusal = str(exc)
    untouched = same_state(opt.state_dict(), before)
    opt.close()
    return {
        "expected": expected,
        "resumed": resumed,
        "residual": residual,
        "refusal": refusal,
        "untouched": untouched,
    }


def test_a_node_first_int8_checkpoint_resumes_bit_identically_on_the_same_nodes_only():
    """The shard residuals travel in the checkpoint: the resumed run is bit-identical. A job
    whose sums go flat (here: the same ranks on one node) refuses them by name, mid-training
    too, with nothing of its own state changed."""
    for rank, out in enumerate(run_ranks(_resume_node_first, world_size=4, timeout=300)):
        assert out["residual"] > 0
        for name, value in out["expected"].items():
            assert np.array_equal(out["resumed"][name], value), (rank, name)
        assert (
            out["refusal"] is not None and "went node first over 2 ranks per node" in out["refusal"]
        ), out["refusal"]
        assert out["untouched"], f"rank {rank}: the refused load changed the optimizer's state"


def _compressed_sums(rank, world_size, kind, numel, nflags):
    from datetime import timedelta

    import torch.distributed as dist

    from sapipe.comm.hierarchical import HierarchicalCompressedSum
    from sapipe.compression.codec import Compression, make_codec
    from sapipe.tracing.tracer import Tracer

    topology = Topology.from_names([f"node {r // 2}" for r in range(world_size)])
    backend = HierarchicalCompressedSum.create(
        dist.group.WORLD, topology, "sync", timedelta(seconds=60), Tracer(False)
    )
    codec = make_codec(
        Compression.of(kind),
        numel,
        nflags,
        world_size,
        torch.float64,
        torch.device("cpu"),
        node_size=topology.local_size,
    )
    gen = torch.Generator().manual_seed(rank)
    values = torch.randn(numel, generator=gen, dtype=torch.float64)
    flags = (torch.arange(nflags) % (rank + 2) == 0).to(
        torch.float64
    )  # which parameters this rank used
    wire = torch.cat([values, flags])
    exact = wire.clone()
    dist.all_reduce(exact)
    backend.wait(backend.start(wire, "a bucket", codec=codec.at(0)))
    backend.close()
    return {"got": wire, "mean": exact[:numel] / world_size, "flags": exact[numel:]}


@pytest.mark.parametrize("kind", ["int8", "bf16"])
def test_a_node_first_compressed_sum_delivers_the_mean_and_the_exact_flag_counts(kind):
    """One bucket of uneven length (the last shard padded), summed node first and compressed
    across nodes: every rank holds the same values, the mean within the format's two
    roundings, and every parameter's count of ranks that used it, exactly."""
    numel, nflags = 1001, 7
    results = run_ranks(_compressed_sums, world_size=4, args=(kind, numel, nflags), timeout=120)
    tolerance = {"int8": 2 * 4 / 127, "bf16": 2 * 2**-8}[
        kind
    ]  # two roundings, relative to the largest value
    for r in results:
        got, mean = torch.as_tensor(r["got"]), torch.as_tensor(r["mean"])
        assert torch.equal(got, torch.as_tensor(results[0]["got"]))
        assert torch.equal(got[numel:], torch.as_tensor(r["flags"]))
        error = (got[:numel] - mean).abs().max().item()
        assert 0 < error < tolerance * mean.abs().max().item(), error


def _reduce_scatters(rank, world_size):
    import torch.distributed as dist

    from sapipe.comm.worker import Scratch, reduce_scatter_sum

    inputs = [
        torch.randn(4 * 1001, generator=torch.Generator().manual_seed(r), dtype=torch.float64)
        for r in range(world_size)
    ]
    mine = slice(rank * 1001, (rank + 1) * 1001)
    expected = inputs[0][mine].clone()
    for x in inputs[1:]:
        expected += x[mine]  # rank order
    ours, theirs, scratch = (
        torch.empty(1001, dtype=torch.float64),
        torch.empty(1001, dtype=torch.float64),
        Scratch(),
    )
    reduce_scatter_sum(ours, inputs[rank].clone(), dist.group.WORLD, scratch, "received")
    waited = torch.empty(1001, dtype=torch.float64)
    work = reduce_scatter_sum(
        waited, inputs[rank].clone(), dist.group.WORLD, scratch, "other", async_op=True
    )
    work.wait()
    dist.reduce_scatter_tensor(theirs, inputs[rank].clone())
    return {"ours": ours, "waited": waited, "theirs": theirs, "expected": expected}


def test_the_cpu_reduce_scatter_sums_each_shard_in_rank_order():
    """On the CPU a reduce-scatter is an all-to-all and a local sum (worker.reduce_scatter_sum):
    each rank's shard is the sum of every rank's, added in rank order, bit for bit, and
    torch's reduce-scatter's within rounding."""
    for r in run_ranks(_reduce_scatters, world_size=4, timeout=120):
        assert np.array_equal(r["ours"], r["expected"]) and np.array_equal(
            r["waited"], r["expected"]
        )
        assert np.allclose(r["ours"], r["theirs"], rtol=1e-13, atol=1e-13)


# 2 nodes of 3 ranks: L = 3 is no power of two (int8's scales are divided by N·L = 6 in
# float32), and a 1-value bucket leaves two of its three node-first shards empty.
THREE_PER_NODE = ((0, 1, 2), (3, 4, 5))
# (hierarchical=, compression=)
SIX_RANK_CASES = [(None, "int8"), (None, "bf16"), (False, "int8")]


def _prelu_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.PReLU(), torch.nn.Linear(10, 3)).to(
        torch.float64
    )


def _train_three_per_node(rank, world_size, cases, batches):
    import sapipe

    os.environ["GROUP_RANK"] = str(rank // 3)
    out = []
    for hierarchical, compression in cases:
        model = _prelu_model()
        opt = sapipe.DistributedOptimizer(
            torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9),
            model,
            stale_layers=1,
            compensation="dc",
            hierarchical=hierarchical,
            compression=compression,
            bucket_cap_mb=1e-6,
            timeout=60,
        )
        real = _run_steps(model, opt, rank, batches, task="mlp")
        out.append(
            {
                "real": real,
                "sum": type(opt._pipeline.sync_comm).__name__,
                "buckets": bucket_layouts(opt, model),
            }
        )
        opt.close()
    return out


def test_two_nodes_of_three_with_a_one_value_bucket_train_as_the_reference():
    """Six ranks as 2 nodes of 3, one bucket per layer (the PReLU's holds 1 value): node first
    with int8 and bf16, and flat int8 over all 6, every rank's weights are the float64
    reference's, whose int8 divides the arriving scales by N·L (or W) in float32 as sapipe
    does."""
    batches = make_batches("mlp", STEPS, 6, dtype=torch.float64, sizes=(6, 3))
    results = run_ranks(
        _train_three_per_node, world_size=6, args=(SIX_RANK_CASES, batches), timeout=300
    )
    for index, (hierarchical, compression) in enumerate(SIX_RANK_CASES):
        buckets = results[0][index]["buckets"]
        assert [1] in [[n for _, n in b] for b in buckets], buckets
        reduce = (
            compressed_mean(compression, buckets)
            if hierarchical is False
            else node_first_mean(compression, buckets, THREE_PER_NODE)
        )
        ref = run_reference(
            _prelu_model(),
            lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
            batches,
            loss_fn_for("mlp"),
            stale_layers=1,
            compensation="dc",
            reduce=reduce,
        ).real[-1]
        for rank, got in enumerate(r[index] for r in results):
            assert got["sum"] == _expected_sum(hierarchical, compression)
            assert_close_dicts(
                got["real"], ref, rtol=1e-9, atol=1e-11, what=f"rank {rank}, {compression}"
            )
