"""What compression buys on a GPU cluster, node first or flat: predicted from H100 profiles.

The profiles of ``benchmarks/results/scaling_h100/`` (one H100, each scaled to its measured
iteration as ``scaling_measured.py`` scales them) are put on N nodes of 8 GPUs with the
links ``scaling_measured.py`` assumes (NVLink ring at 360 GB/s inside a node; 100 or 400
Gbit/s per node between nodes), uncompressed and with each ``compression=`` format, and
sapipe's iteration is predicted (:func:`sapipe.schedule.predict.predict`) with its sums
node first (``hierarchical=None``, the default on several nodes) and flat
(``hierarchical=False``). Flat, each of a node's 8 ranks sends its all-to-all shards to the
other nodes through the node's NIC: 8 times the compressed bytes of a ring
(:mod:`sapipe.schedule.cluster_link`).

What is assumed beyond ``scaling_measured.py``: each format's wire ratio (bytes on the wire
per gradient byte: bf16 1/2, int8 (1 + 4/64)/4), and the codec's time ``--codec-ns-per-byte``
per gradient byte (default 0: not measured on a GPU yet; node first it works on 1/8 of it).

    python benchmarks/compression_cluster.py [--nodes 8] [--models gpt2,vgg16]
        [--codec-ns-per-byte 0]
"""

from __future__ import annotations

import dataclasses

import harness
import scaling_measured

from sapipe.schedule.predict import predict

WIRE_RATIO = {None: 1.0, "bf16": 0.5, "int8": (1 + 4 / 64) / 4}
GPUS_PER_NODE = 8


def rows(profiles, nodes: int, codec_per_byte: float):
    """(model, setting, link, format, DDP ms, node-first ms (k), flat ms (k)) per case."""
    for (setting, model), profile in sorted(profiles.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        for link in scaling_measured.LINKS:
            for kind, ratio in WIRE_RATIO.items():
                case = dataclasses.replace(
                    profile,
                    compression=kind,
                    wire_ratio=ratio,
                    codec_per_byte=codec_per_byte if kind else 0.0,
                )
                sums = [
                    predict(
                        case,
                        nodes,
                        GPUS_PER_NODE,
                        link,
                        scaling_measured.NVLINK_H100,
                        hierarchical=h,
                    )
                    for h in (None, False)
                ]
                ddp = sums[0].modes["ddp"].iteration_time
                yield (
                    model,
                    setting,
                    link,
                    kind or "none",
                    ddp,
                    *[(p.modes["sapipe"].iteration_time, p.modes["sapipe"].k) for p in sums],
                )


def main() -> None:
    p = harness.Parser(__doc__, quick=dict(nodes=2, models="gpt2"))
    p.add_argument("--profiles", default=scaling_measured.PROFILES)
    p.add_argument("--nodes", type=int, default=8)
    p.add_argument(
        "--models", default="gpt2,vgg16", help="model names of the profiles (comma-separated)"
    )
    p.add_argument("--codec-ns-per-byte", type=float, default=0.0)
    args = p.parse_args()
    profiles, _, device = scaling_measured.load(args.profiles)
    wanted = set(args.models.split(","))
    profiles = {key: prof for key, prof in profiles.items() if key[1] in wanted}
    print(
        f"{args.nodes} nodes x {GPUS_PER_NODE} GPUs, profiles of one {device}; codec "
        f"{args.codec_ns_per_byte} ns per gradient byte\n"
    )
    print(
        "| model | setting | between nodes | compression | DDP | sapipe node first (k) "
        "| sapipe flat (k) | flat / node first |"
    )
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: |")
    for model, setting, link, kind, ddp, (first, k1), (flat, k2) in rows(
        profiles, args.nodes, args.codec_ns_per_byte * 1e-9
    ):
        print(
            f"| {model} | {setting} | {link} | {kind} | {ddp * 1e3:.1f} ms "
            f"| {first * 1e3:.1f} ms ({k1}) | {flat * 1e3:.1f} ms ({k2}) | {flat / first:.2f} |"
        )


if __name__ == "__main__":
    main()
