"""A lossy link changes only time: one short 2-rank sapipe job at 0%, 1% and 5% packet loss.

    python benchmarks/lossy_link.py [--drops 0,0.01,0.05] [--steps 30] [--json]   # as root
    python benchmarks/lossy_link.py --check   # exit 0 if this host can run it, else say why

**Needs root, network namespaces and nftables or iptables** (``apt-get install nftables
iptables``). Where any is missing it says which and exits 2 (``--check``: 1), running nothing.

TCP retransmits what a link drops, so a lossy link must change how long a job takes and
nothing else: Gloo sums in a fixed order whatever the timing, and sapipe's pipeline does not
depend on when an all-reduce arrives. This runs the same training (an MLP of 4 layers of
512, ``stale_layers=2``, SGD with momentum, 2 Gloo ranks) once per drop rate and checks that
every rank's final weights are bit-identical to the clean link's, and reports step times.

How the loss is made: this project's kernel has no ``sch_netem`` (``tc ... netem loss``), so
the firewall drops packets instead. The whole benchmark re-runs itself in a fresh network
namespace (``unshare -n``): its loopback is brought up and each run adds an nftables rule
``oifname "lo" numgen random mod 10000 < P*10000 counter drop`` on the output hook (or,
without nft, iptables' ``-o lo -m statistic --mode random --probability P -j DROP``), so
every packet a rank sends, both ways, is dropped with probability P; the rule's counter says
how many were. Nothing outside the namespace is touched, and it disappears with the process.

The ranks of each run are forked from this process, which imports torch once (a fresh
interpreter per rank costs seconds of imports), and which hosts the job's TCPStore as
torchrun's agent would. Each rank saves its final weights and step times; the rank's
collectives have a 120 s limit, far beyond what a retransmission costs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

import harness

UNAVAILABLE = 2
TABLE = "sapipe_lossy"
LIMIT_SECONDS = 120


# ------------------------------------------------------------------ the firewall


def dropper() -> str:
    """The tool that drops packets: nft where installed, else iptables ('' if neither)."""
    return "nft" if shutil.which("nft") else "iptables" if shutil.which("iptables") else ""


def rule_commands(tool: str, drop: float) -> list:
    """The commands that make the namespace's loopback drop ``drop`` of the packets sent."""
    if tool == "nft":
        chain = "{ type filter hook output priority 0 ; policy accept ; }"
        return [
            ["nft", "add", "table", "inet", TABLE],
            ["nft", "add", "chain", "inet", TABLE, "out", chain],
            [
                "nft",
                "add",
                "rule",
                "inet",
                TABLE,
                "out",
                "oifname",
                "lo",
                "numgen",
                "random",
                "mod",
                "10000",
                "lt",
                str(round(drop * 10000)),
                "counter",
                "drop",
            ],
        ]
    commands = [
        [
            "iptables",
            "-A",
            "OUTPUT",
            "-o",
            "lo",
            "-m",
            "statistic",
            "--mode",
            "random",
            "--probability",
            f"{drop:.6f}",
            "-j",
            "DROP",
        ]
    ]
    if shutil.which("ip6tables"):
        commands.append(["ip6tables"] + commands[0][1:])
    return commands


def clear_commands(tool: str) -> list:
    if tool == "nft":
        return [["nft", "delete", "table", "inet", TABLE]]
    return [["iptables", "-F", "OUTPUT"]] + (
        [["ip6tables", "-F", "OUTPUT"]] if shutil.which("ip6tables") else []
    )


def dropped_packets(tool: str) -> int:
    """Packets the rule dropped so far."""
    if tool == "nft":
        text = subprocess.run(
            ["nft", "list", "table", "inet", TABLE], capture_output=True, text=True
        ).stdout
        return sum(int(n) for n in re.findall(r"counter packets (\d+)", text))
    total = 0
    for binary in ("iptables", "ip6tables"):
        if shutil.which(binary):
            text = subprocess.run(
                [binary, "-L", "OUTPUT", "-v", "-x", "-n"], capture_output=True, text=True
            ).stdout
            total += sum(
                int(line.split()[0]) for line in text.splitlines() if " DROP " in f" {line} "
            )
    return total


def why_unavailable() -> str:
    """Why this host cannot run the benchmark ('' if it can), checked by trying it."""
    if os.geteuid() != 0:
        return (
            "lossy_link needs root (a network namespace and firewall rules in it); run it as root"
        )
    if not shutil.which("unshare") or not shutil.which("ip"):
        return "lossy_link needs unshare and ip (apt-get install util-linux iproute2)"
    tool = dropper()
    if not tool:
        return (
            "lossy_link needs nftables or iptables to drop packets "
            "(apt-get install nftables iptables)"
        )
    script = " && ".join(
        shlex.join(c) for c in [["ip", "link", "set", "lo", "up"]] + rule_commands(tool, 0.01)
    )
    try:
        out = subprocess.run(
            ["unshare", "-n", "sh", "-c", script], capture_output=True, text=True, timeout=60
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"lossy_link cannot create a network namespace: {exc}"
    if out.returncode != 0:
        return (
            f"lossy_link cannot drop packets in a network namespace with {tool}: "
            f"{out.stderr.strip()}"
        )
    return ""


def run(commands: list) -> None:
    for command in commands:
        subprocess.run(command, check=True, capture_output=True)


# ------------------------------------------------------------------ one job (inside the namespace)


def rank_main(rank: int, port: int, steps: int, outdir: str) -> None:
    """One rank: train, save the final weights and step times, leave (os._exit: the job's end
    is not what this measures)."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    import sapipe

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=LIMIT_SECONDS))
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=LIMIT_SECONDS)
    )
    torch.manual_seed(0)
    layers = [m for _ in range(4) for m in (torch.nn.Linear(512, 512), torch.nn.Tanh())]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(512, 10))
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
        model,
        stale_layers=2,
        bucket_cap_mb=1,
        timeout=LIMIT_SECONDS,
    )
    data = torch.Generator().manual_seed(rank)
    times = []
    for _ in range(steps):
        x, y = torch.randn(64, 512, generator=data), torch.randn(64, 10, generator=data)
        start = time.perf_counter()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        times.append(time.perf_counter() - start)
    opt.synchronize()
    torch.save(
        {"weights": {n: p.detach().clone() for n, p in model.named_parameters()}, "times": times},
        os.path.join(outdir, f"rank{rank}.pt"),
    )
    opt.close()
    dist.destroy_process_group()


def run_job(steps: int, outdir: str) -> float:
    """Fork the two ranks, host their store, wait; the job's wall time."""
    start = time.monotonic()
    codes = harness.fork_ranks(rank_main, steps, outdir)
    if any(codes):
        raise SystemExit(f"lossy_link: a rank failed (exit codes {codes})")
    return time.monotonic() - start


def measure(drops: list, steps: int) -> list:
    """One job per drop rate, in this (namespaced) process; the result of each."""
    import torch

    import sapipe  # noqa: F401 - imported once, before the forks

    # torch's lazy optimizer modules, once
    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    gc.freeze()
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    run([["ip", "link", "set", "lo", "up"]])
    tool, results, clean = dropper(), [], None
    for drop in drops:
        run(rule_commands(tool, drop))
        outdir = tempfile.mkdtemp(prefix="sapipe-lossy-")
        wall = run_job(steps, outdir)
        dropped = dropped_packets(tool)
        run(clear_commands(tool))
        ranks = [torch.load(os.path.join(outdir, f"rank{r}.pt")) for r in range(2)]
        shutil.rmtree(outdir)
        clean = clean or ranks
        identical = all(
            torch.equal(mine["weights"][n], theirs["weights"][n])
            for mine, theirs in zip(ranks, clean)
            for n in theirs["weights"]
        )
        times = ranks[0]["times"][2:]  # past the first steps' set-up
        results.append(
            {
                "drop": drop,
                "dropped_packets": dropped,
                "identical_to_clean": identical,
                "wall_s": wall,
                "step_ms_median": 1e3 * statistics.median(times),
                "step_ms_max": 1e3 * max(times),
            }
        )
    return results


def report(results: list, as_json: bool) -> None:
    """The table, or with ``as_json`` the results as one JSON line."""
    if as_json:
        print(json.dumps(results))
        return
    print(
        f"{'drop':>6} {'dropped':>8} {'median step':>12} {'max step':>10} {'job':>7}  "
        "weights vs the clean link"
    )
    for r in results:
        same = "bit-identical" if r["identical_to_clean"] else "DIFFERENT"
        print(
            f"{r['drop']:>6.1%} {r['dropped_packets']:>8} {r['step_ms_median']:>9.1f} ms "
            f"{r['step_ms_max']:>7.0f} ms {r['wall_s']:>5.1f} s  {same}"
        )


def main() -> None:
    parser = harness.Parser(__doc__, quick=dict(drops="0,0.05", steps=6), json=True)
    parser.add_argument(
        "--drops", default="0,0.01,0.05", help="drop probabilities, the clean link first"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument(
        "--check", action="store_true", help="only say whether this host can run it"
    )
    # already in the namespace
    parser.add_argument("--inside", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    drops = [float(d) for d in args.drops.split(",")]
    if args.inside:
        results = measure(drops, args.steps)
        report(results, args.json)
        raise SystemExit(0 if all(r["identical_to_clean"] for r in results) else 1)
    reason = why_unavailable()
    if args.check:
        print(
            reason
            or f"ok: network namespaces and {dropper()} can drop packets on a namespace's loopback"
        )
        raise SystemExit(1 if reason else 0)
    if reason:
        print(reason, file=sys.stderr)
        raise SystemExit(UNAVAILABLE)
    if drops[0] != 0.0:
        parser.error("--drops must start with 0 (the clean link the others are compared with)")
    os.execvp(
        "unshare",
        ["unshare", "-n", sys.executable, os.path.abspath(__file__), "--inside", *sys.argv[1:]],
    )


if __name__ == "__main__":
    main()
