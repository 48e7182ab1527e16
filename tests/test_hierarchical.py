"""Hierarchical sums (sapipe/comm/hierarchical.py): the topology, when they are chosen, and
4 Gloo ranks told they sit on 2 nodes (torchrun's GROUP_RANK), which must train as the float64
reference does, flat or hierarchical. tests/test_emulated_cluster.py runs them across real
(emulated) nodes."""
from __future__ import annotations

import os

import pytest
import torch

from dist_utils import assert_close_dicts, run_ranks
from models import loss_fn_for, make_batches, make_model
from reference import run_reference
from sapipe.comm.hierarchical import resolve
from sapipe.comm.topology import Topology
from sapipe.errors import ConfigurationError

TWO_BY_TWO = Topology.from_names(["a", "a", "b", "b"])


def test_the_topology_of_node_names():
    assert TWO_BY_TWO.nodes == ((0, 1), (2, 3)) and TWO_BY_TWO.two_level and TWO_BY_TWO.local_size == 2
    assert TWO_BY_TWO.peers_across(3) == (1, 3) and TWO_BY_TWO.local_index(2) == 0
    interleaved = Topology.from_names(["a", "b", "a", "b"])
    assert interleaved.nodes == ((0, 2), (1, 3)) and interleaved.peers_across(1) == (0, 1)
    assert not Topology.from_names(["a", "a", "b"]).two_level  # 2 + 1 ranks: not uniform
    assert not Topology.from_names(["a", "b"]).two_level  # one rank per node: nothing to do inside
    assert not Topology.from_names(["a", "a"]).two_level  # one node


def test_when_sums_go_node_first():
    one_node = Topology.from_names(["a", "a"])
    assert resolve(None, "torch", None, TWO_BY_TWO) and not resolve(None, "torch", "int8", TWO_BY_TWO)
    assert not resolve(None, "pushpull", None, TWO_BY_TWO) and not resolve(False, "torch", None, TWO_BY_TWO)
    assert not resolve(None, "torch", None, one_node)
    with pytest.raises(ConfigurationError, match="needs several nodes.*1 node × 2"):
        resolve(True, "torch", None, one_node)
    with pytest.raises(ConfigurationError, match="backend='torch' without compression.*'int8'"):
        resolve(True, "torch", "int8", TWO_BY_TWO)


CASES = [(0, "none", None), (3, "wp1", None), (3, "dc", False)]  # (k, compensation, hierarchical=)
STEPS = 5


def _train(rank, world_size, cases):
    import sapipe

    os.environ["GROUP_RANK"] = str(rank // 2)  # 2 "nodes" of 2 ranks, as torchrun would say
    out = []
    for k, mode, hierarchical in cases:
        model = make_model("tied", seed=rank, dtype=torch.float64)
        opt = sapipe.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, stale_layers=k,
                                          compensation=mode, hierarchical=hierarchical, bucket_cap_mb=0.0007,
                                          timeout=60)
        for step in make_batches("tied", STEPS, world_size, dtype=torch.float64):
            x, y = step[rank]
            opt.zero_grad()
            loss_fn_for("tied")(model(x), y).backward()
            opt.step()
        opt.synchronize()
        with opt.real_weights():
            real = {n: p.detach().clone() for n, p in model.named_parameters()}
        out.append({"real": real, "sum": type(opt._pipeline.sync_comm).__name__, "buckets": len(opt.buckets)})
        opt.close()
    return out


@pytest.fixture(scope="module")
def two_nodes():
    return run_ranks(_train, world_size=4, args=(CASES,), timeout=300)


@pytest.mark.parametrize("index", range(len(CASES)), ids=[f"k{k}-{m}-h{h}" for k, m, h in CASES])
def test_two_nodes_of_two_train_as_the_reference(two_nodes, index):
    """Node first (the default on two nodes) or flat, every rank's weights are the float64
    reference's; uneven buckets go through the padded shards."""
    k, mode, hierarchical = CASES[index]
    ref = run_reference(make_model("tied", seed=0, dtype=torch.float64),
                        lambda params: torch.optim.AdamW(params, lr=0.01),
                        make_batches("tied", STEPS, 4, dtype=torch.float64), loss_fn_for("tied"),
                        stale_layers=k, compensation=mode)
    for rank, results in enumerate(two_nodes):
        got = results[index]
        assert got["sum"] == ("AllReduce" if hierarchical is False else "HierarchicalAllReduce")
        assert got["buckets"] >= 2
        assert_close_dicts(got["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {rank}")


def _required_on_one_node(rank, world_size):
    import sapipe

    model = make_model("tied")
    try:
        sapipe.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model, hierarchical=True)
    except ConfigurationError as exc:
        return str(exc)
    return None


def test_hierarchical_true_on_one_node_is_refused_on_every_rank():
    for message in run_ranks(_required_on_one_node, world_size=2):
        assert message is not None and "hierarchical=True needs several nodes" in message, message


def _auto_on_two_nodes(rank, world_size):
    import sapipe

    os.environ["GROUP_RANK"] = str(rank // 2)
    model = make_model("tied", seed=rank)
    opt = sapipe.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=0.01), model, stale_layers="auto",
                                      profile_steps=3, tune_steps=0)
    sync, probed = opt._pipeline.sync_comm, []
    own_sum = sync.sum_now
    sync.sum_now = lambda tensor: (probed.append(tensor.numel()), own_sum(tensor))
    for step in make_batches("tied", 12, world_size):
        x, y = step[rank]
        opt.zero_grad()
        loss_fn_for("tied")(model(x), y).backward()
        opt.step()
    result = (opt.auto.decided, opt.stale_layers, opt.auto.profile.raw["probe_times"], len(probed))
    opt.close()
    return result


def test_auto_probes_the_two_level_sum_and_decides_alike():
    """The scheduler times its link probes through the hierarchical sum itself
    (``CommBackend.sum_now``), and every rank decides the same k from them."""
    results = run_ranks(_auto_on_two_nodes, world_size=4, timeout=300)
    decided, k, probes, probed = results[0]
    assert decided and all(r[:2] == (decided, k) for r in results)
    assert len(probes) >= 2 and all(t > 0 for t in probes)
    assert probed > len(probes), "every probe (and its warm-up) went through the back-end's own sum"


def _sums(rank, world_size, numel):
    from datetime import timedelta

    import torch.distributed as dist

    from sapipe.comm.hierarchical import HierarchicalAllReduce
    from sapipe.trace import Tracer

    topology = Topology.from_names([f"node {r // 2}" for r in range(world_size)])
    backend = HierarchicalAllReduce.create(dist.group.WORLD, topology, "sync", timedelta(seconds=60), Tracer(False))
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=gen, dtype=torch.float64)
    flat = x.clone()
    dist.all_reduce(flat)
    backend.wait(backend.start(x, "a bucket"))
    backend.close()
    return {"hierarchical": x, "flat": flat}


@pytest.mark.parametrize("numel", [3 * (1 << 17) + 5, 1001])  # 3 MiB of float64 in 3 pieces, uneven; one small piece
def test_a_pipelined_bucket_sums_as_a_flat_all_reduce(numel):
    """Cut into pieces whose steps overlap (each padded to the node's shards), a bucket comes
    out as the flat all-reduce's sum on every rank, identical across ranks."""
    results = run_ranks(_sums, world_size=4, args=(numel,), timeout=300)
    for r in results:
        assert torch.allclose(torch.as_tensor(r["hierarchical"]), torch.as_tensor(r["flat"]), rtol=1e-13, atol=1e-13)
        assert (r["hierarchical"] == results[0]["hierarchical"]).all()
