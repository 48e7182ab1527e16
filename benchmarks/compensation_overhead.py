"""What does staleness compensation cost per step? Each mode vs ``none``, fused vs pure PyTorch.

One process (a group of 1 -- Gloo on CPU, NCCL with ``--device cuda``: communication is the
same for every mode and drops out),
k = m by default (every layer stale, the most compensation work; ``--kappa 0.5`` stales the
fewest leading layers that hold half the parameters, closer to what the scheduler picks),
one model copy per mode. Modes are timed in interleaved rounds so that machine-load drift
hits them alike; the overhead of a
mode is the median over rounds of (its median step time in the round / that of ``none`` in
the same round) − 1, so a burst of load from elsewhere spoils a round, not the result. The whole
run is done twice, in separate processes: with the compiled kernels (``cpu-ext``) and with
``SAPIPE_DISABLE_EXT=1`` (the pure-PyTorch path).

A last row, ``torch fused=True, no sapipe``, trains the same model with the same torch
optimizer (``fused=True``, as its best users run it) and no sapipe at all: its ratio to
``none`` is what sapipe's runtime costs on one process beyond the optimizer step itself.

Each mode is also given its *floor*: the extra memory passes over the stale parameters its
definition needs beyond ``none`` (:func:`floor_streams`), times the time of one pass measured
in the same round, relative to ``none``'s step. No implementation can go below it; the
overhead above it is what the kernels could still win.

    python benchmarks/compensation_overhead.py --models gpt2,resnet50,vgg16 --size small
    python benchmarks/compensation_overhead.py --device cuda --size full   # on a GPU

On CUDA every step ends with a device synchronisation (so the host clock times the GPU's
work), and the pass is timed on the device alike.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

import harness
from harness import init_one_rank_group, synchronize

#: The baseline without sapipe: the same model and torch optimizer (``fused=True``), one process.
TORCH_FUSED = "torch fused=True, no sapipe"

MODES = [
    ("none", "outer"),
    ("dc", "outer"),
    ("dc", "diagonal"),
    ("wp1", "outer"),
    ("wp2", "outer"),
    ("wp3", "outer"),
]
#: passes (8 bytes per element: a float32 read and write) of a compression's encode and decode
#: beyond ``none``'s, by definition: 16-bit reads g and writes half, then reads half and writes
#: g (12 bytes); int8 with error feedback reads g and the residual for the chunk's scale, again
#: to quantize, writes int8 and the residual, then reads int8 and writes g (26 bytes)
CODEC_PASSES = {"fp16": 1.5, "bf16": 1.5, "int8": 3.25}


def label_of(mode: str, form: str, compression: str = "") -> str:
    """A row's name: ``dc/outer``, ``wp1``, ``none+bf16``."""
    base = f"{mode}/{form}" if mode == "dc" else mode
    return f"{base}+{compression}" if compression else base


def floor_streams(label: str, optimizer: str) -> float:
    """The fewest extra passes over the stale parameters (float32 reads + writes per element,
    per step) that a mode needs beyond ``none``'s update, by its definition (docs/design.md §3,
    s = 1), for any implementation, however fused:

    * ``dc`` diagonal: Δ's reference — read it, and store this step's for the next (+2);
    * ``dc`` outer: also the per-tensor dot products <g, Δ>, a pass of their own before the
      update can use them, reading g and Δ (+2; sapipe keeps x_{t−1} rather than Δ, so its
      pass reads three streams: one more than this floor);
    * ``wp2``: writing x̃ (+1);
    * ``wp1``: reading l_t and writing x̃, and l_t written apart from the slot its all-reduce
      overwrites in place (+3);
    * ``wp3`` outer: l_{t−1} for the step's dot products and the peek, l_t, x̃, a second pass
      (the coefficient needs every element's step) and l_t kept apart. With SGD the peek is
      linear in g̃, so the second pass can add the DC term to a partial x̃ written by the
      first: read x̃, g, l_{t−1}, write x̃ (+8 in all); Adam's is not, so its second pass
      reads g, l_{t−1}, l_t, x_t and both moments and writes x̃ (+9).
    """
    if "+" in label:  # none with a compression on the wire: its encode and decode
        return CODEC_PASSES[label.split("+")[1]]
    mode = label.split("/")[0]
    if mode == "dc":
        return 2 if label.endswith("diagonal") else 4
    return {"none": 0, "wp1": 3, "wp2": 1, "wp3": 9 if optimizer == "adam" else 8, TORCH_FUSED: 0}[
        mode
    ]


class PassTimer:
    """Seconds per pass over ``elements`` float32 from memory: half of a ``torch`` copy (one
    read, one write), from buffers rotated so that the last level cache does not hold them.
    The buffers are allocated and touched once, so no page fault is timed."""

    def __init__(self, elements: int, device, buffers: int = 3) -> None:
        import torch

        self.device = device
        self.pairs = [
            (torch.randn(elements, device=device), torch.zeros(elements, device=device))
            for _ in range(buffers)
        ]

    def __call__(self) -> float:
        times = []
        for src, dst in self.pairs:
            synchronize(self.device)
            start = time.perf_counter()
            dst.copy_(src)
            synchronize(self.device)
            times.append(time.perf_counter() - start)
        return statistics.median(times) / 2


def worker(args) -> None:
    import bench_models
    import torch

    import sapipe

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    init_one_rank_group(device)
    out = {"backend": sapipe.kernels.ops.backend(device.type), "models": {}}
    for name in args.models.split(","):
        spec = bench_models.build(name, args.size)
        batch = spec.make_batch(spec.batch_size, device, torch.Generator().manual_seed(0))
        probe = spec.make_model().to(device)  # m (layers) is known after one forward
        probe_opt = sapipe.DistributedOptimizer(spec.make_optimizer(probe.parameters()), probe)
        probe(batch[0])
        m = probe_opt.num_layers
        sizes = [layer.numel for layer in probe_opt.layers]
        probe_opt.close()
        # the fewest leading layers holding at least --kappa of the parameters (1: k = m)
        k = next(i for i in range(1, m + 1) if sum(sizes[:i]) >= args.kappa * sum(sizes) - 1e-9)
        runs = []
        stream = []  # per round: seconds per pass over the stale parameters
        one_pass = PassTimer(sum(sizes[:k]), device)
        rows = [
            (mode, form, "")
            for mode, form in MODES
            if label_of(mode, form) in args.modes.split(",")
        ]
        rows += [("none", "outer", c) for c in args.compressions.split(",") if c]
        for mode, form, compression in rows:
            model = spec.make_model().to(device)
            opt = sapipe.DistributedOptimizer(
                spec.make_optimizer(model.parameters()),
                model,
                stale_layers=k,
                compensation=mode,
                dc_form=form,
                compression=compression or None,
            )
            runs.append((label_of(mode, form, compression), model, opt, []))
        plain_model = spec.make_model().to(device)
        runs.append((TORCH_FUSED, plain_model, spec.make_optimizer(plain_model.parameters()), []))
        for round_ in range(args.rounds + 1):
            for _label, model, opt, rounds in runs:
                times = []
                for _ in range(args.steps):
                    synchronize(device)
                    start = time.perf_counter()
                    opt.zero_grad()
                    spec.loss_fn(model(batch[0]), batch[1]).backward()
                    opt.step()
                    synchronize(device)
                    times.append(time.perf_counter() - start)
                if round_ > 0:  # round 0 warms up
                    rounds.append(statistics.median(times))
            if round_ > 0:
                stream.append(one_pass())
        base = runs[0][3]  # none, per round
        out["models"][name] = {
            label: {
                "median_ms": statistics.median(r) * 1e3,
                "overhead": statistics.median(t / b for t, b in zip(r, base)) - 1,
                # the mode's floor in the same round: its inherent extra passes, relative to none's
                # step
                "floor": statistics.median(
                    floor_streams(label, spec.optimizer) * p / b for p, b in zip(stream, base)
                ),
            }
            for label, _, _, r in runs
        }
        out["models"][name]["stream_ms"] = statistics.median(stream) * 1e3
        out["models"][name]["m"] = m
        out["models"][name]["k"] = k
        out["models"][name]["kappa"] = sum(sizes[:k]) / sum(sizes)
        for _, _, opt, _ in runs[:-1]:  # the sapipe modes
            opt.close()
    print(json.dumps(out))


def main() -> None:
    p = harness.Parser(
        __doc__,
        quick=dict(models="gpt2", size="tiny", rounds=2, steps=2, fused_only=True),
        device=("cpu", "cuda"),
        size="small",
        out=harness.result_path("compensation_overhead.md"),
        out_help="the report: a dated section is appended",
        worker=True,
    )
    p.add_argument("--models", default="gpt2,resnet50,vgg16")
    p.add_argument("--rounds", type=int, default=12)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument(
        "--kappa",
        type=float,
        default=1.0,
        help="stale share of the parameters: k = the fewest leading layers holding at least this "
        "(default 1: k = m, every layer stale, the most compensation work)",
    )
    p.add_argument(
        "--modes",
        default=",".join(label_of(*m) for m in MODES),
        help="the compensation modes timed (none first: the others are relative to it)",
    )
    p.add_argument(
        "--compressions",
        default="",
        help="also none with each of these compressions on the wire (fp16, bf16, int8): the "
        "codec's cost",
    )
    p.add_argument(
        "--fused-only", action="store_true", help="skip the pure-PyTorch run (SAPIPE_DISABLE_EXT=1)"
    )
    args = p.parse_args()
    if args.worker:
        return worker(args)
    load_before = f"{os.getloadavg()[0]:.1f}"
    results = {}
    if not args.modes.startswith("none"):
        sys.exit("--modes must start with none: every other mode is timed relative to it")
    implementations = (("fused kernels", {}), ("pure PyTorch", {"SAPIPE_DISABLE_EXT": "1"}))
    for label, env in implementations[:1] if args.fused_only else implementations:
        print(f"[compensation_overhead] {label} ...", file=sys.stderr, flush=True)
        cmd = [sys.executable, os.path.abspath(__file__), "--worker"] + sys.argv[1:]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=harness.worker_env(**env))
        if proc.returncode != 0:
            sys.exit(proc.stderr[-3000:])
        results[label] = json.loads(proc.stdout.strip().splitlines()[-1])
    lines = [
        "| model (k of m, κ; one pass) | mode | floor | fused: ms/step | fused: overhead vs none | "
        "pure PyTorch: ms/step | pure PyTorch: overhead vs none |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    fused = results["fused kernels"]
    plain = results.get("pure PyTorch", {"backend": "(not run)", "models": {}})
    for name, per_mode in fused["models"].items():
        for label, f in per_mode.items():
            if label in ("m", "k", "kappa", "stream_ms"):
                continue
            t = plain["models"].get(name, {}).get(label)
            lines.append(
                f"| {name} (k={per_mode['k']} of {per_mode['m']}, κ={per_mode['kappa']:.2f}; "
                f"{per_mode['stream_ms']:.2f} ms) | {label} | {f['floor']:+.1%} | "
                f"{f['median_ms']:.1f} | "
                f"{f['overhead']:+.1%} | "
                + (f"{t['median_ms']:.1f} | {t['overhead']:+.1%} |" if t else "— | — |")
            )
    table = "\n".join(lines)
    print(f"backends: {fused['backend']} vs {plain['backend']}\n{table}")
    if not args.out:
        return
    command = harness.command()
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "a") as f:
        f.write(
            f"\n## {time.strftime('%Y-%m-%d %H:%M')} — `{command}`\n\nbackends: "
            f"`{fused['backend']}` vs "
            f"`{plain['backend']}`; base optimizer: torch's with `fused=True` (bench_models); "
            f"k for κ ≥ {args.kappa}, one process, {args.rounds} interleaved rounds of "
            f"{args.steps} steps "
            "per mode (ms/step: median of the rounds' medians; overhead: median over rounds of "
            "the "
            "ratio to `none` in the same round; floor: the mode's inherent extra passes over the "
            "stale "
            "parameters (`floor_streams`) × one pass (a cold `torch` copy's time / 2, timed in "
            "each round), "
            f"relative to `none`'s step); load average before / after: {load_before} / "
            f"{os.getloadavg()[0]:.1f}\n\n{table}\n"
        )


if __name__ == "__main__":
    main()
