"""sapipe-launch: argument / environment mapping (pure), the CLI's dry run, and a real
2-rank Gloo job over an emulated (rate-limited) loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from sapipe.launch import LaunchError, byteps_flags, netns, plan

PY = sys.executable
TORCHRUN = [PY, "-m", "torch.distributed.run"]
BPS = {
    "DMLC_NUM_WORKER": "4",
    "DMLC_WORKER_ID": "2",
    "DMLC_PS_ROOT_URI": "10.0.0.1",
    "DMLC_PS_ROOT_PORT": "1234",
}


def _cli_env(**extra):
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for k in list(env):
        if k.startswith(("DMLC_", "BYTEPS_", "PET_")):
            del env[k]
    env.update(extra)
    return env


# --- pass-through -------------------------------------------------------------------------


def test_everything_passes_through_to_torchrun():
    p = plan(
        ["--nproc_per_node", "2", "--max-restarts=1", "train.py", "--lr", "0.1", "--dry-run"], {}
    )
    assert p.argv == TORCHRUN + [
        "--nproc_per_node",
        "2",
        "--max-restarts=1",
        "train.py",
        "--lr",
        "0.1",
        "--dry-run",
    ]
    assert not p.dry_run, "an option after the script belongs to the script"
    assert p.env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} and p.exit_now is None


def test_sapipe_options_are_removed():
    p = plan(
        ["--dry-run", "--standalone", "--quiet", "--no-byteps-env", "-m", "pkg.train", "x"], {}
    )
    assert p.argv == TORCHRUN + ["--standalone", "-m", "pkg.train", "x"]
    assert p.dry_run and p.quiet


def test_bad_torchrun_option_is_refused():
    with pytest.raises(SystemExit):
        plan(["--no-such-option", "train.py"], {})


# --- BytePS-style environment ---------------------------------------------------------------


def test_byteps_env_maps_to_torchrun_flags():
    p = plan(
        ["train.py", "--epochs", "3"],
        dict(BPS, BYTEPS_LOCAL_SIZE="8", NVIDIA_VISIBLE_DEVICES="0,1"),
    )
    assert p.argv == TORCHRUN + [
        "--nnodes=4",
        "--node-rank=2",
        "--master-addr=10.0.0.1",
        "--master-port=1234",
        "--nproc-per-node=8",
        "train.py",
        "--epochs",
        "3",
    ]


@pytest.mark.parametrize(
    "visible,expected",
    [("0,1,2", "3"), ("GPU-a1,GPU-b2", "2"), ("all", "gpu"), ("", "1"), ("none", "1")],
)
def test_nproc_from_visible_devices(visible, expected):
    env = dict(BPS, NVIDIA_VISIBLE_DEVICES=visible) if visible else dict(BPS)
    flags, _ = byteps_flags(env, set())
    assert flags[-1] == f"--nproc-per-node={expected}"


@pytest.mark.parametrize("given", [["--master_port", "99"], ["--master-port=99"]])
def test_explicit_flags_win_over_byteps_env(given):
    p = plan(given + ["--nnodes=2", "train.py"], BPS)
    assert p.argv == TORCHRUN + given + [
        "--nnodes=2",
        "--node-rank=2",
        "--master-addr=10.0.0.1",
        "--nproc-per-node=1",
        "train.py",
    ]
    assert any("DMLC_PS_ROOT_PORT ignored" in n for n in p.notes)


def test_torchrun_pet_variables_win_over_byteps_env():
    p = plan(["train.py"], dict(BPS, PET_NNODES="2", PET_NPROC_PER_NODE="3"))
    assert not any(a.startswith(("--nnodes", "--nproc-per-node")) for a in p.argv)


def test_no_byteps_env_without_dmlc_or_when_disabled():
    assert plan(["t.py"], {"BYTEPS_LOCAL_SIZE": "8"}).argv == TORCHRUN + ["t.py"]
    assert plan(["--no-byteps-env", "t.py"], BPS).argv == TORCHRUN + ["t.py"]


def test_bad_byteps_env_is_refused():
    with pytest.raises(LaunchError, match="DMLC_NUM_WORKER"):
        plan(["t.py"], dict(BPS, DMLC_NUM_WORKER="two"))


@pytest.mark.parametrize("role", ["server", "scheduler"])
def test_byteps_server_and_scheduler_roles_exit_cleanly(role):
    p = plan(["t.py"], dict(BPS, DMLC_ROLE=role))
    assert p.exit_now == 0 and p.argv == []
    assert plan(["t.py"], dict(BPS, DMLC_ROLE="worker")).exit_now is None


# --- --emulate-net (command construction) ----------------------------------------------------


def _tc_script(argv):
    assert argv[0] == "unshare" and argv[1] == ("-n" if os.geteuid() == 0 else "-rn")
    assert argv[2:4] == ["sh", "-c"] and argv[5] == "sapipe-netns"
    return argv[4], argv[6:]


def test_emulate_net_wraps_torchrun_in_a_shaped_namespace():
    p = plan(["--emulate-net", "200mbit", "--nproc-per-node=2", "t.py", "a"], {})
    script, inner = _tc_script(p.argv)
    assert inner == TORCHRUN + ["--nproc-per-node=2", "--standalone", "t.py", "a"]
    assert "ip link set lo up" in script
    assert "tc qdisc add dev lo root tbf rate 200000kbit" in script
    burst = int(script.split(" burst ")[1].split()[0])
    limit = int(script.split(" limit ")[1].split()[0].rstrip(";"))
    assert burst >= 256 * 1024 and limit >= 32 * 1024 * 1024
    assert " netem " not in script
    assert p.env["GLOO_SOCKET_IFNAME"] == "lo" and p.env["NCCL_P2P_DISABLE"] == "1"


def test_emulate_net_latency_uses_netem_with_tbf_child():
    p = plan(["--emulate-net=1gbit,2ms", "--standalone", "t.py"], {"NCCL_P2P_DISABLE": "0"})
    script, inner = _tc_script(p.argv)
    assert inner.count("--standalone") == 1
    assert "root handle 1: netem delay 2000us" in script
    assert "parent 1:1 handle 10: tbf rate 1000000kbit" in script
    assert "NCCL_P2P_DISABLE" not in p.env, "a variable the user set is kept"
    p = plan(["--emulate-net", "unlimited,500us", "t.py"], {})
    script, _ = _tc_script(p.argv)
    assert "netem delay 500us" in script and " tbf " not in script


@pytest.mark.parametrize(
    "argv,env",
    [
        (["--emulate-net", "1gbit", "--nnodes=2", "t.py"], {}),
        (["--emulate-net", "1gbit", "--nnodes", "1:4", "t.py"], {}),
        (["--emulate-net", "1gbit", "t.py"], {"DMLC_NUM_WORKER": "2"}),
    ],
)
def test_emulate_net_refuses_multi_node(argv, env):
    with pytest.raises(LaunchError, match="multi-node"):
        plan(argv, env)


def test_emulate_net_single_worker_byteps_spec_maps_only_local_size():
    p = plan(
        ["--emulate-net", "1gbit", "t.py"],
        dict(BPS, DMLC_NUM_WORKER="1", DMLC_WORKER_ID="0", BYTEPS_LOCAL_SIZE="4"),
    )
    _, inner = _tc_script(p.argv)
    assert inner == TORCHRUN + ["--nproc-per-node=4", "--standalone", "t.py"]


@pytest.mark.parametrize("spec", ["1gbt", "fast", "1gbit,2", "1gbit,2ms,3", "1gbit,x ms"])
def test_emulate_net_bad_spec(spec):
    with pytest.raises(LaunchError, match="--emulate-net"):
        plan(["--emulate-net", spec, "t.py"], {})


def test_rate_and_latency_units():
    assert netns.parse_rate("1gbit") == 1e9
    assert netns.parse_rate("200mbit") == 2e8
    assert netns.parse_rate("100mbps") == 8e8
    assert netns.parse_rate("unlimited") is None
    assert netns.parse_latency("2ms") == pytest.approx(2e-3)
    assert netns.parse_latency("500us") == pytest.approx(5e-4)
    assert netns.parse_latency("0.1s") == pytest.approx(0.1)


# --- the CLI ------------------------------------------------------------------------------


def test_cli_help():
    out = subprocess.run(
        [PY, "-m", "sapipe.launch", "--help"],
        capture_output=True,
        text=True,
        env=_cli_env(),
        timeout=120,
    )
    assert out.returncode == 0
    for word in ("--emulate-net", "DMLC_NUM_WORKER", "multi-node", "examples:", "--nproc-per-node"):
        assert word in out.stdout


def test_cli_dry_run_and_errors(monkeypatch, capsys):
    from sapipe.launch import main

    for k in list(os.environ):
        if k.startswith(("DMLC_", "BYTEPS_", "PET_")):
            monkeypatch.delenv(k)
    for k, v in dict(
        DMLC_NUM_WORKER="2", DMLC_WORKER_ID="1", DMLC_PS_ROOT_URI="h0", DMLC_PS_ROOT_PORT="9000"
    ).items():
        monkeypatch.setenv(k, v)
    assert main(["--dry-run", "/nonexistent/train.py", "--x"]) == 0  # runs nothing
    err = capsys.readouterr().err
    assert (
        "would run: " + " ".join(TORCHRUN) + " --nnodes=2 --node-rank=1 --master-addr=h0 "
        "--master-port=9000 --nproc-per-node=1 /nonexistent/train.py --x"
    ) in err
    assert "--nnodes=2 from DMLC_NUM_WORKER" in err
    assert main(["--emulate-net", "1gbit", "t.py"]) == 2  # DMLC_NUM_WORKER=2: multi-node
    assert "multi-node" in capsys.readouterr().err
    monkeypatch.setenv("DMLC_ROLE", "scheduler")
    assert main(["t.py"]) == 0
    assert "nothing to run" in capsys.readouterr().err


def test_console_script_if_installed():
    exe = os.path.join(os.path.dirname(PY), "sapipe-launch")
    if not os.path.exists(exe):
        pytest.skip("sapipe-launch console script not installed yet (re-run `make venv`)")
    out = subprocess.run(
        [exe, "--dry-run", "t.py"], capture_output=True, text=True, env=_cli_env(), timeout=120
    )
    assert out.returncode == 0 and "torch.distributed.run" in out.stderr


# --- --emulate-net, for real --------------------------------------------------------------

JOB = textwrap.dedent("""
    import json, subprocess, sys, time
    import torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    dist.all_reduce(torch.ones(16))                      # warm up the connections
    x = torch.ones(1 << 20)                              # 4 MiB
    dist.barrier()
    t0 = time.perf_counter()
    dist.all_reduce(x)
    seconds = time.perf_counter() - t0
    assert float(x[0]) == dist.get_world_size()
    if rank == 0:
        qdisc = subprocess.run(["tc", "qdisc", "show", "dev", "lo"], capture_output=True,
                               text=True).stdout
        with open(sys.argv[1], "w") as f:
            json.dump({"seconds": seconds, "qdisc": qdisc, "world": dist.get_world_size()}, f)
    dist.destroy_process_group()
""")


def test_emulate_net_runs_a_job_on_a_shaped_loopback(tmp_path):
    ok, why = netns.check(netns.NetSpec(50e6))
    if not ok:
        pytest.skip(f"cannot emulate a network here: {why}")
    script, result = tmp_path / "job.py", tmp_path / "result.json"
    script.write_text(JOB)
    out = subprocess.run(
        [
            PY,
            "-m",
            "sapipe.launch",
            "--emulate-net",
            "50mbit",
            "--nproc-per-node=2",
            "--monitor-interval=0.5",
            str(script),
            str(result),
        ],
        capture_output=True,
        text=True,
        env=_cli_env(),
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    got = json.loads(result.read_text())
    assert got["world"] == 2
    assert "tbf" in got["qdisc"] and "50Mbit" in got["qdisc"], got["qdisc"]
    # a 2-rank all-reduce of 4 MiB puts ~8 MiB (64 Mbit) on the one 50 Mbit/s loopback: ~1.3 s
    assert got["seconds"] >= 0.5, got


def test_emulate_net_latency_for_real(tmp_path):
    spec = netns.NetSpec(None, 0.005)
    ok, why = netns.check(spec)
    if not ok:
        pytest.skip(f"cannot add a netem delay here: {why}")
    out = subprocess.run(
        [
            PY,
            "-m",
            "sapipe.launch",
            "--emulate-net",
            "unlimited,5ms",
            "--no-python",
            "--monitor-interval=0.5",
            "tc",
            "qdisc",
            "show",
            "dev",
            "lo",
        ],
        capture_output=True,
        text=True,
        env=_cli_env(),
        timeout=240,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "netem" in out.stdout and "delay 5ms" in out.stdout, out.stdout


def test_restarts_get_a_fresh_rendezvous_store_per_attempt():
    p = plan(["--max-restarts=2", "t.py"], {})
    assert p.env == {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    assert plan(["--max_restarts", "1", "t.py"], {}).env == {
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"
    }
    assert plan(["--max-restarts=1", "t.py"], {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "0"}).env == {}
    assert plan(["--max-restarts=0", "t.py"], {}).env == {}
    assert plan(["t.py"], {}).env == {}
