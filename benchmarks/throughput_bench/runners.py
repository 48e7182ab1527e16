"""The modes a job times, one :class:`Runner` each: set up lazily, stepped in rounds,
paused between rounds, described at the end."""

from __future__ import annotations

import argparse
import os
from typing import Any, Protocol

from .rank import Ctx


class Job(Protocol):
    """What a runner reads of its job (:class:`job.Job`, which holds the runners)."""

    ctx: Ctx
    args: argparse.Namespace
    spec: Any  # bench_models.ModelSpec
    m: int
    numel: int
    elem: int
    dtype: Any  # torch.dtype
    notes: list[str]

    def fresh(self) -> tuple[Any, Any]: ...

    def train_step(self, model, opt, i: int) -> None: ...


class Skip(Exception):
    """A mode that cannot run here (the message says why)."""


class Runner:
    """One mode: set up lazily, stepped in rounds, paused between rounds."""

    warmup = 0

    def __init__(self, job: Job, mode: str):
        self.job, self.mode = job, mode
        self.ready = False
        self.dead: str | None = None
        self.i = 0
        self.times: list[float] = []
        self.waits: list[float] = []  # per timed step: seconds blocked on communication (sapipe)

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

    def info(self) -> dict[str, Any]:
        return {}

    def labels(self) -> dict[str, Any]:
        """Fields the mode's result always carries (also when it was skipped or failed)."""
        return {}

    def waited(self) -> float | None:
        """Seconds this mode has blocked on communication so far (None: not measured)."""
        return None

    def close(self):
        for name in ("model", "opt", "base", "buf", "ddp"):
            self.__dict__.pop(name, None)


class TrainRunner(Runner):
    """local / ddp / ceiling / sapipe / horovod: a fresh model and optimizer."""

    def __init__(
        self,
        job,
        mode,
        kind: str,
        k=None,
        compensation: str = "none",
        backend: str = "torch",
        expose_gradients: bool = True,
        twin_of: str | None = None,
        compression: str | None = None,
        options: dict[str, Any] | None = None,
    ):
        super().__init__(job, mode)
        self.kind, self.k, self.compensation, self.backend = kind, k, compensation, backend
        self.compression = compression  # sapipe's compression= (None: full precision)
        self.options = dict(options or {})  # further sapipe settings (e.g. hierarchical=False)
        #: sapipe's ``expose_gradients``; False only for a ``deferred`` twin of ``twin_of``
        self.expose_gradients, self.twin_of = expose_gradients, twin_of
        self.ks: list[int | None] = []

    def setup(self):
        import torch
        import torch.distributed as dist

        job = self.job
        self.warmup = job.args.warmup
        self.model, self.base = job.fresh()
        self.opt = self.base
        self.net = self.model
        self._dist = dist
        if self.kind in ("ceiling", "ceiling-node-first"):
            self.buf = torch.zeros(job.numel, dtype=job.dtype, device=job.ctx.device)
            self.sum = job.ctx.node_first_sum() if self.kind == "ceiling-node-first" else None
        elif self.kind == "ddp":
            self._setup_ddp()
        elif self.kind == "sapipe":
            self._setup_sapipe()
        elif self.kind == "horovod":
            self._setup_horovod()

    def _setup_ddp(self):
        from torch.nn.parallel import DistributedDataParallel as DDP

        device = self.job.ctx.device
        ids = [device.index] if device.type == "cuda" else None
        self.ddp = self.net = DDP(
            self.model, device_ids=ids, bucket_cap_mb=self.job.args.bucket_cap_mb
        )

    def _setup_sapipe(self):
        import sapipe

        a = self.job.args
        if self.k == "auto":
            self.warmup = a.auto_warmup
        if self.backend == "horovod":
            _start_horovod(self.job.ctx, detail=False)
        try:
            self.opt = sapipe.DistributedOptimizer(
                self.base,
                self.model,
                stale_layers=self.k,
                compensation=self.compensation,
                bucket_cap_mb=a.bucket_cap_mb,
                backend=self.backend,
                trace=bool(a.trace),
                expose_gradients=self.expose_gradients,
                compression=self.compression,
                **self.options,
            )
        except sapipe.ConfigurationError as exc:
            raise Skip(f"skipped: sapipe refused stale_layers={self.k!r}: {exc}") from exc

    def _setup_horovod(self):
        hvd = _start_horovod(self.job.ctx, detail=True)
        hvd.broadcast_parameters(self.model.state_dict(), root_rank=0)
        self.opt = hvd.DistributedOptimizer(
            self.base, named_parameters=self.model.named_parameters()
        )

    def step(self, i):
        if self.kind == "ceiling":
            work = self._dist.all_reduce(self.buf, group=self.job.ctx.side, async_op=True)
            self.job.train_step(self.net, self.opt, i)
            work.wait()
            return
        if self.kind == "ceiling-node-first":  # the same, summed as sapipe sums across nodes
            handle = self.sum.start(self.buf, "the ceiling's gradients")
            self.job.train_step(self.net, self.opt, i)
            self.sum.wait(handle)
            return
        self.job.train_step(self.net, self.opt, i)
        if self.kind == "sapipe":
            k = self.opt.stale_layers
            self.ks.append(k if isinstance(k, int) else None)

    def pause(self):
        if self.kind == "sapipe":
            # the stale all-reduces still in flight must not overlap the next mode's steps
            self.opt.wait_for_communication()
        elif self.kind == "horovod" and "horovod" not in self.job.args.backends.split(","):
            # Horovod's idle background loop costs ~7% of a core per rank (measured here):
            # stopped between its rounds, so that it does not slow the modes after it
            # (unless sapipe's own horovod back-end, with stale all-reduces in flight, needs it).
            import horovod.torch as hvd

            hvd.shutdown()

    def resume(self):
        if self.kind == "horovod":
            _start_horovod(self.job.ctx, detail=True)

    def settled(self) -> bool:
        return self.kind != "sapipe" or self.opt.stale_layers != "auto"

    def waited(self) -> float | None:
        return self.opt.communication_wait if self.kind == "sapipe" else None

    def labels(self):
        if self.kind != "sapipe":
            return {}
        out: dict[str, Any] = {"expose_gradients": self.expose_gradients}
        if self.twin_of is not None:
            out["twin_of"] = self.twin_of
        return out

    def info(self):
        if self.kind in ("local", "ceiling", "ceiling-node-first"):
            return {}
        if self.kind != "sapipe":
            return {"k": 0, "kappa": 0.0}
        layers = self.opt.layers
        k_used = self.opt.stale_layers
        total = sum(layer.numel for layer in layers)
        kappa = (
            sum(layer.numel for layer in layers[:k_used]) / total
            if isinstance(k_used, int)
            else None
        )
        info: dict[str, Any] = dict(
            k=k_used,
            kappa=kappa,
            compensation=self.compensation,
            m=len(layers),
            compression=self.compression,
        )
        auto = self.opt.auto
        if auto is not None and auto.decision is not None:
            info["decision"] = str(auto.decision.summary())
            info["decided_at"] = auto.decided_at  # the iteration whose step() made k final
            if auto.tuner is not None:
                info["decision"] += f"; {auto.tuner.summary()}"
        timed = {k for k in self.ks[-len(self.times) :]} if self.times else set()
        if len(timed) > 1:
            info["note"] = (
                f"k changed during the timed steps: {sorted(x for x in timed if x is not None)}"
            )
        if len(layers) != self.job.m:
            self.job.notes.append(
                f"sapipe found m={len(layers)} layers, the benchmark's own count is {self.job.m}"
            )
        return info

    def close(self):
        if self.kind == "sapipe" and "opt" in self.__dict__:
            self.opt.synchronize()
            self.opt.wait_for_communication()
            if self.job.args.trace:
                self.write_traces(self.job.args.trace)
        super().close()

    def write_traces(self, folder: str) -> None:
        """This rank's recorded timeline (and, for auto, the predicted iteration) as Chrome
        traces."""
        os.makedirs(folder, exist_ok=True)
        rate = str(self.job.args.rate or "local").replace("/", "-").replace(" ", "")
        mode = self.mode.replace(" ", "").replace("=", "")
        path = os.path.join(
            folder, f"{self.job.spec.name}_{rate}_{mode}_rank{self.job.ctx.rank}.json"
        )
        self.opt.write_trace(path)
        if self.k == "auto" and self.opt.auto is not None and self.opt.auto.decision is not None:
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


def _start_horovod(ctx, detail: bool):
    """``horovod.torch``, its Gloo controller started in this torchrun job; Skip when it cannot
    be."""
    try:
        import horovod.torch as hvd
    except Exception as exc:  # noqa: BLE001 - any import failure means "not available"
        why = (
            f"{type(exc).__name__}: {str(exc)[:120]}); `make peers` installs it"
            if detail
            else f"{type(exc).__name__})"
        )
        raise Skip(f"skipped: horovod not importable ({why}") from exc
    ok, why = _horovod_init(ctx, hvd)
    if not ok:
        raise Skip(f"skipped: {why}")
    return hvd


def _horovod_init(ctx, hvd):
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
