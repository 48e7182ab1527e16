#!/usr/bin/env python
"""sapipe throughput benchmark: samples/s of sapipe vs DDP (and Horovod) under an emulated network.

Two ways to run it:

* **Sweep (one host, emulated network)** — ``python benchmarks/throughput.py`` (``make bench``).
  For every model and bandwidth it starts one ``torchrun`` job (``--nproc`` ranks, Gloo, CPU)
  with all ranks inside a fresh network namespace whose loopback is rate-limited with
  ``tc tbf`` (see ``netem.py``, DESIGN.md §6). Bandwidths are given explicitly
  (``--bandwidths 1gbit,300mbit``) or, by default, calibrated per model to hit target
  ratios T_comm / T_compute (``--ratios 0.3,0.65,1.3``) from a short probe job. Results go
  to ``benchmarks/results/throughput.md`` and ``throughput_*.png``.
* **Directly under torchrun** (any device, any number of nodes, no emulation) — e.g.
  ``torchrun --nnodes 2 --nproc_per_node 8 ... benchmarks/throughput.py --model gpt2 --size full``.
  Each rank uses ``cuda:LOCAL_RANK`` with NCCL when CUDA is available (Gloo on CPU
  otherwise), and rank 0 prints the same table.

Every job runs, in the same namespace and process group, these modes (each: warm-up, then
``--steps`` timed steps; per rank the median step time, the job's T = the slowest rank's
median, spread = interquartile range / median):

| mode | what |
| --- | --- |
| ``local`` | each rank trains alone with the plain optimizer: compute only (T_compute) |
| ``comm`` | one all-reduce of a buffer the size of all gradients, alone (T_comm) |
| ``ceiling`` | the local step while that buffer is all-reduced on a second process group, started at the top of the step and waited for at its end: perfect overlap (T_ceiling) |
| ``ddp`` | ``torch.nn.parallel.DistributedDataParallel`` |
| ``sapipe k=K`` | ``sapipe.DistributedOptimizer(stale_layers=K, compensation="none")`` for each ``--k`` |
| ``pipesgd`` | sapipe with k = m (all layers stale), ``none`` |
| ``sapipe-auto`` | ``stale_layers="auto"`` (skipped with a note while sapipe refuses it) |
| ``sapipe-<comp>`` | each ``--compensations`` mode at the auto k, or, without auto, at the *oracle* k: the smallest measured k within 3 % of pipesgd |
| ``horovod`` | ``horovod.torch.DistributedOptimizer`` over Gloo (skipped with a note when not installed; ``make peers``) |

Reported per mode: samples/s, speedup over DDP (T_ddp / T), efficiency T_ceiling / T, k and
κ (the fraction of parameters that are stale), and for sapipe modes the time per step blocked on
communication (``DistributedOptimizer.communication_wait``); per job: possible speedup
T_ddp / T_ceiling. sapipe-auto against pipesgd is also given per round (the median of the
ratios within each round), which cancels the host's drifts between rounds.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import gc
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from typing import Any, Dict, List, Optional

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

import bench_models  # noqa: E402
import hostenv  # noqa: E402
import netem  # noqa: E402

DEFAULT_MODELS = "vgg16,resnet50,gpt2,transformer"
PROGRESS_TAG = "@@bench "
ORACLE_TOLERANCE = 0.03
MAX_SETTLE_STEPS = 500  # untimed steps sapipe-auto may take to profile and measure its k


# ============================================================================ arguments


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="sapipe throughput benchmark (see the module docstring)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--models", "--model", dest="models", default=None,
                   help=f"comma-separated model families from {list(bench_models.FAMILIES)} "
                        f"(default: {DEFAULT_MODELS}; --quick: gpt2,vgg16)")
    p.add_argument("--size", default=None, choices=bench_models.SIZES,
                   help="model size (default small; --quick: tiny; 'full' = the paper's models, for GPUs)")
    p.add_argument("--batch", type=int, default=0, help="samples per rank per step (0: the model's default)")
    p.add_argument("--nproc", type=int, default=2, help="ranks per emulated job (sweep mode)")
    p.add_argument("--ratios", default=None,
                   help="target T_comm/T_compute per job; each model's bandwidths are calibrated by a "
                        "probe job (default 0.3,0.65,1.3; --quick: 0.65)")
    p.add_argument("--bandwidths", default="",
                   help="explicit loopback rates instead of --ratios, e.g. 2gbit,500mbit,unlimited")
    p.add_argument("--k", default=None,
                   help="fixed stale-layer counts for sapipe/none; integers or expressions of m "
                        "(m, m/2, m/4, ...) (default 0,1,m/4,m; --quick: 0,1,m)")
    p.add_argument("--compensations", default=None,
                   help="compensation modes run at the auto/oracle k (default dc,wp1,wp2,wp3; --quick: dc)")
    p.add_argument("--backends", default="",
                   help="extra sapipe communication back-ends run at stale_layers='auto' as modes "
                        "'sapipe-auto-<backend>', e.g. pushpull,horovod (default: none)")
    p.add_argument("--skip", default="", help="modes to leave out: any of local,comm,ceiling,ddp,sapipe,auto,comp,horovod")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per mode (default 3; --quick: 2)")
    p.add_argument("--auto-warmup", type=int, default=None,
                   help="untimed steps for stale_layers='auto' once its k is final (it first trains untimed "
                        "while it profiles and measures k) (default: --warmup)")
    p.add_argument("--steps", type=int, default=None, help="timed steps per mode (default 20; --quick: 6)")
    p.add_argument("--rounds", type=int, default=0,
                   help="split each mode's timed steps into this many rounds, interleaved with the other "
                        "modes' (alternating order), so that load drifts hit all modes alike "
                        "(0: 4 on CPU, 1 on CUDA, where 1 also frees each mode's model after it ran)")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads per rank")
    p.add_argument("--bucket-cap-mb", type=float, default=25.0, help="bucket size for DDP and sapipe")
    p.add_argument("--quick", action="store_true", help="smoke test: tiny models, few steps, one bandwidth")
    p.add_argument("--out", default=None,
                   help="results folder for throughput.md and PNGs (default benchmarks/results; "
                        "--quick: a temporary folder)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda:LOCAL_RANK with NCCL when CUDA is available, else CPU with Gloo")
    p.add_argument("--render", default="",
                   help="only re-write the report and plots from a sweep's saved results (the JSON path "
                        "a sweep prints at its end)")
    p.add_argument("--no-netns", action="store_true",
                   help="sweep without network emulation (plain torchrun on this host)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per collective before a job fails")
    p.add_argument("--trace", default="",
                   help="folder: every sapipe mode records its timeline and writes it there as a Chrome trace "
                        "per rank (Perfetto), named <model>_<rate>_<mode>_rank<r>.json; sapipe-auto also its "
                        "predicted iteration (.predicted.json). Recording costs a little time per layer.")
    # internal (orchestrator -> worker)
    p.add_argument("--json", default="", help=argparse.SUPPRESS)
    p.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--rate", default="", help=argparse.SUPPRESS)
    p.add_argument("--target-ratio", type=float, default=float("nan"), help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    q = a.quick
    a.models = a.models or ("gpt2,vgg16" if q else DEFAULT_MODELS)
    a.size = a.size or ("tiny" if q else "small")
    a.ratios = a.ratios or ("0.65" if q else "0.3,0.65,1.3")
    a.k = a.k or ("0,1,m" if q else "0,1,m/4,m")
    a.compensations = a.compensations if a.compensations is not None else ("dc" if q else "dc,wp1,wp2,wp3")
    a.warmup = a.warmup if a.warmup is not None else (2 if q else 3)
    a.auto_warmup = a.auto_warmup if a.auto_warmup is not None else a.warmup
    a.steps = a.steps if a.steps is not None else (6 if q else 20)
    a.skip = {s for s in a.skip.split(",") if s}
    return a


def resolve_k(expr: str, m: int) -> int:
    """'3' -> 3, 'm' -> m, 'm/4' -> max(1, m // 4) (clamped to [0, m])."""
    e = expr.strip().lower()
    if e == "m":
        return m
    if e.startswith("m/"):
        return max(1, min(m, m // int(e[2:])))
    return max(0, min(m, int(e)))


# ============================================================================ worker


class Ctx:
    """Per-job state of one rank."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.args = args
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            self.backend = "nccl"
        else:
            self.device = torch.device("cpu")
            self.backend = "gloo"
            torch.set_num_threads(args.threads)
        timeout = _dt.timedelta(seconds=args.timeout)
        dist.init_process_group(self.backend, timeout=timeout)
        # Control traffic (barriers, gathering results) on its own Gloo group.
        self.ctrl = dist.new_group(backend="gloo", timeout=timeout) if self.backend != "gloo" else dist.group.WORLD
        # The second group that `ceiling` all-reduces on, created once, in the same order on every rank.
        self.side = dist.new_group(backend=self.backend, timeout=timeout)

    def sync(self):
        import torch
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self):
        import torch.distributed as dist
        dist.barrier(group=self.ctrl)

    def gather(self, obj) -> list:
        import torch.distributed as dist
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def say(self, event: Dict[str, Any]):
        """Rank 0: a progress event (machine-readable for the sweep, readable by people)."""
        if self.rank != 0:
            return
        if os.environ.get("SAPIPE_BENCH_PROGRESS"):
            print(PROGRESS_TAG + json.dumps(event), flush=True)
        elif event.get("event") == "mode":
            r = event["result"]
            t = f"{1e3 * r['t']:8.1f} ms" if r.get("t") else "  skipped"
            print(f"[{event['model']}] {event['i']:3d}/{event['n']} round {event['round']}/{event['rounds']} "
                  f"{r['mode']:<14s} {t}  {r.get('note', '')}",
                  file=sys.stderr, flush=True)


def stats(per_rank: List[List[float]]) -> Dict[str, float]:
    """The job's step time: the slowest rank's median; spread: that rank's IQR / median."""
    best = None
    for rank, times in enumerate(per_rank):
        s = sorted(times)
        med = statistics.median(s)
        q1, q3 = _quantile(s, 0.25), _quantile(s, 0.75)
        if best is None or med > best["t"]:
            best = {"t": med, "p25": q1, "p75": q3, "min": s[0], "max": s[-1], "rank": rank}
    best["iqr"] = (best["p75"] - best["p25"]) / best["t"] if best["t"] else 0.0
    return best


def round_medians(per_rank: List[List[float]], per_round: int) -> List[float]:
    """Per round (``per_round`` timed steps each): the slowest rank's median step time in that
    round. Modes interleave by round, so two modes' values of the same round were measured
    minutes apart at most and their ratio is free of the host's slower drifts (see
    ``paired_ratio``)."""
    return [max(statistics.median(times[start:start + per_round]) for times in per_rank)
            for start in range(0, len(per_rank[0]), per_round)]


def paired_ratio(a: Dict[str, Any], b: Dict[str, Any]) -> Optional[float]:
    """T_a / T_b − 1 as the median over rounds of the ratio within each round (None when the
    two modes were not timed in the same rounds)."""
    ra, rb = a.get("round_t") or [], b.get("round_t") or []
    if not ra or len(ra) != len(rb):
        return None
    return statistics.median(x / y for x, y in zip(ra, rb)) - 1


def _quantile(s: List[float], q: float) -> float:
    if len(s) == 1:
        return s[0]
    pos = q * (len(s) - 1)
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class Skip(Exception):
    """A mode that cannot run here (the message says why)."""


class Runner:
    """One mode: set up lazily, stepped in rounds, paused between rounds."""

    warmup = 0

    def __init__(self, job: "Job", mode: str):
        self.job, self.mode = job, mode
        self.ready = False
        self.dead: Optional[str] = None
        self.i = 0
        self.times: List[float] = []
        self.waits: List[float] = []  # per timed step: seconds blocked on communication (sapipe)

    def setup(self):
        raise NotImplementedError

    def step(self, i: int):
        raise NotImplementedError

    def pause(self):
        """Finish this mode's asynchronous work before another mode runs."""

    def resume(self):
        """Undo ``pause()`` before this mode's next round."""

    def settled(self) -> bool:
        """Whether the mode is in its steady state (sapipe-auto: its k is final)."""
        return True

    def info(self) -> Dict[str, Any]:
        return {}

    def waited(self) -> Optional[float]:
        """Seconds this mode has blocked on communication so far (None: not measured)."""
        return None

    def close(self):
        for name in ("model", "opt", "base", "buf", "ddp"):
            self.__dict__.pop(name, None)


class TrainRunner(Runner):
    """local / ddp / ceiling / sapipe / horovod: a fresh model and optimizer."""

    def __init__(self, job, mode, kind: str, k=None, compensation: str = "none", backend: str = "torch"):
        super().__init__(job, mode)
        self.kind, self.k, self.compensation, self.backend = kind, k, compensation, backend
        self.ks: List[Optional[int]] = []

    def setup(self):
        import torch
        import torch.distributed as dist

        job, a = self.job, self.job.args
        self.warmup = a.warmup
        self.model, self.base = job.fresh()
        self.opt = self.base
        net = self.model
        if self.kind == "ceiling":
            self.buf = torch.zeros(job.numel, dtype=job.dtype, device=job.ctx.device)
        elif self.kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            ids = [job.ctx.device.index] if job.ctx.device.type == "cuda" else None
            self.ddp = net = DDP(self.model, device_ids=ids, bucket_cap_mb=a.bucket_cap_mb)
        elif self.kind == "sapipe":
            import sapipe

            if self.k == "auto":
                self.warmup = a.auto_warmup
            if self.backend == "horovod":
                try:
                    import horovod.torch as hvd
                except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
                    raise Skip(f"skipped: horovod not importable ({type(exc).__name__})") from exc
                ok, why = _horovod_init(job.ctx, hvd)
                if not ok:
                    raise Skip(f"skipped: {why}")
            try:
                self.opt = sapipe.DistributedOptimizer(self.base, self.model, stale_layers=self.k,
                                                       compensation=self.compensation,
                                                       bucket_cap_mb=a.bucket_cap_mb, backend=self.backend,
                                                       trace=bool(a.trace))
            except sapipe.ConfigurationError as exc:
                raise Skip(f"skipped: sapipe refused stale_layers={self.k!r}: {exc}") from exc
        elif self.kind == "horovod":
            try:
                import horovod.torch as hvd
            except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
                raise Skip(f"skipped: horovod not importable ({type(exc).__name__}: {str(exc)[:120]}); "
                           "`make peers` installs it") from exc
            ok, why = _horovod_init(job.ctx, hvd)
            if not ok:
                raise Skip(f"skipped: {why}")
            hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
            self.opt = hvd.DistributedOptimizer(self.base, named_parameters=self.model.named_parameters())
        self.net = net
        self._dist = dist

    def step(self, i):
        if self.kind == "ceiling":
            work = self._dist.all_reduce(self.buf, group=self.job.ctx.side, async_op=True)
            self.job.train_step(self.net, self.opt, i)
            work.wait()
            return
        self.job.train_step(self.net, self.opt, i)
        if self.kind == "sapipe":
            k = self.opt.stale_layers
            self.ks.append(k if isinstance(k, int) else None)

    def pause(self):
        if self.kind == "sapipe":
            _drain(self.opt)
        elif self.kind == "horovod" and "horovod" not in self.job.args.backends.split(","):
            # Horovod's idle background loop costs ~7% of a core per rank (measured here):
            # stopped between its rounds, so that it does not slow the modes after it
            # (unless sapipe's own horovod back-end, with stale all-reduces in flight, needs it).
            import horovod.torch as hvd

            hvd.shutdown()

    def resume(self):
        if self.kind == "horovod":
            import horovod.torch as hvd

            ok, why = _horovod_init(self.job.ctx, hvd)
            if not ok:
                raise Skip(f"skipped: {why}")

    def settled(self) -> bool:
        return self.kind != "sapipe" or self.opt.stale_layers != "auto"

    def waited(self) -> Optional[float]:
        return self.opt.communication_wait if self.kind == "sapipe" else None

    def info(self):
        if self.kind in ("local", "ceiling"):
            return {}
        if self.kind != "sapipe":
            return {"k": 0, "kappa": 0.0}
        layers = self.opt.layers
        k_used = self.opt.stale_layers
        total = sum(layer.numel for layer in layers)
        kappa = sum(layer.numel for layer in layers[:k_used]) / total if isinstance(k_used, int) else None
        info: Dict[str, Any] = dict(k=k_used, kappa=kappa, compensation=self.compensation, m=len(layers))
        decision = getattr(self.opt, "decision", None)
        if decision is not None and hasattr(decision, "summary"):
            info["decision"] = str(decision.summary())
            tuner = getattr(self.opt, "tuner", None)
            if tuner is not None:
                info["decision"] += f"; {tuner.summary()}"
        timed = {k for k in self.ks[-len(self.times):]} if self.times else set()
        if len(timed) > 1:
            info["note"] = f"k changed during the timed steps: {sorted(x for x in timed if x is not None)}"
        if len(layers) != self.job.m:
            self.job.notes.append(f"sapipe found m={len(layers)} layers, the benchmark's own count is {self.job.m}")
        return info

    def close(self):
        if self.kind == "sapipe" and "opt" in self.__dict__:
            self.opt.synchronize()
            _drain(self.opt)
            if self.job.args.trace:
                self.write_traces(self.job.args.trace)
        super().close()

    def write_traces(self, folder: str) -> None:
        """This rank's recorded timeline (and, for auto, the predicted iteration) as Chrome traces."""
        os.makedirs(folder, exist_ok=True)
        rate = str(self.job.args.rate or "local").replace("/", "-").replace(" ", "")
        mode = self.mode.replace(" ", "").replace("=", "")
        path = os.path.join(folder, f"{self.job.spec.name}_{rate}_{mode}_rank{self.job.ctx.rank}.json")
        self.opt.write_trace(path)
        if self.k == "auto" and getattr(self.opt, "decision", None) is not None:
            self.opt.write_trace(path[: -len(".json")] + ".predicted.json", predicted=True)
        self.__dict__.pop("net", None)


class CommRunner(Runner):
    """T_comm: one all-reduce of a buffer the size of all gradients, alone."""

    def setup(self):
        import torch
        import torch.distributed as dist

        self.warmup = max(2, self.job.args.warmup)
        self.buf = torch.zeros(self.job.numel, dtype=self.job.dtype, device=self.job.ctx.device)
        self._dist = dist

    def step(self, i):
        self._dist.all_reduce(self.buf)

    def info(self):
        return {"bytes": self.job.numel * self.job.elem}


class Job:
    """All modes of one model in one process group, interleaved in rounds."""

    def __init__(self, ctx: Ctx, model_name: str):
        import torch

        self.ctx = ctx
        self.args = ctx.args
        self.spec = bench_models.build(model_name, self.args.size, self.args.batch)
        gen = torch.Generator().manual_seed(1000 + ctx.rank)
        self.batches = [self.spec.make_batch(self.spec.batch_size, ctx.device, gen) for _ in range(4)]
        probe = self.spec.make_model().to(ctx.device)
        self.layer_sizes = bench_models.describe_layers(probe, self.batches[0][0][:1])
        self.m = len(self.layer_sizes)
        params = [p for p in probe.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in params)
        self.elem = params[0].element_size()
        self.dtype = params[0].dtype
        del probe
        self.results: List[Dict[str, Any]] = []
        self.notes: List[str] = []
        self.rounds = self.args.rounds or (1 if ctx.device.type == "cuda" else 4)
        self.progress = [0, 0]  # done, total

    # ------------------------------------------------------------------ helpers

    def fresh(self):
        model = self.spec.make_model().to(self.ctx.device)
        return model, self.spec.make_optimizer(model.parameters())

    def train_step(self, model, opt, i: int):
        x, y = self.batches[i % len(self.batches)]
        opt.zero_grad()
        self.spec.loss_fn(model(x), y).backward()
        opt.step()

    def by_mode(self, mode: str) -> Optional[Dict[str, Any]]:
        for r in self.results:
            if r["mode"] == mode and r.get("t"):
                return r
        return None

    # ------------------------------------------------------------------ plan

    def runners(self, comp_k=None) -> List[Runner]:
        """First phase (comp_k None): every mode, compensations at auto; else compensations at comp_k."""
        a, skip = self.args, self.args.skip
        first = comp_k is None
        out: List[Runner] = []
        if first:
            if "local" not in skip:
                out.append(TrainRunner(self, "local", "local"))
            if "comm" not in skip:
                out.append(CommRunner(self, "comm"))
            if "ceiling" not in skip:
                out.append(TrainRunner(self, "ceiling", "ceiling"))
            if "ddp" not in skip:
                out.append(TrainRunner(self, "ddp", "ddp"))
            if "sapipe" not in skip:
                for k in sorted({resolve_k(e, self.m) for e in a.k.split(",") if e.strip()}):
                    out.append(TrainRunner(self, "pipesgd" if k == self.m else f"sapipe k={k}", "sapipe", k))
            if "auto" not in skip:
                out.append(TrainRunner(self, "sapipe-auto", "sapipe", "auto"))
            comp_k = "auto" if "auto" not in skip else None
        if "comp" not in skip and comp_k is not None:
            for c in [c for c in a.compensations.split(",") if c and c != "none"]:
                out.append(TrainRunner(self, f"sapipe-{c}", "sapipe", comp_k, c))
        if first and "horovod" not in skip:
            out.append(TrainRunner(self, "horovod", "horovod"))
        if first:
            for backend in [b for b in a.backends.split(",") if b]:
                out.append(TrainRunner(self, f"sapipe-auto-{backend}", "sapipe", "auto", backend=backend))
        return out

    def oracle_k(self) -> Optional[int]:
        """The smallest measured fixed k within ORACLE_TOLERANCE of pipesgd (None without both)."""
        pipe = self.by_mode("pipesgd")
        if pipe is None:
            return None
        for r in sorted((r for r in self.results if r["mode"].startswith("sapipe k=") and r.get("t")),
                        key=lambda r: r["k"]):
            if r["t"] <= (1 + ORACLE_TOLERANCE) * pipe["t"]:
                return r["k"]
        return self.m

    def fallback_k(self):
        """k for the compensation modes when auto is unavailable: the oracle k (or k >= 1)."""
        fixed = sorted(r["k"] for r in self.results if r["mode"].startswith("sapipe k=") and r.get("t"))
        k = self.oracle_k()
        if k is None:
            k = fixed[-1] if fixed else self.m
            return k, f"largest measured k={k} (pipesgd not run)"
        why = f"oracle k={k} (smallest measured k within {ORACLE_TOLERANCE:.0%} of pipesgd)"
        if k == 0:  # nothing to gain from staleness; still show what compensation costs
            k1 = next((q for q in fixed if q > 0), self.m)
            return k1, why + f"; k=0 makes compensation moot, so they run at k={k1}"
        return k, why

    # ------------------------------------------------------------------ run

    @property
    def per_round(self) -> int:
        """Timed steps per mode per round."""
        return max(1, math.ceil(self.args.steps / self.rounds))

    def execute(self, runners: List[Runner]):
        """Run ``runners`` interleaved: round r steps every mode (alternating order) in turn."""
        ctx = self.ctx
        per_round = self.per_round
        for rnd in range(self.rounds):
            order = runners if rnd % 2 == 0 else runners[::-1]
            for run in order:
                if run.dead:
                    continue
                try:
                    ctx.barrier()
                    if not run.ready:
                        run.setup()
                        run.ready = True
                        warm = run.warmup
                        # "auto" profiles, then measures k on the job: untimed until k is final
                        # (the same on every rank: the decision is agreed on)
                        for _ in range(MAX_SETTLE_STEPS):
                            if run.settled():
                                break
                            run.step(run.i)
                            ctx.sync()
                            run.i += 1
                        if not run.settled():
                            raise Skip(f"skipped: k not final after {MAX_SETTLE_STEPS} steps")
                    else:
                        run.resume()
                        warm = 1  # caches and the link are someone else's after another mode
                    for j in range(warm + per_round):
                        w0 = run.waited()
                        t0 = time.perf_counter()
                        run.step(run.i)
                        ctx.sync()
                        dt = time.perf_counter() - t0
                        w1 = run.waited()
                        run.i += 1
                        if j >= warm:
                            run.times.append(dt)
                            if w0 is not None and w1 is not None:
                                run.waits.append(w1 - w0)
                    run.pause()
                except Skip as s:
                    run.dead = str(s)
                except Exception as exc:  # noqa: BLE001 - recorded, the job goes on
                    traceback.print_exc()
                    run.dead = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
                if run.dead and "opt" in run.__dict__:
                    run.__dict__.pop("opt")  # a broken optimizer must not be synchronised
                self.progress[0] += 1
                last = run.times[-per_round:] if run.times and not run.dead else []
                ctx.say({"event": "mode", "model": self.spec.name, "i": self.progress[0], "n": self.progress[1],
                         "round": rnd + 1, "rounds": self.rounds,
                         "result": {"mode": run.mode, "t": statistics.median(last) if last else None,
                                    "note": run.dead or ""}})
                if self.rounds == 1 or rnd == self.rounds - 1 or run.dead:
                    self.finish(run)

    def finish(self, run: Runner):
        if any(r["mode"] == run.mode for r in self.results):
            return
        info: Dict[str, Any] = {}
        if not run.dead:
            try:
                info = run.info()
            except Exception as exc:  # noqa: BLE001
                info = {"note": f"info failed: {exc}"}
        per_rank = self.ctx.gather(run.times if not run.dead else [])
        waits = self.ctx.gather(run.waits if not run.dead else [])
        r: Dict[str, Any] = {"mode": run.mode}
        if all(per_rank):
            r.update(stats(per_rank))
            slowest = r.pop("rank")
            r["round_t"] = round_medians(per_rank, self.per_round)
            if all(waits) and all(len(w) == len(t) for w, t in zip(waits, per_rank)):
                # the median wait per step of the rank whose median step time is the job's T
                r["wait"] = statistics.median(waits[slowest])
        r.update(info)
        if run.dead:
            r["note"] = run.dead
        self.results.append(r)
        try:
            run.close()
        except Exception:  # noqa: BLE001
            pass
        gc.collect()
        if self.ctx.device.type == "cuda":
            import torch

            torch.cuda.empty_cache()

    def run(self) -> Dict[str, Any]:
        first = self.runners()
        n_comp = len([c for c in self.args.compensations.split(",") if c and c != "none"])
        self.progress = [0, self.rounds * len(first)]
        self.ctx.say({"event": "start", "model": self.spec.name, "n": self.progress[1]})
        self.order = [r.mode for r in first]
        self.execute(first)
        auto = self.by_mode("sapipe-auto")
        if auto is not None and "comp" not in self.args.skip:
            self.notes.append("compensation modes run with stale_layers=\"auto\"")
        if auto is None and "comp" not in self.args.skip and n_comp:
            # auto unavailable (refused or failed): the compensation modes run at the oracle k,
            # in a second phase, since the oracle needs the first phase's measurements.
            self.results = [r for r in self.results if not (r["mode"].startswith("sapipe-") and r["mode"] != "sapipe-auto")]
            k, why = self.fallback_k()
            self.notes.append(f"compensation modes run at {why}, in a second phase after the others")
            second = self.runners(comp_k=k)
            self.progress[1] += self.rounds * len(second)
            self.execute(second)
        self.results.sort(key=lambda r: self.order.index(r["mode"]) if r["mode"] in self.order else len(self.order))
        return self.summary()

    def summary(self) -> Dict[str, Any]:
        import torch

        c = self.ctx
        return {
            "oracle_k": self.oracle_k(),
            "model": self.spec.name, "size": self.spec.size, "batch": self.spec.batch_size,
            "optimizer": self.spec.optimizer, "params": self.numel, "grad_bytes": self.numel * self.elem,
            "m": self.m, "largest_layers": _largest(self.layer_sizes, self.numel),
            "world": c.world, "device": str(c.device.type) + (f" ({torch.cuda.get_device_name(c.device)})"
                                                               if c.device.type == "cuda" else ""),
            "backend": c.backend, "threads": self.args.threads if c.device.type == "cpu" else None,
            "rate": self.args.rate or "not emulated", "target_ratio": self.args.target_ratio,
            "warmup": self.args.warmup, "steps": self.args.steps, "rounds": self.rounds, "results": self.results,
            "notes": self.notes, "host": platform.node(), "torch": torch.__version__,
        }


def _largest(layers, total, n=3):
    top = sorted(range(len(layers)), key=lambda i: -layers[i][1])[:n]
    return [(i + 1, layers[i][0], layers[i][1] / total) for i in top]


def _drain(opt):
    """Wait for sapipe's stale all-reduces still in flight, so they do not overlap the next mode."""
    for bucket in getattr(opt, "_buckets", []):
        grads = getattr(bucket, "grads", None)
        for handle in getattr(grads, "in_flight", []) or []:
            work = getattr(handle, "work", None)
            if work is not None:
                work.wait()  # idempotent; sapipe still owns the handle and waits on it again


def _horovod_init(ctx: Ctx, hvd):
    """Start Horovod's Gloo controller inside this torchrun job, once (no horovodrun needed)."""
    if ctx.device.type == "cuda" and not getattr(hvd, "nccl_built", lambda: False)():
        return False, "horovod was built without NCCL"
    if hvd.is_initialized():
        return True, ""
    from sapipe.comm.horovod_backend import init_horovod_for_torch_job

    try:
        init_horovod_for_torch_job()
    except Exception as exc:  # noqa: BLE001 - reported as a skipped mode
        return False, str(exc)
    return True, ""


def run_probe(ctx: Ctx, model_name: str) -> Dict[str, Any]:
    """Calibration: T_compute (all ranks training alone) and the all-reduce floor T_comm(∞)."""
    job = Job(ctx, model_name)
    job.args.steps = max(job.args.steps, 10)
    job.rounds = 1
    job.execute([TrainRunner(job, "local", "local"), CommRunner(job, "comm")])
    local, comm = job.by_mode("local"), job.by_mode("comm")
    return {"model": model_name, "t_local": local["t"], "t_comm_floor": comm["t"],
            "grad_bytes": job.numel * job.elem, "world": ctx.world, "m": job.m}


def worker(args) -> int:
    import torch.distributed as dist

    ctx = Ctx(args)
    jobs = []
    try:
        for name in [m for m in args.models.split(",") if m]:
            if args.probe:
                jobs.append(run_probe(ctx, name))
            else:
                jobs.append(Job(ctx, name).run())
                if ctx.rank == 0 and not os.environ.get("SAPIPE_BENCH_PROGRESS"):
                    print(format_job(jobs[-1]), flush=True)
        if ctx.rank == 0 and args.json:
            with open(args.json, "w") as f:
                json.dump(jobs, f, indent=1)
        ctx.barrier()
    finally:
        try:
            hvd = sys.modules.get("horovod.torch")
            if hvd is not None and hvd.is_initialized():
                hvd.shutdown()
        except Exception:  # noqa: BLE001
            pass
        dist.destroy_process_group()
    return 0


# ============================================================================ reporting


def _ref(job, mode):
    for r in job["results"]:
        if r["mode"] == mode and r.get("t"):
            return r
    return None


def derived(job) -> Dict[str, Optional[float]]:
    loc, comm, ceil, ddp = (_ref(job, m) for m in ("local", "comm", "ceiling", "ddp"))
    d = {
        "t_local": loc and loc["t"], "t_comm": comm and comm["t"], "t_ceiling": ceil and ceil["t"],
        "t_ddp": ddp and ddp["t"],
    }
    d["ratio"] = d["t_comm"] / d["t_local"] if d["t_comm"] and d["t_local"] else None
    d["possible"] = d["t_ddp"] / d["t_ceiling"] if d["t_ddp"] and d["t_ceiling"] else None
    return d


def headline(job) -> Optional[Dict[str, Any]]:
    """The sapipe result a user would get: auto when it ran, else the oracle-k run."""
    auto = _ref(job, "sapipe-auto")
    if auto:
        return auto
    k = job.get("oracle_k")
    for r in job["results"]:
        if isinstance(k, int) and r.get("t") and r.get("k") == k and r["mode"] in (f"sapipe k={k}", "pipesgd"):
            return r
    return None


def _ms(t):
    return "–" if t is None else f"{1e3 * t:.1f}"


def format_job(job) -> str:
    d = derived(job)
    samples = job["world"] * job["batch"]
    lines = [
        f"### {job['model']} ({job['size']}) — {job['rate']}" + (
            f", T_comm/T_compute = {d['ratio']:.2f}" if d["ratio"] else ""),
        "",
        f"{job['params'] / 1e6:.2f} M parameters ({job['grad_bytes'] / 2**20:.1f} MiB of gradients), "
        f"m = {job['m']} layers, largest: "
        + ", ".join(f"#{i} {n} ({s:.0%})" for i, n, s in job["largest_layers"])
        + f". {job['world']} ranks × {job['batch']} samples, {job['device']}, {job['backend']}"
        + (f", {job['threads']} thread(s)/rank" if job.get("threads") else "") + ".",
        "",
        f"T_compute (local) {_ms(d['t_local'])} ms · T_comm {_ms(d['t_comm'])} ms · "
        f"T_ceiling {_ms(d['t_ceiling'])} ms · T_ddp {_ms(d['t_ddp'])} ms · possible speedup "
        f"T_ddp/T_ceiling = {d['possible']:.2f}×" if d["possible"] else "(references incomplete)",
        "",
        "| mode | k | κ | step ms (median) | IQR | min ms | waits ms/step | samples/s | × DDP | efficiency |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in job["results"]:
        if not r.get("t"):
            lines.append(f"| {r['mode']} | | | {r.get('note', 'skipped')} | | | | | | |")
            continue
        k = r.get("k")
        kappa = r.get("kappa")
        if r["mode"] == "comm":
            lines.append(f"| comm | | | {_ms(r['t'])} | {r['iqr']:.0%} | {_ms(r['min'])} | | | | (one all-reduce of "
                         f"{r['bytes'] / 2**20:.1f} MiB) |")
            continue
        sps = samples / r["t"]
        x = f"{d['t_ddp'] / r['t']:.2f}" if d["t_ddp"] and r["mode"] not in ("local",) else ""
        eff = f"{d['t_ceiling'] / r['t']:.2f}" if d["t_ceiling"] and r["mode"] not in ("local", "ceiling") else ""
        lines.append(
            f"| {r['mode']}{' ⚠' if r.get('note') else ''} | {'' if k is None else k} | "
            f"{'' if kappa is None else f'{kappa:.2f}'} | {_ms(r['t'])} | {r['iqr']:.0%} | {_ms(r['min'])} | "
            f"{_ms(r['wait']) if 'wait' in r else ''} | {sps:.1f} | {x} | {eff} |")
    notes = list(job["notes"]) + [f"{r['mode']}: {r['note']}" for r in job["results"] if r.get("note") and r.get("t")]
    notes += [f"{r['mode']} scheduler: {r['decision']}" for r in job["results"] if r.get("decision")][:1]
    if notes:
        lines += [""] + [f"* {n}" for n in notes]
    return "\n".join(lines) + "\n"


def summary_rows(jobs) -> List[Dict[str, Any]]:
    rows = []
    for job in jobs:
        d = derived(job)
        h = headline(job)
        pipe = _ref(job, "pipesgd")
        row = dict(model=job["model"], rate=job["rate"], rate_bits=job.get("rate_bits"), **d)
        row["headline"] = h and h["mode"]
        row["k"] = h and h.get("k")
        row["kappa"] = h and h.get("kappa")
        row["speedup"] = d["t_ddp"] / h["t"] if h and d["t_ddp"] else None
        row["eff"] = d["t_ceiling"] / h["t"] if h and d["t_ceiling"] else None
        row["pipe_speedup"] = d["t_ddp"] / pipe["t"] if pipe and d["t_ddp"] else None
        row["vs_pipe"] = h["t"] / pipe["t"] - 1 if h and pipe else None
        row["vs_pipe_paired"] = paired_ratio(h, pipe) if h and pipe else None
        row["t"] = h and h["t"]
        row["wait"] = h and h.get("wait")
        row["pipe_wait"] = pipe and pipe.get("wait")
        sap = [r for r in job["results"] if r.get("t") and (r["mode"].startswith("sapipe") or r["mode"] == "pipesgd")]
        row["best_speedup"] = max((d["t_ddp"] / r["t"] for r in sap), default=None) if d["t_ddp"] else None
        hv = _ref(job, "horovod")
        row["horovod"] = d["t_ddp"] / hv["t"] if hv and d["t_ddp"] else None
        row["comps"] = {r["mode"]: d["t_ddp"] / r["t"] for r in sap if r.get("compensation") not in (None, "none")
                        and d["t_ddp"]}
        rows.append(row)
    return rows


def format_summary(jobs) -> str:
    lines = [
        "| model | rate | T_comm/T_compute | possible (T_ddp/T_ceil) | sapipe config | k | κ | × DDP | efficiency "
        "| vs pipesgd | vs pipesgd, per round | waits ms/step (sapipe / pipesgd) | pipesgd × DDP | horovod × DDP |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    f = lambda v, fmt: ("–" if v is None else format(v, fmt))  # noqa: E731
    for r in summary_rows(jobs):
        lines.append(
            f"| {r['model']} | {r['rate']} | {f(r['ratio'], '.2f')} | {f(r['possible'], '.2f')} | "
            f"{r['headline'] or '–'} | {f(r['k'], '')} | {f(r['kappa'], '.2f')} | {f(r['speedup'], '.2f')} | "
            f"{f(r['eff'], '.2f')} | {f(r['vs_pipe'], '+.1%')} | {f(r['vs_pipe_paired'], '+.1%')} | "
            f"{_ms(r['wait'])} / {_ms(r['pipe_wait'])} | {f(r['pipe_speedup'], '.2f')} | {f(r['horovod'], '.2f')} |")
    return "\n".join(lines) + "\n"


def format_targets(jobs) -> str:
    out = []
    rows = summary_rows(jobs)
    bound = [r for r in rows if r["ratio"] is not None and r["ratio"] <= 1.0 and r["eff"] is not None]
    if bound:
        miss = [r for r in bound if r["eff"] < 0.95 or r["speedup"] < 1.0]
        out.append(f"* **Efficiency ≥ 0.95 and never slower than DDP where T_comm ≤ T_compute**: "
                   f"{len(bound) - len(miss)}/{len(bound)} jobs meet it." + (" Misses: " + "; ".join(
                       f"{r['model']} @ {r['rate']} (ratio {r['ratio']:.2f}): efficiency {r['eff']:.2f}, "
                       f"{r['speedup']:.2f}× DDP{_wait_evidence(r)}" for r in miss) if miss else ""))
    g = [r for r in rows if r["model"] == "gpt2" and r["ratio"] and r["speedup"]]
    if g:
        r = min(g, key=lambda r: abs(r["ratio"] - 0.65))
        out.append(f"* **GPT-2 ≈ 1.4× DDP at T_comm ≈ 0.65 T_compute**: at ratio {r['ratio']:.2f} sapipe "
                   f"({r['headline']}) is {r['speedup']:.2f}× DDP; the possible speedup there is "
                   f"{r['possible']:.2f}× (T_ddp/T_ceiling)." if r["possible"] else "")
    over = [_ref(j, "sapipe k=0")["t"] / _ref(j, "ddp")["t"] - 1 for j in jobs if _ref(j, "sapipe k=0") and _ref(j, "ddp")]
    if over:
        out.append(f"* sapipe k=0 (fully synchronous) vs DDP, step time: median {statistics.median(over):+.1%} "
                   f"(range {min(over):+.1%} … {max(over):+.1%}; positive = sapipe slower). With k = 0 sapipe "
                   "communicates what DDP does, so this is its runtime overhead, plus noise.")
    a = [r for r in rows if r["vs_pipe"] is not None and r["headline"] == "sapipe-auto"]
    if a:
        gap = {id(r): r["vs_pipe_paired"] if r["vs_pipe_paired"] is not None else r["vs_pipe"] for r in a}
        within = [r for r in a if gap[id(r)] <= 0.03]
        fewer = [r for r in a if r["kappa"] is not None and r["kappa"] < 1.0]
        both = [r for r in within if r in fewer]
        missed = [r for r in a if r not in within]
        out.append(f"* **sapipe-auto within 3 % of pipesgd while staling fewer layers** (step time, median over "
                   f"rounds of the ratio within a round): within 3 % in "
                   f"{len(within)}/{len(a)} jobs, κ < 1 in {len(fewer)}/{len(a)}, both in {len(both)}/{len(a)} "
                   f"(median κ {statistics.median([r['kappa'] for r in a if r['kappa'] is not None] or [float('nan')]):.2f}; "
                   f"auto vs pipesgd: " + ", ".join(f"{r['model']} {gap[id(r)]:+.0%}" for r in a) + ")."
                   + (" Misses: " + "; ".join(f"{r['model']} @ {r['rate']} {gap[id(r)]:+.1%} (k = {r['k']}, "
                                              f"κ {r['kappa']:.2f}){_wait_evidence(r, pipe=True)}" for r in missed)
                      if missed else ""))
    no_auto = [r["model"] + " @ " + r["rate"] for r in rows if r["headline"] != "sapipe-auto"]
    if no_auto:
        out.append("* sapipe-auto did not run (see the per-job notes) in: " + ", ".join(no_auto) + ".")
    return "\n".join(out) + "\n"


def _wait_evidence(row: Dict[str, Any], pipe: bool = False) -> str:
    """Where a miss's time went: the step's communication wait (sapipe's own counter,
    ``DistributedOptimizer.communication_wait``) against the rest of the step."""
    if row.get("wait") is None or not row.get("t"):
        return ""
    text = f": waits {_ms(row['wait'])} of {_ms(row['t'])} ms/step"
    if pipe and row.get("pipe_wait") is not None and row.get("pipe_speedup") and row.get("t_ddp"):
        text += f" (pipesgd {_ms(row['pipe_wait'])} of {_ms(row['t_ddp'] / row['pipe_speedup'])})"
    return text


def plot(jobs, out_dir) -> List[str]:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        print(f"no plots: matplotlib unavailable ({exc})", file=sys.stderr)
        return []
    rows = summary_rows(jobs)
    models = list(dict.fromkeys(r["model"] for r in rows))
    paths = []
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        rs = sorted([r for r in rows if r["model"] == model and r["rate_bits"]], key=lambda r: r["rate_bits"])
        if not rs:
            continue
        x = [r["rate_bits"] / 1e6 for r in rs]
        series = [("possible (T_ddp/T_ceiling)", [r["possible"] for r in rs], "k^--"),
                  ("sapipe: auto (oracle k where auto failed)",
                   [r["speedup"] for r in rs], "o-"),
                  ("pipesgd (k=m)", [r["pipe_speedup"] for r in rs], "s-")]
        for comp in sorted({c for r in rs for c in r["comps"]}):
            series.append((comp, [r["comps"].get(comp) for r in rs], ".:"))
        if any(r["horovod"] for r in rs):
            series.append(("horovod", [r["horovod"] for r in rs], "x-"))
        for label, ys, style in series:
            pts = [(a, b) for a, b in zip(x, ys) if b]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, label=label)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log")
        ax.set_title(f"{model}")
        ax.set_xlabel("emulated bandwidth (Mbit/s, log)")
        for r, xv in zip(rs, x):
            if r["ratio"]:
                ax.annotate(f"{r['ratio']:.2f}", (xv, 1.0), textcoords="offset points", xytext=(0, -12),
                            ha="center", fontsize=7, color="grey")
    axes[0][0].set_ylabel("speedup over DDP (T_ddp / T)\n(grey: T_comm/T_compute)")
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    p = os.path.join(out_dir, "throughput_speedup.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)

    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for model in models:
        rs = sorted([r for r in rows if r["model"] == model and r["ratio"] and r["eff"]], key=lambda r: r["ratio"])
        if rs:
            ax.plot([r["ratio"] for r in rs], [r["eff"] for r in rs], "o-", label=model)
    ax.axhline(0.95, color="grey", ls="--", lw=0.8)
    ax.axvline(1.0, color="grey", ls=":", lw=0.8)
    ax.set_xlabel("T_comm / T_compute")
    ax.set_ylabel("sapipe efficiency (T_ceiling / T)")
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    fig.tight_layout()
    p = os.path.join(out_dir, "throughput_efficiency.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    paths.append(p)
    return paths


# ============================================================================ orchestrator


class Progress:
    """One-line progress bar on stderr (plain lines when not a terminal)."""

    def __init__(self, total: int):
        self.total, self.done, self.start = max(1, total), 0, time.time()
        self.tty = sys.stderr.isatty()
        self.last_print = 0.0

    def update(self, advance: float, text: str, at: Optional[float] = None):
        self.done = at if at is not None else self.done + advance
        frac = min(1.0, self.done / self.total)
        el = time.time() - self.start
        eta = el / frac - el if frac > 0.01 else float("nan")
        bar = "#" * int(30 * frac) + "-" * (30 - int(30 * frac))
        line = f"[{bar}] {100 * frac:5.1f}% {el / 60:5.1f} min, ~{eta / 60:4.1f} min left | {text}"
        if self.tty:
            print("\r" + line[:150].ljust(150), end="", file=sys.stderr, flush=True)
        elif time.time() - self.last_print > 20 or not text.split(": ")[-1].startswith("round"):
            print(line, file=sys.stderr, flush=True)  # a log, not a terminal: a line now and then
            self.last_print = time.time()

    def close(self):
        if self.tty:
            print(file=sys.stderr)


def worker_argv(args, model: str, json_path: str, extra: List[str]) -> List[str]:
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun if os.path.exists(torchrun) else "torchrun", "--standalone", f"--nproc_per_node={args.nproc}",
           os.path.abspath(__file__), "--models", model, "--size", args.size, "--batch", str(args.batch),
           "--k", args.k, "--compensations", args.compensations, "--warmup", str(args.warmup),
           "--auto-warmup", str(args.auto_warmup), "--steps", str(args.steps), "--rounds", str(args.rounds),
           "--threads", str(args.threads), "--device", args.device,
           "--bucket-cap-mb", str(args.bucket_cap_mb), "--timeout", str(args.timeout), "--json", json_path]
    if args.skip:
        cmd += ["--skip", ",".join(sorted(args.skip))]
    if args.backends:
        cmd += ["--backends", args.backends]
    if args.trace:
        cmd += ["--trace", os.path.abspath(args.trace)]
    return cmd + extra


def launch(args, argv: List[str], bits: Optional[float], log, on_event=None) -> int:
    env = hostenv.worker_env(SAPIPE_BENCH_PROGRESS="1", OMP_NUM_THREADS=str(args.threads),
               PYTHONUNBUFFERED="1", TORCHELASTIC_ERROR_FILE="")
    if not args.no_netns:
        env["GLOO_SOCKET_IFNAME"] = "lo"
        env["MASTER_ADDR"] = "127.0.0.1"
        argv = netem.wrap(argv, bits)
    log.write(f"\n$ {shlex.join(argv)}\n")
    log.flush()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=REPO)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(PROGRESS_TAG):
            if on_event:
                on_event(json.loads(line[len(PROGRESS_TAG):]))
        else:
            log.write(line)
    return proc.wait()


def orchestrate(args) -> int:
    models = [m for m in args.models.split(",") if m]
    for m in models:
        bench_models.build(m, args.size)  # fail early on a bad name
    out_dir = args.out or (tempfile.mkdtemp(prefix="sapipe-bench-") if args.quick else os.path.join(HERE, "results"))
    os.makedirs(out_dir, exist_ok=True)
    log_path = os.path.join(tempfile.gettempdir(), f"sapipe-throughput-{os.getpid()}.log")
    log = open(log_path, "w")
    if not args.no_netns:
        ok, why = netem.check()
        if not ok:
            print(f"cannot emulate the network: {why}\n(use --no-netns to run without emulation)", file=sys.stderr)
            return 2
        print(f"network emulation: {why}", file=sys.stderr)
    print(f"log: {log_path}", file=sys.stderr)

    explicit = [netem.parse_rate(b) for b in args.bandwidths.split(",") if b.strip()] if args.bandwidths else None
    if args.no_netns:
        explicit = [None]
    ratios = [float(r) for r in args.ratios.split(",") if r.strip()]
    n_bw = len(explicit) if explicit else len(ratios)
    probe_cost = 0.0 if explicit else 0.15  # in jobs
    progress = Progress(len(models) * (n_bw + probe_cost))
    jobs: List[Dict[str, Any]] = []
    calib: Dict[str, Any] = {}
    tmp = tempfile.mkdtemp(prefix="sapipe-bench-json-")
    t_start = time.time()
    load_start = os.getloadavg()
    for model in models:
        rates: List[tuple] = []
        if explicit:
            rates = [(b, None) for b in explicit]
        else:
            progress.update(0, f"{model}: calibrating (probe job)")
            path = os.path.join(tmp, f"{model}-probe.json")
            rc = launch(args, worker_argv(args, model, path, ["--probe"]), None, log)
            progress.update(probe_cost, f"{model}: calibrated")
            if rc != 0 or not os.path.exists(path):
                print(f"\n{model}: probe job failed (rc {rc}); see {log_path}", file=sys.stderr)
                continue
            probe = json.load(open(path))[0]
            calib[model] = probe
            # A ring all-reduce puts 2(n-1)·S bytes on the one shaped loopback: T(R) = floor + 16(n-1)S/R.
            wire_bits = 16 * (probe["world"] - 1) * probe["grad_bytes"]
            for r in ratios:
                budget = r * probe["t_local"] - probe["t_comm_floor"]
                if budget <= 0.05 * r * probe["t_local"]:
                    rates.append((None, r))  # the all-reduce floor alone exceeds the target
                else:
                    rates.append((wire_bits / budget, r))
        for bits, ratio in rates:
            path = os.path.join(tmp, f"{model}-{int(bits or 0)}.json")
            label = netem.format_rate(bits) if not args.no_netns else "not emulated"
            extra = ["--rate", label] + (["--target-ratio", str(ratio)] if ratio is not None else [])

            base = progress.done

            def on_event(ev, model=model, label=label, base=base):
                if ev["event"] == "mode":
                    r = ev["result"]
                    t = f"{1e3 * r['t']:.0f} ms" if r.get("t") else (r.get("note") or "skipped")[:40]
                    progress.update(0, f"{model} @ {label}: round {ev['round']}/{ev['rounds']} {r['mode']} {t}",
                                    at=base + min(1.0, ev["i"] / max(1, ev["n"])))

            progress.update(0, f"{model} @ {label}: starting")
            rc = launch(args, worker_argv(args, model, path, extra), bits, log, on_event)
            progress.update(0, f"{model} @ {label}: done", at=base + 1)
            if rc != 0 or not os.path.exists(path):
                print(f"\n{model} @ {label}: job failed (rc {rc}); see {log_path}", file=sys.stderr)
                continue
            job = json.load(open(path))[0]
            job["rate_bits"] = bits
            jobs.append(job)
    progress.close()
    log.close()
    if not jobs:
        print(f"no job finished; see {log_path}", file=sys.stderr)
        return 1
    meta = {"argv": sys.argv[1:], "seconds": time.time() - t_start, "load": [load_start, os.getloadavg()],
            "finished": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count()}
    saved = os.path.join(tmp, "sweep.json")
    with open(saved, "w") as f:
        json.dump({"meta": meta, "jobs": jobs, "calib": calib}, f, indent=1)
    print(f"raw results: {saved} (re-render with --render {saved})", file=sys.stderr)
    return report(args, jobs, calib, out_dir, meta)


def report(args, jobs, calib, out_dir, meta) -> int:
    for job in jobs:
        print("\n" + format_job(job))
    print(format_summary(jobs))
    print(format_targets(jobs))
    pngs = plot(jobs, out_dir)
    md = write_markdown(args, jobs, calib, pngs, out_dir, meta)
    print(f"wrote {md}" + "".join(f", {p}" for p in pngs))
    return 0


def write_markdown(args, jobs, calib, pngs, out_dir, meta) -> str:
    argv, seconds = meta["argv"], meta["seconds"]
    cmd = ("python benchmarks/throughput.py " + shlex.join(argv)) if argv else \
        "make bench   # = python benchmarks/throughput.py"
    j0 = jobs[0]
    lines = [
        "# Throughput: sapipe vs DDP under an emulated network",
        "",
        f"Generated {meta['finished']} on {j0['host']} ({meta['cpus']} CPUs), torch {j0['torch']}, "
        f"in {seconds / 60:.1f} min (load average {meta['load'][0][0]:.1f} at the start, "
        f"{meta['load'][1][0]:.1f} at the end) by:",
        "",
        "```sh",
        cmd,
        "```",
        "",
    ]
    if meta["load"][0][0] > 0.75 * meta["cpus"] or meta["load"][1][0] > 0.75 * meta["cpus"]:
        lines += [
            f"> **Noisy run.** The host was busy with other work (load average {meta['load'][0][0]:.1f} / "
            f"{meta['load'][1][0]:.1f} on {meta['cpus']} CPUs), so each rank got a fraction of a core and step "
            "times vary by up to several × (see the IQR and min columns); ratios between modes, the "
            "calibrated T_comm/T_compute and the scheduler's own profile are unreliable. Rerun `make bench` "
            "on a quiet machine before drawing conclusions.",
            "",
        ]
    lines += [
        f"{j0['world']} ranks per job ({j0['device']}, {j0['backend']}, "
        f"{j0.get('threads')} thread(s) per rank), all in one fresh network namespace whose loopback is shaped by "
        "`tc qdisc add dev lo root tbf rate R` (benchmarks/netem.py): R is the aggregate rate of all ranks, and a "
        "ring all-reduce of S bytes puts 2(n−1)·S bytes through it. Each mode: "
        f"{j0['warmup']} warm-up steps (auto: untimed until its k is final, then {args.auto_warmup}), then "
        f"{j0['steps']} timed steps, split into "
        f"{j0.get('rounds', 3)} rounds that interleave all modes of the job (alternating order, one extra untimed "
        "step per round), so that load drifts hit every mode alike; "
        "T = the slowest rank's median step time, IQR = its interquartile range / median. Synthetic data.",
        "",
        "Definitions (DESIGN.md §6): T_compute = `local` (each rank trains alone, no communication); "
        "T_comm = one all-reduce of all gradients alone; T_ceiling = the local step while a buffer of all "
        "gradients is all-reduced on a second process group (perfect overlap; on a CPU host the busy link "
        "costs CPU, so this, not `local`, is the best any overlapping schedule can do). "
        "× DDP = T_ddp / T; efficiency = T_ceiling / T; possible speedup = T_ddp / T_ceiling; "
        "κ = fraction of parameters in the k stale layers. "
        "vs pipesgd = T / T_pipesgd − 1; *per round*: the median over rounds of the same ratio taken within "
        "each round (both modes timed minutes apart at most, so the host's slower drifts cancel). "
        "waits = the median time per step that sapipe blocked on its all-reduces "
        "(`DistributedOptimizer.communication_wait`): a slow step with few waits ran slow in compute, "
        "not for the network.",
        "",
    ]
    if calib:
        lines += ["Bandwidths were calibrated per model for target ratios T_comm/T_compute = "
                  f"{args.ratios} from a probe job (T_compute and the unshaped all-reduce time):", "",
                  "| model | probe T_compute ms | all-reduce floor ms | gradients MiB |", "| --- | --- | --- | --- |"]
        for m, p in calib.items():
            lines.append(f"| {m} | {1e3 * p['t_local']:.1f} | {1e3 * p['t_comm_floor']:.1f} | "
                         f"{p['grad_bytes'] / 2**20:.1f} |")
        lines.append("")
    lines += ["## Summary", "",
              "sapipe config = `sapipe-auto` when sapipe supports `stale_layers=\"auto\"`, else the *oracle* k "
              "(the smallest measured k within 3 % of pipesgd, compensation `none`); vs pipesgd = its step time "
              "relative to pipesgd's.", "", format_summary(jobs), "## Targets", "", format_targets(jobs)]
    for p in pngs:
        lines += [f"![{os.path.basename(p)}]({os.path.basename(p)})", ""]
    lines += ["## Per job", ""]
    for job in jobs:
        lines += [format_job(job), ""]
    path = os.path.join(out_dir, "throughput.md")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    if "RANK" in os.environ and "LOCAL_RANK" in os.environ:
        return worker(args)
    if args.render:
        with open(args.render) as f:
            saved = json.load(f)
        old = parse_args(saved["meta"]["argv"])
        out_dir = args.out or os.path.join(HERE, "results")
        os.makedirs(out_dir, exist_ok=True)
        return report(old, saved["jobs"], saved["calib"], out_dir, saved["meta"])
    return orchestrate(args)


if __name__ == "__main__":
    sys.exit(main())
