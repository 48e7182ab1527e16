"""Does a one-node profile predict the cluster? ``sapipe.schedule.predict`` vs emulated nodes.

As root, on one host (docs/design.md §6, ``sapipe-launch --emulate-cluster``; Gloo on the CPU,
one thread per rank, ``OMP_NUM_THREADS=1``):

1. a one-node job of 4 ranks (``1x4``, the node's loopback unshaped) trains ``--model``
   (``bench_models``, size ``--size``: gpt2 small, as the throughput benchmark's cluster
   jobs) with ``stale_layers="auto"`` (default settings) until k is final, and rank 0
   saves the profile (``opt.save_profile``);
2. one job per ``--topologies`` (``2x2``, ``4x1``) with ``--inter-node`` (1 Gbit/s)
   between nodes times, in interleaved rounds of alternating order, DDP (torch's, the
   model's fused optimizer, 25 MiB buckets), sapipe with k = m (Pipe-SGD) and sapipe
   ``"auto"`` once its k is final; measured = the mean step time of rank 0 over
   ``--steps`` timed steps per mode (a saturated link alternates long and short steps;
   only the mean is the rate). Each job saves its own auto profile too;
3. :func:`sapipe.schedule.predict.predict` from the ``1x4`` profile for each topology
   at ``--inter-node`` (the intra-node link derived from the profile), and, for reference,
   from each cluster job's own profile (intra-node link from the ``1x4`` profile where
   a node has several ranks) and from the other cluster job's profile (2x2's for 4x1 and
   4x1's for 2x2: compute measured under the same emulated network, a different layout).

Output: a table (measured vs predicted per mode and topology, error) on stdout and in
``--out`` (default ``benchmarks/results/predict_validation.md``) with the command.
Target: within 10 %. Not root (or no emulated cluster here): a message, exit status 0.

    python benchmarks/predict_validation.py --steps 40 --rounds 4
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time

import harness

from sapipe.launch import cluster

MODES = ("ddp", "pipesgd", "sapipe")
MAX_SETTLE_STEPS = 500  # untimed steps "auto" may take to profile and measure its k
WARMUP = 3  # untimed steps of each mode after its setup


# ----------------------------------------------------------------------------- on every rank


def worker(args) -> None:
    import bench_models
    import torch
    import torch.distributed as dist

    import sapipe

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    spec = bench_models.build(args.model, args.size)
    gen = torch.Generator().manual_seed(1000 + rank)
    batches = [spec.make_batch(spec.batch_size, torch.device("cpu"), gen) for _ in range(4)]
    count = [0]

    def step(net, opt):
        x, y = batches[count[0] % len(batches)]
        count[0] += 1
        opt.zero_grad()
        spec.loss_fn(net(x), y).backward()
        opt.step()

    def timed(net, opt, steps):
        """Per-iteration times: gaps between consecutive step ends (no barrier in the loop)."""
        dist.barrier()
        times, last = [], time.perf_counter()
        for _ in range(steps):
            step(net, opt)
            now = time.perf_counter()
            times.append(now - last)
            last = now
        return times

    def sapipe_run(stale_layers):
        model = spec.make_model()
        opt = sapipe.DistributedOptimizer(
            spec.make_optimizer(model.parameters()),
            model,
            stale_layers=stale_layers,
            bucket_cap_mb=25,
            timeout=600,
        )
        for _ in range(MAX_SETTLE_STEPS):  # "auto" profiles, then measures its k: until k is final
            if opt.stale_layers != "auto":
                break
            step(model, opt)
        return model, opt

    auto = sapipe_run("auto")
    if rank == 0:
        auto[1].save_profile(args.profile_out)
    if args.role == "profile":
        _finish(dist)
    from torch.nn.parallel import DistributedDataParallel as DDP

    runs = {"sapipe": auto, "pipesgd": sapipe_run(auto[1].num_layers)}
    ddp_model = spec.make_model()
    runs["ddp"] = (DDP(ddp_model, bucket_cap_mb=25), spec.make_optimizer(ddp_model.parameters()))
    for net, opt in runs.values():
        timed(net, opt, WARMUP)
        _pause(opt)
    times = {mode: [] for mode in runs}
    per_round = max(1, math.ceil(args.steps / args.rounds))
    for r in range(args.rounds):  # interleaved, alternating order: host drifts hit every mode alike
        for mode in MODES if r % 2 == 0 else MODES[::-1]:
            net, opt = runs[mode]
            timed(net, opt, 1)  # caches and the link were another mode's
            times[mode] += timed(net, opt, per_round)
            _pause(opt)
    if rank == 0:
        decision = auto[1].decision
        result = {
            "k": auto[1].stale_layers,
            "m": auto[1].num_layers,
            "times": times,
            "measured": {mode: statistics.fmean(ts) for mode, ts in times.items()},
            "own_prediction": decision.iteration_time if decision is not None else None,
        }
        with open(args.result_out, "w") as f:
            json.dump(result, f)
    _finish(dist)


def _pause(opt) -> None:
    """A sapipe run's stale all-reduces must not overlap the next mode's steps."""
    wait = getattr(opt, "wait_for_communication", None)
    if wait is not None:
        wait()


def _finish(dist) -> None:
    dist.barrier()
    # sapipe runs leave their last stale all-reduce in flight (as a training loop that just
    # ends does); tearing Gloo down under it can abort the process at exit
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


# ----------------------------------------------------------------------------- the host


def launch(topology: str, args, role: str, profile_out: str, result_out: str) -> None:
    """One emulated-cluster job of the worker; RuntimeError with its output's tail if it fails."""
    cmd = [
        sys.executable,
        "-m",
        "sapipe.launch",
        "--quiet",
        "--emulate-cluster",
        topology,
        "--inter-node",
        args.inter_node,
        "--monitor-interval=0.5",
        os.path.abspath(__file__),
        "--worker",
        "--role",
        role,
        "--model",
        args.model,
        "--size",
        args.size,
        "--steps",
        str(args.steps),
        "--rounds",
        str(args.rounds),
        "--profile-out",
        profile_out,
        "--result-out",
        result_out,
    ]
    print(
        f"[predict_validation] {topology} ({role}), load {os.getloadavg()[0]:.2f}: "
        f"{shlex.join(cmd)}",
        file=sys.stderr,
        flush=True,
    )
    env = harness.worker_env(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        raise RuntimeError(
            f"{topology} ({role}) failed with status {done.returncode}:\n"
            f"{(done.stdout + done.stderr)[-3000:]}"
        )


def _err(predicted: float, measured: float) -> str:
    return f"{(predicted - measured) / measured:+.1%}"


def table(args, reference, jobs) -> str:
    """Measured vs predicted per topology and mode (module docstring)."""
    from sapipe.schedule.cluster_link import intra_link_from_profile
    from sapipe.schedule.predict import predict, simulator_arguments
    from sapipe.schedule.simulator import simulate

    lines = [
        "| topology | mode | k measured / predicted | measured ms "
        "| predicted ms (1x4 profile) | error "
        "| at the measured k | predicted ms (the other topology's profile) | error "
        "| predicted ms (own profile) | error |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    intra = intra_link_from_profile(reference)
    for topology, (result, own) in jobs.items():
        nodes, g = cluster.parse_topology(topology)
        pred = predict(reference, nodes, g, args.inter_node)
        ref = predict(own, nodes, g, args.inter_node, intra=intra if g > 1 else None)
        others = [profile for name, (_, profile) in jobs.items() if name != topology]
        cross = (
            predict(others[0], nodes, g, args.inter_node, intra=intra if g > 1 else None)
            if others
            else None
        )
        for mode in MODES:
            measured = result["measured"][mode] * 1e3
            p, r = pred.modes[mode], ref.modes[mode]
            k = {"ddp": "0", "pipesgd": f"{result['m']}"}.get(mode, f"{result['k']} / {p.k}")
            at_k = ""
            if mode == "sapipe":
                at = simulate(
                    reference.layer_profiles(p.alpha, p.beta),
                    result["k"],
                    record_events=False,
                    **simulator_arguments(reference, p.alpha, p.beta, reference.slowdown),
                )
                at_k = f"{at.iteration_time * 1e3:.1f} ({_err(at.iteration_time * 1e3, measured)})"
            c = cross.modes[mode].iteration_time * 1e3 if cross is not None else math.nan
            lines.append(
                f"| {topology} | {mode} | {k} | {measured:.1f} | {p.iteration_time * 1e3:.1f} "
                f"| {_err(p.iteration_time * 1e3, measured)} | {at_k} | {c:.1f} "
                f"| {_err(c, measured)} "
                f"| {r.iteration_time * 1e3:.1f} | {_err(r.iteration_time * 1e3, measured)} |"
            )
    return "\n".join(lines)


def main() -> None:
    p = harness.Parser(
        __doc__,
        quick=dict(size="tiny", topologies="2x2", steps=4, rounds=2),
        size="small",
        out=harness.result_path("predict_validation.md"),
        out_help="the report: a dated section is appended",
        worker=True,
    )
    p.add_argument("--model", default="gpt2")
    p.add_argument("--topologies", default="2x2,4x1")
    p.add_argument("--inter-node", default="1gbit")
    p.add_argument("--steps", type=int, default=40, help="timed steps per mode")
    p.add_argument(
        "--rounds",
        type=int,
        default=4,
        help="the timed steps are split into this many interleaved rounds",
    )
    p.add_argument("--role", default="measure", help=argparse.SUPPRESS)
    p.add_argument("--profile-out", help=argparse.SUPPRESS)
    p.add_argument("--result-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        return worker(args)
    ok, why = cluster.check()
    if not ok:
        print(f"predict_validation skipped: {why}", file=sys.stderr)
        return
    from sapipe.schedule.saved_profile import SavedProfile

    with tempfile.TemporaryDirectory() as tmp:
        launch(
            "1x4",
            args,
            "profile",
            os.path.join(tmp, "profile_1x4.json"),
            os.path.join(tmp, "unused.json"),
        )
        reference = SavedProfile.load(os.path.join(tmp, "profile_1x4.json"))
        jobs = {}
        for topology in filter(None, args.topologies.split(",")):
            profile, result = (
                os.path.join(tmp, f"profile_{topology}.json"),
                os.path.join(tmp, f"{topology}.json"),
            )
            launch(topology, args, "measure", profile, result)
            with open(result) as f:
                jobs[topology] = (json.load(f), SavedProfile.load(profile))
    text = (
        f"## {time.strftime('%Y-%m-%d %H:%M')} — `{harness.command()}`\n\n"
        f"{args.model}/{args.size}, Gloo on CPU, one thread per rank; "
        f"`--inter-node {args.inter_node}`, each node's loopback unshaped. The 1x4 profile: "
        f"k = {reference.stale_layers} of {len(reference.layers)}, "
        f"compute {reference.compute_time * 1e3:.1f} ms, sigma = {reference.slowdown:g}, "
        f"link alpha = {reference.alpha * 1e3:.3g} ms + {reference.beta * 1e9:.3g} ns/byte. "
        "Target: |error| <= 10 %.\n\n" + table(args, reference, jobs) + "\n"
    )
    print(text)
    if not args.out:
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    fresh = not os.path.exists(args.out)
    with open(args.out, "a") as f:
        f.write("# A one-node profile's predictions against emulated nodes\n" if fresh else "")
        f.write("\n" + text)


if __name__ == "__main__":
    main()
