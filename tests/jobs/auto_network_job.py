"""A compute-heavy, parameter-light job under ``stale_layers="auto"`` on 2 Gloo ranks (used by
tests/system/test_auto_network.py): prints rank 0's decision as one JSON line.

    python tests/jobs/auto_network_job.py
    unshare -n bash -c 'ip link set lo mtu 1500 up && tc qdisc add dev lo root tbf rate 40mbit \\
        burst 64kbit latency 400ms && exec "$@"' _ python tests/jobs/auto_network_job.py

On the plain loopback the scheduler must keep the job synchronous (k = 0); on the 40 Mbit
link it stales layers.
"""

from __future__ import annotations

import json

import torch
from support.dist_utils import run_ranks


def _decide(rank, world_size):
    """A compute-heavy, parameter-light job (MLP on a large batch) under "auto"."""
    import sapipe

    torch.manual_seed(0)
    # ~33K parameters (130 KB of gradients) against ~12 GFLOP per step (~250 ms here): on
    # loopback the one bucket's all-reduce, exposed after backward, is ~1% of compute, and
    # the 5 ms it was once fitted at (host hiccups inflate the link's fit) stays ~2%, under
    # the 3% tolerance; on the 40 Mbit link it is tens of percent.
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128),
        torch.nn.Tanh(),
        torch.nn.Linear(128, 128),
        torch.nn.Tanh(),
        torch.nn.Linear(128, 64),
        torch.nn.Tanh(),
        torch.nn.Linear(64, 8),
    )
    opt = sapipe.DistributedOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.01),
        model,
        stale_layers="auto",
        profile_steps=4,
        timeout=120,
        tune_steps=4,
    )
    x, y = torch.randn(65536, 64), torch.randn(65536, 8)
    for _ in range(200):  # warm-up, then the measured search (if the model's k is not 0 or m)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if opt.stale_layers != "auto":
            break
    d = opt.decision
    summary = d.summary() + (f"; {opt.auto.tuner.summary()}" if opt.auto.tuner else "")
    return {
        "k": opt.stale_layers,
        "m": opt.num_layers,
        "summary": summary,
        "comm_bound": d.comm_bound,
    }


def main() -> None:
    print(json.dumps(run_ranks(_decide, world_size=2, timeout=240)[0]))


if __name__ == "__main__":
    main()
