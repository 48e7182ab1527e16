"""Record, on this machine's GPU, the profile (``opt.save_profile``) of each ``scaling.py`` model.

``python benchmarks/scaling_measured.py --profiles DIR`` predicts the paper's scaling figure
from these instead of from FLOP counts. Each model trains on one NCCL rank with the per-GPU batch of
``scaling.py``, torch's ``fused=True`` optimizer (SGD with momentum or Adam, as
``bench_models``), random data, under ``stale_layers="auto"`` until k is final; then
its profile is saved: per-layer forward and backward times as the GPU runs them (the
profiler waits for the device at each timestamp of its profiled iterations), the update and
the step time. Two settings: ``fp32`` (float32, torch's default: no TF32) and ``amp``
(bfloat16 autocast over forward and loss, float32 parameters and gradients). A one-rank
group has no link to measure: a prediction from these profiles names both links.

Beside the profiles, ``summary.json`` gives per run the decision iteration and the
iteration time timed after the decision (the device synchronised around 10 iterations),
against the profile's own compute (forward + backward + update + step), to show how
complete the profile is.

    python benchmarks/gpu_profiles.py --out gpu-results/profiles [--models vgg16_cifar,gpt2]
        [--settings fp32,amp]
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time

import bench_models
import harness
import scaling
from harness import init_one_rank_group, synchronize

#: the loss and learning rate each model trains with (bench_models' choices)
LM_MODELS = {"gpt2"}
CLASSES = {"vgg16_cifar": 10, "resnet50_cifar": 10, "vgg16": 1000, "resnet50": 1000}
TIMED_ITERATIONS = 10
MAX_ITERATIONS = 80


def batch_of(name: str, model: scaling.Model, batch: int, device, generator):
    """Random inputs and targets of ``batch`` samples for ``name``."""
    import torch

    if name in LM_MODELS:
        return bench_models.build(name, "full").make_batch(batch, device, generator)
    x = torch.randn((batch,) + model.sample, generator=generator)
    y = torch.randint(0, CLASSES[name], (batch,), generator=generator)
    return x.to(device), y.to(device)


def record(name: str, setting: str, out: str, device, batch: int = 0) -> dict:
    """Train ``name`` under ``setting`` until auto decided; save the profile; what was seen.
    ``batch``: samples per iteration (0: the per-GPU batch of scaling.py)."""
    import torch
    import torch.nn.functional as F

    import sapipe
    from sapipe.schedule.saved_profile import SavedProfile

    model = scaling.MODELS[name]
    net = model.make().to(device)
    loss_fn = bench_models._lm_loss if name in LM_MODELS else F.cross_entropy
    if model.optimizer == "sgd":
        base = torch.optim.SGD(
            net.parameters(), lr=0.01, momentum=0.9, weight_decay=1e-4, fused=True
        )
    else:
        base = torch.optim.Adam(net.parameters(), lr=3e-4, fused=True)
    opt = sapipe.DistributedOptimizer(base, net, stale_layers="auto")
    x, y = batch_of(name, model, batch or model.batch, device, torch.Generator().manual_seed(0))
    autocast = (
        (lambda: torch.autocast(device.type, dtype=torch.bfloat16))
        if setting == "amp"
        else contextlib.nullcontext
    )

    def iteration():
        opt.zero_grad(set_to_none=True)
        with autocast():
            loss = loss_fn(net(x), y)
        loss.backward()
        opt.step()

    for _ in range(MAX_ITERATIONS):
        iteration()
        if opt.auto.decided:
            break
    if not opt.auto.decided:
        raise RuntimeError(
            f"{name} {setting}: auto did not decide within {MAX_ITERATIONS} iterations"
        )
    times = []
    for _ in range(TIMED_ITERATIONS):
        synchronize(device)
        start = time.perf_counter()
        iteration()
        synchronize(device)
        times.append(time.perf_counter() - start)
    path = os.path.join(out, f"{name}_{setting}.json")
    opt.save_profile(path)
    profile = SavedProfile.load(path)
    seen = {
        "model": name,
        "setting": setting,
        "layers": len(profile.layers),
        "k": profile.stale_layers,
        "decided_at": opt.auto.decided_at,
        "iteration_ms": statistics.median(times) * 1e3,
        "profile_compute_ms": profile.compute_time * 1e3,
        "forward_ms": sum(profile.forward) * 1e3,
        "backward_ms": sum(profile.backward) * 1e3,
        "update_ms": profile.update_time * 1e3,
        "step_ms": profile.step_time * 1e3,
    }
    opt.close()
    if device.type == "cuda":
        seen["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        del opt, base, net
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    return seen


def main() -> None:
    p = harness.Parser(
        __doc__,
        quick=dict(device="cpu", models="vgg16_cifar", settings="fp32", batch=2),
        device=("cuda", "cpu"),
        out=None,
        out_help="folder for <model>_<setting>.json and summary.json (required)",
    )
    p.add_argument("--models", default=",".join(scaling.MODELS))
    p.add_argument("--settings", default="fp32,amp")
    p.add_argument(
        "--batch",
        type=int,
        default=0,
        help="samples per iteration (0: scaling.py's per-GPU batch)",
    )
    args = p.parse_args()
    if args.out is None and not args.quick:
        p.error("--out is required")
    args.out = args.out or tempfile.mkdtemp(prefix="sapipe-profiles-")
    import torch
    import torch.distributed as dist

    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        sys.exit("gpu_profiles: torch sees no CUDA device")
    init_one_rank_group(device)
    os.makedirs(args.out, exist_ok=True)
    summary = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "runs": [],
    }
    for name in args.models.split(","):
        for setting in args.settings.split(","):
            seen = record(name, setting, args.out, device, args.batch)
            summary["runs"].append(seen)
            print(json.dumps(seen), flush=True)
            with open(os.path.join(args.out, "summary.json"), "w") as f:
                json.dump(summary, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
