"""The scaling figure of ``scaling.py``, predicted from profiles recorded on a GPU, not FLOPs.

``benchmarks/gpu_profiles.py`` trained each model of ``scaling.py`` (same layers, same
per-GPU batch) on one GPU under ``stale_layers="auto"`` and saved its profile
(``benchmarks/results/scaling_h100/``: one H100, fp32 and bfloat16 amp). This script
predicts DDP, Pipe-SGD and sapipe on 1–8 nodes of 8 such GPUs from them, with
:func:`sapipe.schedule.predict.predict`, and writes ``results/scaling_h100.md`` and
``results/scaling_h100.png``.

What is measured and what is assumed:

* **Measured** (one H100): per-layer forward and backward times, the optimizer update, the
  step time, and the iteration time timed after the decision (``summary.json``).
* **Scaled**: the profiler waits for the GPU at every timestamp of its profiled iterations,
  which serialises the host's kernel launches with the GPU's work; its compute came out
  7–101% above the iteration time (most for ResNet-50's 107 small layers under amp). Each
  profile is scaled uniformly to its measured iteration time; the split between layers is
  the profile's.
* **Assumed links**: inside a node a ring over NVLink at 360 GB/s bus bandwidth and 1 µs per
  step (NCCL all-reduce on an 8-GPU H100 node reaches 360–450 GB/s); between nodes the
  paper's 100 Gbit/s per node (and 400 Gbit/s, one current NIC, for comparison), 5 µs per
  ring step. Gradients float32, 25 MiB buckets, σ = 0, no clipping.

    python benchmarks/scaling_measured.py [--profiles benchmarks/results/scaling_h100]
        [--nodes 1,2,4,8]
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile

import harness
import scaling

from sapipe.schedule.cluster_link import LinkSpec
from sapipe.schedule.predict import MODES, Prediction, format_table, predict
from sapipe.schedule.saved_profile import SavedProfile

PROFILES = os.path.join(scaling.RESULTS, "scaling_h100")
NVLINK_H100 = LinkSpec(360e9, 1e-6)
LINKS = ("100gbit,5us", "400gbit,5us")
SETTINGS = ("fp32", "amp")


def load(
    folder: str,
) -> tuple[dict[tuple[str, str], SavedProfile], dict[tuple[str, str], dict], str]:
    """The profiles by (setting, model), each scaled to its measured iteration time; what was
    measured per run; the device."""
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    profiles, seen = {}, {}
    for run in summary["runs"]:
        key = (run["setting"], run["model"])
        profile = SavedProfile.load(os.path.join(folder, f"{run['model']}_{run['setting']}.json"))
        factor = run["iteration_ms"] / (profile.compute_time * 1e3)
        profiles[key] = dataclasses.replace(
            profile,
            forward=tuple(u * factor for u in profile.forward),
            backward=tuple(b * factor for b in profile.backward),
            step_time=profile.step_time * factor,
            update_time=profile.update_time * factor,
        )
        seen[key] = dict(run, factor=factor)
    return profiles, seen, summary["device"]


def headline(results: dict[tuple[str, str, str], list[Prediction]], keys, link: str) -> str:
    lines = [
        "| model | compute | GPUs | compute ms | sapipe × DDP | Pipe-SGD × DDP | sapipe k "
        "| efficiency DDP / Pipe-SGD / sapipe |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for setting, name in keys:
        p = results[(setting, name, link)][-1]
        lines.append(
            f"| {scaling.MODELS[name].title} | {setting} | {p.world_size} "
            f"| {p.compute_time * 1e3:.1f} | {p.speedup('sapipe'):.2f} "
            f"| {p.speedup('pipesgd'):.2f} | {p.modes['sapipe'].k} of {p.m} | "
            + " / ".join(f"{p.efficiency(mode):.0%}" for mode in MODES)
            + " |"
        )
    return "\n".join(lines)


def main() -> None:
    p = harness.Parser(
        __doc__,
        quick=dict(nodes="1,2"),
        out=harness.RESULTS,
        out_help="folder for scaling_h100.md and scaling_h100.png",
    )
    p.add_argument("--profiles", default=PROFILES)
    p.add_argument("--nodes", default="1,2,4,8")
    args = p.parse_args()
    if args.out is None:  # --quick: not over the committed figure
        args.out = tempfile.mkdtemp(prefix="sapipe-scaling-")
    nodes = [int(n) for n in args.nodes.split(",")]
    profiles, seen, device = load(args.profiles)
    keys = [(s, n) for n in scaling.MODELS for s in SETTINGS if (s, n) in profiles]
    results = {
        (s, n, link): [
            predict(profiles[(s, n)], k, scaling.GPUS_PER_NODE, link, NVLINK_H100) for k in nodes
        ]
        for s, n in keys
        for link in LINKS
    }
    names = [
        n
        for n in scaling.FIGURES["scaling.png"][0] + scaling.FIGURES["scaling_imagenet.png"][0]
        if all((s, n) in profiles for s in SETTINGS)
    ]
    scaling.write_figure(
        os.path.join(args.out, "scaling_h100.png"),
        {(s, n): results[(s, n, LINKS[0])] for s, n in keys},
        names,
        SETTINGS,
        "CIFAR-10, GPT-2 and ImageNet",
        f"predicted from profiles recorded on one {device} (sapipe.schedule.predict)\n"
        f"8 GPUs per node, NVLink inside ({NVLINK_H100.rate / 1e9:g} GB/s), "
        f"{LINKS[0]} between nodes",
    )
    command = harness.command()
    measured = [
        "| model | compute | layers | iteration (timed) ms | profile's compute ms | scaled by |",
        "| --- | --- | ---: | ---: | ---: | ---: |",
    ]
    for setting, name in keys:
        r = seen[(setting, name)]
        measured.append(
            f"| {scaling.MODELS[name].title} | {setting} | {r['layers']} | {r['iteration_ms']:.1f} "
            f"| {r['profile_compute_ms']:.1f} | {r['factor']:.2f} |"
        )
    tables = [
        f"### {scaling.MODELS[n].title}, {s}, `{link}` between nodes\n\n"
        + format_table(results[(s, n, link)], scaling.MODELS[n].batch)
        for s, n in keys
        for link in LINKS
    ]
    text = (
        f"# Predicted scaling from profiles recorded on one {device}\n\n```\n{command}\n```\n\n"
        f"Profiles: `{os.path.relpath(args.profiles, scaling.REPO)}`, recorded by "
        "`python benchmarks/gpu_profiles.py` (one NCCL rank, torch's `fused=True` optimizers, "
        "random data, `scaling.py`'s models and per-GPU batches; fp32 is float32 without TF32, "
        "amp is bfloat16 autocast). How they are used, and the assumed links: the docstring of "
        "`benchmarks/scaling_measured.py`.\n\n"
        "## What was measured\n\n"
        + "\n".join(measured)
        + "\n\n"
        + "".join(
            f"## At {nodes[-1] * scaling.GPUS_PER_NODE} GPUs, `{link}` between nodes\n\n"
            + headline(results, keys, link)
            + "\n\n"
            for link in LINKS
        )
        + "![scaling from H100 profiles](scaling_h100.png)\n\n## Per model\n\n"
        + "\n\n".join(tables)
        + "\n"
    )
    with open(os.path.join(args.out, "scaling_h100.md"), "w") as f:
        f.write(text)
    print("\n\n".join(headline(results, keys, link) for link in LINKS))


if __name__ == "__main__":
    main()
