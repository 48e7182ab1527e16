"""Soak: a long sapipe run whose memory, threads and step times must stay flat.

One ``torchrun`` job of 2 Gloo ranks (CPU, one thread each, :func:`harness.worker_env`
but for the allocator, below) trains a small embedding-first model (an ``nn.Embedding`` of
8192 x 128, the largest layer, runs first, as GPT-2's does; then two MLP blocks and a 64-way
head: 1.4 M parameters, most of its time is communication, so ``"auto"`` stales layers on
loopback)
with ``sapipe.DistributedOptimizer(Adam, stale_layers="auto", compensation="wp1",
compression="int8")`` for ``--steps`` steps. Every ``--sample-every`` steps each rank
samples its resident memory (``VmRSS``), its thread count (``/proc/self/task``) and the
median time of the last steps (``zero_grad`` + forward + backward + ``step()``).

**Relayouts mid-run.** Once ``"auto"`` has decided, a live job changes its layout in one
supported way: ``sapipe.load_checkpoint`` between ``step()`` and the next forward lays the
buckets out for the checkpoint's k (docs/design.md §5.2, §5.7). While ``"auto"`` searches,
the job saves a checkpoint at every new layout (the warm-up's k = 0, each trial's k). From
step ``--relayout-every // 2`` on, every ``--relayout-every`` steps a *detour* runs:

1. save checkpoint C (k = the decided k); train ``--replay`` steps; snapshot A;
2. load the last checkpoint saved at another k than the decided one (the job goes back to
   that iteration: mid-search, the search resumes, restarting the pipeline at the trials'
   k, or the warm-up); train ``--detour`` steps there;
3. load C (the buckets are laid out for the decided k again); train the same ``--replay``
   steps (same batches); snapshot B.

A snapshot holds the model's weights (under WP the predicted ones), the real weights and
every tensor and value of ``opt.state_dict()`` (stale gradients, int8 residuals, WP's
local gradient and real weights, optimizer state, hyper-parameters, counters). The
contract (docs/design.md §5.7: a job resumed from a checkpoint continues bit-identically)
says B == A bit for bit: the relayouts and the detour leave no trace. (A pipeline restart,
§3.7, is not such an identity: it applies the stale gradients in flight as plain updates and
refills the pipeline, which ``tests/distributed/test_auto.py`` holds to the float64
reference; here the restarts happen inside the detour, and C's reload undoes them.)

Verdicts (each rank): RSS and thread count flat after ``--warmup`` steps (the median of the
last 3 samples within 2% of the median of the first 3 after warm-up); no step after warm-up
slower than 10x the median step (relayouts, the search's restarts inside ``step()``
included); relayouts happened after warm-up; B == A for every detour. Exit status 1 if
any fails.

Each sample also records, without a verdict, what tells a leak from the allocator: the
objects Python's collector tracks (after a collection) and glibc's bytes in use and free
inside its arenas (``mallinfo2``). The ranks run with :func:`harness.worker_env`, but by
default (``--allocator returning``) with glibc returning freed blocks of 64 KiB and more, so
that RSS follows what is held. With the harness's own settings (``--allocator harness``:
freed memory kept) RSS rose by 1.8% and 3.3% (ranks 0 and 1) after warm-up in a 5000-step
run, and by 1.0-1.7% in a 2000-step run with a detour every 100 steps in which glibc's bytes
in use stayed flat and only the free bytes inside its arenas grew: the heap fragmenting
over checkpoints and relayouts, no leak. The ranks wait for each other (a barrier) after each
checkpoint, snapshot and sample, so that a step does not absorb how much longer that work took
on the other rank.
Sampling reads nothing of the model or its gradients: a walk over live tensors that called
``untyped_storage()`` on an exposed ``p.grad`` would apply a deferred sync update early
(docs/design.md §3.11) and make the two passes differ.

    python benchmarks/soak.py                  # 5000 steps (about 5 min on a 2-core host)
    python benchmarks/soak.py --quick          # 600 steps
    python benchmarks/soak.py --json           # the samples and verdicts as JSON
    python benchmarks/soak.py --out soak.md    # also write the report there
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import hashlib
import json
import os
import resource
import statistics
import sys
import tempfile
import time

import harness

GROWTH_LIMIT = 0.02  # RSS and threads: at most 2% above the first samples after warm-up
SLOW_STEP_LIMIT = 10.0  # no step after warm-up slower than this many times the median
EDGE_SAMPLES = 3  # samples whose median stands for the start and the end of the window
VOCAB, WIDTH, BLOCKS, CLASSES, BATCH, CONTEXT = 8192, 128, 2, 64, 8, 16


# ============================================================================ the job (each rank)


def make_model():
    import torch
    from torch import nn

    class SoakNet(nn.Module):
        """Embedding first (the largest layer, its gradient ready last), then MLP blocks, a head."""

        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.blocks = nn.ModuleList(
                nn.Sequential(
                    nn.LayerNorm(WIDTH),
                    nn.Linear(WIDTH, 4 * WIDTH),
                    nn.GELU(),
                    nn.Linear(4 * WIDTH, WIDTH),
                )
                for _ in range(BLOCKS)
            )
            self.head = nn.Linear(WIDTH, CLASSES)

        def forward(self, tokens):
            h = self.embed(tokens)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)

    torch.manual_seed(0)
    return SoakNet()


def batch(iteration: int, rank: int):
    """The batch of ``iteration`` on ``rank``: the same whenever that iteration is trained again."""
    import torch

    gen = torch.Generator().manual_seed(iteration * 1000 + rank)
    return (
        torch.randint(0, VOCAB, (BATCH, CONTEXT), generator=gen),
        torch.randint(0, CLASSES, (BATCH, CONTEXT), generator=gen),
    )


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024.0
    raise RuntimeError("no VmRSS in /proc/self/status")


def heap_mib():
    """(MiB malloc has handed out and not had back, MiB free inside its arenas) from glibc's
    ``mallinfo2`` (all arenas; None elsewhere): a leak grows the first, a fragmented heap the
    second, and RSS grows with either."""
    try:
        info = ctypes.CDLL("libc.so.6").mallinfo2
    except (OSError, AttributeError):
        return None, None

    class MallInfo2(ctypes.Structure):
        _fields_ = [
            (name, ctypes.c_size_t)
            for name in (
                "arena",
                "ordblks",
                "smblks",
                "hblks",
                "hblkhd",
                "usmblks",
                "fsmblks",
                "uordblks",
                "fordblks",
                "keepcost",
            )
        ]

    info.restype = MallInfo2
    m = info()
    return (m.uordblks + m.hblkhd) / 2**20, m.fordblks / 2**20


def realign() -> None:
    """Wait for the other rank after work outside the steps (checkpoints, snapshots, samples), so
    that the first step after it does not absorb how much longer that work took on the other
    rank."""
    import torch.distributed as dist

    dist.barrier()


def preempted() -> int:
    """Involuntary context switches of the calling thread so far: the kernel took its core away."""
    return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw


def threads() -> int:
    return len(os.listdir("/proc/self/task"))


def stale_k(opt) -> int:
    """k of the current layout: the layers in stale buckets (``opt.stale_layers`` says "auto" mid-
    search)."""
    return sum(len(b.layers) for b in opt.buckets if b.stale)


class Job:
    """One rank's training loop, its samples, its checkpoints and its detours."""

    def __init__(self, args, rank: int, directory: str):
        import torch

        import sapipe

        self.args, self.rank, self.dir = args, rank, directory
        self.model = make_model()
        self.opt = sapipe.DistributedOptimizer(
            torch.optim.Adam(self.model.parameters(), lr=1e-3),
            self.model,
            stale_layers="auto",
            compensation="wp1",
            compression="int8",
            bucket_cap_mb=args.bucket_cap_mb,
            timeout=300,
        )
        self.iteration = 0  # the optimizer's: which batch comes next (rewound by a checkpoint)
        self.steps = 0  # loop steps run, replays and detours included: the soak's clock
        self.times = []  # seconds per loop step
        self.cpu = []  # per loop step: (CPU seconds of this thread, times the kernel preempted it)
        self.gc_ms = {}  # loop step -> ms the cyclic garbage collector ran inside it (where it did)
        self._gc_start = None
        gc.callbacks.append(self._on_gc)
        self.samples = []
        self.layouts = []  # (loop step, k) at every new bucket layout
        # (k, path) saved at each new layout before k was final, oldest first
        self.search_checkpoints = []
        self._layout_id = None
        self.decided_k = self.decided_step = None  # k once final, and the loop step it became so
        self.detours = []
        self.loss = float("nan")

    def path(self, name: str) -> str:
        """A checkpoint's path, ``{rank}`` filled in by sapipe (one file per rank)."""
        return os.path.join(self.dir, name + "-{rank}.pt")

    def train(self, n: int) -> None:
        import torch.nn.functional as F

        for _ in range(n):
            x, y = batch(self.iteration + 1, self.rank)
            start, cpu, switches = time.perf_counter(), time.thread_time(), preempted()
            self.opt.zero_grad()
            loss = F.cross_entropy(self.model(x).reshape(-1, CLASSES), y.reshape(-1))
            loss.backward()
            self.opt.step()
            self.times.append(time.perf_counter() - start)
            self.cpu.append((time.thread_time() - cpu, preempted() - switches))
            self.iteration += 1
            self.steps += 1
            self._watch_layout()
            if self.steps % self.args.sample_every == 0:
                self.loss = float(loss)
                self._sample()

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_start = time.perf_counter()
        elif self._gc_start is not None:
            step = self.steps + 1  # the step running now (or the next one, between steps)
            self.gc_ms[step] = self.gc_ms.get(step, 0.0) + 1e3 * (
                time.perf_counter() - self._gc_start
            )
            self._gc_start = None

    def _watch_layout(self) -> None:
        buckets = self.opt.buckets
        if id(buckets[0]) == self._layout_id:
            return
        self._layout_id = id(buckets[0])
        k = stale_k(self.opt)
        self.layouts.append((self.steps, k))
        if (
            self.decided_k is None and self.opt.stale_layers == "auto"
        ):  # k not final yet: keep this layout's state
            self.search_checkpoints.append((k, self.save(f"search-{len(self.search_checkpoints)}")))

    def _sample(self) -> None:
        window = self.times[-self.args.sample_every :]
        gc.collect()  # the objects counted are the live ones
        in_use, free = heap_mib()
        self.samples.append(
            {
                "step": self.steps,
                "rss_mib": rss_mib(),
                "threads": threads(),
                "median_ms": 1e3 * statistics.median(window),
                "k": stale_k(self.opt),
                "loss": self.loss,
                "objects": len(gc.get_objects()),
                "heap_in_use_mib": in_use,
                "heap_free_mib": free,
            }
        )
        realign()

    def save(self, name: str) -> str:
        import sapipe

        sapipe.save_checkpoint(self.path(name), self.model, self.opt, iteration=self.iteration)
        realign()
        return self.path(name)

    def load(self, path: str) -> None:
        import sapipe

        self.iteration = sapipe.load_checkpoint(path, self.model, self.opt)["iteration"]
        realign()

    # ------------------------------------------------------------------ detours

    def other_checkpoint(self):
        """The last checkpoint saved before k was final at another k than the final one, or None."""
        others = [path for k, path in self.search_checkpoints if k != self.decided_k]
        return others[-1] if others else None

    def snapshot(self) -> dict:
        """What a detour must leave as it was: the weights the model holds, the real weights, and
        every value of the optimizer's checkpoint."""
        held = digests("held", dict(self.model.named_parameters()))
        with self.opt.real_weights():
            real = digests("real", dict(self.model.named_parameters()))
        snapshot = {**held, **real, **digests("opt", self.opt.state_dict())}
        realign()
        return snapshot

    def detour(self, other: str) -> None:
        """Save C, train, snapshot; load a checkpoint of another k, train; load C, train the same
        steps again, snapshot: both snapshots must be bit-identical (docs/design.md §5.7)."""
        a = self.args
        record = {"step": self.steps, "iteration": self.iteration, "k": stale_k(self.opt)}
        mark = self.save("detour")
        self.train(a.replay)
        before = self.snapshot()
        start = time.perf_counter()
        self.load(other)
        record["load_other_ms"] = 1e3 * (time.perf_counter() - start)
        record["other_iteration"], record["other_k"] = self.iteration, stale_k(self.opt)
        self._watch_layout()
        self.train(a.detour)
        record["k_after_detour"] = stale_k(self.opt)
        record["decided_after_detour"] = self.opt.stale_layers != "auto"  # the resumed search ended
        start = time.perf_counter()
        self.load(mark)
        record["load_back_ms"] = 1e3 * (time.perf_counter() - start)
        self._watch_layout()
        self.train(a.replay)
        record["differs"] = differences(before, self.snapshot())[:10]
        record["compared"] = len(before)
        self.detours.append(record)

    def run(self) -> dict:
        a = self.args
        next_detour = a.relayout_every // 2
        length = 2 * a.replay + a.detour
        while self.steps < a.steps:
            other = self.other_checkpoint() if self.decided_k is not None else None
            if other is not None and self.steps >= next_detour and self.steps + length <= a.steps:
                self.detour(other)
                next_detour += a.relayout_every
            else:
                self.train(1)
            if self.decided_k is None and self.opt.stale_layers != "auto":
                self.decided_k, self.decided_step = self.opt.stale_layers, self.steps
        m = len(self.opt.layers)
        self.opt.close()
        return {
            "rank": self.rank,
            "m": m,
            "decided_k": self.decided_k,
            "decided_step": self.decided_step,
            "samples": self.samples,
            "times_ms": [round(1e3 * t, 3) for t in self.times],
            "cpu_ms": [round(1e3 * c, 3) for c, _ in self.cpu],
            "preempted": [n for _, n in self.cpu],
            "gc_ms": {str(k): round(v, 2) for k, v in self.gc_ms.items() if v >= 1.0},
            "layouts": self.layouts,
            "search_ks": [k for k, _ in self.search_checkpoints],
            "detours": self.detours,
        }


def digests(prefix: str, value, out=None) -> dict:
    """``value`` (nested dicts, lists, tensors) as {dotted path: a tensor's dtype, shape and the
    SHA-256 of its bytes, or another value's repr}: two snapshots agree bit for bit where these
    do."""
    import torch

    out = {} if out is None else out
    if isinstance(value, dict):
        for key, item in value.items():
            digests(f"{prefix}.{key}", item, out)
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            digests(f"{prefix}[{i}]", item, out)
    elif isinstance(value, torch.Tensor):
        data = value.detach().contiguous().reshape(-1).view(torch.uint8).numpy()
        out[prefix] = f"{value.dtype} {tuple(value.shape)} {hashlib.sha256(data).hexdigest()}"
    else:
        out[prefix] = repr(value)
    return out


def differences(a: dict, b: dict) -> list:
    """The paths where two snapshots differ (or that only one has)."""
    return sorted(set(a) ^ set(b)) + sorted(key for key in set(a) & set(b) if a[key] != b[key])


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result = Job(args, rank, args.ckpt_dir).run()
    gathered = [None] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(result, gathered, dst=0)
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"ranks": gathered}, f)
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ verdicts and report


def _growth(samples: list, key: str, warmup: int):
    """(relative growth of ``key`` from the first to the last samples after warm-up, start, end),
    each end the median of EDGE_SAMPLES samples; None if there are too few samples."""
    values = [s[key] for s in samples if s["step"] > warmup]
    if len(values) < 2 * EDGE_SAMPLES:
        return None
    start, end = statistics.median(values[:EDGE_SAMPLES]), statistics.median(values[-EDGE_SAMPLES:])
    return end / start - 1.0, start, end


def verdicts(result: dict, warmup: int) -> dict:
    """Every criterion, per rank and passed or not (computed from the ranks' raw records)."""
    ranks = result["ranks"]
    out = {}
    for key, name in (("rss_mib", "rss_flat"), ("threads", "threads_flat")):
        growth = [_growth(r["samples"], key, warmup) for r in ranks]
        out[name] = {
            "passed": all(g is not None and g[0] <= GROWTH_LIMIT for g in growth),
            "limit": GROWTH_LIMIT,
            "growth": [None if g is None else g[0] for g in growth],
            "start": [None if g is None else g[1] for g in growth],
            "end": [None if g is None else g[2] for g in growth],
        }
    slow = []
    for r in ranks:
        after = r["times_ms"][warmup:]  # times_ms[i] is loop step i + 1
        median = statistics.median(after) if after else float("nan")
        worst = sorted(range(len(after)), key=after.__getitem__, reverse=True)[:5]
        changes = [step for step, _ in r["layouts"]]
        slowest = [
            {
                "step": warmup + i + 1,
                "ms": after[i],
                "cpu_ms": r["cpu_ms"][warmup + i],
                "preempted": r["preempted"][warmup + i],
                "since_relayout": warmup
                + i
                + 1
                - max((c for c in changes if c <= warmup + i + 1), default=0),
                "gc_ms": r["gc_ms"].get(str(warmup + i + 1), 0.0),
            }
            for i in worst
        ]
        cpu = r["cpu_ms"][warmup:]
        cpu_median = statistics.median(cpu) if cpu else float("nan")
        slow.append(
            {
                "cpu_median_ms": cpu_median,
                "cpu_ratio": max(cpu) / cpu_median if cpu else float("inf"),
                "median_ms": median,
                "max_ms": slowest[0]["ms"] if slowest else float("nan"),
                "ratio": slowest[0]["ms"] / median if slowest else float("inf"),
                "step": slowest[0]["step"] if slowest else None,
                "slowest": slowest,
            }
        )
    out["step_time"] = {
        "passed": all(s["ratio"] <= SLOW_STEP_LIMIT for s in slow),
        "limit": SLOW_STEP_LIMIT,
        "ranks": slow,
    }
    relayouts = [sum(1 for step, _ in r["layouts"] if step > warmup) for r in ranks]
    out["relayout"] = {
        "passed": all(n > 0 for n in relayouts),
        "after_warmup": relayouts,
        "k_seen": sorted({k for r in ranks for _, k in r["layouts"]}),
        "decided_k": ranks[0]["decided_k"],
        "decided_step": ranks[0]["decided_step"],
    }
    detours = [r["detours"] for r in ranks]
    identical = [sum(1 for d in ds if not d["differs"]) for ds in detours]
    out["equal_after_relayout"] = {
        "passed": all(ds and n == len(ds) for ds, n in zip(detours, identical)),
        "detours": [len(ds) for ds in detours],
        "identical": identical,
        "first_difference": next(
            (d["differs"] for ds in detours for d in ds if d["differs"]), None
        ),
    }
    out["passed"] = all(v["passed"] for v in out.values() if isinstance(v, dict))
    return out


def _sample_table(ranks: list) -> list:
    lines = [
        (
            "| step | k | RSS MiB (rank 0 / 1) | threads (rank 0 / 1) | median step ms (rank 0 / "
            "1) | loss (rank 0) "
            "| malloc in use MiB (rank 0) | Python objects (rank 0) |"
        ),
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for samples in zip(*(r["samples"] for r in ranks)):
        s = samples[0]
        heap = f"{s['heap_in_use_mib']:.1f}" if s["heap_in_use_mib"] is not None else "n/a"
        lines.append(
            f"| {s['step']} | {s['k']} | "
            + " / ".join(f"{x['rss_mib']:.1f}" for x in samples)
            + " | "
            + " / ".join(str(x["threads"]) for x in samples)
            + " | "
            + " / ".join(f"{x['median_ms']:.1f}" for x in samples)
            + f" | {s['loss']:.3f} | {heap} | "
            + f"{s['objects']} |"
        )
    return lines


def _verdict_table(v: dict) -> list:
    def pct(values):
        return " / ".join(
            "n/a (too few samples)" if g is None else f"{100 * g:+.2f}%" for g in values
        )

    def ok(name):
        return "PASS" if v[name]["passed"] else "FAIL"

    steps, rl, eq = v["step_time"]["ranks"], v["relayout"], v["equal_after_relayout"]
    end = " / ".join(f"{x:.1f}" for x in v["rss_flat"]["end"] if x is not None)
    slow = " / ".join(
        f"{s['ratio']:.1f}x ({s['max_ms']:.0f} ms at step {s['step']}, median {s['median_ms']:.1f} "
        "ms)"
        for s in steps
    )
    cpu = " / ".join(f"{s['cpu_ratio']:.1f}x (median {s['cpu_median_ms']:.1f} ms)" for s in steps)
    identical = " / ".join(f"{n} of {d}" for n, d in zip(eq["identical"], eq["detours"]))
    first = (
        f"; first difference: {', '.join(eq['first_difference'])}" if eq["first_difference"] else ""
    )
    return [
        "| criterion | measured (rank 0 / 1) | verdict |",
        "| --- | --- | --- |",
        (
            f"| RSS flat after warm-up (growth <= {100 * GROWTH_LIMIT:.0f}%) | "
            f"{pct(v['rss_flat']['growth'])} "
            f"({end} MiB at the end) | {ok('rss_flat')} |"
        ),
        (
            f"| threads flat after warm-up (growth <= {100 * GROWTH_LIMIT:.0f}%) | "
            f"{pct(v['threads_flat']['growth'])} "
            f"| {ok('threads_flat')} |"
        ),
        f"| no step after warm-up over {SLOW_STEP_LIMIT:.0f}x the median | {slow} | "
        f"{ok('step_time')} |",
        "| (no verdict) the training thread's CPU time per step, slowest against the median | "
        f"{cpu} | |",
        (
            f"| relayouts after warm-up (k seen: {rl['k_seen']}) | "
            f"{' / '.join(map(str, rl['after_warmup']))} "
            f"| {ok('relayout')} |"
        ),
        f"| detours bit-identical to the run without them | {identical}{first} | "
        f"{ok('equal_after_relayout')} |",
    ]


def _slowest(v: dict) -> str:
    def where(s):
        since = (
            "a relayout in it"
            if s["since_relayout"] == 0
            else f"{s['since_relayout']} after a relayout"
        )
        return (
            f"{s['ms']:.0f} ms at {s['step']} ({since}; the training thread ran {s['cpu_ms']:.0f} "
            "ms of it "
            f"and was preempted {s['preempted']} times; GC {s['gc_ms']:.0f} ms)"
        )

    return "; ".join(
        f"rank {i}: " + ", ".join(where(s) for s in r["slowest"])
        for i, r in enumerate(v["step_time"]["ranks"])
    )


def report(result: dict, v: dict, command: str, warmup: int) -> str:
    ranks = result["ranks"]
    r0 = ranks[0]
    lines = [
        (
            f'`{command}`: 2 Gloo ranks, SoakNet ({r0["m"]} layers), Adam, stale_layers="auto" '
            f"(k = {r0['decided_k']} of {r0['m']}, final at step {r0['decided_step']}), wp1, int8; "
            f"warm-up {warmup} steps\n"
        )
    ]
    lines += _sample_table(ranks) + [""] + _verdict_table(v)
    for d in r0["detours"]:
        again = "decided again" if d["decided_after_detour"] else "still undecided"
        lines.append(
            f"\ndetour at step {d['step']} (iteration {d['iteration']}, k = {d['k']}): loaded "
            "iteration "
            f"{d['other_iteration']} at k = {d['other_k']} ({d['load_other_ms']:.0f} ms), k = "
            f"{d['k_after_detour']} after it ({again}), back at k = {d['k']} "
            f"({d['load_back_ms']:.0f} ms); "
            f"{d['compared']} values compared, {len(d['differs'])} differ"
        )
    lines.append(f"\nslowest steps after warm-up: {_slowest(v)}")
    lines.append(f"\n**{'PASS' if v['passed'] else 'FAIL'}**")
    return "\n".join(lines)


def launch(args) -> dict:
    """Run the job under torchrun; the ranks' records. Kills the whole job if it overruns."""
    with tempfile.TemporaryDirectory(prefix="sapipe-soak-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = harness.torchrun(
            2,
            __file__,
            "--worker",
            "--result",
            out,
            "--ckpt-dir",
            tmp,
            *[f"--{k.replace('_', '-')}={getattr(args, k)}" for k in JOB_ARGS],
        )
        env = harness.worker_env(
            OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **ALLOCATORS[args.allocator]
        )
        return harness.run_job("soak", cmd, env, args.timeout, out)


# glibc's malloc settings for the ranks. "returning": blocks of 64 KiB and more are mapped
# alone and unmapped when freed, and the heap is trimmed, so RSS follows what is held (a leak
# shows, fragmentation does not); "harness": the other benchmarks' (harness.worker_env: freed
# memory is kept, so RSS also grows as the heap fragments over checkpoints and relayouts).
ALLOCATORS = {
    "returning": {"MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "65536"},
    "harness": {},
}
JOB_ARGS = (
    "steps",
    "warmup",
    "sample_every",
    "relayout_every",
    "replay",
    "detour",
    "bucket_cap_mb",
)


def main(argv=None) -> int:
    p = harness.Parser(
        __doc__,
        quick=dict(steps=600, warmup=300, relayout_every=100, sample_every=50),
        json=True,
        out=None,
        out_help="also write the report (or the JSON) to this file",
        timeout=3600.0,
        worker=True,
    )
    p.add_argument(
        "--steps", type=int, default=5000, help="loop steps in all, replays and detours included"
    )
    p.add_argument(
        "--warmup",
        type=int,
        default=1000,
        help="steps before memory, threads and times must be flat (the first detours included)",
    )
    p.add_argument("--sample-every", type=int, default=100, help="steps between samples")
    p.add_argument(
        "--relayout-every",
        type=int,
        default=250,
        help="steps between the starts of detours (the first at half of it)",
    )
    p.add_argument(
        "--replay", type=int, default=30, help="steps trained from C before each snapshot"
    )
    p.add_argument(
        "--detour", type=int, default=40, help="steps trained at the other checkpoint's k"
    )
    p.add_argument("--bucket-cap-mb", type=float, default=1.0)
    p.add_argument(
        "--allocator",
        choices=sorted(ALLOCATORS),
        default="returning",
        help="glibc malloc settings of the ranks (see ALLOCATORS)",
    )
    p.add_argument("--result", help=argparse.SUPPRESS)
    p.add_argument("--ckpt-dir", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args)
        return 0
    command = harness.command(argv)
    result = launch(args)
    v = verdicts(result, args.warmup)
    text = (
        json.dumps({"command": command, "verdicts": v, **result})
        if args.json
        else report(result, v, command, args.warmup)
    )
    harness.emit(text, args.out)
    return 0 if v["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
