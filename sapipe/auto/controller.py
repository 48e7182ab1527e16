"""``stale_layers="auto"``: profile the warm-up, choose k with the model, then check it on the job.

Three phases (docs/design.md §4):

1. **profiling** — the last ``profile_steps`` warm-up iterations are timed per layer and
   the link is fitted (:mod:`sapipe.schedule.profiler`);
2. **trials** — at the end of warm-up the simulator's k is laid out and, unless it is 0 or
   m, measured on the running job; if the pipeline still waits, other k are measured
   (:class:`sapipe.auto.search.Tuner`) where the model, calibrated on the trials so
   far, points, each trial restarting the pipeline;
3. **decided** — k is final, by iteration ``auto_budget`` at the latest.

The controller only decides. It changes the runtime through two calls of its
:class:`Runtime`: ``relayout(k)`` (new buckets for k, between iterations, nothing in flight
on stale buckets) and ``restart(k, iteration, hyperparams)`` (drain the pipeline, then start
it anew with k stale layers).
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import math
import statistics
import time
from typing import Any, Protocol

import torch

from sapipe.auto import search
from sapipe.config import Settings
from sapipe.errors import UsageError
from sapipe.layout.layers import Layer
from sapipe.rendezvous import ControlChannel, failure_named
from sapipe.runtime.pipeline import GradientPipeline
from sapipe.schedule import profiler, simulator, solver
from sapipe.schedule.saved_profile import SavedProfile

log = logging.getLogger("sapipe")

#: A predicted stall below this fraction of compute counts as none (the solver's default).
STALL_TOLERANCE = solver.STALL_TOLERANCE

#: A trial of the measured search for k lasts ``tune_steps`` iterations, and is extended by
#: as many again, up to this many times in all, while its time is too noisy to resolve
#: ``STALL_TOLERANCE`` (the median's standard error above half of it).
TRIAL_MAX_ROUNDS = 4

#: The first trial, right after warm-up, leaves this many iterations unmeasured beyond the
#: ``staleness`` every trial skips: the new layout's one-off costs (fresh buckets and state,
#: the first stale updates) slow its first iterations, which would tip short trials towards
#: staling more layers than needed.
FIRST_TRIAL_HEAD = 2


class Runtime(Protocol):
    """What the controller may ask of the optimizer's runtime."""

    def relayout(self, k: int) -> None: ...

    def restart(self, k: int, iteration: int, hyperparams: list[dict[str, Any]]) -> None: ...


class AutoController:
    """The scheduler's side of ``stale_layers="auto"``: what it measured, what it decided."""

    def __init__(
        self,
        settings: Settings,
        control: ControlChannel,
        pipeline: GradientPipeline,
        runtime: Runtime,
        rank: int,
    ):
        self._settings = settings
        self._control = control
        self._pipeline = pipeline
        self._runtime = runtime
        self._rank = rank
        self.timer: profiler.LayerTimer | None = None  # while the warm-up is profiled
        self.profile: profiler.Profile | None = None  # what the decision was made from
        self.layer_profiles: list[solver.LayerProfile] | None = None
        self.link: tuple | None = None  # (alpha, beta, bytes per layer, step time)
        self.sim_options: dict[str, Any] = {}  # slowdown, shared_link, update_per_element
        self.sync_at_step = False  # the sync updates run in step() (the script reads p.grad)
        self.decision: solver.Decision | None = None
        self.tuner: search.Tuner | None = None  # the measured search, once the model chose
        self.decided = False  # k is final (decided now, or restored from a checkpoint)
        self.decided_at: int | None = None  # the iteration whose step() made k final (in this run)
        self._trial_start = 0  # the iteration the current trial's pipeline began after
        self._trial_times: list[float] = []  # per measured iteration: forward start to step end
        self._trial_waits: list[float] = []  # per measured iteration: seconds waited for comm

    # ------------------------------------------------------------------ profiling

    def start_profiling(self, layers: list[Layer]) -> None:
        """The layer order is known: time the warm-up's last iterations per layer."""
        if not self.decided and self.tuner is None:
            self.timer = profiler.LayerTimer(
                len(layers), [layer.executed for layer in layers], sync=_device_sync(layers)
            )
            self._pipeline.timer = self.timer

    def profiles(self, iteration: int) -> bool:
        """Whether ``iteration`` is one of the profiled warm-up iterations."""
        origin = self._pipeline.origin
        return (
            self.timer is not None and origin - self._settings.profile_steps < iteration <= origin
        )

    def end_step(
        self, iteration: int, hyperparams: list[dict[str, Any]], forward_start: float | None
    ) -> None:
        """After ``step()`` of ``iteration``: profile, decide at warm-up's end, or measure a
        trial."""
        if self.timer is not None:
            self.timer.end_iteration()
            if iteration == self._pipeline.origin:
                self._decide()
        elif self.tuner is not None and not self.decided:
            self._measure_trial(iteration, hyperparams, forward_start)

    # ------------------------------------------------------------------ the model's decision

    def _decide(self) -> None:
        """End of warm-up: profile, choose k, re-lay the buckets out for it."""
        assert self.timer is not None and self._pipeline.layout is not None
        layout, sync = self._pipeline.layout, self._pipeline.sync_comm
        first = layout.buckets[0]
        with failure_named(
            "profiling the warm-up for stale_layers='auto' (its link probes and reductions)"
        ):
            self.profile = profiler.measure(
                self.timer,
                sync.group if sync.group is not None else self._control.group,
                [b.nbytes for b in layout.buckets],
                first.dtype,
                first.device,
                sum_now=sync.sum_now,
            )
        self.timer = self._pipeline.timer = None
        if self._settings.compression is not None:
            self.profile = self._compressed_link(self.profile, layout.buckets)
        self._set_model_inputs(layout.layers, first.params[0].element_size())
        # The timeline to model: sync updates in step() if any rank's script reads p.grad
        (reads,) = self._control.agree_on_max(
            [float(self._runtime.syncs_at_step)], "whether p.grad is read"
        )
        self.sync_at_step = reads > 0.0
        self.decision = solver.choose_k(
            self.layer_profiles, tolerance=STALL_TOLERANCE, **self.simulator_arguments()
        )
        self._runtime.relayout(self.decision.k)
        m = len(layout.layers)
        if self._worth_measuring(m):
            self.tuner = search.Tuner(self.decision.k, m, STALL_TOLERANCE, self._search_guide())
            self._begin_trial(self._pipeline.origin)
        else:
            self._finish(self._pipeline.origin)

    def _worth_measuring(self, m: int) -> bool:
        """Whether the model's k is checked on the job (the measured search).

        k = 0 and k = m need no check: the profile was measured at k = 0, and nothing hides
        more communication than k = m. Within a budget, a communication-bound k neither:
        from it up every k runs at the link's pace, so trials of a few iterations can only
        tell noise apart (in the scheduler benchmark they moved such jobs past the model's
        k, each time to a slower one).
        """
        decision = self.decision
        assert decision is not None
        if self._settings.tune_steps == 0 or not 0 < decision.k < m:
            return False
        if self._settings.auto_budget is not None and decision.comm_bound:
            return False
        return self._trial_fits(self._pipeline.origin, first=True)

    def _compressed_link(self, profile: profiler.Profile, buckets) -> profiler.Profile:
        """The link model for compressed sums: the bytes the format puts on the wire, and the
        local work of compressing and summing, timed on a scratch copy of the largest bucket
        (the slowest rank's time, so every rank models alike), per byte this rank compresses
        (node first: its shard, 1/L of the bucket; the saved profile's ``codec_per_byte`` is
        thus what compressing a whole bucket costs, for predictions of other layouts). Where
        sums go node first, the probes timed the two-level sum at full precision, and only the
        bytes across nodes shrink: the model scales both levels (the profiled iterations' β
        bounds it below)."""
        formats = [self._pipeline.gradients(b).buffer.codec.format for b in buckets]
        ring = sum(
            2
            * (f.world - 1)
            / f.world
            * f.numel
            * b.nbytes
            / b.numel  # the values compressed, in bytes
            for f, b in zip(formats, buckets)
            if b.numel
        )
        if ring == 0:
            return profile  # one rank (or one node): nothing compressed travels
        largest = max(buckets, key=lambda b: b.numel)
        sums = self._runtime.compression
        assert sums is not None
        scratch = sums.codec(largest.numel, len(largest.params), largest.dtype, largest.device)
        wire = torch.randn(
            largest.numel + len(largest.params), dtype=largest.dtype, device=largest.device
        )
        (seconds,) = self._control.agree_on_max(
            [profiler.time_codec(scratch, wire)], "the time to compress"
        )
        wire_ratio = sum(f.wire_bytes() for f in formats) / ring
        compressed_bytes = (
            scratch.format.numel * largest.nbytes / largest.numel
        )  # node first: one shard
        return profiler.compressed(
            profile, wire_ratio, seconds / compressed_bytes, compressed_bytes / largest.nbytes
        )

    def _set_model_inputs(self, layers: list[Layer], element_size: int) -> None:
        """The simulator's inputs from the measured profile."""
        profile = self.profile
        assert profile is not None
        layer_bytes = [layer.numel * element_size for layer in layers]
        self.layer_profiles = [
            solver.LayerProfile(
                layer.name, u, b, profile.alpha + profile.beta * nbytes, layer.numel
            )
            for layer, u, b, nbytes in zip(layers, profile.forward, profile.backward, layer_bytes)
        ]
        self.link = (profile.alpha, profile.beta, layer_bytes, profile.step_time)
        # The runtime's link: sync and stale traffic on two process groups, sharing it; no
        # compute slow-down unless the profile measured one; the measured search, if it runs,
        # fits one for the final predictions. Every layer was synchronous while profiling:
        # its deferred updates covered all of them.
        numel = sum(layer.numel for layer in layers)
        self.sim_options = {
            "slowdown": profile.slowdown,
            "shared_link": True,
            "update_per_element": profile.update_time / numel if numel else 0.0,
        }

    def simulator_arguments(self) -> dict[str, Any]:
        """The simulator's and solver's keyword arguments besides the profiles (one builder for
        both).

        ``sync_at_step``: whether the job's script reads the exposed ``p.grad`` before ``step()``
        (on any rank, during the warm-up). That decides where the runtime waits for the sync
        all-reduces and applies their updates (when ``p.grad`` is read and in ``step()``, or
        at each bucket's next forward), so the model must follow it too.
        """
        assert self.link is not None
        alpha, beta, layer_bytes, step_time = self.link
        return dict(
            bucket_cap_bytes=self._settings.bucket_cap_bytes,
            alpha=alpha,
            beta=beta,
            bytes_per_layer=layer_bytes,
            step_time=step_time,
            sync_at_step=self.sync_at_step,
            **self.sim_options,
        )

    def predict(
        self,
        k: int,
        slowdown: float | None = None,
        record_events: bool = True,
        link_scale: float = 1.0,
    ) -> simulator.SimResult:
        """The model's steady-state iteration at ``k`` (with compute slow-down σ = ``slowdown``,
        and the link ``link_scale`` times as slow as profiled)."""
        assert self.layer_profiles is not None
        arguments = self.simulator_arguments()
        if slowdown is not None:
            arguments["slowdown"] = slowdown
        arguments["alpha"] *= link_scale
        arguments["beta"] *= link_scale
        return simulator.simulate(self.layer_profiles, k, record_events=record_events, **arguments)

    def _finish(self, iteration: int) -> None:
        self.decided = True
        self.decided_at = iteration
        if self._rank == 0 and self.decision is not None:
            tuned = (
                f"; {self.tuner.summary()}; predictions with the compute slow-down that fits them "
                "best, "
                f"sigma={self.sim_options['slowdown']:g}"
                if self.tuner is not None
                else ""
            )
            log.info("%s%s", self.decision.summary(), tuned)
            if self.decision.advice is not None:
                log.warning("sapipe: %s", self.decision.advice)

    @property
    def advice(self) -> str | None:
        """Once k is decided: what to do where even k = m cannot hide the link (elastic
        averaging, with a period from the profile), else None."""
        return self.decision.advice if self.decided and self.decision is not None else None

    # ------------------------------------------------------------------ the measured search

    def _begin_trial(self, iteration: int) -> None:
        """The pipeline (re)started after ``iteration``: measure the trial's iterations from
        here."""
        self._trial_start = iteration
        self._trial_times = []
        self._trial_waits = []

    def _measure_trial(
        self, iteration: int, hyperparams: list[dict[str, Any]], forward_start: float | None
    ) -> None:
        """Record one iteration of the trial; after ``tune_steps`` of them, report and move on.

        The trial's head is not measured (:meth:`_trial_head`).
        An iteration runs from its first forward to the end of its ``step()``, so what the
        training loop does between steps does not count. On CUDA the host does not block on
        communication, so an iteration synchronises the device before it is timed and its
        waits count as unknown (the search then always measures k = m).
        """
        assert self.tuner is not None
        if iteration - self._trial_start <= self._trial_head(first=not self.tuner.trials):
            return
        device = self._pipeline.buckets[0].device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = forward_start if forward_start is not None else time.perf_counter()
        self._trial_times.append(time.perf_counter() - start)
        self._trial_waits.append(math.inf if device.type == "cuda" else self._pipeline.waited)
        if len(self._trial_times) % self._settings.tune_steps == 0:
            self._judge_trial(iteration, hyperparams)

    def _judge_trial(self, iteration: int, hyperparams: list[dict[str, Any]]) -> None:
        """The trial's value, agreed over ranks: the slowest rank's median of the means of
        consecutive pairs of iterations (a saturated link often alternates long and short
        iterations, which a plain median misreads). Too noisy for a verdict: measure on."""
        assert self.tuner is not None
        pairs = _pair_means(self._trial_times)
        median = statistics.median(pairs)
        # the median's standard error, relative (≈ 1.25 σ / √n for a roughly normal sample)
        noise = (
            1.25 * statistics.stdev(pairs) / math.sqrt(len(pairs)) / median
            if len(pairs) > 1
            else 0.0
        )
        iteration_time, waits, noise = self._control.agree_on_max(
            [median, statistics.median(_pair_means(self._trial_waits)), noise],
            "the scheduler's measurements",
        )
        if self._may_extend(iteration) and noise > self._resolution(iteration_time, waits):
            return  # every rank measures on (they agreed on the noise)
        self.tuner.record(iteration_time, waits)
        if self.tuner.trial is not None and not self._trial_fits(iteration):
            self.tuner.stop()
        if self.tuner.trial is None:
            if self.tuner.final != self._pipeline.layout.k:
                self._runtime.restart(self.tuner.final, iteration, hyperparams)
            self.sim_options["slowdown"] = search.fit_slowdown(
                self.tuner.trials,
                lambda k, sigma: self.predict(k, sigma, record_events=False).iteration_time,
            )
            self.decision = solver.choose_k(
                self.layer_profiles,
                tolerance=STALL_TOLERANCE,
                only_k=self.tuner.final,
                **self.simulator_arguments(),
            )
            self._finish(iteration)
        else:
            self._runtime.restart(self.tuner.trial, iteration, hyperparams)
            self._begin_trial(iteration)

    def end_search_for_resize(self, iteration: int) -> int | None:
        """A checkpoint of a job of another world size was loaded mid-search: its trials timed
        that job's iterations, not this one's, so the search ends with the best k they measured
        (:meth:`Tuner.stop <sapipe.auto.search.Tuner.stop>`), decided after ``iteration``. The k
        the pipeline restarts at; None where no search was running."""
        tuner = self.tuner
        if self.decided or tuner is None or tuner.trial is None:
            return None
        tuner.stop()
        assert tuner.final is not None
        self.sim_options["slowdown"] = search.fit_slowdown(
            tuner.trials,
            lambda k, sigma: self.predict(k, sigma, record_events=False).iteration_time,
        )
        self.decision = solver.choose_k(
            self.layer_profiles,
            tolerance=STALL_TOLERANCE,
            only_k=tuner.final,
            **self.simulator_arguments(),
        )
        self._finish(iteration)
        return tuner.final

    def _may_extend(self, iteration: int) -> bool:
        """Whether the current trial may run ``tune_steps`` more iterations. Within a budget,
        the first trial never does (a doubtful verdict on k₁'s waits is settled by measuring
        k = m next, which keeps k₁ unless m is clearly faster), and the others only where a
        further trial still fits after the extension."""
        tune = self._settings.tune_steps
        if len(self._trial_times) >= TRIAL_MAX_ROUNDS * tune:
            return False
        if self._settings.auto_budget is None:
            return True
        assert self.tuner is not None
        return bool(self.tuner.trials) and self._trial_fits(iteration + tune)

    def _resolution(self, iteration_time: float, waits: float) -> float:
        """The relative noise a trial may have: without a budget, half the tolerance (times 3%
        apart told apart); with one, the distance to the threshold its verdict turns on, so
        that a clear-cut trial ends early and leaves the budget to the next."""
        if self._settings.auto_budget is None:
            return STALL_TOLERANCE / 2
        assert self.tuner is not None
        return self.tuner.margin(iteration_time, waits)

    def _within_budget(self, iteration: int) -> bool:
        budget = self._settings.auto_budget
        return budget is None or iteration <= budget

    def _trial_head(self, first: bool) -> int:
        """Iterations a trial leaves unmeasured: the pipeline's first s steps (no stale update
        waits in them yet), and for the first trial the new layout's one-off costs."""
        return self._settings.staleness + (FIRST_TRIAL_HEAD if first else 0)

    def _trial_fits(self, iteration: int, first: bool = False) -> bool:
        """Whether a trial that starts after ``iteration`` ends within ``auto_budget``."""
        return self._within_budget(iteration + self._trial_head(first) + self._settings.tune_steps)

    def _search_guide(self):
        """With a budget, the search probes where the calibrated model points; without, it
        bisects."""
        return None if self._settings.auto_budget is None else self._suggest

    def _suggest(self, lo: int, hi: int) -> int:
        """The smallest k in (lo, hi] that the model, its link rescaled to explain the trials'
        times and waits so far (:func:`~sapipe.auto.search.fit_link_scale`), predicts
        within half the tolerance of k = hi (known to be fast enough)."""
        assert self.tuner is not None

        def seen(k: int, scale: float):
            r = self.predict(k, record_events=False, link_scale=scale)
            return r.iteration_time, r.forward_wait + r.step_wait

        scale = search.fit_link_scale(self.tuner.trials, seen)
        times = {k: seen(k, scale)[0] for k in range(lo + 1, hi + 1)}
        return min(k for k in times if times[k] <= times[hi] * (1.0 + STALL_TOLERANCE / 2))

    # ------------------------------------------------------------------ saved profiles

    def saved_profile(self) -> SavedProfile:
        """What this job measured and decided, for :mod:`sapipe.schedule.predict`."""
        if not self.decided or self.profile is None or self.decision is None:
            raise UsageError(
                "no profile to save yet: stale_layers='auto' has not decided k in this run "
                "(it profiles the warm-up, then measures; a job resumed after the decision has "
                "none)"
            )
        layers = self._pipeline.layout.layers
        first = self._pipeline.buckets[0]
        topology = self._runtime.job_topology
        world = torch.distributed.get_world_size(self._control.group)
        device = (
            torch.cuda.get_device_name(first.device)
            if first.device.type == "cuda"
            else first.device.type
        )
        profile, settings = self.profile, self._settings
        return SavedProfile(
            layers=tuple(layer.name for layer in layers),
            numel=tuple(layer.numel for layer in layers),
            element_size=first.params[0].element_size(),
            forward=tuple(profile.forward),
            backward=tuple(profile.backward),
            step_time=profile.step_time,
            update_time=profile.update_time,
            alpha=profile.alpha,
            beta=profile.beta,
            slowdown=float(self.sim_options.get("slowdown", 0.0)),
            world_size=world,
            nodes=topology.num_nodes if topology else 1,
            ranks_per_node=topology.local_size if topology else world,
            hierarchical=self._runtime.topology is not None,
            backend=settings.backend,
            compression=settings.compression,
            wire_ratio=float(profile.raw.get("wire_ratio", 1.0)),
            codec_per_byte=float(profile.raw.get("codec_per_byte", 0.0)),
            bucket_cap_bytes=settings.bucket_cap_bytes,
            sync_at_step=self.sync_at_step,
            device=device,
            stale_layers=self.decision.k,
            iteration_time=self.decision.iteration_time,
            wire_beta=profile.beta_isolated if math.isfinite(profile.beta_isolated) else 0.0,
        )

    # ------------------------------------------------------------------ checkpoints

    def state_dict(self) -> dict[str, Any]:
        """Whether k is final, and, while the search runs, where it stands and the model's
        inputs."""
        searching = not self.decided and self.tuner is not None
        return {
            "decided": self.decided,
            "search": None
            if not searching
            else {
                "tuner": self.tuner.state_dict(),
                "trial_start": self._trial_start,
                "times": list(self._trial_times),
                "waits": list(self._trial_waits),
                # the model's inputs, so the resumed job predicts the final k as this one would
                "profiles": [dataclasses.asdict(p) for p in self.layer_profiles or []],
                "link": self.link,
                "sim_options": dict(self.sim_options),
                "decision": dataclasses.asdict(self.decision),
                # what the warm-up measured: for save_profile() once decided, and the model's
                # sync_at_step
                "profile": dataclasses.asdict(self.profile),
                "sync_at_step": self.sync_at_step,
            },
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.decided = state["decided"]
        saved = state["search"]
        self.tuner = search.Tuner.from_state(saved["tuner"]) if saved else None
        if saved:
            self.tuner.suggest = self._search_guide()
            self._trial_start = saved["trial_start"]
            self._trial_times, self._trial_waits = (list(saved["times"]), list(saved["waits"]))
            self.layer_profiles = [solver.LayerProfile(**p) for p in saved["profiles"]] or None
            self.link, self.sim_options = (tuple(saved["link"]), dict(saved["sim_options"]))
            self.decision = solver.Decision(**saved["decision"])
            if "profile" in saved:  # absent from checkpoints written before it was kept
                self.profile = profiler.Profile(**copy.deepcopy(saved["profile"]))
            self.sync_at_step = saved.get("sync_at_step", False)
        if self.decided or self.tuner is not None:
            self.timer = self._pipeline.timer = None
        else:  # a checkpoint of the warm-up: what this job decided since is void; profile again
            self.profile = self.layer_profiles = self.link = self.decision = self.decided_at = None
            self.sim_options, self.sync_at_step = {}, False
            if (
                self._pipeline.layout is not None
            ):  # a live job (a fresh one starts at its first layout)
                self.start_profiling(self._pipeline.layout.layers)


def _device_sync(layers: list[Layer]):
    """For a model on a GPU: wait for its queued compute (profiled timestamps are then the GPU's,
    see :class:`profiler.LayerTimer`); None on a CPU, where the host's clock is the compute's."""
    device = next((p.device for layer in layers for p in layer.params), None)
    if device is None or device.type != "cuda":
        return None
    return lambda: torch.cuda.current_stream(device).synchronize()


def _pair_means(values: list[float]) -> list[float]:
    """Means of consecutive pairs (a lone last value is its own pair)."""
    return [statistics.fmean(values[i : i + 2]) for i in range(0, len(values), 2)]


__all__ = ["FIRST_TRIAL_HEAD", "STALL_TOLERANCE", "TRIAL_MAX_ROUNDS", "AutoController", "Runtime"]
