"""Predict a profiled model on a cluster: DDP, Pipe-SGD and sapipe at other node counts.

A job with ``stale_layers="auto"`` saves what it measured (``opt.save_profile(path)``,
:class:`~sapipe.schedule.saved_profile.SavedProfile`): per-layer compute, the optimizer's
update cost, the link it summed over. :func:`predict` keeps the compute (the model, the
batch and the device stay) and replaces the link by that of a cluster of N nodes of G
ranks (:mod:`sapipe.schedule.cluster_link`: a flat ring, or node first, from the rates
between and inside nodes). It then runs the scheduler's simulator (docs/design.md §4.3)
for three ways of training:

* **DDP**: every layer synchronous (k = 0) on DDP's timeline: the end of backward waits
  for every all-reduce, ``step()`` applies the updates (``sync_at_step``); one process
  group, so one all-reduce at a time (``shared_link=False``); 25 MiB buckets (DDP's
  default); a flat all-reduce, uncompressed;
* **Pipe-SGD**: sapipe with k = m (every layer one step stale), on sapipe's link;
* **sapipe**: the k ``stale_layers="auto"`` would choose from the model
  (:func:`~sapipe.schedule.solver.choose_k`, 3 % tolerance), with the arguments the
  controller builds from a profile (``sapipe/auto/controller.py``): the profile's bucket
  cap and ``sync_at_step``, sync and stale sums on two process groups sharing the link.

The compute slow-down σ while the link is busy is the profile's (a property of the host:
0 for a GPU profile) unless given. Not predicted: the measured search that checks auto's
k on the running job, rank skew, and a network whose sharing is not the model's.

Command line::

    python -m sapipe.schedule.predict PROFILE --nodes 1,2,4,8 --gpus-per-node 8 \\
        --inter-node 100gbit,5us [--intra-node 130gbps,1us] [--hierarchical auto|on|off] \\
        [--slowdown SIGMA] [--batch N] [--plot out.png] [--json]

prints a markdown table (or JSON); errors print ``error: ...`` and exit with status 2.
Pure Python but for ``--plot`` (matplotlib).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from sapipe.errors import ConfigurationError
from sapipe.schedule.cluster_link import (
    ClusterLink,
    LinkSpec,
    intra_link_from_profile,
    parse_link,
    sapipe_hierarchical,
)
from sapipe.schedule.saved_profile import SavedProfile
from sapipe.schedule.simulator import simulate
from sapipe.schedule.solver import STALL_TOLERANCE, choose_k

__all__ = [
    "DDP_BUCKET_CAP_BYTES",
    "MODES",
    "ModePrediction",
    "Prediction",
    "TOLERANCE",
    "format_table",
    "main",
    "plot_throughput",
    "predict",
    "simulator_arguments",
]

#: DDP's default ``bucket_cap_mb`` (25 MiB)
DDP_BUCKET_CAP_BYTES = 25 * 1024 * 1024
#: the stall ``stale_layers="auto"`` accepts as none
TOLERANCE = STALL_TOLERANCE
MODES = ("ddp", "pipesgd", "sapipe")
LABELS = {"ddp": "DDP", "pipesgd": "Pipe-SGD", "sapipe": "sapipe"}


@dataclass(frozen=True)
class ModePrediction:
    """One way of training on one cluster (times in seconds)."""

    mode: str  # one of MODES
    k: int  # stale layers
    iteration_time: float
    comm_time: float  # link busy time per iteration
    stall: float  # iteration_time - compute time
    alpha: float  # the link its sums were modelled with
    beta: float
    two_level: bool  # sums node first


@dataclass(frozen=True)
class Prediction:
    """DDP, Pipe-SGD and sapipe on ``nodes`` × ``ranks_per_node``."""

    nodes: int
    ranks_per_node: int
    m: int  # layers
    compute_time: (
        float  # the profile's iteration without communication (forward, backward, step, updates)
    )
    link: str  # the cluster's links, in words
    modes: dict[str, ModePrediction]

    @property
    def world_size(self) -> int:
        return self.nodes * self.ranks_per_node

    def speedup(self, mode: str) -> float:
        """DDP's iteration time over ``mode``'s."""
        return self.modes["ddp"].iteration_time / self.modes[mode].iteration_time

    def efficiency(self, mode: str) -> float:
        """Per-rank throughput relative to the profile's pure compute: compute / iteration time."""
        return self.compute_time / self.modes[mode].iteration_time

    def throughput(self, mode: str, batch: float = 1.0) -> float:
        """Samples per second of the whole job with ``batch`` samples per rank per iteration."""
        return self.world_size * batch / self.modes[mode].iteration_time

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["world_size"] = self.world_size
        for mode in MODES:
            out["modes"][mode].update(speedup=self.speedup(mode), efficiency=self.efficiency(mode))
        return out


def simulator_arguments(
    profile: SavedProfile, alpha: float, beta: float, slowdown: float
) -> dict[str, Any]:
    """The simulator's and solver's keyword arguments for ``profile`` on a link α + β·bytes,
    as ``AutoController.simulator_arguments`` builds them from a measured profile."""
    numel = sum(profile.numel)
    return dict(
        bucket_cap_bytes=profile.bucket_cap_bytes,
        alpha=alpha,
        beta=beta,
        bytes_per_layer=profile.layer_bytes,
        step_time=profile.step_time,
        sync_at_step=profile.sync_at_step,
        slowdown=slowdown,
        shared_link=True,
        update_per_element=profile.update_time / numel if numel else 0.0,
    )


def _links(
    profile: SavedProfile,
    nodes: int,
    ranks_per_node: int,
    inter: LinkSpec,
    intra: LinkSpec | None,
    hierarchical: bool | None,
) -> tuple[ClusterLink, ClusterLink]:
    """The cluster as sapipe sums on it, and as DDP does (flat); the intra-node link derived
    from the profile where it is needed and not given."""
    two_level = sapipe_hierarchical(hierarchical, profile.backend, nodes, ranks_per_node)
    cluster = ClusterLink(nodes, ranks_per_node, inter, intra, hierarchical=two_level)
    if intra is None and (
        cluster.needs_intra() or ClusterLink(nodes, ranks_per_node, inter).needs_intra()
    ):
        cluster = ClusterLink(
            nodes, ranks_per_node, inter, intra_link_from_profile(profile), hierarchical=two_level
        )
    return cluster, ClusterLink(nodes, ranks_per_node, inter, cluster.intra, hierarchical=False)


def predict(
    profile: SavedProfile,
    nodes: int,
    ranks_per_node: int,
    inter: str | LinkSpec,
    intra: str | LinkSpec | None = None,
    hierarchical: bool | None = None,
    slowdown: float | None = None,
) -> Prediction:
    """DDP, Pipe-SGD and sapipe for ``profile``'s model on ``nodes`` × ``ranks_per_node``.

    ``inter``/``intra``: the links between and inside nodes (:class:`LinkSpec`, or
    ``RATE[,LATENCY]`` text such as ``"100gbit,5us"``); ``intra`` None: derived from a
    profile of one node where a sum needs it (else ConfigurationError). ``hierarchical``:
    sapipe's setting (None: its default, node first on two levels). ``slowdown``: σ (None:
    the profile's). ConfigurationError, naming the cause, for what cannot be predicted.
    """
    if not isinstance(profile, SavedProfile) or not profile.layers:
        raise ConfigurationError("predict needs a SavedProfile with at least one layer")
    sigma = profile.slowdown if slowdown is None else slowdown
    if not 0 <= sigma < math.inf:
        raise ConfigurationError(f"the slow-down must be finite and >= 0; got {sigma}")
    inter_link = parse_link(inter, "inter-node link")
    if inter_link is None:
        raise ConfigurationError("predict needs the inter-node link (RATE[,LATENCY])")
    cluster, flat = _links(
        profile,
        nodes,
        ranks_per_node,
        inter_link,
        parse_link(intra, "intra-node link"),
        hierarchical,
    )
    if profile.compression is not None:
        alpha, beta = cluster.compressed_sum(profile.wire_ratio, profile.codec_per_byte)
    else:
        alpha, beta = cluster.allreduce()
    layers = profile.layer_profiles(alpha, beta)
    arguments = simulator_arguments(profile, alpha, beta, sigma)
    m = len(layers)
    decision = choose_k(layers, tolerance=TOLERANCE, **arguments)
    pipe = simulate(layers, m, record_events=False, **arguments)
    ddp_alpha, ddp_beta = flat.allreduce()
    ddp_arguments = dict(
        arguments,
        alpha=ddp_alpha,
        beta=ddp_beta,
        bucket_cap_bytes=DDP_BUCKET_CAP_BYTES,
        sync_at_step=True,
        shared_link=False,
    )
    ddp = simulate(
        profile.layer_profiles(ddp_alpha, ddp_beta), 0, record_events=False, **ddp_arguments
    )
    modes = {
        "ddp": ModePrediction(
            "ddp", 0, ddp.iteration_time, ddp.comm_time, ddp.stall, ddp_alpha, ddp_beta, False
        ),
        "pipesgd": ModePrediction(
            "pipesgd",
            m,
            pipe.iteration_time,
            pipe.comm_time,
            pipe.stall,
            alpha,
            beta,
            cluster.two_level,
        ),
        "sapipe": ModePrediction(
            "sapipe",
            decision.k,
            decision.iteration_time,
            decision.comm_time,
            decision.stall,
            alpha,
            beta,
            cluster.two_level,
        ),
    }
    return Prediction(nodes, ranks_per_node, m, ddp.compute_time, cluster.describe(), modes)


# --------------------------------------------------------------------------- output


def format_table(predictions: Sequence[Prediction], batch: float | None = None) -> str:
    """A markdown table: per cluster, each mode's iteration time, sapipe's k, the speed-ups
    over DDP, and efficiency (compute / iteration time); samples/s with ``batch``."""
    head = (
        "| nodes | ranks | sapipe sums | DDP ms | Pipe-SGD ms | sapipe ms | sapipe k | Pipe-SGD × "
        "DDP "
        "| sapipe × DDP | efficiency DDP / Pipe-SGD / sapipe |"
    )
    rule = "| ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |"
    if batch:
        head += " samples/s DDP / Pipe-SGD / sapipe |"
        rule += " --- |"
    lines = [head, rule]
    for p in predictions:
        t = {mode: p.modes[mode].iteration_time * 1e3 for mode in MODES}
        row = (
            f"| {p.nodes} | {p.world_size} | "
            f"{'two-level' if p.modes['sapipe'].two_level else 'flat'} "
            f"| {t['ddp']:.4g} | {t['pipesgd']:.4g} | {t['sapipe']:.4g} | {p.modes['sapipe'].k} of "
            f"{p.m} "
            f"| {p.speedup('pipesgd'):.2f} | {p.speedup('sapipe'):.2f} | "
            + " / ".join(f"{p.efficiency(mode):.0%}" for mode in MODES)
            + " |"
        )
        if batch:
            row += " " + " / ".join(_rate(p.throughput(mode, batch)) for mode in MODES) + " |"
        lines.append(row)
    return "\n".join(lines)


def _rate(x: float) -> str:
    return f"{x:.0f}" if x >= 100 else f"{x:.3g}"


def plot_throughput(
    ax, predictions: Sequence[Prediction], batch: float | None = None, title: str = ""
) -> None:
    """Throughput vs ranks of each mode on matplotlib axes ``ax``, with linear scaling of
    the profile's compute for reference (samples/s with ``batch``, else iterations × ranks / s)."""
    ranks = [p.world_size for p in predictions]
    per = batch or 1.0
    for mode, style in zip(MODES, ("o-", "s-", "^-")):
        ax.plot(ranks, [p.throughput(mode, per) for p in predictions], style, label=LABELS[mode])
    ax.plot(
        ranks,
        [r * per / p.compute_time for r, p in zip(ranks, predictions)],
        "k:",
        label="linear (compute only)",
    )
    ax.set_xlabel("ranks (GPUs)")
    ax.set_ylabel("samples/s" if batch else "rank-iterations/s")
    ax.set_xticks(ranks)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if title:
        ax.set_title(title)
    ax.legend(fontsize="small")


def _write_plot(
    path: str, predictions: Sequence[Prediction], batch: float | None, title: str
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    plot_throughput(ax, predictions, batch, title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# --------------------------------------------------------------------------- command line


def _counts(text: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigurationError(f"--nodes takes node counts like 1,2,4,8; got {text!r}") from None
    if not values or min(values) < 1:
        raise ConfigurationError(f"--nodes takes node counts >= 1, like 1,2,4,8; got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m sapipe.schedule.predict",
        description="Predict DDP, Pipe-SGD and sapipe for a saved profile (opt.save_profile) "
        "on clusters of several nodes.",
    )
    p.add_argument("profile", help="a profile file written by opt.save_profile(path)")
    p.add_argument(
        "--nodes", default="1,2,4,8", help="node counts, comma-separated (default 1,2,4,8)"
    )
    p.add_argument("--gpus-per-node", type=int, default=8, help="ranks per node (default 8)")
    p.add_argument(
        "--inter-node",
        required=True,
        help="link between nodes, per NIC and direction: RATE[,LATENCY] "
        "(e.g. 100gbit,5us; gbit = bits, gbps = bytes per second; LATENCY per ring step)",
    )
    p.add_argument(
        "--intra-node",
        default=None,
        help="link inside a node, per edge: RATE[,LATENCY] (default: "
        "derived from a profile of one node of several ranks)",
    )
    p.add_argument(
        "--hierarchical",
        default="auto",
        choices=["auto", "on", "off"],
        help="sapipe's sums node first (auto: its default, where there are two levels)",
    )
    p.add_argument(
        "--slowdown",
        type=float,
        default=None,
        help="compute slow-down sigma while the link is busy (default: the profile's)",
    )
    p.add_argument(
        "--batch",
        type=float,
        default=None,
        help="samples per rank per iteration: also give samples/s",
    )
    p.add_argument(
        "--plot", default=None, metavar="PNG", help="write throughput vs ranks to this file"
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of the table")
    return p


def run(args: argparse.Namespace) -> str:
    """What the command prints (ConfigurationError for anything it cannot predict)."""
    profile = SavedProfile.load(args.profile)
    if args.gpus_per_node < 1:
        raise ConfigurationError(f"--gpus-per-node must be >= 1; got {args.gpus_per_node}")
    if args.batch is not None and not args.batch > 0:
        raise ConfigurationError(f"--batch must be > 0; got {args.batch}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise ConfigurationError(
            "--plot needs matplotlib (pip install matplotlib); the table needs nothing"
        )
    hierarchical = {"auto": None, "on": True, "off": False}[args.hierarchical]
    predictions = [
        predict(
            profile,
            n,
            args.gpus_per_node,
            args.inter_node,
            args.intra_node,
            hierarchical,
            args.slowdown,
        )
        for n in _counts(args.nodes)
    ]
    if args.plot:
        _write_plot(
            args.plot,
            predictions,
            args.batch,
            f"{profile.device}, {len(profile.layers)} layers: {args.inter_node} between nodes",
        )
    if args.json:
        return json.dumps(
            {
                "profile": args.profile,
                "inter_node": args.inter_node,
                "intra_node": args.intra_node,
                "predictions": [p.to_dict() for p in predictions],
            },
            indent=1,
        )
    sigma = profile.slowdown if args.slowdown is None else args.slowdown
    return (
        f"{args.profile}: {len(profile.layers)} layers measured on {profile.world_size} rank(s) "
        f"({profile.device}), compute {profile.compute_time * 1e3:.4g} ms/iteration, "
        f"sigma={sigma:g}\n"
        f"{predictions[-1].link}\n{_slow_intra_note(profile, args)}\n"
        + format_table(predictions, args.batch)
    )


def _slow_intra_note(profile: SavedProfile, args: argparse.Namespace) -> str:
    """A line of warning where the link inside a node (given or derived) is slower than the
    network."""
    inter, intra = (
        parse_link(args.inter_node, "--inter-node"),
        parse_link(args.intra_node, "--intra-node"),
    )
    try:
        intra = intra or intra_link_from_profile(profile)
    except ConfigurationError:
        return ""
    if intra.rate >= inter.rate:
        return ""
    return (
        f"note: the link inside a node ({intra.describe()}) is slower than between nodes; a "
        "profile taken on a "
        "CPU host's loopback gives such a link. For GPU nodes give --intra-node (NVLink: e.g. "
        "1800gbit,1us)\n"
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        print(run(args))
    except (ConfigurationError, ValueError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
