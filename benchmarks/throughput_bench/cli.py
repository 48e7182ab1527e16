"""The throughput benchmark's command line, its ``--quick`` defaults, and ``main()``."""

from __future__ import annotations

import argparse
import json
import os

import bench_models

from . import RESULTS_DIR

DEFAULT_MODELS = "vgg16,resnet50,gpt2,transformer"


def _add_workload_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models",
        "--model",
        dest="models",
        default=None,
        help=f"comma-separated model families from {list(bench_models.FAMILIES)} "
        f"(default: {DEFAULT_MODELS}; --quick: gpt2,vgg16)",
    )
    p.add_argument(
        "--size",
        default=None,
        choices=bench_models.SIZES,
        help="model size (default small; --quick: tiny; 'full' = the paper's models, for GPUs)",
    )
    p.add_argument(
        "--batch", type=int, default=0, help="samples per rank per step (0: the model's default)"
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks per emulated job (sweep mode)")
    p.add_argument(
        "--ratios",
        default=None,
        help="target T_comm/T_compute per job; each model's bandwidths are calibrated by a "
        "probe job (default 0.3,0.65,1.6; --quick: 0.65)",
    )
    p.add_argument(
        "--bandwidths",
        default="",
        help="explicit loopback rates instead of --ratios, e.g. 2gbit,500mbit,unlimited",
    )
    p.add_argument(
        "--clusters",
        default=None,
        help="emulated multi-node jobs (sapipe-launch --emulate-cluster NODESxRANKS; needs root), "
        "run "
        "for each of --cluster-models after the single-node sweep (default 2x2,4x1; --quick: none; "
        "'' for none)",
    )
    p.add_argument("--cluster-models", default="gpt2", help="models of the --clusters jobs")
    p.add_argument(
        "--inter-node",
        default="1gbit",
        help="the --clusters jobs' link between nodes, per NIC and direction (within a node: "
        "unshaped)",
    )


def _add_mode_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--k",
        default=None,
        help="fixed stale-layer counts for sapipe/none; integers or expressions of m "
        "(m, m/2, m/4, ...) (default 0,1,m/4,m; --quick: 0,1,m)",
    )
    p.add_argument(
        "--compensations",
        default=None,
        help="compensation modes run at the auto/oracle k (default dc,wp1,wp2,wp3; --quick: dc)",
    )
    p.add_argument(
        "--backends",
        default="",
        help="extra sapipe communication back-ends run at stale_layers='auto' as modes "
        "'sapipe-auto-<backend>', e.g. pushpull,horovod (default: none)",
    )
    p.add_argument(
        "--compressions",
        default=None,
        help="sapipe compressions run at stale_layers='auto' as modes 'sapipe-auto-<compression>' "
        "(default bf16,int8; --quick: int8; '' for none), judged against the full-precision "
        "ceiling",
    )
    p.add_argument(
        "--skip",
        default="",
        help="modes to leave out: any of local,comm,ceiling,ddp,sapipe,auto,comp,horovod,deferred "
        "(deferred: the twins of the fixed-k modes run with expose_gradients=False)",
    )


def _add_timing_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per mode (default 3; --quick: 2)"
    )
    p.add_argument(
        "--auto-warmup",
        type=int,
        default=None,
        help="untimed steps for stale_layers='auto' once its k is final (it first trains untimed "
        "while it profiles and measures k) (default: --warmup)",
    )
    p.add_argument(
        "--steps", type=int, default=None, help="timed steps per mode (default 20; --quick: 6)"
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=0,
        help="split each mode's timed steps into this many rounds, interleaved with the other "
        "modes' (alternating order), so that load drifts hit all modes alike "
        "(0: 4 on CPU, 1 on CUDA, where 1 also frees each mode's model after it ran)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    p.add_argument(
        "--bucket-cap-mb", type=float, default=25.0, help="bucket size for DDP and sapipe"
    )
    p.add_argument(
        "--timeout", type=float, default=600.0, help="seconds per collective before a job fails"
    )


def _add_run_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--quick", action="store_true", help="smoke test: tiny models, few steps, one bandwidth"
    )
    p.add_argument(
        "--out",
        default=None,
        help="results folder for throughput.md and PNGs (default benchmarks/results; "
        "--quick: a temporary folder)",
    )
    p.add_argument(
        "--device",
        default="auto",
        choices=["auto", "cpu", "cuda"],
        help="auto: cuda:LOCAL_RANK with NCCL when CUDA is available, else CPU with Gloo",
    )
    p.add_argument(
        "--render",
        default="",
        help="only re-write the report and plots from a sweep's saved results (the JSON path "
        "a sweep prints at its end)",
    )
    p.add_argument(
        "--no-netns",
        action="store_true",
        help="sweep without network emulation (plain torchrun on this host)",
    )
    p.add_argument(
        "--trace",
        default="",
        help="folder: every sapipe mode records its timeline and writes it there as a Chrome trace "
        "per rank (Perfetto), named <model>_<rate>_<mode>_rank<r>.json; sapipe-auto also its "
        "predicted iteration (.predicted.json). Recording costs a little time per layer.",
    )
    # internal (orchestrator -> worker)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rate", default="", help=argparse.SUPPRESS)
    p.add_argument("--target-ratio", type=float, default=float("nan"), help=argparse.SUPPRESS)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="sapipe throughput benchmark (see benchmarks/throughput_bench/__init__.py)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for add in (_add_workload_options, _add_mode_options, _add_timing_options, _add_run_options):
        add(p)
    return p


def _apply_defaults(a: argparse.Namespace) -> argparse.Namespace:
    """The defaults that depend on ``--quick``."""
    q = a.quick
    a.models = a.models or ("gpt2,vgg16" if q else DEFAULT_MODELS)
    a.size = a.size or ("tiny" if q else "small")
    a.ratios = a.ratios or ("0.65" if q else "0.3,0.65,1.6")
    a.compressions = (
        a.compressions if a.compressions is not None else ("int8" if q else "bf16,int8")
    )
    a.clusters = a.clusters if a.clusters is not None else ("" if q else "2x2,4x1")
    a.k = a.k or ("0,1,m" if q else "0,1,m/4,m")
    a.compensations = (
        a.compensations if a.compensations is not None else ("dc" if q else "dc,wp1,wp2,wp3")
    )
    a.warmup = a.warmup if a.warmup is not None else (2 if q else 3)
    a.auto_warmup = a.auto_warmup if a.auto_warmup is not None else a.warmup
    a.steps = a.steps if a.steps is not None else (6 if q else 20)
    a.skip = {s for s in a.skip.split(",") if s}
    return a


def parse_args(argv=None) -> argparse.Namespace:
    return _apply_defaults(build_parser().parse_args(argv))


def render(args: argparse.Namespace) -> int:
    """``--render``: the report and plots again, from a sweep's saved results."""
    from . import report

    with open(args.render) as f:
        saved = json.load(f)
    old = parse_args(saved["meta"]["argv"])
    out_dir = args.out or RESULTS_DIR
    os.makedirs(out_dir, exist_ok=True)
    return report.report(old, saved["jobs"], saved["calib"], out_dir, saved["meta"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:  # a rank under torchrun
        from . import job

        return job.worker(args)
    if args.render:
        return render(args)
    from . import orchestration

    return orchestration.orchestrate(args)
