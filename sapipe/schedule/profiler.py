"""Measure u_i, b_i and the all-reduce cost on the running job (DESIGN.md §4).

* **Forward u_i**: the time from layer i's forward pre-hook to the next layer's (the last
  layer runs until the model's forward returns), so the ops between parameterised layers
  (activations, attention arithmetic, residual adds) are charged to the layer before them
  and Σu is the whole forward.
* **Backward b_i**: from gradient *release* times, the moment the last gradient of layer i
  is accumulated. Releases are made monotone in reverse layer order (a bucket can only be
  sent once all later layers' gradients are in), and b_i is the gap between consecutive
  releases, so Σb is the whole backward up to the last gradient.
* **Step time**: from an iteration's last gradient release to the next iteration's first
  layer (``step()``, ``zero_grad()``, the next batch), minus communication waits: serial
  compute the simulator places between backward and the next forward.
* **Communication**: an α–β model (t = α + β·bytes) fitted by least squares to timed
  all-reduces of a few sizes on the job's own process group.

Each rank measures; the profile is then reduced with MAX over ranks, so every rank
decides the same k from the same numbers (and the slowest rank, which sets the pace of a
synchronous job, is what the decision plans for).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist


@dataclass
class Profile:
    """Per-layer median times in forward order (seconds) and the fitted link model."""

    forward: List[float]
    backward: List[float]
    step_time: float  # serial compute between backward and the next forward
    alpha: float  # seconds per all-reduce
    beta: float  # seconds per byte


class LayerTimer:
    """Collects forward-start and gradient-release timestamps of profiled iterations.

    ``executed[i]`` says whether layer i runs its own forward (a module whose parameters
    its parent uses directly, like ``nn.MultiheadAttention.out_proj``, never does: its
    forward time is part of the layer before it, and its u is 0).
    """

    def __init__(self, num_layers: int, executed: Optional[Sequence[bool]] = None):
        self.num_layers = num_layers
        self.executed = list(executed) if executed is not None else [True] * num_layers
        self._forward: List[List[float]] = []
        self._backward: List[List[float]] = []
        self._starts: Dict[int, float] = {}
        self._waits: Dict[int, float] = {}  # communication waited for before layer i ran
        self._releases: Dict[int, float] = {}
        self._forward_end: Optional[float] = None
        self._step_times: List[float] = []
        self._last_release: Optional[float] = None  # of the previous profiled iteration
        self.active = False

    def begin_iteration(self) -> None:
        self._starts.clear()
        self._waits.clear()
        self._releases.clear()
        self._forward_end = None
        self.active = True

    def layer_forward(self, layer: int, waited: float = 0.0) -> None:
        """Layer ``layer`` starts its forward, after waiting ``waited`` s for communication.

        The wait is a stall, not compute: it is taken out of the previous layer's u.
        """
        if self.active and layer not in self._starts:
            now = time.perf_counter()
            self._starts[layer] = now
            self._waits[layer] = waited
            if layer == 0 and self._last_release is not None:
                self._step_times.append(max(0.0, now - self._last_release - waited))
                self._last_release = None

    def forward_end(self) -> None:
        if self.active and self._forward_end is None:
            self._forward_end = time.perf_counter()

    def gradient_released(self, layer: int) -> None:
        if self.active:
            self._releases[layer] = time.perf_counter()  # the last one of the layer wins

    def end_iteration(self) -> None:
        """Turn this iteration's timestamps into u_i and b_i (skipped if incomplete)."""
        self.active = False
        m = self.num_layers
        ran = [i for i in range(m) if self.executed[i]]
        if self._forward_end is None or not self._releases or any(i not in self._starts for i in ran):
            return  # a layer did not run: not a representative iteration
        self._last_release = max(self._releases.values())
        forward = [0.0] * m
        for j, i in enumerate(ran):
            nxt = ran[j + 1] if j + 1 < len(ran) else None
            # Waits between two executed starts (layers hosted by the next one included) are stalls.
            stalled = sum(self._waits.get(x, 0.0) for x in range(i + 1, (nxt if nxt is not None else m - 1) + 1))
            end = self._starts[nxt] if nxt is not None else self._forward_end
            forward[i] = max(0.0, end - self._starts[i] - stalled)
        self._forward.append(forward)
        # Monotone releases: layer i's bucket can go once layers i+1..m are in. A layer that
        # got no gradient this iteration counts as released with the layer after it.
        release: List[float] = [0.0] * m
        for i in range(m - 1, -1, -1):
            after = release[i + 1] if i + 1 < m else self._forward_end
            release[i] = max(self._releases.get(i, after), after)
        previous = [self._forward_end] + release[::-1][:-1]
        gaps_reversed = [max(0.0, r - p) for r, p in zip(release[::-1], previous)]
        self._backward.append(gaps_reversed[::-1])

    @property
    def samples(self) -> int:
        return len(self._forward)

    def medians(self) -> Tuple[List[float], List[float], float]:
        """Median u_i, b_i and step time over the profiled iterations.

        Per-layer medians are rescaled so that they add up to the median per-iteration
        total: under bursty noise a sum of medians underestimates the whole pass, and the
        total is what sets the iteration time.
        """
        if not self._forward:
            raise RuntimeError("sapipe: no complete iteration was profiled")
        u = _median_shares(self._forward)
        b = _median_shares(self._backward)
        step = statistics.median(self._step_times) if self._step_times else 0.0
        return u, b, step


def _median_shares(samples: List[List[float]]) -> List[float]:
    per_layer = [statistics.median(col) for col in zip(*samples)]
    total = statistics.median(sum(row) for row in samples)
    scale = total / sum(per_layer) if sum(per_layer) > 0 else 1.0
    return [value * scale for value in per_layer]


def fit_alpha_beta(sizes_bytes: Sequence[int], seconds: Sequence[float]) -> Tuple[float, float]:
    """Least-squares t = α + β·bytes, clamped to α, β ≥ 0."""
    n = len(sizes_bytes)
    mean_x = sum(sizes_bytes) / n
    mean_y = sum(seconds) / n
    var = sum((x - mean_x) ** 2 for x in sizes_bytes)
    beta = sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes_bytes, seconds)) / var if var else 0.0
    beta = max(beta, 0.0)
    alpha = max(mean_y - beta * mean_x, 0.0)
    return alpha, beta


def time_allreduce(group, nbytes: int, dtype: torch.dtype, device: torch.device, repeats: int = 5) -> float:
    """Fastest wall time of a blocking all-reduce of ``nbytes`` on ``group``.

    The minimum, not the median: noise (a descheduled thread, a busy core) only ever adds
    time, and the fit should describe what the link can do.
    """
    element = torch.empty((), dtype=dtype).element_size()
    buffer = torch.zeros(max(1, nbytes // element), dtype=dtype, device=device)
    dist.all_reduce(buffer, group=group)  # warm the connection and allocator
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dist.all_reduce(buffer, group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def probe_sizes(bucket_bytes: Sequence[int]) -> List[int]:
    """A few message sizes spanning the job's buckets (for the α–β fit)."""
    largest = max(bucket_bytes)
    return sorted({4096, max(4096, largest // 16), max(8192, largest // 4), max(16384, largest)})


def measure(
    timer: LayerTimer, group, bucket_bytes: Sequence[int], dtype: torch.dtype, device: torch.device
) -> Profile:
    """The job's profile, identical on every rank (MAX over ranks)."""
    u, b, step = timer.medians()
    sizes = probe_sizes(bucket_bytes)
    comm = [time_allreduce(group, s, dtype, device) for s in sizes]
    local = torch.tensor(u + b + [step] + comm, dtype=torch.float64)
    if device.type == "cuda":
        local = local.to(device)
    dist.all_reduce(local, op=dist.ReduceOp.MAX, group=group)
    values = local.cpu().tolist()
    m = len(u)
    alpha, beta = fit_alpha_beta(sizes, values[2 * m + 1 :])
    return Profile(
        forward=values[:m], backward=values[m : 2 * m], step_time=values[2 * m], alpha=alpha, beta=beta
    )
