"""Measure u_i, b_i and the link on the running job (docs/design.md §4).

Everything below is measured during the profiled warm-up iterations, which run with k = 0
(fully synchronous, real all-reduces in flight), and then by a few timed all-reduces.

* **Forward u_i**: the time from layer i's forward pre-hook to the next layer's (the last
  layer runs until the model's forward returns), so the ops between parameterised layers
  (activations, attention arithmetic, residual adds) are charged to the layer before them
  and Σu is the whole forward. Time spent waiting for communication is taken out.
* **Backward b_i**: from gradient *release* times, the moment the last gradient of layer i
  is accumulated. Releases are made monotone in reverse layer order (a bucket can only be
  sent once all later layers' gradients are in), and b_i is the gap between consecutive
  releases, so Σb is the whole backward up to the last gradient.
* **Step time**: from an iteration's last gradient release to the next iteration's first
  layer (``step()``, ``zero_grad()``, the next batch), minus communication waits and
  deferred updates: serial compute the simulator places between backward and the next
  forward.
* **Deferred updates**: a synchronous bucket's optimizer update runs just before its first
  layer's next forward, once its all-reduce is in; its time (waits excluded) is measured
  apart and taken out of the span it fell in (the layer before, or the step time), because
  unlike the rest of that span it cannot start before the all-reduce ends. The profile
  keeps its total per iteration (all buckets are synchronous while profiling); the
  simulator charges each bucket its share by parameter count, after its all-reduce for a
  synchronous bucket and inside ``step()`` for a stale one.
* **Link, α–β**: t = α + β·bytes. α and an *isolated* β come from a least-squares fit to
  timed blocking all-reduces of a few sizes on the job's own process group (fastest of 5).
  The all-reduces of the profiled iterations are timed too, from issue to completion (the
  back-end's completion future, where it has one); their busy time per iteration gives
  the *observed* β, the link as the training job actually gets it (rank skew, Gloo's
  threads and copies competing with step() and the next batch for the CPU: all in). On a
  host with few cores it exceeds the isolated β at full loopback speed; on a rate-limited
  link the two agree. The slower of the two is used.
* **Compute slow-down σ while the link is busy** is not measured here: one profiled
  sample per rank is too noisy to use on a CPU host with few cores (the slow-down arrives
  in bursts of several ms, a core handed to a communication thread, not evenly).
  :attr:`Profile.slowdown` is 0; the runtime fits σ to the measured search's trials
  instead (:func:`sapipe.auto.search.fit_slowdown`), for its final predictions. Given a
  σ, :meth:`LayerTimer.medians` takes the slow-down out of samples that overlapped the
  job's own all-reduces, and the simulator puts it back where its timeline has a transfer
  in flight.

Each rank measures; the profile is then combined over ranks so every rank decides the same
k from the same numbers (:func:`combine`, pure, so a saved run can be replayed offline):
MAX for compute and the timed all-reduces (the slowest rank sets the pace of a synchronous
job), per iteration MIN for the observed link (a rank that issued an all-reduce early waits
for its peers inside it; the one that issued last sees the link alone).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

from sapipe.errors import ConfigurationError


@dataclass
class Profile:
    """Per-layer median times in forward order (seconds) and the link model."""

    forward: list[float]
    backward: list[float]
    step_time: float  # serial compute between backward and the next forward
    alpha: float  # seconds per all-reduce
    beta: float  # seconds per byte: the one the model uses (max of isolated and observed)
    slowdown: float = (
        0.0  # σ: compute runs at 1/(1+σ) while a transfer is in flight (not measured: 0)
    )
    beta_isolated: float = math.nan  # from the timed blocking all-reduces alone
    beta_observed: float = math.nan  # from the profiled iterations' all-reduces (nan: none seen)
    update_time: float = 0.0  # deferred optimizer updates per iteration, all layers synchronous
    raw: dict[str, Any] = field(default_factory=dict)  # this rank's measurements (diagnostics)


class LayerTimer:
    """Collects forward-start, gradient-release and all-reduce timestamps of profiled iterations.

    ``executed[i]`` says whether layer i runs its own forward (a module whose parameters
    its parent uses directly, like ``nn.MultiheadAttention.out_proj``, never does: its
    forward time is part of the layer before it, and its u is 0).

    ``sync``, for a model on a GPU, waits for the device's queued compute (its current
    stream). A hook runs when the host *queues* a layer's kernels, long before the GPU runs
    them, so on a GPU host timestamps alone say nothing about a layer's cost; with ``sync``
    every timestamp of a profiled iteration (:meth:`now`) is taken once the GPU has caught
    up, which makes it the GPU's completion time. Only the profiled iterations pay for it.
    """

    def __init__(
        self,
        num_layers: int,
        executed: Sequence[bool] | None = None,
        sync: Callable[[], None] | None = None,
    ):
        self.num_layers = num_layers
        self.sync = sync
        self.executed = list(executed) if executed is not None else [True] * num_layers
        self._forward: list[list[float]] = []
        self._backward: list[list[float]] = []
        self._comm: list[list[list[Any]]] = []  # per iteration: [bucket, nbytes, issue, done]
        self._spans: list[
            tuple[list, list]
        ] = []  # per iteration: forward and backward (start, end) per layer
        self._step_spans: list[
            tuple[float, float, list[list[Any]]]
        ] = []  # (start, end, comm then in flight)
        self._last_comm: list[list[Any]] = []
        self._starts: dict[int, float] = {}
        self._waits: dict[
            int, float
        ] = {}  # not layer i's compute: waits and deferred updates before it
        self._updated: dict[int, float] = {}  # deferred updates applied before layer i ran
        self._updates: list[float] = []  # per profiled iteration: deferred update seconds
        self._releases: dict[int, float] = {}
        self._forward_end: float | None = None
        self._iter_comm: list[list[Any]] = []
        self._step_times: list[float] = []
        self._last_release: float | None = None  # of the previous profiled iteration
        self.active = False

    def now(self) -> float:
        """The time, in a profiled iteration once the device's queued compute is done (``sync``)."""
        if self.active and self.sync is not None:
            self.sync()
        return time.perf_counter()

    def begin_iteration(self) -> None:
        self._starts.clear()
        self._waits.clear()
        self._updated.clear()
        self._releases.clear()
        self._forward_end = None
        self._iter_comm = []
        self.active = True

    def layer_forward(self, layer: int, waited: float = 0.0, updated: float = 0.0) -> None:
        """Layer ``layer`` starts its forward, after waiting ``waited`` s for communication
        and then ``updated`` s applying deferred updates.

        Both are taken out of the previous layer's u (or, before the first layer, out of
        the step time): the wait is a stall, and the update is compute of its own that
        depends on the all-reduce (see the module docstring).
        """
        if self.active and layer not in self._starts:
            now = self.now()
            self._starts[layer] = now
            self._waits[layer] = waited + updated
            self._updated[layer] = updated
            if layer == 0 and self._last_release is not None:
                self._step_times.append(max(0.0, now - self._last_release - waited - updated))
                self._step_spans.append(
                    (self._last_release, now - waited - updated, self._last_comm)
                )
                self._last_release = None

    def comm_started(self, bucket: int, nbytes: int, handle: Any) -> None:
        """Bucket ``bucket`` (``nbytes``) was handed to the back-end; time it to completion."""
        if not self.active:
            return
        record: list[Any] = [bucket, nbytes, time.perf_counter(), math.nan]
        if _on_completion(handle, lambda: record.__setitem__(3, time.perf_counter())):
            self._iter_comm.append(record)

    def forward_end(self) -> None:
        if self.active and self._forward_end is None:
            self._forward_end = self.now()

    def gradient_released(self, layer: int) -> None:
        if self.active:
            self._releases[layer] = self.now()  # the last one of the layer wins

    def end_iteration(self) -> None:
        """Turn this iteration's timestamps into u_i and b_i (skipped without a whole forward
        and backward). A layer that did not run this iteration (a data-dependent branch, an
        expert this rank's batch never reached) counts u_i = 0: ranks may differ in which
        iterations run which layers, and each must still have iterations to measure."""
        self.active = False
        m = self.num_layers
        ran = [i for i in range(m) if self.executed[i] and i in self._starts]
        if self._forward_end is None or not self._releases or not ran:
            return
        self._last_release = max(self._releases.values())
        self._last_comm = self._iter_comm
        forward = [0.0] * m
        spans: list[tuple[float, float]] = [
            (math.nan, math.nan)
        ] * m  # forward [start, end), waits excluded
        for j, i in enumerate(ran):
            nxt = ran[j + 1] if j + 1 < len(ran) else None
            # Waits between two executed starts (layers hosted by the next one included) are stalls.
            stalled = sum(
                self._waits.get(x, 0.0)
                for x in range(i + 1, (nxt if nxt is not None else m - 1) + 1)
            )
            end = self._starts[nxt] if nxt is not None else self._forward_end
            forward[i] = max(0.0, end - self._starts[i] - stalled)
            spans[i] = (self._starts[i], end - stalled)
        # Monotone releases: layer i's bucket can go once layers i+1..m are in. A layer that
        # got no gradient this iteration counts as released with the layer after it.
        release: list[float] = [0.0] * m
        for i in range(m - 1, -1, -1):
            after = release[i + 1] if i + 1 < m else self._forward_end
            release[i] = max(self._releases.get(i, after), after)
        previous = [self._forward_end] + release[::-1][:-1]
        gaps_reversed = [max(0.0, r - p) for r, p in zip(release[::-1], previous)]
        backward = gaps_reversed[::-1]
        self._forward.append(forward)
        self._backward.append(backward)
        self._updates.append(math.fsum(self._updated.values()))
        self._comm.append(self._iter_comm)
        self._spans.append(
            (
                spans,
                [
                    (release[i + 1] if i + 1 < m else self._forward_end, release[i])
                    for i in range(m)
                ],
            )
        )

    @property
    def samples(self) -> int:
        return len(self._forward)

    def medians(self, slowdown: float = 0.0) -> tuple[list[float], list[float], float]:
        """Median u_i, b_i and step time over the profiled iterations.

        Per-layer medians are rescaled so that they add up to the median per-iteration
        total: under bursty noise a sum of medians underestimates the whole pass, and the
        total is what sets the iteration time.

        With ``slowdown`` σ > 0, every sample is first cleaned of the slow-down it suffered:
        a span that overlapped the job's own all-reduces for o seconds loses o·σ/(1+σ)
        (the simulator puts it back wherever its timeline has a transfer in flight).
        """
        if not self._forward:
            raise RuntimeError("no complete iteration was profiled")
        forward, backward = self._forward, self._backward
        steps = self._step_times
        if slowdown > 0:
            cut = slowdown / (1.0 + slowdown)
            forward, backward = [], []
            for f, bw, comm, (fspans, bspans) in zip(
                self._forward, self._backward, self._comm, self._spans
            ):
                busy = _intervals(comm)
                forward.append(
                    [max(0.0, x - cut * _overlap(span, busy)) for x, span in zip(f, fspans)]
                )
                backward.append(
                    [max(0.0, x - cut * _overlap(span, busy)) for x, span in zip(bw, bspans)]
                )
            steps = [
                max(0.0, x - cut * _overlap((lo, hi), _intervals(comm)))
                for x, (lo, hi, comm) in zip(self._step_times, self._step_spans)
            ]
        u = _median_shares(forward)
        b = _median_shares(backward)
        step = statistics.median(steps) if steps else 0.0
        return u, b, step

    def update_time(self) -> float:
        """Median deferred-update seconds per profiled iteration (0 if none were seen)."""
        return statistics.median(self._updates) if self._updates else 0.0

    def link_samples(self) -> list[tuple[float, int, int]]:
        """Per clean profiled iteration: (link busy seconds, all-reduces, bytes) of its timed
        all-reduces (see :func:`busy_time`); busy is nan where a completion was not seen."""
        out = []
        for records in self._comm:
            done = [(r[2], r[3]) for r in records if not math.isnan(r[3])]
            busy = busy_time(done) if records and len(done) == len(records) else math.nan
            out.append((busy, len(records), sum(r[1] for r in records)))
        return out

    @classmethod
    def from_raw(cls, raw: dict[str, Any], executed: Sequence[bool] | None = None) -> LayerTimer:
        """A timer holding the measurements of :meth:`raw` (for offline analysis)."""
        timer = cls(len(raw["forward"][0]) if raw["forward"] else 0, executed)
        timer._forward, timer._backward, timer._step_times = (
            raw["forward"],
            raw["backward"],
            raw["step_times"],
        )
        timer._comm = raw["comm"]
        timer._updates = list(raw.get("updates", []))  # absent in raw files older than the field
        timer._spans = [tuple(x) for x in raw["spans"]]
        timer._step_spans = [tuple(x) for x in raw["step_spans"]]
        return timer

    def raw(self) -> dict[str, Any]:
        """Everything measured, for offline analysis (JSON-serialisable)."""
        return {
            "forward": self._forward,
            "backward": self._backward,
            "step_times": self._step_times,
            "comm": self._comm,
            "spans": self._spans,
            "step_spans": self._step_spans,
            "updates": self._updates,
        }


def _intervals(records: Sequence[Sequence[Any]]) -> list[tuple[float, float]]:
    """(issue, done) of timed all-reduce records whose completion was seen."""
    return [(r[-2], r[-1]) for r in records if not math.isnan(r[-1])]


def _overlap(span: tuple[float, float], intervals: Sequence[tuple[float, float]]) -> float:
    """Length of ``span`` covered by the union of ``intervals``."""
    lo, hi = span
    if math.isnan(lo) or hi <= lo:
        return 0.0
    total, covered_to = 0.0, lo
    for start, end in sorted(intervals):
        start, end = max(start, covered_to), min(end, hi)
        if end > start:
            total += end - start
            covered_to = end
    return total


def _on_completion(handle: Any, callback: Callable[[], None]) -> bool:
    """Call ``callback`` when ``handle``'s collective completes; False if it cannot tell."""
    try:
        owner = getattr(handle, "owner", None)
        if owner is not None:  # a sapipe.comm Handle: its back-end knows
            return owner.when_done(handle, callback)
        get_future = getattr(handle, "get_future", None)  # a raw torch.distributed work
        if get_future is None:
            return False
        get_future().add_done_callback(lambda _: callback())
        return True
    except Exception:  # noqa: BLE001 - no timing, nothing else lost
        return False


def busy_time(intervals: Sequence[tuple[float, float]]) -> float:
    """Link busy time of transfers (issue, done) on a one-at-a-time (FIFO) link.

    Each transfer's service is ``done − max(issue, previous done)``: queueing behind an
    earlier transfer is not its own cost. Equals the length of the union of the intervals.
    """
    busy, free = 0.0, -math.inf
    for issue, done in sorted(intervals):
        busy += max(0.0, done - max(issue, free))
        free = max(free, done)
    return busy


def _median_shares(samples: list[list[float]]) -> list[float]:
    per_layer = [statistics.median(col) for col in zip(*samples)]
    total = statistics.median(sum(row) for row in samples)
    scale = total / sum(per_layer) if sum(per_layer) > 0 else 1.0
    return [value * scale for value in per_layer]


def fit_alpha_beta(sizes_bytes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares t = α + β·bytes, clamped to α, β ≥ 0."""
    n = len(sizes_bytes)
    mean_x = sum(sizes_bytes) / n
    mean_y = sum(seconds) / n
    var = sum((x - mean_x) ** 2 for x in sizes_bytes)
    beta = (
        sum((x - mean_x) * (y - mean_y) for x, y in zip(sizes_bytes, seconds)) / var if var else 0.0
    )
    beta = max(beta, 0.0)
    alpha = max(mean_y - beta * mean_x, 0.0)
    return alpha, beta


def observed_beta(alpha: float, per_rank: Sequence[Sequence[tuple[float, int, int]]]) -> float:
    """β of the link as the profiled iterations saw it; nan without usable data.

    ``per_rank[r][i]`` is rank r's :meth:`LayerTimer.link_samples` entry of iteration i.
    Per iteration the MIN over ranks is taken (a rank that issued early waits for its peers
    inside the all-reduce; the last to issue sees the link alone), then β makes
    α·count + β·bytes equal that busy time, and the median over iterations is returned.
    Iterations where ranks disagree on the transfers, or a completion was missed, are skipped.
    """
    betas = []
    for samples in zip(*per_rank):
        counts = {(c, n) for _, c, n in samples}
        busy = min(b for b, _, _ in samples)
        if len(counts) != 1 or math.isnan(busy) or busy <= 0:
            continue
        ((count, nbytes),) = counts
        if count and nbytes > 0:
            betas.append(max(busy - alpha * count, 0.0) / nbytes)
    return statistics.median(betas) if betas else math.nan


def combine(
    rows: Sequence[Sequence[float]],
    m: int,
    sizes: Sequence[int],
    link: Sequence[Sequence[tuple[float, int, int]]],
    slowdown: float = 0.0,
) -> Profile:
    """The job's profile from every rank's ``u + b + [step] + probe times [+ [update]]`` row
    and link samples.

    MAX over ranks for compute, deferred updates and the probes (the slowest rank sets the pace of a
    synchronous job); :func:`observed_beta` for the link seen in training. Pure: every rank,
    and an offline analysis of a saved run, computes the same profile from the same inputs.
    ``slowdown`` is σ as the caller knows it (the samples in ``rows`` should have been cleaned
    with it, :meth:`LayerTimer.medians`); :func:`measure` leaves it 0.
    """
    values = [max(col) for col in zip(*rows)]
    alpha, beta_isolated = fit_alpha_beta(sizes, values[2 * m + 1 : 2 * m + 1 + len(sizes)])
    update = values[2 * m + 1 + len(sizes)] if len(values) > 2 * m + 1 + len(sizes) else 0.0
    beta_seen = observed_beta(alpha, link)
    beta = beta_isolated if math.isnan(beta_seen) else max(beta_isolated, beta_seen)
    return Profile(
        forward=values[:m],
        backward=values[m : 2 * m],
        step_time=values[2 * m],
        alpha=alpha,
        beta=beta,
        slowdown=slowdown,
        beta_isolated=beta_isolated,
        beta_observed=beta_seen,
        update_time=update,
    )


def compressed(
    profile: Profile, wire_ratio: float, codec_per_byte: float, codec_share: float = 1.0
) -> Profile:
    """``profile``'s link model for compressed sums (docs/design.md §5.9), per byte of gradient.

    The probes timed an all-reduce of the gradients' dtype. A compressed sum is two
    collectives (2α) carrying ``wire_ratio`` of those bytes, plus compressing, summing and
    decoding, ``codec_per_byte`` seconds per byte compressed (timed on this host), of
    ``codec_share`` of each bucket (1; node first, a rank's shard: 1/L). β stays at least
    what the profiled iterations, which ran compressed, observed.
    """
    beta = profile.beta_isolated * wire_ratio + codec_per_byte * codec_share
    if not math.isnan(profile.beta_observed):
        beta = max(beta, profile.beta_observed)
    return dataclasses.replace(
        profile,
        alpha=2 * profile.alpha,
        beta=beta,
        raw=dict(
            profile.raw,
            wire_ratio=wire_ratio,
            codec_per_byte=codec_per_byte,
            codec_share=codec_share,
        ),
    )


def time_codec(codec, wire: torch.Tensor, repeats: int = 3) -> float:
    """Fastest wall time of one compressed sum's local work on ``wire`` (compress, sum the
    received messages, compress the sum, decode; per partition where the codec has them),
    without its collectives. A codec that ``encodes_on_intake`` leaves the compression to
    backward's copy of each gradient (which costs no more than the plain copy), so it is not
    timed."""
    parts = codec.at(0, encoded=codec.encodes_on_intake).partitions()
    times = []
    for _ in range(repeats + 1):  # the first run warms caches and the allocator
        if wire.is_cuda:
            torch.cuda.synchronize(wire.device)
        start = time.perf_counter()
        for lo, hi, part in parts:
            part.scatter_messages(wire[lo:hi])
            part.gather_message()
            part.decode_mean(wire[lo:hi])
        if wire.is_cuda:
            torch.cuda.synchronize(wire.device)
        times.append(time.perf_counter() - start)
    return min(times[1:])


def time_allreduce(
    group,
    nbytes: int,
    dtype: torch.dtype,
    device: torch.device,
    repeats: int = 5,
    sum_now: Callable[[torch.Tensor], None] | None = None,
) -> float:
    """Fastest wall time of a blocking all-reduce of ``nbytes`` on ``group`` (or of
    ``sum_now``: the back-end's own sum, where it is not one all-reduce on a group).

    The minimum, not the median: noise (a descheduled thread, a busy core) only ever adds
    time, and the fit should describe what the link can do.
    """
    element = torch.empty((), dtype=dtype).element_size()
    buffer = torch.zeros(max(1, nbytes // element), dtype=dtype, device=device)
    reduce = sum_now or (lambda t: dist.all_reduce(t, group=group))
    reduce(buffer)  # warm the connection and allocator
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        reduce(buffer)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return min(times)


def probe_sizes(bucket_bytes: Sequence[int]) -> list[int]:
    """A few message sizes spanning the job's buckets (for the α–β fit)."""
    largest = max(bucket_bytes)
    return sorted({4096, max(4096, largest // 16), max(8192, largest // 4), max(16384, largest)})


def measure(
    timer: LayerTimer,
    group,
    bucket_bytes: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
    sum_now: Callable[[torch.Tensor], None] | None = None,
) -> Profile:
    """The job's profile, identical on every rank (see the module docstring for reductions).
    The link is probed with ``sum_now`` where the back-end gives one (its own sum)."""
    world = dist.get_world_size(group)

    def gather(values: list[float]) -> list[list[float]]:
        local = torch.tensor(
            values, dtype=torch.float64, device=device if device.type == "cuda" else "cpu"
        )
        out = [torch.empty_like(local) for _ in range(world)]
        dist.all_gather(out, local, group=group)
        return [t.cpu().tolist() for t in out]

    samples = timer.link_samples()  # one per profiled iteration
    counts = [int(count) for (count,) in gather([float(len(samples))])]
    if min(counts) == 0:  # raised on every rank, before collectives one rank would not join
        raise ConfigurationError(
            "stale_layers='auto' profiled no iteration with a whole forward and backward on "
            "rank(s) "
            f"{[rank for rank, count in enumerate(counts) if count == 0]}; give stale_layers a "
            "number"
        )
    u, b, step = timer.medians()
    sizes = probe_sizes(bucket_bytes)
    comm = [time_allreduce(group, s, dtype, device, sum_now=sum_now) for s in sizes]
    rows = gather(u + b + [step] + comm + [timer.update_time()])
    longest = max(counts)
    padded = samples + [(math.nan, -1, -1)] * (longest - len(samples))
    flat = gather([x for sample in padded for x in sample])
    link = [
        [(r[3 * i], int(r[3 * i + 1]), int(r[3 * i + 2])) for i in range(longest)] for r in flat
    ]
    profile = combine(rows, len(u), sizes, link)
    profile.raw = dict(
        timer.raw(),
        probe_sizes=sizes,
        probe_times=comm,
        link_samples=samples,
        row=rows[dist.get_rank(group)],
    )
    return profile
