"""sapipe-launch --emulate-cluster: the plan (pure), the namespaces and shaping it builds, and
real 2-node jobs on one host: a sapipe job against the float64 reference, a node that fails,
and clean-up on every way out. The real runs need root and iproute2; they skip otherwise."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from jobs import cluster_job
from support.dist_utils import assert_close_dicts
from support.models import loss_fn_for, make_batches, make_model
from support.optimizers import recipe
from support.paths import JOBS, job_env
from support.reference import node_first_mean, run_reference

from sapipe.launch import LaunchError, cluster, netns, plan

PY = sys.executable


def _env():
    return job_env(drop=("DMLC_", "BYTEPS_", "PET_"))


# --- the plan ---------------------------------------------------------------------------------


def test_one_torchrun_per_node_with_the_topology():
    p = plan(
        [
            "--emulate-cluster",
            "3x2",
            "--inter-node",
            "1gbit,50us",
            "--max-restarts=0",
            "train.py",
            "--lr",
            "1",
        ],
        {},
        python="py",
    )
    assert p.argv == [] and p.cluster == cluster.ClusterSpec(3, 2, netns.parse_spec("1gbit,50us"))
    assert [a[:9] for a in p.node_argv] == [
        [
            "py",
            "-m",
            "torch.distributed.run",
            "--nnodes=3",
            f"--node-rank={i}",
            "--nproc-per-node=2",
            "--master-addr=10.77.0.1",
            "--master-port=29500",
            "--max-restarts=0",
        ]
        for i in range(3)
    ]
    assert all(a[9:] == ["train.py", "--lr", "1"] for a in p.node_argv)
    assert p.env == {
        "GLOO_SOCKET_IFNAME": "eth0",
        "NCCL_SOCKET_IFNAME": "eth0",
        "NCCL_IB_DISABLE": "1",
    }
    shaped = plan(
        ["--emulate-cluster", "2x4", "--inter-node", "1gbit", "--intra-node", "20gbit", "t.py"], {}
    )
    assert shaped.env["NCCL_P2P_DISABLE"] == shaped.env["NCCL_SHM_DISABLE"] == "1"
    assert (
        plan(
            ["--emulate-cluster", "2x1", "--inter-node", "1gbit", "t.py"],
            {"GLOO_SOCKET_IFNAME": "x"},
        ).env.get("GLOO_SOCKET_IFNAME")
        is None
    ), "the user's environment wins"


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--emulate-cluster", "2x2", "t.py"], "needs --inter-node"),
        (["--inter-node", "1gbit", "t.py"], "go with --emulate-cluster"),
        (["--emulate-cluster", "2", "--inter-node", "1gbit", "t.py"], "expected NODESxRANKS"),
        (["--emulate-cluster", "0x2", "--inter-node", "1gbit", "t.py"], "expected NODESxRANKS"),
        (["--emulate-cluster", "2x2", "--inter-node", "fast", "t.py"], "cannot parse rate"),
        (
            ["--emulate-cluster", "2x2", "--inter-node", "1gbit", "--nnodes=2", "t.py"],
            "sets --nnodes",
        ),
        (
            ["--emulate-cluster", "2x2", "--inter-node", "1gbit", "--standalone", "t.py"],
            "sets --standalone",
        ),
        (
            ["--emulate-cluster", "2x2", "--inter-node", "1gbit", "--emulate-net", "1gbit", "t.py"],
            "--intra-node",
        ),
    ],
)
def test_contradictions_are_refused_by_name(argv, message):
    with pytest.raises(LaunchError, match=message):
        plan(argv, {})


def test_the_nics_are_shaped_both_ways_and_delayed_once():
    spec = cluster.ClusterSpec(2, 1, netns.NetSpec(1e9, 1e-4), netns.NetSpec(5e9))
    cmds = [" ".join(c) for c in cluster.EmulatedCluster(spec, tag="t").setup_commands()]
    for node, port in (("tn0", "v0"), ("tn1", "v1")):
        sent = [c for c in cmds if c.startswith(f"ip netns exec {node} tc") and "dev eth0" in c]
        received = [
            c for c in cmds if c.startswith("ip netns exec thub tc") and f"dev {port} " in c
        ]
        assert any("netem delay 100us" in c for c in sent) and any(
            "tbf rate 1000000kbit" in c for c in sent
        )
        assert (
            len(received) == 1
            and "tbf rate 1000000kbit" in received[0]
            and "netem" not in received[0]
        )
        assert any(
            c.startswith(f"ip netns exec {node} tc") and "dev lo" in c and "5000000kbit" in c
            for c in cmds
        )
    assert "ip -n tn1 addr add 10.77.0.2/24 dev eth0" in cmds


# --- for real ---------------------------------------------------------------------------------


def _requires_cluster():
    ok, why = cluster.check()
    if not ok:
        pytest.skip(f"cannot emulate a cluster here: {why}")


def _run(argv, timeout):
    """``argv`` to its end; past ``timeout`` it is interrupted (SIGTERM: the launcher removes its
    namespaces), then the test fails."""
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
        pytest.fail(f"the launch took more than {timeout} s:\n{err[-3000:]}")
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _launch(tmp_path, *extra, inter="200mbit"):
    return [
        PY,
        "-m",
        "sapipe.launch",
        "--emulate-cluster",
        "2x2",
        "--inter-node",
        inter,
        "--monitor-interval=0.5",
        str(JOBS / "cluster_job.py"),
        str(tmp_path),
        *extra,
    ]


def _leftover_namespaces():
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.startswith("sapipe")]


@pytest.mark.slow
@pytest.mark.parametrize("compression", [None, "int8"])
def test_a_2x2_job_trains_as_the_float64_reference(tmp_path, compression):
    """4 ranks on 2 emulated nodes (Gloo across a shaped bridge), k = 3 with wp1, buckets summed
    node first (int8: compressed across nodes only): every rank's real and held weights are
    the reference's (rtol 1e-9), and the namespaces are gone."""
    _requires_cluster()
    out = _run(
        _launch(tmp_path, *(["--compression", compression] if compression else [])), timeout=300
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    assert [(r["world"], r["node"]) for r in ranks] == [(4, 0), (4, 0), (4, 1), (4, 1)]
    node_first = "HierarchicalAllReduce" if compression is None else "HierarchicalCompressedSum"
    assert {r["sum"] for r in ranks} == {node_first}, "two nodes of two ranks sum node first"
    reduce = (
        None
        if compression is None
        else node_first_mean(compression, ranks[0]["buckets"], ((0, 1), (2, 3)))
    )
    ref = run_reference(
        make_model("tied", seed=0, dtype=torch.float64),
        recipe("adamw", lr=cluster_job.LR),  # the job's optimizer
        make_batches("tied", cluster_job.STEPS, 4, dtype=torch.float64),
        loss_fn_for("tied"),
        stale_layers=cluster_job.STALE_LAYERS,
        compensation=cluster_job.COMPENSATION,
        reduce=reduce,
    )
    for r in ranks:
        assert_close_dicts(
            r["real"], ref.real[-1], rtol=1e-9, atol=1e-11, what=f"rank {r['rank']} real"
        )
        assert_close_dicts(
            r["held"], ref.held[-1][r["rank"]], rtol=1e-9, atol=1e-11, what=f"rank {r['rank']} held"
        )
    assert not _leftover_namespaces()


@pytest.mark.slow
def test_a_failing_node_ends_the_job_and_the_namespaces(tmp_path):
    _requires_cluster()
    out = _run(_launch(tmp_path, "--fail-node", "1"), timeout=200)
    assert out.returncode != 0, out.stderr[-2000:]
    assert not _leftover_namespaces()


def test_an_interrupted_launch_removes_its_namespaces(tmp_path):
    """SIGTERM to the launcher stops the job and deletes its namespaces. The kernel may take
    a while to create namespaces while it still tears down the previous tests' (their
    sockets linger), so the wait for the cluster is generous; the launcher is stopped
    whatever happens, so that a failure here leaves nothing to the next test."""
    _requires_cluster()
    proc = subprocess.Popen(
        _launch(tmp_path, inter="1mbit"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    try:
        deadline = time.monotonic() + 180
        while not _leftover_namespaces() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert _leftover_namespaces(), f"the cluster never came up (launcher: {proc.poll()})"
        time.sleep(2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 128 + signal.SIGTERM
    finally:
        if proc.poll() is None:
            proc.terminate()
            proc.wait(timeout=60)
    assert not _leftover_namespaces(), proc.stderr.read()[-2000:]


def test_a_host_that_cannot_build_it_says_why(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    ok, why = cluster.check()
    assert not ok and "needs root" in why


def test_the_namespaces_of_a_killed_launcher_are_removed_by_the_next():
    _requires_cluster()
    dead = 4_000_000  # beyond pid_max: no such process
    names = [f"sapipe{dead}hub", f"sapipe{dead}n0"]
    for name in names:
        subprocess.run(["ip", "netns", "add", name], check=True)
    assert set(cluster.remove_stale()) >= set(names)
    assert not _leftover_namespaces()
