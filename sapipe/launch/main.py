"""``sapipe-launch``: a thin layer over ``torchrun`` (``python -m torch.distributed.run``).

Everything that is not a sapipe option is passed to torchrun unchanged. sapipe adds:

* ``--emulate-net RATE[,LATENCY]`` — run the whole single-node job inside a fresh network
  namespace whose loopback is rate-limited (:mod:`sapipe.launch.netns`, docs/design.md §6);
* ``--emulate-cluster NODESxRANKS --inter-node RATE[,LATENCY] [--intra-node RATE[,LATENCY]]``
  — a multi-node job on one host: one network namespace per node on a bridge, shaped NICs,
  one torchrun per node (:mod:`sapipe.launch.cluster`);
* BytePS-style job specs — ``DMLC_NUM_WORKER``, ``DMLC_WORKER_ID``, ``DMLC_PS_ROOT_URI``,
  ``DMLC_PS_ROOT_PORT``, ``BYTEPS_LOCAL_SIZE`` / ``NVIDIA_VISIBLE_DEVICES`` — are mapped
  to the torchrun flags the command line does not give (:func:`byteps_flags`);
* ``--dry-run`` — print the command instead of running it.

The mapping is done by pure functions (:func:`plan`, :func:`byteps_flags`) so that it can
be tested without running anything.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from sapipe.launch import cluster as cluster_mod
from sapipe.launch import netns

PROG = "sapipe-launch"

DESCRIPTION = """\
Launch a (sapipe) data-parallel training job with torchrun.

Every option that is not a sapipe option below is a torchrun option and is passed to
`python -m torch.distributed.run` unchanged (all are listed further down; see also
`torchrun --help`). Options must be spelled in full (no abbreviations) and come before
SCRIPT.py; everything after SCRIPT.py goes to the script."""

EPILOG = """\
emulated network (--emulate-net RATE[,LATENCY]):
  The whole job -- the torchrun agent and every rank -- runs in a fresh network namespace
  (`unshare -n` as root, `unshare -rn` otherwise) whose loopback is shaped by tc:
      ip link set lo up
      tc qdisc add dev lo root tbf rate RATE burst >=256KiB limit 32MiB
  With a LATENCY, `netem delay LATENCY` is the root qdisc and tbf its child.
  * RATE is the AGGREGATE rate of all ranks (they all share the one loopback queue), in
    tc units: 1gbit, 200mbit, 1.5gbit (bits/s), 100mbps (BYTES/s), or `unlimited`.
  * LATENCY (2ms, 500us) is a one-way delay on every packet: round trips grow by twice it.
    It needs the kernel's sch_netem module.
  * Only single-node jobs can be emulated: --emulate-net implies --standalone (added unless
    given) and refuses --nnodes (or DMLC_NUM_WORKER) other than 1.
  * GLOO_SOCKET_IFNAME=lo is set, and, so that NCCL traffic crosses the shaped loopback
    too instead of NVLink/PCIe/shared memory, NCCL_SOCKET_IFNAME=lo NCCL_P2P_DISABLE=1
    NCCL_SHM_DISABLE=1 NCCL_IB_DISABLE=1 -- each unless already set in the environment.
  * Needs iproute2 (ip, tc) and util-linux (unshare), and root or unprivileged user
    namespaces. The job exits with 125 when the namespace cannot be set up.

emulated cluster (--emulate-cluster NODESxRANKS --inter-node RATE[,LATENCY]):
  Each node is a network namespace with an eth0 (10.77.0.<node+1>) on one bridge, which
  sits in a namespace of its own: the host's network is not touched.
  * --inter-node shapes each node's NIC both ways (tbf on what it sends and on the bridge
    port it receives from), RATE per node and direction; a LATENCY is added once per packet.
  * --intra-node (default: unshaped) shapes each node's loopback, which carries the traffic
    between the ranks of one node (their aggregate, as --emulate-net).
  * One torchrun per node runs with --nnodes NODES --node-rank i --nproc-per-node RANKS
    --master-addr 10.77.0.1, GLOO_SOCKET_IFNAME=eth0 and NCCL_SOCKET_IFNAME=eth0; give no
    --nnodes, --node-rank, --nproc-per-node, --master-addr or --standalone yourself.
  * A node that fails stops the others; the namespaces are removed on every way out.
  * Needs root and iproute2 (ip, tc); the job exits with 125 when the cluster cannot be
    built, naming the command that failed.

BytePS-style job specs (bpslaunch):
  When DMLC_NUM_WORKER, DMLC_WORKER_ID, DMLC_PS_ROOT_URI or DMLC_PS_ROOT_PORT is set,
  each torchrun flag that the command line (or torchrun's own PET_* variable) does not
  already give is derived from the environment:
      --nnodes          = DMLC_NUM_WORKER
      --node-rank       = DMLC_WORKER_ID
      --master-addr     = DMLC_PS_ROOT_URI    (must be worker 0's host: torchrun's static
      --master-port     = DMLC_PS_ROOT_PORT    rendezvous is hosted by node rank 0)
      --nproc-per-node  = BYTEPS_LOCAL_SIZE, else the number of GPUs in
                          NVIDIA_VISIBLE_DEVICES ("all": gpu), else 1
  All-reduce needs no parameter server: with DMLC_ROLE=server or scheduler, sapipe-launch
  prints a note and exits 0, so a BytePS job spec's server and scheduler tasks finish.
  --no-byteps-env ignores these variables.

restarts (--max-restarts=N, N > 0):
  TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 is set unless already set: with torchrun's shared
  rendezvous store, restarted workers can read the dead attempt's Gloo/NCCL addresses and
  fail to connect (pytorch/pytorch#135712). Resume in the script with
  sapipe.checkpoint_exists() / sapipe.load_checkpoint() (or sapipe.Checkpointer; an example:
  tests/jobs/restart_job.py in sapipe's repository).

examples:
  # 8 GPUs on one machine
  sapipe-launch --standalone --nproc-per-node=8 train.py --epochs 90

  # two machines (run on each; NODE_RANK is 0 or 1)
  sapipe-launch --nnodes=2 --node-rank=$NODE_RANK --nproc-per-node=8 \\
      --master-addr=10.0.0.1 --master-port=29500 train.py

  # 4 CPU ranks over an emulated 1 Gbit/s network with 2 ms one-way delay
  sapipe-launch --emulate-net 1gbit,2ms --nproc-per-node=4 train.py

  # 2 emulated nodes of 2 ranks: 1 Gbit/s with 50 us between nodes, unshaped within
  sapipe-launch --emulate-cluster 2x2 --inter-node 1gbit,50us train.py

  # a BytePS (bpslaunch) job spec, unchanged
  DMLC_NUM_WORKER=2 DMLC_WORKER_ID=1 DMLC_PS_ROOT_URI=10.0.0.1 DMLC_PS_ROOT_PORT=1234 \\
  BYTEPS_LOCAL_SIZE=8 sapipe-launch train.py

  # fault tolerance: restart all workers up to 3 times (resume with sapipe.load_checkpoint)
  sapipe-launch --standalone --nproc-per-node=4 --max-restarts=3 train.py

  # show the torchrun command without running it
  sapipe-launch --dry-run --emulate-net 200mbit --nproc-per-node=2 train.py
"""

#: sapipe options taking a value / taking none (removed before calling torchrun)
_VALUE_OPTIONS = ("--emulate-net", "--emulate-cluster", "--inter-node", "--intra-node")
_FLAG_OPTIONS = ("--dry-run", "--quiet", "--no-byteps-env")

_DMLC_VARS = ("DMLC_NUM_WORKER", "DMLC_WORKER_ID", "DMLC_PS_ROOT_URI", "DMLC_PS_ROOT_PORT")

#: environment set under --emulate-net unless already present
EMULATION_ENV = {
    "GLOO_SOCKET_IFNAME": "lo",
    "NCCL_SOCKET_IFNAME": "lo",
    "NCCL_P2P_DISABLE": "1",
    "NCCL_SHM_DISABLE": "1",
    "NCCL_IB_DISABLE": "1",
}


#: With torchrun's shared rendezvous TCPStore (the default since torch 2.5), restarted
#: workers can read the previous attempt's Gloo/NCCL addresses from the store and fail to
#: connect (pytorch/pytorch#135712). Set to 1 when --max-restarts > 0, unless already set.
RESTART_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


class LaunchError(ValueError):
    """A command line or environment sapipe-launch cannot turn into a torchrun job."""


@dataclass
class Plan:
    """What :func:`main` runs: ``argv`` with ``env`` added to the environment."""

    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    dry_run: bool = False
    quiet: bool = False
    exit_now: int | None = None  # exit with this status without running anything
    #: --emulate-cluster: the cluster, and each node's command (``argv`` is then empty)
    cluster: cluster_mod.ClusterSpec | None = None
    node_argv: list[list[str]] = field(default_factory=list)

    def shell(self) -> str:
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        if self.cluster is not None:
            return "; ".join(
                f"node {i}: {prefix + ' ' if prefix else ''}{shlex.join(a)}"
                for i, a in enumerate(self.node_argv)
            )
        return (prefix + " " if prefix else "") + shlex.join(self.argv)


def build_parser() -> argparse.ArgumentParser:
    """torchrun's own parser, renamed, with the sapipe options added in front."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.prog = PROG
    parser.usage = f"{PROG} [sapipe options] [torchrun options] SCRIPT.py [script args]"
    parser.description = DESCRIPTION
    parser.epilog = EPILOG
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.allow_abbrev = False
    parser._optionals.title = "torchrun options"  # noqa: SLF001
    group = parser.add_argument_group("sapipe options")
    group.add_argument(
        "--emulate-net",
        metavar="RATE[,LATENCY]",
        default=None,
        help="run the job in a network namespace whose loopback is limited to RATE "
        "(aggregate), with an optional one-way LATENCY, e.g. 1gbit or 200mbit,2ms. "
        "Single node only (implies --standalone); see below.",
    )
    group.add_argument(
        "--emulate-cluster",
        metavar="NODESxRANKS",
        default=None,
        help="run NODES emulated nodes of RANKS ranks each on this host, one network namespace per "
        "node on a bridge (needs root and --inter-node); see below.",
    )
    group.add_argument(
        "--inter-node",
        metavar="RATE[,LATENCY]",
        default=None,
        help="with --emulate-cluster: each node's NIC, per direction, e.g. 1gbit,50us",
    )
    group.add_argument(
        "--intra-node",
        metavar="RATE[,LATENCY]",
        default=None,
        help="with --emulate-cluster: each node's loopback (its ranks together); default unshaped",
    )
    group.add_argument(
        "--dry-run",
        action="store_true",
        help="print the command (to stderr) and exit without running it",
    )
    group.add_argument(
        "--quiet", action="store_true", help="do not print the command before running it"
    )
    group.add_argument(
        "--no-byteps-env", action="store_true", help="ignore DMLC_* / BYTEPS_LOCAL_SIZE (see below)"
    )
    # put the sapipe group first in --help
    parser._action_groups.insert(0, parser._action_groups.pop())  # noqa: SLF001
    return parser


def _split(
    argv: Sequence[str], parser: argparse.ArgumentParser
) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(parsed namespace, launcher tokens before the script, script + its args)."""
    ns = parser.parse_args(list(argv))
    n_rest = len(ns.training_script_args)
    idx = len(argv) - n_rest - 1
    if idx < 0 or argv[idx] != ns.training_script:  # e.g. the script after "--"
        idx = max(
            i for i, tok in enumerate(argv[: len(argv) - n_rest]) if tok == ns.training_script
        )
    return ns, list(argv[:idx]), list(argv[idx:])


def _strip_sapipe(prefix: Sequence[str]) -> list[str]:
    out, i = [], 0
    while i < len(prefix):
        tok = prefix[i]
        if tok in _VALUE_OPTIONS:
            i += 2
            continue
        if tok.split("=", 1)[0] in _VALUE_OPTIONS or tok in _FLAG_OPTIONS:
            i += 1
            continue
        out.append(tok)
        i += 1
    return out


def given_options(
    prefix: Sequence[str], parser: argparse.ArgumentParser, environ: Mapping[str, str]
) -> set[str]:
    """The ``dest`` of every torchrun option the user gave: on the command line, or through
    torchrun's own ``PET_<DEST>`` environment variable."""
    given = set()
    tokens = {tok.split("=", 1)[0] for tok in prefix if tok.startswith("-")}
    for action in parser._actions:  # noqa: SLF001
        if not action.option_strings:
            continue
        if tokens.intersection(action.option_strings) or f"PET_{action.dest.upper()}" in environ:
            given.add(action.dest)
    return given


def _gpu_count(visible: str) -> str | None:
    v = visible.strip().lower()
    if v in ("", "none", "void"):
        return None
    if v == "all":
        return "gpu"
    return str(len([d for d in v.split(",") if d.strip()]))


def _int_env(environ: Mapping[str, str], name: str, minimum: int) -> str:
    value = environ[name].strip()
    try:
        if int(value) < minimum:
            raise ValueError
    except ValueError:
        raise LaunchError(
            f"{PROG}: {name}={environ[name]!r} must be an integer >= {minimum}"
        ) from None
    return value


def byteps_flags(
    environ: Mapping[str, str], given: set[str], *, single_node: bool = False
) -> tuple[list[str], list[str]]:
    """torchrun flags derived from a BytePS-style environment, and notes saying which.

    Pure: looks only at ``environ`` and at the option dests in ``given``. Nothing is derived
    unless one of the DMLC_* variables is set. ``single_node`` (``--emulate-net``) maps only
    the per-node process count: the rendezvous is then local.
    """
    if not any(v in environ for v in _DMLC_VARS):
        return [], []
    flags: list[str] = []
    notes: list[str] = []

    def add(dest: str, flag: str, value: str, source: str) -> None:
        if dest in given:
            notes.append(f"{source} ignored: {flag} given")
            return
        flags.append(f"{flag}={value}")
        notes.append(f"{flag}={value} from {source}")

    if not single_node:
        if "DMLC_NUM_WORKER" in environ:
            add("nnodes", "--nnodes", _int_env(environ, "DMLC_NUM_WORKER", 1), "DMLC_NUM_WORKER")
        if "DMLC_WORKER_ID" in environ:
            add(
                "node_rank", "--node-rank", _int_env(environ, "DMLC_WORKER_ID", 0), "DMLC_WORKER_ID"
            )
        if environ.get("DMLC_PS_ROOT_URI", "").strip():
            add(
                "master_addr",
                "--master-addr",
                environ["DMLC_PS_ROOT_URI"].strip(),
                "DMLC_PS_ROOT_URI",
            )
        if "DMLC_PS_ROOT_PORT" in environ:
            add(
                "master_port",
                "--master-port",
                _int_env(environ, "DMLC_PS_ROOT_PORT", 1),
                "DMLC_PS_ROOT_PORT",
            )
    if environ.get("BYTEPS_LOCAL_SIZE", "").strip():
        add(
            "nproc_per_node",
            "--nproc-per-node",
            _int_env(environ, "BYTEPS_LOCAL_SIZE", 1),
            "BYTEPS_LOCAL_SIZE",
        )
    elif _gpu_count(environ.get("NVIDIA_VISIBLE_DEVICES", "")) is not None:
        add(
            "nproc_per_node",
            "--nproc-per-node",
            _gpu_count(environ["NVIDIA_VISIBLE_DEVICES"]),
            "NVIDIA_VISIBLE_DEVICES",
        )
    else:
        add(
            "nproc_per_node",
            "--nproc-per-node",
            "1",
            "default (no BYTEPS_LOCAL_SIZE / NVIDIA_VISIBLE_DEVICES)",
        )
    return flags, notes


def _restarts(ns: argparse.Namespace, given: set[str]) -> int:
    try:
        return int(ns.max_restarts) if "max_restarts" in given else 0
    except (TypeError, ValueError):
        return 0


def _single_node(nnodes: str) -> bool:
    return str(nnodes).strip() in ("1", "1:1")


def plan(argv: Sequence[str], environ: Mapping[str, str], python: str = sys.executable) -> Plan:
    """Turn ``sapipe-launch`` arguments + environment into the command to run. Pure."""
    parser = build_parser()
    ns, prefix, script = _split(argv, parser)
    torchrun_prefix = _strip_sapipe(prefix)
    given = given_options(torchrun_prefix, parser, environ)
    notes: list[str] = []

    role = environ.get("DMLC_ROLE", "worker").strip().lower()
    if not ns.no_byteps_env and role in ("server", "scheduler"):
        note = (
            f"DMLC_ROLE={role}: sapipe all-reduces between workers and needs no BytePS "
            "server or scheduler; nothing to run"
        )
        return Plan([], notes=[note], dry_run=ns.dry_run, quiet=ns.quiet, exit_now=0)

    if ns.emulate_cluster is not None or ns.inter_node is not None or ns.intra_node is not None:
        return _cluster_plan(ns, torchrun_prefix, script, given, environ, python)

    spec = None
    if ns.emulate_net is not None:
        try:
            spec = netns.parse_spec(ns.emulate_net)
        except ValueError as exc:
            raise LaunchError(f"{PROG}: --emulate-net: {exc}") from None

    extra: list[str] = []
    if not ns.no_byteps_env:
        extra, bps_notes = byteps_flags(environ, given, single_node=spec is not None)
        notes += bps_notes

    env: dict[str, str] = {}
    if spec is not None:
        nnodes = ns.nnodes if "nnodes" in given else environ.get("DMLC_NUM_WORKER", "1")
        if ns.no_byteps_env and "nnodes" not in given:
            nnodes = "1"
        if not _single_node(nnodes):
            raise LaunchError(
                f"{PROG}: --emulate-net emulates a network between the ranks of ONE machine; "
                f"a multi-node job (nnodes={nnodes}) cannot be emulated. Use --nnodes=1 and "
                "--nproc-per-node=N for N ranks."
            )
        if "standalone" not in given:
            extra.append("--standalone")
        env = {k: v for k, v in EMULATION_ENV.items() if k not in environ}
        notes.append(f"emulated network: loopback {spec.describe()} (all ranks together)")

    if _restarts(ns, given) > 0 and RESTART_ENV not in environ:
        env[RESTART_ENV] = "1"
        notes.append(
            f"{RESTART_ENV}=1: a fresh rendezvous store per restart (pytorch/pytorch#135712)"
        )

    torchrun = [python, "-m", "torch.distributed.run", *torchrun_prefix, *extra, *script]
    argv_out = netns.wrap(torchrun, spec) if spec is not None else torchrun
    return Plan(argv_out, env=env, notes=notes, dry_run=ns.dry_run, quiet=ns.quiet)


#: torchrun options the emulated cluster sets itself
_CLUSTER_SETS = {
    "nnodes": "--nnodes",
    "node_rank": "--node-rank",
    "nproc_per_node": "--nproc-per-node",
    "master_addr": "--master-addr",
    "master_port": "--master-port",
    "standalone": "--standalone",
    "rdzv_endpoint": "--rdzv-endpoint",
}


def _cluster_spec(ns: argparse.Namespace) -> cluster_mod.ClusterSpec:
    if ns.emulate_cluster is None:
        raise LaunchError(
            f"{PROG}: --inter-node and --intra-node go with --emulate-cluster NODESxRANKS"
        )
    if ns.inter_node is None:
        raise LaunchError(
            f"{PROG}: --emulate-cluster needs --inter-node RATE[,LATENCY] (e.g. 1gbit or "
            "10gbit,50us; 'unlimited' for none)"
        )
    if ns.emulate_net is not None:
        raise LaunchError(
            f"{PROG}: --emulate-net shapes one node's loopback; with --emulate-cluster use "
            "--intra-node for that"
        )
    try:
        nodes, ranks = cluster_mod.parse_topology(ns.emulate_cluster)
        inter = netns.parse_spec(ns.inter_node)
        intra = netns.parse_spec(ns.intra_node) if ns.intra_node is not None else None
        return cluster_mod.ClusterSpec(nodes, ranks, inter, intra)
    except ValueError as exc:
        raise LaunchError(f"{PROG}: --emulate-cluster: {exc}") from None


def _cluster_plan(
    ns: argparse.Namespace,
    torchrun_prefix: list[str],
    script: list[str],
    given: set[str],
    environ: Mapping[str, str],
    python: str,
) -> Plan:
    """``--emulate-cluster``: one torchrun per emulated node (see :mod:`sapipe.launch.cluster`)."""
    spec = _cluster_spec(ns)
    clash = sorted(flag for dest, flag in _CLUSTER_SETS.items() if dest in given)
    if clash:
        raise LaunchError(
            f"{PROG}: --emulate-cluster sets {', '.join(clash)} for every node itself; "
            "remove them (the topology is NODESxRANKS)"
        )
    notes = [f"emulated cluster: {spec.describe()}"]
    if any(v in environ for v in _DMLC_VARS) and not ns.no_byteps_env:
        notes.append("DMLC_* ignored: --emulate-cluster gives the topology")
    env = cluster_mod.node_environment(spec, dict(environ))
    if _restarts(ns, given) > 0 and RESTART_ENV not in environ:
        env[RESTART_ENV] = "1"
    node_argv = [
        cluster_mod.torchrun_argv(spec, i, python, torchrun_prefix, script)
        for i in range(spec.nodes)
    ]
    return Plan(
        [],
        env=env,
        notes=notes,
        dry_run=ns.dry_run,
        quiet=ns.quiet,
        cluster=spec,
        node_argv=node_argv,
    )


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        build_parser().print_help(sys.stderr)
        return 2
    try:
        p = plan(argv, os.environ)
    except LaunchError as exc:
        print(exc, file=sys.stderr)
        return 2
    if not p.quiet or p.dry_run:
        for note in p.notes:
            print(f"{PROG}: {note}", file=sys.stderr)
    if p.exit_now is not None:
        return p.exit_now
    if p.dry_run or not p.quiet:
        print(f"{PROG}: {'would run' if p.dry_run else 'running'}: {p.shell()}", file=sys.stderr)
    if p.dry_run:
        return 0
    sys.stderr.flush()
    sys.stdout.flush()
    if p.cluster is not None:
        ok, why = cluster_mod.check(p.cluster)
        if not ok:
            print(f"{PROG}: cannot emulate the cluster here: {why}", file=sys.stderr)
            return netns.SETUP_FAILED
        return cluster_mod.run(p.cluster, lambda node: p.node_argv[node], p.env)
    os.environ.update(p.env)
    try:
        os.execvp(p.argv[0], p.argv)  # signals go straight to unshare/torchrun
    except OSError as exc:
        print(f"{PROG}: cannot run {p.argv[0]}: {exc}", file=sys.stderr)
        return 127
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
