"""Cluster-scale prediction from a saved profile: the two-level link model against
hand-computed sums, the intra-node link derived from a profile, predict() against direct
calls of the simulator and solver, and the command line end to end."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import subprocess
import sys
from types import SimpleNamespace

import pytest

from sapipe.errors import ConfigurationError
from sapipe.schedule import choose_k, simulate
from sapipe.schedule.cluster_link import (
    ClusterLink,
    LinkSpec,
    intra_link_from_profile,
    sapipe_hierarchical,
)
from sapipe.schedule.predict import (
    DDP_BUCKET_CAP_BYTES,
    TOLERANCE,
    main,
    predict,
    simulator_arguments,
)
from sapipe.schedule.saved_profile import FORMAT, SavedProfile

INTER = LinkSpec(1e9, 1e-5)  # "8gbit,10us"
INTRA = LinkSpec(1e10, 1e-6)  # "80gbit,1us"


def _profile(**changes) -> SavedProfile:
    """A one-node profile of 4 ranks whose link is INTRA's flat ring, 8 layers of unequal sizes."""
    numel = [300_000, 50_000, 400_000, 100_000, 250_000, 80_000, 500_000, 20_000]
    w = changes.get("world_size", 4)
    data = dict(
        format=FORMAT,
        layers=[f"layer{i}" for i in range(8)],
        numel=numel,
        element_size=4,
        forward=[n * 4e-9 + 2e-4 for n in numel],
        backward=[n * 8e-9 + 4e-4 for n in numel],
        step_time=5e-4,
        update_time=1e-3,
        alpha=2 * (w - 1) * INTRA.latency,
        beta=2 * (w - 1) / w / INTRA.rate,
        slowdown=0.0,
        world_size=w,
        nodes=1,
        ranks_per_node=w,
        hierarchical=False,
        backend="torch",
        compression=None,
        wire_ratio=1.0,
        codec_per_byte=0.0,
        bucket_cap_bytes=1 << 20,
        sync_at_step=False,
        device="cpu",
        stale_layers=2,
        iteration_time=0.02,
    )
    data.update(changes)
    return SavedProfile.from_dict(data)


# ----------------------------------------------------------------------------- the link model


@pytest.mark.parametrize(
    "nodes,g,hierarchical,alpha,beta",
    [
        (2, 2, False, 2 * 3 * 1e-5, 2 * 3 / 4 / 1e9),
        (2, 2, True, 2 * 1 * 1e-6 + 2 * 1 * 1e-5, 2 * 1 / 2 / 1e10 + 2 * 1 / 2 / 1e9),
        (4, 1, False, 2 * 3 * 1e-5, 2 * 3 / 4 / 1e9),
        (4, 1, True, 2 * 3 * 1e-5, 2 * 3 / 4 / 1e9),
        (8, 8, False, 2 * 63 * 1e-5, 2 * 63 / 64 / 1e9),
        (8, 8, True, 2 * 7 * 1e-6 + 2 * 7 * 1e-5, 2 * 7 / 8 / 1e10 + 2 * 7 / 8 / 1e9),
        (1, 8, False, 2 * 7 * 1e-6, 2 * 7 / 8 / 1e10),
        (1, 8, True, 2 * 7 * 1e-6, 2 * 7 / 8 / 1e10),  # one node: flat whatever it says
        (1, 1, True, 0.0, 0.0),
    ],
)
def test_the_sum_of_a_bucket_by_hand(nodes, g, hierarchical, alpha, beta):
    got = ClusterLink(nodes, g, INTER, INTRA, hierarchical).allreduce()
    assert got == pytest.approx((alpha, beta), rel=1e-12, abs=0.0)


@pytest.mark.parametrize("nodes", [2, 3, 8, 16])
def test_flat_and_node_first_agree_with_one_rank_per_node(nodes):
    flat = ClusterLink(nodes, 1, INTER, None, False).allreduce()
    assert ClusterLink(nodes, 1, INTER, None, True).allreduce() == pytest.approx(flat, rel=1e-12)
    assert ClusterLink(nodes, 1, INTER, INTRA, True).allreduce() == pytest.approx(flat, rel=1e-12)


def test_compressed_sums_by_hand():
    # one node: the profiler's rule (2 alpha, beta * wire_ratio + codec)
    a, b = ClusterLink(1, 4, INTER, INTRA).allreduce()
    assert ClusterLink(1, 4, INTER, INTRA).compressed_sum(0.5, 1e-11) == pytest.approx(
        (2 * a, b * 0.5 + 1e-11)
    )
    # 8x8 flat: the all-to-all puts 8 ranks' cross-node shards through the node's NIC
    got = ClusterLink(8, 8, INTER, INTRA, hierarchical=False).compressed_sum(0.5, 1e-11)
    assert got == pytest.approx((2 * 2 * 63 * 1e-5, 2 * 8 * 7 / 8 / 1e9 * 0.5 + 1e-11), rel=1e-12)
    # 8x8 node first: full precision inside the node, one compressed share per rank across
    # nodes (a ring's bytes per NIC), the codec on 1/8 of the bucket
    got = ClusterLink(8, 8, INTER, INTRA, hierarchical=True).compressed_sum(0.5, 1e-11)
    want = (2 * 7 * 1e-6 + 2 * 2 * 7 * 1e-5, 2 * 7 / 8 / 1e10 + 2 * 7 / 8 / 1e9 * 0.5 + 1e-11 / 8)
    assert got == pytest.approx(want, rel=1e-12)
    # one rank per node: a ring's bytes
    a, b = ClusterLink(4, 1, INTER).allreduce()
    assert ClusterLink(4, 1, INTER).compressed_sum(0.25, 0.0) == pytest.approx((2 * a, b * 0.25))


def test_rates_parse_as_the_launcher_takes_them():
    for text, rate, latency in (
        ("100gbit,5us", 100e9 / 8, 5e-6),
        ("130gbps", 130e9, 0.0),
        ("1gbit,2ms", 1.25e8, 2e-3),
    ):
        link = LinkSpec.parse(text)
        assert (link.rate, link.latency) == pytest.approx((rate, latency), rel=1e-12)
    assert math.isinf(LinkSpec.parse("unlimited").rate)
    with pytest.raises(ConfigurationError, match="cannot read the inter-node link 'fast'"):
        LinkSpec.parse("fast", "inter-node link")
    with pytest.raises(ConfigurationError, match="cannot read the link '1gbit,5'"):
        LinkSpec.parse("1gbit,5")


@pytest.mark.parametrize(
    "make,message",
    [
        (lambda: LinkSpec(-1.0), "rate must be > 0"),
        (lambda: LinkSpec(0.0), "rate must be > 0"),
        (lambda: LinkSpec(1e9, -1e-6), "latency must be finite and >= 0"),
        (lambda: ClusterLink(0, 8, INTER), "nodes >= 1"),
        (lambda: ClusterLink(2, 0, INTER), "ranks_per_node >= 1"),
        (lambda: ClusterLink(2, 2.5, INTER), "ranks_per_node >= 1"),
        (lambda: ClusterLink(2, 2, INTER, None, True).allreduce(), "no intra-node link was given"),
        (lambda: ClusterLink(1, 2, INTER).allreduce(), "no intra-node link was given"),
        (lambda: ClusterLink(2, 2, INTER).compressed_sum(0.0, 0.0), "wire_ratio > 0"),
    ],
)
def test_nonsense_is_refused(make, message):
    with pytest.raises(ConfigurationError, match=message):
        make()


def test_a_flat_ring_across_nodes_needs_no_intra_node_link():
    assert ClusterLink(2, 4, INTER).allreduce() == pytest.approx((2 * 7 * 1e-5, 2 * 7 / 8 / 1e9))


def test_a_flat_ring_is_paced_by_the_slower_link():
    """An intra-node link slower than the network (a CPU host's loopback) paces the flat ring
    through it: DDP on 2 nodes is then no faster than on one."""
    slow = LinkSpec(1e8, 5e-5)
    assert ClusterLink(2, 4, INTER, slow).allreduce() == pytest.approx(
        (2 * 7 * 5e-5, 2 * 7 / 8 / 1e8)
    )
    assert ClusterLink(2, 4, INTER, INTRA).allreduce() == ClusterLink(2, 4, INTER).allreduce()
    one, two = (ClusterLink(n, 4, INTER, slow).allreduce()[1] for n in (1, 2))
    assert two > one
    # compressed and flat: the ring through the slow edges, not the NIC's all-to-all, sets the pace
    a, b = ClusterLink(2, 4, INTER, slow).allreduce()
    assert ClusterLink(2, 4, INTER, slow).compressed_sum(0.5, 0.0) == pytest.approx(
        (2 * a, b * 0.5)
    )


# ----------------------------------------------------------------------------- from a profile


@pytest.mark.parametrize("w", [2, 4, 8])
def test_the_intra_node_link_derived_from_a_one_node_profile(w):
    derived = intra_link_from_profile(_profile(world_size=w, ranks_per_node=w))
    assert (derived.rate, derived.latency) == pytest.approx((INTRA.rate, INTRA.latency), rel=1e-12)
    # and the profiled topology predicted again is the link it was measured on
    p = _profile(world_size=w, ranks_per_node=w)
    sapipe_link = predict(p, 1, w, "1gbit").modes["sapipe"]
    assert (sapipe_link.alpha, sapipe_link.beta) == pytest.approx((p.alpha, p.beta), rel=1e-12)


def test_the_intra_node_link_of_a_compressed_profile():
    wire = ClusterLink(1, 4, INTER, INTRA)
    alpha, beta = wire.compressed_sum(0.25, 3e-11)
    p = _profile(compression="int8", wire_ratio=0.25, codec_per_byte=3e-11, alpha=alpha, beta=beta)
    derived = intra_link_from_profile(p)
    assert (derived.rate, derived.latency) == pytest.approx((INTRA.rate, INTRA.latency), rel=1e-9)
    # β raised to what the compressed sums were seen to take: the probes' own wire β decides
    wire = 2 * 3 / 4 / INTRA.rate
    seen = _profile(
        compression="int8",
        wire_ratio=0.25,
        codec_per_byte=3e-11,
        alpha=alpha,
        beta=3 * beta,
        wire_beta=wire,
    )
    derived = intra_link_from_profile(seen)
    assert (derived.rate, derived.latency) == pytest.approx((INTRA.rate, INTRA.latency), rel=1e-9)


@pytest.mark.parametrize(
    "changes,message",
    [
        ({"world_size": 1, "ranks_per_node": 1}, "profile of 1 rank"),
        (
            {"world_size": 4, "nodes": 2, "ranks_per_node": 2, "hierarchical": True},
            "profile of 2 nodes",
        ),
        ({"beta": 0.0}, "no rate to derive"),
    ],
)
def test_where_the_intra_node_link_cannot_be_derived(changes, message):
    p = _profile(**changes)
    with pytest.raises(ConfigurationError, match=message):
        intra_link_from_profile(p)
    with pytest.raises(ConfigurationError, match=message):
        predict(p, 2, 4, "1gbit")  # two-level: needs it
    with pytest.raises(ConfigurationError, match=message):
        predict(p, 1, 4, "1gbit")  # one node: needs it
    predict(p, 4, 1, "1gbit")  # one rank per node: does not
    predict(p, 2, 4, "1gbit", hierarchical=False)  # a flat ring across nodes: does not
    predict(p, 2, 4, "1gbit", intra="80gbit,1us")  # given


def test_predict_refuses_nonsense():
    p = _profile()
    with pytest.raises(ConfigurationError, match="at least one layer"):
        predict(dataclasses.replace(p, layers=(), numel=(), forward=(), backward=()), 2, 2, "1gbit")
    with pytest.raises(ConfigurationError, match="nodes >= 1"):
        predict(p, 0, 2, "1gbit")
    with pytest.raises(ConfigurationError, match="slow-down must be finite"):
        predict(p, 2, 2, "1gbit", slowdown=-0.5)
    with pytest.raises(ConfigurationError, match="needs the inter-node link"):
        predict(p, 2, 2, None)
    with pytest.raises(
        ConfigurationError,
        match="hierarchical=True runs on backend='torch'; the profile has backend='pushpull'",
    ):
        predict(_profile(backend="pushpull"), 2, 2, "1gbit", hierarchical=True)


def test_node_first_where_sapipe_would_sum_node_first():
    from sapipe.comm.hierarchical import resolve
    from sapipe.comm.topology import Topology

    for nodes in (1, 2, 4):
        for g in (1, 2, 8):
            topology = Topology(tuple(tuple(range(i * g, (i + 1) * g)) for i in range(nodes)))
            for backend in ("torch", "pushpull"):
                assert sapipe_hierarchical(None, backend, nodes, g) == resolve(
                    None, backend, topology
                )
                if topology.two_level and backend == "torch":
                    assert sapipe_hierarchical(True, backend, nodes, g) == resolve(
                        True, backend, topology
                    )


def test_the_model_inputs_are_those_auto_builds():
    """predict's simulator arguments and layer profiles are AutoController's for the same
    profile."""
    from sapipe.auto.controller import STALL_TOLERANCE, AutoController
    from sapipe.schedule.profiler import Profile

    p = _profile(slowdown=0.4, sync_at_step=True)
    controller = AutoController.__new__(AutoController)
    controller.profile = Profile(
        forward=list(p.forward),
        backward=list(p.backward),
        step_time=p.step_time,
        alpha=p.alpha,
        beta=p.beta,
        slowdown=p.slowdown,
        update_time=p.update_time,
    )
    controller._settings = SimpleNamespace(bucket_cap_bytes=p.bucket_cap_bytes)
    controller.sync_at_step = p.sync_at_step
    controller._set_model_inputs(
        [SimpleNamespace(name=n, numel=k) for n, k in zip(p.layers, p.numel)], p.element_size
    )
    assert controller.simulator_arguments() == simulator_arguments(p, p.alpha, p.beta, p.slowdown)
    assert controller.layer_profiles == p.layer_profiles(p.alpha, p.beta)
    assert TOLERANCE == STALL_TOLERANCE


@pytest.mark.parametrize("nodes,g,sigma", [(2, 2, None), (4, 1, 0.3), (8, 8, None)])
def test_predict_is_the_simulator_and_solver(nodes, g, sigma):
    p = _profile(slowdown=0.2)
    got = predict(p, nodes, g, INTER, INTRA, slowdown=sigma)
    s = p.slowdown if sigma is None else sigma
    cluster = ClusterLink(nodes, g, INTER, INTRA, hierarchical=nodes > 1 and g > 1)
    alpha, beta = cluster.allreduce()
    layers = p.layer_profiles(alpha, beta)
    kw = dict(
        bucket_cap_bytes=p.bucket_cap_bytes,
        alpha=alpha,
        beta=beta,
        bytes_per_layer=p.layer_bytes,
        step_time=p.step_time,
        slowdown=s,
        update_per_element=p.update_time / sum(p.numel),
        sync_at_step=p.sync_at_step,
    )
    decision = choose_k(layers, tolerance=0.03, shared_link=True, **kw)
    assert (got.modes["sapipe"].k, got.modes["sapipe"].iteration_time) == (
        decision.k,
        decision.iteration_time,
    )
    pipe = simulate(layers, 8, shared_link=True, record_events=False, **kw)
    assert (
        got.modes["pipesgd"].iteration_time == pipe.iteration_time and got.modes["pipesgd"].k == 8
    )
    flat_alpha, flat_beta = ClusterLink(nodes, g, INTER).allreduce() if nodes > 1 else (alpha, beta)
    kw.update(
        alpha=flat_alpha, beta=flat_beta, bucket_cap_bytes=DDP_BUCKET_CAP_BYTES, sync_at_step=True
    )
    ddp = simulate(
        p.layer_profiles(flat_alpha, flat_beta), 0, shared_link=False, record_events=False, **kw
    )
    assert got.modes["ddp"].iteration_time == ddp.iteration_time and got.modes["ddp"].k == 0
    assert got.compute_time == pytest.approx(p.compute_time)
    assert got.speedup("sapipe") == ddp.iteration_time / decision.iteration_time
    assert got.efficiency("ddp") == pytest.approx(p.compute_time / ddp.iteration_time)


@pytest.mark.parametrize("inter", ["100mbit", "1gbit", "10gbit,20us"])
@pytest.mark.parametrize("nodes,g", [(1, 4), (2, 2), (4, 1), (8, 8)])
def test_pipe_sgd_is_never_slower_than_ddp(inter, nodes, g):
    got = predict(_profile(), nodes, g, inter)
    ddp = got.modes["ddp"].iteration_time
    assert got.modes["pipesgd"].iteration_time <= ddp * (1 + 1e-9)
    assert got.modes["sapipe"].iteration_time <= ddp * (1 + TOLERANCE)
    assert min(got.efficiency(mode) for mode in ("ddp", "pipesgd", "sapipe")) > 0
    assert max(got.efficiency(mode) for mode in ("ddp", "pipesgd", "sapipe")) <= 1 + 1e-9


def test_with_a_huge_rate_every_mode_takes_the_compute_time():
    p = _profile()
    for nodes in (1, 2, 8):
        got = predict(p, nodes, 8, "1000000gbit", "1000000gbit")
        for mode in ("ddp", "pipesgd", "sapipe"):
            assert got.modes[mode].iteration_time == pytest.approx(p.compute_time, rel=1e-3)
        assert got.modes["sapipe"].k == 0
    got = predict(p, 8, 8, "unlimited", "unlimited")
    assert got.modes["ddp"].iteration_time == pytest.approx(p.compute_time, rel=1e-12)


def test_a_slower_network_costs_ddp_more_than_sapipe():
    p = _profile()
    fast, slow = predict(p, 4, 2, "10gbit"), predict(p, 4, 2, "1gbit")
    assert slow.modes["ddp"].iteration_time > fast.modes["ddp"].iteration_time
    assert slow.speedup("sapipe") > fast.speedup("sapipe") >= 1 - TOLERANCE


# ----------------------------------------------------------------------------- the command line


@pytest.fixture
def profile_file(tmp_path):
    path = tmp_path / "profile.json"
    _profile().save(str(path))
    return str(path)


def test_the_command_prints_a_table(profile_file, capsys):
    assert (
        main(
            [
                profile_file,
                "--nodes",
                "1,2,4",
                "--gpus-per-node",
                "4",
                "--inter-node",
                "1gbit,10us",
                "--batch",
                "8",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [row.split("|")[1].strip() for row in rows] == ["1", "2", "4"]
    assert [row.split("|")[2].strip() for row in rows] == ["4", "8", "16"]
    assert "two-level" in rows[1] and "flat" in rows[0] and "samples/s" in out
    expected = predict(_profile(), 2, 4, "1gbit,10us")
    assert f"| {expected.modes['ddp'].iteration_time * 1e3:.4g} |" in rows[1]


def test_the_command_notes_an_intra_node_link_slower_than_the_network(profile_file, capsys):
    for inter, noted in (
        ("1gbit", False),
        ("400gbit", True),
    ):  # the profile's intra link: 80 Gbit/s
        assert (
            main([profile_file, "--nodes", "1,2", "--gpus-per-node", "4", "--inter-node", inter])
            == 0
        )
        assert ("slower than between nodes" in capsys.readouterr().out) is noted, inter
    assert (
        main([profile_file, "--nodes", "2", "--inter-node", "400gbit", "--intra-node", "1800gbit"])
        == 0
    )
    assert "slower than between nodes" not in capsys.readouterr().out


def test_the_command_writes_json_and_a_plot(profile_file, capsys, tmp_path):
    png = tmp_path / "out.png"
    plot = ["--plot", str(png)] if importlib.util.find_spec("matplotlib") is not None else []
    assert (
        main(
            [
                profile_file,
                "--nodes",
                "1,2",
                "--gpus-per-node",
                "2",
                "--inter-node",
                "1gbit",
                "--json",
                "--hierarchical",
                "off",
                "--slowdown",
                "0.1",
            ]
            + plot
        )
        == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert [p["nodes"] for p in data["predictions"]] == [1, 2]
    second = data["predictions"][1]
    expected = predict(_profile(), 2, 2, "1gbit", hierarchical=False, slowdown=0.1)
    assert second["modes"]["sapipe"]["iteration_time"] == expected.modes["sapipe"].iteration_time
    assert second["modes"]["sapipe"]["two_level"] is False and second["world_size"] == 4
    assert second["modes"]["pipesgd"]["speedup"] == pytest.approx(expected.speedup("pipesgd"))
    if plot:  # matplotlib is a benchmark dependency (make convergence installs it), not a test one
        assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_a_plot_without_matplotlib_is_refused_by_name(profile_file, capsys, tmp_path, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "matplotlib" else real(name, *a),
    )
    assert main([profile_file, "--inter-node", "1gbit", "--plot", str(tmp_path / "x.png")]) == 2
    assert "error: sapipe: --plot needs matplotlib" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv,message",
    [
        (
            ["missing.json", "--inter-node", "1gbit"],
            "error: sapipe: cannot read the profile missing.json",
        ),
        (
            ["{profile}", "--inter-node", "fast"],
            "error: sapipe: cannot read the inter-node link 'fast'",
        ),
        (
            ["{profile}", "--inter-node", "1gbit", "--nodes", "1,x"],
            "error: sapipe: --nodes takes node counts",
        ),
        (
            ["{profile}", "--inter-node", "1gbit", "--nodes", "0"],
            "error: sapipe: --nodes takes node counts >= 1",
        ),
        (
            ["{profile}", "--inter-node", "1gbit", "--gpus-per-node", "0"],
            "error: sapipe: --gpus-per-node must be >= 1",
        ),
        (
            ["{notprofile}", "--inter-node", "1gbit"],
            "error: sapipe: {notprofile} is not a sapipe profile",
        ),
        (
            ["{twonodes}", "--inter-node", "1gbit", "--gpus-per-node", "4"],
            "cannot be derived from a profile of 2 nodes",
        ),
    ],
)
def test_the_command_reports_errors(argv, message, profile_file, tmp_path, capsys):
    names = {
        "profile": profile_file,
        "notprofile": str(tmp_path / "other.json"),
        "twonodes": str(tmp_path / "2n.json"),
    }
    (tmp_path / "other.json").write_text(json.dumps({"format": "other/1"}))
    _profile(nodes=2, ranks_per_node=2, hierarchical=True).save(names["twonodes"])
    assert main([a.format(**names) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message.format(**names) in err and "Traceback" not in err


def test_the_command_refuses_an_unknown_hierarchical_setting(profile_file, capsys):
    with pytest.raises(SystemExit) as exc:
        main([profile_file, "--inter-node", "1gbit", "--hierarchical", "maybe"])
    assert exc.value.code == 2
    assert "invalid choice: 'maybe'" in capsys.readouterr().err


def test_the_module_runs_as_a_program(profile_file):
    """The entry point's exit status (one run: importing sapipe imports torch, seconds)."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "sapipe.schedule.predict",
            profile_file + ".nope",
            "--inter-node",
            "1gbit",
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 2 and done.stderr.startswith("error: sapipe: cannot read the profile")
