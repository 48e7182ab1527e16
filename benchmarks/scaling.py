"""The shape of the SAPipe paper's scaling figure, predicted from FLOP counts (no GPU here).

The paper (§5, Figure 3) trains VGG-16, ResNet-50 and GPT-2 on 1 to 8 machines of 8 V100
GPUs (NVLink inside a machine, 100 Gbit/s between machines) and plots throughput against
the number of workers for Horovod, BytePS, Pipe-SGD and SAPipe. This script builds, for
each model, the profile a V100 job would have saved (``opt.save_profile``) from stated
assumptions instead of a measurement, writes it to ``benchmarks/results/scaling/``, and
predicts DDP, Pipe-SGD and sapipe on 1, 2, 4 and 8 nodes of 8 GPUs with
:func:`sapipe.schedule.predict.predict`. Output: ``benchmarks/results/scaling.md`` (the
command, the assumptions, one table per model and compute rate, how the shape compares with
the paper's) and ``benchmarks/results/scaling.png``.

How a profile is derived (every number is in the md):

* **Layers** are the models of ``bench_models`` at size ``full`` (VGG-16 and ResNet-50 at
  224×224 with 1000 classes, ResNet-50 with GroupNorm where torchvision has BatchNorm: the
  same parameters; GPT-2 small, 124 M parameters, context 1024), cut into layers by
  sapipe's rule (modules that own parameters, in forward order; ``describe_layers``).
* **Forward** u_i: the FLOPs ``torch.utils.flop_counter.FlopCounterMode`` counts (matrix
  products, convolutions, attention) on the meta device, from layer i's start to the next
  layer's (as sapipe's profiler charges ops between layers to the layer before), at a
  sustained rate. **Backward** b_i = 2 u_i.
* **Rate**: 9.3 TFLOP/s (fp32) is what our ResNet-50 count gives for 380 images/s, V100 fp32
  training throughput as published (NVIDIA's DeepLearningExamples report 360–400), so the
  memory-bound work the counter misses (normalisation, activations) is folded in as it is
  in ResNet-50; a second setting, 29 TFLOP/s, is ResNet-50 at 1200 images/s under mixed
  precision (tensor cores), gradients still float32.
* **Update**: the optimizer reads and writes its state once per step at 800 GB/s (V100
  HBM2, 900 GB/s peak): SGD with momentum 20 bytes per parameter (read p, g, m; write p,
  m), Adam 28 (read p, g, m, v; write p, m, v). No other step time.
* **Link**: float32 gradients in 25 MiB buckets. Inside a node a ring over NVLink at
  130 GB/s bus bandwidth (NCCL's all-reduce busbw on a DGX-1-class V100 node) and 1 µs
  per ring step, as the profile of one node of 8 GPUs would measure it (the prediction
  derives the intra-node link back from it); between nodes 100 Gbit/s and 5 µs per ring step.
* σ = 0 (a GPU's compute is not slowed by the host's communication threads),
  ``sync_at_step`` False (no clipping).

    python benchmarks/scaling.py
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Dict, List, Sequence, Tuple

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import bench_models  # noqa: E402
from sapipe.schedule.cluster_link import ClusterLink, LinkSpec  # noqa: E402
from sapipe.schedule.predict import MODES, Prediction, format_table, plot_throughput, predict  # noqa: E402
from sapipe.schedule.saved_profile import SavedProfile  # noqa: E402
from sapipe.schedule.solver import choose_k  # noqa: E402

REPO = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
#: per model: samples per GPU per iteration, what a sample is
MODELS = {"vgg16": (128, "images"), "resnet50": (128, "images"), "gpt2": (8, "sequences of 1024 tokens")}
RATES = {"fp32": 9.3e12, "amp": 29e12}  # sustained FLOP/s (module docstring)
MEMORY_BANDWIDTH = 800e9  # bytes/s the optimizer's update streams at
UPDATE_BYTES = {"sgd": 20, "adam": 28}  # per parameter, float32 state
NVLINK = LinkSpec(130e9, 1e-6)  # per ring edge: NCCL bus bandwidth on one V100 node
INTER = "100gbit,5us"
#: slower links between nodes, for the sensitivity table (at the largest node count)
SLOWER = ("40gbit,5us", "25gbit,5us", "10gbit,5us")
GPUS_PER_NODE = 8
BUCKET_CAP_BYTES = 25 * 1024 * 1024


def layer_flops(name: str, batch: int) -> Tuple[List[str], List[int], List[float]]:
    """sapipe's layers of ``bench_models``' full ``name`` (names, parameters, forward FLOPs at
    ``batch``), counted on the meta device: each layer from its forward's start to the next's."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    spec = bench_models.build(name, "full", batch)
    with torch.device("meta"):
        model = spec.make_model()
        x = torch.zeros(batch, 1024, dtype=torch.long) if name == "gpt2" else torch.empty(batch, 3, 224, 224)
    layers = bench_models.describe_layers(model, x[:1])
    modules = dict(model.named_modules())
    starts: Dict[str, float] = {}
    counter = FlopCounterMode(display=False)

    def started(name: str) -> None:
        starts.setdefault(name, counter.get_total_flops())  # a pre-hook returning a value would replace the input

    hooks = [modules[n].register_forward_pre_hook(lambda mod, args, n=n: started(n)) for n, _ in layers]
    with counter, torch.no_grad():
        model(x)
    for hook in hooks:
        hook.remove()
    total = counter.get_total_flops()
    ran = sorted((at, n) for n, at in starts.items())
    ends = {n: (ran[i + 1][0] if i + 1 < len(ran) else total) for i, (_, n) in enumerate(ran)}
    flops = [float(ends[n] - starts[n]) if n in starts else 0.0 for n, _ in layers]
    return [n for n, _ in layers], [k for _, k in layers], flops


def derived_profile(name: str, batch: int, flop_rate: float, setting: str) -> SavedProfile:
    """The profile a job of ``name`` on one node of 8 V100s would save (module docstring)."""
    names, numel, flops = layer_flops(name, batch)
    forward = [f / flop_rate for f in flops]
    update = sum(numel) * UPDATE_BYTES[bench_models.build(name, "full").optimizer] / MEMORY_BANDWIDTH
    alpha, beta = ClusterLink(1, GPUS_PER_NODE, LinkSpec(1.0), NVLINK).allreduce()
    fields = dict(layers=tuple(names), numel=tuple(numel), element_size=4, forward=tuple(forward),
                  backward=tuple(2 * u for u in forward), step_time=0.0, update_time=update, alpha=alpha, beta=beta,
                  slowdown=0.0, world_size=GPUS_PER_NODE, nodes=1, ranks_per_node=GPUS_PER_NODE, hierarchical=False,
                  backend="torch", compression=None, wire_ratio=1.0, codec_per_byte=0.0,
                  bucket_cap_bytes=BUCKET_CAP_BYTES, sync_at_step=False,
                  device=f"V100 (derived from FLOPs, {setting}: {flop_rate / 1e12:g} TFLOP/s)",
                  stale_layers=0, iteration_time=0.0)
    draft = SavedProfile(**fields)
    decision = choose_k(draft.layer_profiles(alpha, beta), tolerance=0.03, bucket_cap_bytes=BUCKET_CAP_BYTES,
                        alpha=alpha, beta=beta, bytes_per_layer=draft.layer_bytes, shared_link=True,
                        update_per_element=update / sum(numel))
    return SavedProfile(**dict(fields, stale_layers=decision.k, iteration_time=decision.iteration_time))


def _shape_notes(results: Dict[Tuple[str, str], List[Prediction]]) -> List[str]:
    """Facts of the predictions the comparison with the paper rests on, one line each."""
    notes = []
    for (setting, name), preds in results.items():
        best = max(preds, key=lambda p: p.speedup("sapipe"))
        over_pipe = max(p.modes["pipesgd"].iteration_time / p.modes["sapipe"].iteration_time for p in preds)
        eff = {mode: preds[-1].efficiency(mode) for mode in MODES}
        notes.append(f"* {name} ({setting}): sapipe up to {best.speedup('sapipe') - 1:+.0%} over DDP "
                     f"({best.world_size} GPUs, k = {best.modes['sapipe'].k} of {best.m}); sapipe / Pipe-SGD "
                     f"throughput at most {over_pipe:.3f}; at {preds[-1].world_size} GPUs the efficiency "
                     f"(compute / iteration) is DDP {eff['ddp']:.0%}, Pipe-SGD {eff['pipesgd']:.0%}, "
                     f"sapipe {eff['sapipe']:.0%}")
    return notes


def sensitivity(profiles: Dict[Tuple[str, str], SavedProfile], nodes: int) -> str:
    """sapipe's and Pipe-SGD's speed-up over DDP on ``nodes`` nodes as the link between nodes slows."""
    rates = (INTER,) + SLOWER
    lines = ["| model | compute | " + " | ".join(f"`{r}`" for r in rates) + " |",
             "| --- | --- | " + " | ".join("---" for _ in rates) + " |"]
    for (setting, name), profile in profiles.items():
        cells = []
        for rate in rates:
            p = predict(profile, nodes, GPUS_PER_NODE, rate)
            cells.append(f"{p.speedup('sapipe'):.2f} (k={p.modes['sapipe'].k}) / {p.speedup('pipesgd'):.2f}; "
                         f"DDP {p.efficiency('ddp'):.0%}")
        lines.append(f"| {name} | {setting} | " + " | ".join(cells) + " |")
    return (f"Speed-up over DDP of sapipe (its k) / of Pipe-SGD, and DDP's efficiency, on {nodes} nodes × "
            f"{GPUS_PER_NODE} GPUs as the link between nodes slows (latency 5 µs per step throughout):\n\n"
            + "\n".join(lines))


def write_figure(path: str, results: Dict[Tuple[str, str], List[Prediction]], settings: Sequence[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(settings), len(MODELS), figsize=(5 * len(MODELS), 3.8 * len(settings)),
                             squeeze=False)
    for row, setting in enumerate(settings):
        for col, name in enumerate(MODELS):
            batch, unit = MODELS[name]
            plot_throughput(axes[row][col], results[(setting, name)], batch,
                            f"{name}, {batch} {unit.split(' of ')[0]}/GPU, {setting} ({RATES[setting] / 1e12:g} TFLOP/s)")
            axes[row][col].set_xlabel("GPUs (8 per node)")
            axes[row][col].set_ylabel(f"{unit.split(' of ')[0]}/s")
    fig.suptitle(f"Predicted from FLOP counts: V100 nodes, NVLink inside, {INTER} between (sapipe.schedule.predict)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nodes", default="1,2,4,8")
    p.add_argument("--settings", default="fp32,amp", help=f"compute rates, of {list(RATES)}")
    p.add_argument("--out", default=RESULTS, help="folder for scaling.md, scaling.png and scaling/<model>.json")
    args = p.parse_args()
    nodes = [int(n) for n in args.nodes.split(",")]
    settings = [s for s in args.settings.split(",") if s]
    os.makedirs(os.path.join(args.out, "scaling"), exist_ok=True)
    results: Dict[Tuple[str, str], List[Prediction]] = {}
    profiles: Dict[Tuple[str, str], SavedProfile] = {}
    tables = []
    for setting in settings:
        for name, (batch, unit) in MODELS.items():
            started = time.perf_counter()
            profile = derived_profile(name, batch, RATES[setting], setting)
            path = os.path.join(args.out, "scaling", f"{name}_{setting}.json")
            profile.save(path)
            profiles[(setting, name)] = profile
            results[(setting, name)] = [predict(profile, n, GPUS_PER_NODE, INTER) for n in nodes]
            print(f"[scaling] {name} {setting}: {len(profile.layers)} layers, compute "
                  f"{profile.compute_time * 1e3:.1f} ms, {time.perf_counter() - started:.1f} s", file=sys.stderr)
            tables.append(f"### {name}, {setting}: {batch} {unit} per GPU\n\n"
                          f"Profile `{os.path.relpath(path, REPO)}`: {len(profile.layers)} layers, "
                          f"{sum(profile.numel) / 1e6:.1f} M parameters, compute "
                          f"{profile.compute_time * 1e3:.1f} ms per iteration (of which the update "
                          f"{profile.update_time * 1e3:.2f} ms); gradients {sum(profile.layer_bytes) / 2**20:.0f} MiB.\n\n"
                          + format_table(results[(setting, name)], batch))
    write_figure(os.path.join(args.out, "scaling.png"), results, settings)
    command = "python benchmarks/scaling.py" + ("" if len(sys.argv) == 1 else " " + " ".join(sys.argv[1:]))
    with open(os.path.join(args.out, "scaling.md"), "w") as f:
        f.write(report(command, tables + [sensitivity(profiles, nodes[-1])], _shape_notes(results)))
    print("\n\n".join(tables + [sensitivity(profiles, nodes[-1])]))


def report(command: str, tables: Sequence[str], notes: Sequence[str]) -> str:
    assumptions = (
        f"| what | assumed |\n| --- | --- |\n"
        f"| models | `bench_models` size `full`: VGG-16 and ResNet-50 (GroupNorm) at 224×224, GPT-2 small at "
        f"context 1024; per GPU " + ", ".join(f"{n} {b} {u}" for n, (b, u) in MODELS.items()) + " |\n"
        f"| forward | FLOPs of `FlopCounterMode` (matmuls, convolutions, attention; causal attention counted "
        f"in full) per layer; backward = 2 × forward |\n"
        f"| compute rate | fp32 {RATES['fp32'] / 1e12:g} TFLOP/s (= ResNet-50 at 380 images/s); amp "
        f"{RATES['amp'] / 1e12:g} TFLOP/s (= 1200 images/s, mixed precision) |\n"
        f"| update | {UPDATE_BYTES['sgd']} (SGD, momentum) or {UPDATE_BYTES['adam']} (Adam) bytes per parameter "
        f"at {MEMORY_BANDWIDTH / 1e9:g} GB/s; no other step time |\n"
        f"| gradients | float32, {BUCKET_CAP_BYTES // 2**20} MiB buckets (sapipe and DDP) |\n"
        f"| inside a node | ring over NVLink, {NVLINK.rate / 1e9:g} GB/s bus bandwidth, "
        f"{NVLINK.latency * 1e6:g} µs per step (the profile is of one node of 8; the prediction derives it back) |\n"
        f"| between nodes | `{INTER}`: 100 Gbit/s per node, 5 µs per ring step |\n"
        f"| σ, clipping | 0 (GPU), none (`sync_at_step` False) |\n")
    return (f"# Predicted scaling: VGG-16, ResNet-50, GPT-2 on V100 nodes\n\n`{command}`\n\n"
            "No GPU was used: each model's profile is derived from FLOP counts under the assumptions below "
            "(`benchmarks/scaling.py`), then `sapipe.schedule.predict` predicts DDP (k = 0, DDP's timeline, one "
            "flat all-reduce at a time), Pipe-SGD (k = m) and sapipe (the k `stale_layers=\"auto\"` would choose, "
            "sums node first) on 1, 2, 4 and 8 nodes of 8 GPUs. Figure: `scaling.png`.\n\n"
            f"## Assumptions\n\n{assumptions}\n## Predictions\n\n" + "\n\n".join(tables)
            + "\n\n## Against the paper's Figure 3\n\n" + "\n".join(notes) + "\n\n" + COMPARISON)


#: The comparison with the paper, written from the predictions above (re-read it when they change).
COMPARISON = """\
The paper's figure is not in its text; what its §5 says of it: throughput grows with the
number of workers for every system; Horovod is lowest, BytePS next, Pipe-SGD the best
baseline, SAPipe on top, up to 57 % over BytePS, 203 % over Horovod and 6 % over Pipe-SGD.
DDP here stands for both Horovod and BytePS (one all-reduce per bucket, overlapping the
backward, no scheduling), so only the orderings and the size of the gaps can be compared.

**Where the shape matches.** The order DDP ≤ sapipe ≤ Pipe-SGD holds at every point, and
the gap between DDP and the stale pipelines opens where the job first crosses the network
(1 → 2 nodes) and is largest for GPT-2, whose gradients are the largest relative to its
compute (the paper too singles out GPT-2 as the model where BytePS keeps a large
communication overhead). With faster compute (the `amp` rows) the gaps grow, and on slower
links between nodes (the sensitivity table) they reach the paper's order of magnitude:
GPT-2 at 25 Gbit/s gains 60 % over DDP, ResNet-50 (amp) 41 % at 10 Gbit/s.

**Where it does not.** At the stated 100 Gbit/s, V100 compute and 128 images per GPU, the
α–β model finds VGG-16 and ResNet-50 compute-bound: every mode within about 1 % of linear
scaling, sapipe's k = 0, nothing like the paper's tens of percent. GPT-2 gains 3 % (fp32)
to 10 % (amp), not 57–203 %. Three reasons, none of them measured here: (1) the model's
links run at their nominal rate with ideal rings, where real NCCL/Gloo over TCP, BytePS's
CPU servers and Horovod's negotiation reach well below 100 Gbit/s (the sensitivity table
shows how fast the gaps grow as the effective rate falls); (2) DDP is modelled with
perfect overlap of every bucket with the backward that follows it, better than Horovod
without tuning; (3) the paper's batches may be smaller than the ones chosen here (its
GPT-2 batch is "80 tokens" per GPU, which would make GPT-2 communication-bound), or its
images CIFAR-sized. And sapipe never beats Pipe-SGD here: with the same runtime, k = m
hides the most, and sapipe takes the smallest k within 3 % of it by design; the paper's
6 % over Pipe-SGD comes from its runtime optimisations over its own Pipe-SGD
implementation, which a model of one runtime cannot show.
"""


if __name__ == "__main__":
    main()
