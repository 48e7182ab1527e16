"""An emulated multi-node cluster on one host (``sapipe-launch --emulate-cluster``).

Each node is a network namespace of its own, and the nodes hang off one bridge (a hub
namespace, so nothing of the host's own network changes)::

    node i: namespace <tag>n<i>, interface eth0 = 10.77.0.<i+1>/24  ── veth ──  v<i> ─┐
                                                                       hub: br0 ────┘

* **Between nodes** (``--inter-node RATE[,LATENCY]``): each node's NIC is shaped both ways,
  as a switch port is: ``tbf rate RATE`` on the node's ``eth0`` (what it sends) and on its
  hub-side ``v<i>`` (what it receives); a LATENCY is a ``netem`` delay on the sending side
  only, so each packet is delayed once.
* **Within a node** (``--intra-node RATE[,LATENCY]``, default unshaped): ranks of one node
  reach each other's ``eth0`` address through the namespace's loopback (the kernel delivers
  traffic to a local address over ``lo``), shaped as ``--emulate-net`` shapes it (the
  node's aggregate).

One ``torchrun --nnodes N --node-rank i --nproc-per-node R --master-addr 10.77.0.1`` runs in
each namespace, with ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME=eth0``. The namespaces are
removed on every way out: the job ends, fails, or the launcher is interrupted (SIGINT,
SIGTERM). Those of a launcher killed outright (SIGKILL) are named after its process id and
removed by the next launch (:func:`remove_stale`).

Needs root (``ip netns`` creates named namespaces), iproute2 and the kernel's veth, bridge
and sch_tbf (sch_netem for a LATENCY); :func:`check` says which is missing.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Callable

from sapipe.launch import netns

SUBNET = "10.77.0"
NIC = "eth0"
MASTER_PORT = 29500
MAX_NODES = 250  # addresses .1 ... .250 of the /24
_GRACE_SECONDS = 10.0  # after a node fails, how long the others get to exit before SIGKILL


class ClusterError(RuntimeError):
    """The emulated cluster could not be set up (the cause is in the message)."""


@dataclass(frozen=True)
class ClusterSpec:
    """``nodes`` × ``ranks_per_node`` ranks; each node's NIC shaped as ``inter``, its
    loopback as ``intra`` (None: unshaped)."""

    nodes: int
    ranks_per_node: int
    inter: netns.NetSpec
    intra: netns.NetSpec | None = None

    def __post_init__(self):
        if not 1 <= self.nodes <= MAX_NODES or self.ranks_per_node < 1:
            raise ValueError(
                f"an emulated cluster has 1 to {MAX_NODES} nodes of at least one rank; "
                f"got {self.nodes}x{self.ranks_per_node}"
            )

    @staticmethod
    def address(node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    def describe(self) -> str:
        delay = f", +{self.inter.delay_s * 1e3:g} ms one-way" if self.inter.delay_s else ""
        intra = (
            "unshaped" if self.intra is None else f"{self.intra.describe()} (each node's loopback)"
        )
        return (
            f"{self.nodes} nodes × {self.ranks_per_node} ranks; between nodes "
            f"{netns.format_rate(self.inter.rate_bits)} per NIC and direction{delay}; within a "
            f"node {intra}"
        )


def parse_topology(text: str) -> tuple[int, int]:
    """``NODESxRANKS`` (e.g. ``2x4``) -> (nodes, ranks per node)."""
    m = re.fullmatch(r"\s*([0-9]+)\s*[xX×]\s*([0-9]+)\s*", str(text))
    if not m or int(m.group(1)) < 1 or int(m.group(2)) < 1:
        raise ValueError(f"cannot parse {text!r}; expected NODESxRANKS, e.g. 2x4")
    return int(m.group(1)), int(m.group(2))


class EmulatedCluster:
    """The namespaces, bridge and shaped links of one emulated cluster, as a context manager
    that builds them on entry and removes them on exit."""

    def __init__(self, spec: ClusterSpec, tag: str | None = None):
        self.spec = spec
        self.tag = tag or f"sapipe{os.getpid()}"
        self.hub = f"{self.tag}hub"
        self.node_names = [f"{self.tag}n{i}" for i in range(spec.nodes)]
        self._created: list[str] = []

    def setup_commands(self) -> list[list[str]]:
        """Every ``ip``/``tc`` command that builds the cluster, in order (namespaces first)."""
        spec, hub = self.spec, self.hub
        cmds = [["ip", "netns", "add", name] for name in (hub, *self.node_names)]
        cmds += [
            ["ip", "-n", hub, "link", "add", "br0", "type", "bridge"],
            ["ip", "-n", hub, "link", "set", "br0", "up"],
        ]
        for i, node in enumerate(self.node_names):
            port = f"v{i}"
            cmds += [
                [
                    "ip",
                    "link",
                    "add",
                    port,
                    "netns",
                    hub,
                    "type",
                    "veth",
                    "peer",
                    "name",
                    NIC,
                    "netns",
                    node,
                ],
                ["ip", "-n", hub, "link", "set", port, "master", "br0"],
                ["ip", "-n", hub, "link", "set", port, "up"],
                ["ip", "-n", node, "addr", "add", f"{spec.address(i)}/24", "dev", NIC],
                ["ip", "-n", node, "link", "set", NIC, "up"],
                ["ip", "-n", node, "link", "set", "lo", "up"],
            ]
            cmds += [
                ["ip", "netns", "exec", node, *c] for c in netns.tc_commands(spec.inter, NIC)[1:]
            ]
            receive = netns.NetSpec(
                spec.inter.rate_bits
            )  # the switch port: rate only, no second delay
            cmds += [["ip", "netns", "exec", hub, *c] for c in netns.tc_commands(receive, port)[1:]]
            if spec.intra is not None:
                cmds += [
                    ["ip", "netns", "exec", node, *c]
                    for c in netns.tc_commands(spec.intra, "lo")[1:]
                ]
        return cmds

    def teardown_commands(self) -> list[list[str]]:
        """Deleting the namespaces deletes their interfaces, bridge and qdiscs with them."""
        return [
            ["ip", "netns", "del", name]
            for name in reversed(self._created or [self.hub, *self.node_names])
        ]

    def exec_in(self, node: int, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.node_names[node], *argv]

    def __enter__(self) -> EmulatedCluster:
        remove_stale()
        try:
            for cmd in self.setup_commands():
                out = subprocess.run(cmd, capture_output=True, text=True)
                if out.returncode != 0:
                    raise ClusterError(
                        f"sapipe: cannot build the emulated cluster: `{shlex.join(cmd)}` failed: "
                        f"{out.stderr.strip() or out.returncode}"
                    )
                if cmd[:3] == ["ip", "netns", "add"]:
                    self._created.append(cmd[3])
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc) -> None:
        for cmd in self.teardown_commands():
            subprocess.run(cmd, capture_output=True)
        self._created = []


_OWN_NAME = re.compile(r"sapipe([0-9]+)(?:hub|n[0-9]+)$")


def remove_stale() -> list[str]:
    """Delete the namespaces of launchers that are gone (killed before they could clean up:
    SIGKILL); their names carry the launcher's process id. Returns the names deleted."""
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    removed = []
    for line in out.stdout.splitlines():
        name = line.split()[0] if line.split() else ""
        match = _OWN_NAME.match(name)
        if match and not _alive(int(match.group(1))):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def check(spec: ClusterSpec | None = None) -> tuple[bool, str]:
    """Whether this host can build ``spec`` (default: 2 nodes at 1 gbit); (ok, explanation)."""
    if os.geteuid() != 0:
        return (
            False,
            "an emulated cluster needs root (`ip netns add` creates named network namespaces)",
        )
    missing = [b for b in ("ip", "tc") if shutil.which(b) is None]
    if missing:
        return False, f"missing {', '.join(missing)}: install iproute2 (apt-get install iproute2)"
    probe = spec or ClusterSpec(2, 1, netns.NetSpec(1e9))
    try:
        with EmulatedCluster(probe, tag=f"sapipecheck{os.getpid()}"):
            pass
    except ClusterError as exc:
        return False, str(exc)
    return True, f"network namespaces on a bridge, tc on each node's {NIC}"


def node_environment(spec: ClusterSpec, environ: dict[str, str]) -> dict[str, str]:
    """What every node's torchrun gets: its socket interface for Gloo and NCCL, and, where the
    loopback is shaped, NCCL kept off shared memory and P2P so that it crosses the shaping."""
    env = {"GLOO_SOCKET_IFNAME": NIC, "NCCL_SOCKET_IFNAME": NIC, "NCCL_IB_DISABLE": "1"}
    if spec.intra is not None:
        env.update(NCCL_P2P_DISABLE="1", NCCL_SHM_DISABLE="1")
    return {k: v for k, v in env.items() if k not in environ}


def torchrun_argv(
    spec: ClusterSpec,
    node: int,
    python: str,
    torchrun_options: Sequence[str],
    script: Sequence[str],
) -> list[str]:
    """Node ``node``'s torchrun command: the topology's flags, then the caller's options."""
    return [
        python,
        "-m",
        "torch.distributed.run",
        f"--nnodes={spec.nodes}",
        f"--node-rank={node}",
        f"--nproc-per-node={spec.ranks_per_node}",
        f"--master-addr={spec.address(0)}",
        f"--master-port={MASTER_PORT}",
        *torchrun_options,
        *script,
    ]


def run(spec: ClusterSpec, argv_for: Callable[[int], list[str]], env: dict[str, str]) -> int:
    """Build the cluster, run ``argv_for(i)`` in node i's namespace, wait for all of them, tear
    the cluster down. A node that fails ends the others; the first failure's status is returned
    (128 + signal for an interrupted launcher)."""
    interrupted: list[int] = []

    def interrupt(signum, _frame):
        interrupted.append(signum)

    previous = {s: signal.signal(s, interrupt) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with EmulatedCluster(spec) as cluster:
            procs = [
                subprocess.Popen(cluster.exec_in(i, argv_for(i)), env={**os.environ, **env})
                for i in range(spec.nodes)
            ]
            return _supervise(procs, interrupted)
    except ClusterError as exc:
        print(exc, file=sys.stderr)
        return netns.SETUP_FAILED
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(procs: list[subprocess.Popen], interrupted: list[int]) -> int:
    """Wait for every node; on a failure or an interrupt, stop the rest."""
    while True:
        codes = [p.poll() for p in procs]  # every node, every time
        failed = [c for c in codes if c not in (None, 0)]
        if interrupted or failed:
            _stop(procs)
            return 128 + interrupted[0] if interrupted else failed[0]
        if all(c == 0 for c in codes):
            return 0
        time.sleep(0.2)


def _stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + _GRACE_SECONDS
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


__all__ = [
    "ClusterError",
    "ClusterSpec",
    "EmulatedCluster",
    "check",
    "node_environment",
    "parse_topology",
    "remove_stale",
    "run",
    "torchrun_argv",
]
