"""All modes of one model in one process group, interleaved in rounds; the per-rank worker."""

from __future__ import annotations

import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from typing import Any

import bench_models

from .rank import Ctx
from .runners import CommRunner, Runner, Skip, TrainRunner
from .stats import round_medians, stats
from .summary import fixed_k_results

ORACLE_TOLERANCE = 0.03
MAX_SETTLE_STEPS = 500  # untimed steps sapipe-auto may take to profile and measure its k


def resolve_k(expr: str, m: int) -> int:
    """'3' -> 3, 'm' -> m, 'm/4' -> max(1, m // 4) (clamped to [0, m])."""
    e = expr.strip().lower()
    if e == "m":
        return m
    if e.startswith("m/"):
        return max(1, min(m, m // int(e[2:])))
    return max(0, min(m, int(e)))


class Job:
    """All modes of one model in one process group, interleaved in rounds."""

    def __init__(self, ctx: Ctx, model_name: str):
        import torch

        self.ctx = ctx
        self.args = ctx.args
        self.spec = bench_models.build(model_name, self.args.size, self.args.batch)
        gen = torch.Generator().manual_seed(1000 + ctx.rank)
        self.batches = [
            self.spec.make_batch(self.spec.batch_size, ctx.device, gen) for _ in range(4)
        ]
        probe = self.spec.make_model().to(ctx.device)
        self.layer_sizes = bench_models.describe_layers(probe, self.batches[0][0][:1])
        self.m = len(self.layer_sizes)
        params = [p for p in probe.parameters() if p.requires_grad]
        self.numel = sum(p.numel() for p in params)
        self.elem = params[0].element_size()
        self.dtype = params[0].dtype
        # every mode's optimizer is this one (fused=True unless torch cannot fuse it)
        self.fused = bool(self.spec.make_optimizer(probe.parameters()).defaults.get("fused"))
        del probe
        self.results: list[dict[str, Any]] = []
        self.notes: list[str] = []
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

    def by_mode(self, mode: str) -> dict[str, Any] | None:
        for r in self.results:
            if r["mode"] == mode and r.get("t"):
                return r
        return None

    # ------------------------------------------------------------------ plan

    def runners(self, comp_k=None) -> list[Runner]:
        """First phase (comp_k None): every mode, compensations at auto; else compensations at
        comp_k."""
        a, skip = self.args, self.args.skip
        first = comp_k is None
        out: list[Runner] = []
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
                    mode = "pipesgd" if k == self.m else f"sapipe k={k}"
                    out.append(TrainRunner(self, mode, "sapipe", k))
                    if "deferred" not in skip:
                        # its twin, identical but for p.grad exposure: what the default costs at
                        # this k
                        out.append(
                            TrainRunner(
                                self,
                                f"{mode} deferred",
                                "sapipe",
                                k,
                                expose_gradients=False,
                                twin_of=mode,
                            )
                        )
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
                out.append(
                    TrainRunner(self, f"sapipe-auto-{backend}", "sapipe", "auto", backend=backend)
                )
            for compression in [c for c in a.compressions.split(",") if c]:
                out.append(
                    TrainRunner(
                        self,
                        f"sapipe-auto-{compression}",
                        "sapipe",
                        "auto",
                        compression=compression,
                    )
                )
            if self.two_level():  # every sapipe mode sums node first; these do not
                out.append(
                    TrainRunner(
                        self, "sapipe-auto-flat", "sapipe", "auto", options={"hierarchical": False}
                    )
                )
                for compression in [c for c in a.compressions.split(",") if c]:
                    out.append(
                        TrainRunner(
                            self,
                            f"sapipe-auto-{compression}-flat",
                            "sapipe",
                            "auto",
                            compression=compression,
                            options={"hierarchical": False},
                        )
                    )
                if (
                    "ceiling" not in skip
                ):  # perfect overlap with node-first sums: the bound for those
                    out.append(TrainRunner(self, "ceiling-node-first", "ceiling-node-first"))
        return out

    def two_level(self) -> bool:
        """Whether the job's ranks sit on several nodes of several ranks (torchrun's
        LOCAL_WORLD_SIZE between 1 and the world), where sapipe sums node first."""
        return 1 < int(os.environ.get("LOCAL_WORLD_SIZE", self.ctx.world)) < self.ctx.world

    def oracle_k(self) -> int | None:
        """The smallest measured fixed k within ORACLE_TOLERANCE of pipesgd (None without both)."""
        pipe = self.by_mode("pipesgd")
        if pipe is None:
            return None
        for r in sorted(fixed_k_results(self.results), key=lambda r: r["k"]):
            if r["t"] <= (1 + ORACLE_TOLERANCE) * pipe["t"]:
                return r["k"]
        return self.m

    def fallback_k(self):
        """k for the compensation modes when auto is unavailable: the oracle k (or k >= 1)."""
        fixed = sorted(r["k"] for r in fixed_k_results(self.results))
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

    def execute(self, runners: list[Runner]):
        """Run ``runners`` interleaved: round r steps every mode (alternating order) in turn."""
        for rnd in range(self.rounds):
            order = runners if rnd % 2 == 0 else runners[::-1]
            for run in order:
                if run.dead:
                    continue
                self._play_round(run)
                self.progress[0] += 1
                last = run.times[-self.per_round :] if run.times and not run.dead else []
                self.ctx.say(
                    {
                        "event": "mode",
                        "model": self.spec.name,
                        "i": self.progress[0],
                        "n": self.progress[1],
                        "round": rnd + 1,
                        "rounds": self.rounds,
                        "result": {
                            "mode": run.mode,
                            "t": statistics.median(last) if last else None,
                            "note": run.dead or "",
                        },
                    }
                )
                if self.rounds == 1 or rnd == self.rounds - 1 or run.dead:
                    self.finish(run)

    def _play_round(self, run: Runner):
        """One round of ``run``: set it up (first round) or resume it, its timed steps, pause it."""
        try:
            self.ctx.barrier()
            warm = self._start(run) if not run.ready else self._resume(run)
            self._timed_steps(run, warm)
            run.pause()
        except Skip as s:
            run.dead = str(s)
        except Exception as exc:  # noqa: BLE001 - recorded, the job goes on
            traceback.print_exc()
            run.dead = f"failed: {type(exc).__name__}: {str(exc)[:200]}"
        if run.dead and "opt" in run.__dict__:
            run.__dict__.pop("opt")  # a broken optimizer must not be synchronised

    def _start(self, run: Runner) -> int:
        """Set ``run`` up and step it until it is settled; its warm-up steps."""
        run.setup()
        run.ready = True
        # "auto" profiles, then measures k on the job: untimed until k is final
        # (the same on every rank: the decision is agreed on)
        for _ in range(MAX_SETTLE_STEPS):
            if run.settled():
                break
            run.step(run.i)
            self.ctx.sync()
            run.i += 1
        if not run.settled():
            raise Skip(f"skipped: k not final after {MAX_SETTLE_STEPS} steps")
        return run.warmup

    @staticmethod
    def _resume(run: Runner) -> int:
        run.resume()
        return 1  # caches and the link are someone else's after another mode

    def _timed_steps(self, run: Runner, warm: int):
        for j in range(warm + self.per_round):
            w0 = run.waited()
            t0 = time.perf_counter()
            run.step(run.i)
            self.ctx.sync()
            dt = time.perf_counter() - t0
            w1 = run.waited()
            run.i += 1
            if j >= warm:
                run.times.append(dt)
                if w0 is not None and w1 is not None:
                    run.waits.append(w1 - w0)

    def finish(self, run: Runner):
        if any(r["mode"] == run.mode for r in self.results):
            return
        info: dict[str, Any] = {}
        if not run.dead:
            try:
                info = run.info()
            except Exception as exc:  # noqa: BLE001
                info = {"note": f"info failed: {exc}"}
        r = self._measured(run)
        r.update(info)
        r.update(run.labels())
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

    def _measured(self, run: Runner) -> dict[str, Any]:
        """``run``'s step times gathered from every rank, as the job's statistics."""
        per_rank = self.ctx.gather(run.times if not run.dead else [])
        waits = self.ctx.gather(run.waits if not run.dead else [])
        r: dict[str, Any] = {"mode": run.mode}
        if all(per_rank):
            r.update(stats(per_rank))
            slowest = r.pop("rank")
            r["round_t"] = round_medians(per_rank, self.per_round)
            if all(waits) and all(len(w) == len(t) for w, t in zip(waits, per_rank)):
                # the median wait per step of the rank whose median step time is the job's T
                r["wait"] = statistics.median(waits[slowest])
        return r

    def run(self) -> dict[str, Any]:
        first = self.runners()
        n_comp = len([c for c in self.args.compensations.split(",") if c and c != "none"])
        self.progress = [0, self.rounds * len(first)]
        self.ctx.say({"event": "start", "model": self.spec.name, "n": self.progress[1]})
        self.order = [r.mode for r in first]
        self.execute(first)
        auto = self.by_mode("sapipe-auto")
        if auto is not None and "comp" not in self.args.skip:
            self.notes.append('compensation modes run with stale_layers="auto"')
        if auto is None and "comp" not in self.args.skip and n_comp:
            # auto unavailable (refused or failed): the compensation modes run at the oracle k,
            # in a second phase, since the oracle needs the first phase's measurements.
            self.results = [
                r
                for r in self.results
                if not (r["mode"].startswith("sapipe-") and r["mode"] != "sapipe-auto")
            ]
            k, why = self.fallback_k()
            self.notes.append(
                f"compensation modes run at {why}, in a second phase after the others"
            )
            second = self.runners(comp_k=k)
            self.progress[1] += self.rounds * len(second)
            self.execute(second)
        self.results.sort(
            key=lambda r: (
                self.order.index(r["mode"]) if r["mode"] in self.order else len(self.order)
            )
        )
        return self.summary()

    def summary(self) -> dict[str, Any]:
        import torch

        c = self.ctx
        return {
            "oracle_k": self.oracle_k(),
            "model": self.spec.name,
            "size": self.spec.size,
            "batch": self.spec.batch_size,
            "optimizer": self.spec.optimizer,
            "fused": self.fused,
            "params": self.numel,
            "grad_bytes": self.numel * self.elem,
            "m": self.m,
            "largest_layers": _largest(self.layer_sizes, self.numel),
            "world": c.world,
            "device": str(c.device.type)
            + (f" ({torch.cuda.get_device_name(c.device)})" if c.device.type == "cuda" else ""),
            "backend": c.backend,
            "threads": self.args.threads if c.device.type == "cpu" else None,
            "rate": self.args.rate or "not emulated",
            "target_ratio": self.args.target_ratio,
            "warmup": self.args.warmup,
            "steps": self.args.steps,
            "rounds": self.rounds,
            "results": self.results,
            "notes": self.notes,
            "host": platform.node(),
            "torch": torch.__version__,
        }


def _largest(layers, total, n=3):
    top = sorted(range(len(layers)), key=lambda i: -layers[i][1])[:n]
    return [(i + 1, layers[i][0], layers[i][1] / total) for i in top]


def run_probe(ctx: Ctx, model_name: str) -> dict[str, Any]:
    """Calibration: T_compute (all ranks training alone) and the all-reduce floor T_comm(∞)."""
    job = Job(ctx, model_name)
    job.args.steps = max(job.args.steps, 10)
    job.rounds = 1
    job.execute([TrainRunner(job, "local", "local"), CommRunner(job, "comm")])
    local, comm = job.by_mode("local"), job.by_mode("comm")
    return {
        "model": model_name,
        "t_local": local["t"],
        "t_comm_floor": comm["t"],
        "grad_bytes": job.numel * job.elem,
        "world": ctx.world,
        "m": job.m,
    }


def worker(args) -> int:
    """One rank under torchrun: every model's job (or calibration probe) in one process group."""
    import torch.distributed as dist

    from .report import format_job

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
        if ctx.rank == 0 and args.result:
            with open(args.result, "w") as f:
                json.dump(jobs, f, indent=1)
        ctx.barrier()
    finally:
        _stop_horovod()
        ctx.close()
        dist.destroy_process_group()
    return 0


def _stop_horovod():
    try:
        hvd = sys.modules.get("horovod.torch")
        if hvd is not None and hvd.is_initialized():
            hvd.shutdown()
    except Exception:  # noqa: BLE001
        pass
