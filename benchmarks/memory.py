"""Memory: what sapipe holds beyond DDP, for the same model, mode by mode.

For each model of :mod:`bench_models` (``--models``, ``--size``), one ``torchrun`` job of 2
Gloo ranks (CPU; on a CUDA machine NCCL, one rank per GPU, at most 2) trains each mode for
``--steps`` steps with the model's own optimizer (torch's ``fused=True`` SGD or Adam) and
then counts, on rank 0, the bytes of every tensor it holds:

* DDP (``DistributedDataParallel``, default and ``gradient_as_bucket_view=True``): the
  parameters, their ``.grad``, DDP's gradient buckets (seen through a comm hook that runs
  torch's own ``allreduce_hook``: ``GradBucket.buffer()``), the optimizer's state;
* sapipe (``sapipe.DistributedOptimizer``): the parameters, their ``.grad`` and every tensor
  reachable from the optimizer through sapipe's objects (buckets: staleness slots with their
  flags, ``local`` / ``prev_local``, the real weights under WP, the DC weight history, the
  codec's messages and error-feedback residuals; segments: the optimizer state; ...).

Each storage counts once (by ``untyped_storage().data_ptr()``), under the most specific
thing that holds it: a ``p.grad`` that is a view of a sapipe slot or a DDP bucket counts as
that slot or bucket. The optimizer's state (the same on both sides) is reported apart.
**Extra** = everything held beyond the parameters and the optimizer state, less one
gradient (G, the parameters' bytes: what ``p.grad`` alone takes in a one-process job), so
DDP with ``gradient_as_bucket_view=True`` is +0 and default DDP +1x G (its buckets beside
``p.grad``). It is counted twice: *between steps* (after ``step()``, before ``zero_grad()``,
``p.grad`` set) and *in backward* (at the last gradient of the last step, in a hook that
runs after sapipe's: every autograd gradient exists and sapipe's exposure has not yet
pointed ``p.grad`` into its slots; DDP's reducer runs C++ hooks of its own at that point and
may already have moved gradients into its buckets, so DDP's figure there is that instant's).
Cross-checks: the change of the process's RSS over the mode (model built to after the
steps) less G and the optimizer state, with glibc returning freed blocks of 64 KiB and
more (``MALLOC_MMAP_THRESHOLD_``; the other benchmarks keep them, :mod:`harness`); and, on
CUDA, ``torch.cuda.max_memory_allocated`` over the mode less its start.

The *model* column is the multiple of G each mode is expected to hold, from its buffers:
slots (1 per sync bucket, s + 1 per stale one), ``local`` (wp1, wp3), ``prev_local`` (wp3),
real weights (wp1-3, t2), T2's velocity, s + 1 history copies (dc), one gradient fewer where
``p.grad`` is a view of a slot (``expose_gradients=True``), and for a compression the codec:
per slot 3 W + 1 messages of 1/W of the bucket (outgoing, received, gathered, this rank's
sum) at the format's bytes per value (bf16 2, int8 1 + 4/64 of scale), and with error
feedback the residual (1) and the residual of this rank's shard of the sums (1/W). Flags,
padding and headers are small and not modelled; a measured extra more than 2% of G off the
model is marked ``!``.

    python benchmarks/memory.py              # gpt2, resnet50 (small), every mode (~3 min)
    python benchmarks/memory.py --models gpt2 --modes ddp,k0,km-none --out memory.md
    python benchmarks/memory.py --json                       # the numbers as JSON
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile

import harness

MiB = 2.0**20
# name -> settings: "ddp" (None or "view"), else sapipe's keyword arguments ("k": 0 or "m")
MODES = {
    "ddp": {"ddp": "default"},
    "ddp-view": {"ddp": "view"},
    "k0": {"k": 0},
    "k0-noexpose": {"k": 0, "expose_gradients": False},
    "k0-bf16": {"k": 0, "compression": "bf16"},
    "k0-int8": {"k": 0, "compression": "int8"},
    "km-none": {"k": "m"},
    "km-none-noexpose": {"k": "m", "expose_gradients": False},
    "km-dc": {"k": "m", "compensation": "dc"},
    "km-wp1": {"k": "m", "compensation": "wp1"},
    "km-wp2": {"k": "m", "compensation": "wp2"},
    "km-wp3": {"k": "m", "compensation": "wp3"},
    "km-t2": {"k": "m", "compensation": "t2"},
    "km-none-s2": {"k": "m", "staleness": 2},
    "km-dc-s2": {"k": "m", "compensation": "dc", "staleness": 2},
    "km-none-bf16": {"k": "m", "compression": "bf16"},
    "km-none-bf16-ef": {"k": "m", "compression": "bf16", "error_feedback": True},
    "km-none-int8": {"k": "m", "compression": "int8"},
    "km-none-int8-noef": {"k": "m", "compression": "int8", "error_feedback": False},
}
CATEGORIES = (
    "slots",
    "own p.grad",
    "local",
    "real weights",
    "history",
    "velocity",
    "codec buffers",
    "residuals",
    "DDP buckets",
    "update scratch",
    "other",
)
MODEL_TOLERANCE = 0.02  # of G: a measured extra farther than this from the model is marked


# ============================================================================ counting (each rank)


def model_multiple(mode: dict, world: int) -> float:
    """The extra this mode is expected to hold, as a multiple of G (see the module's docstring)."""
    if "ddp" in mode:
        return 1.0 if mode["ddp"] == "default" else 0.0
    s, comp = mode.get("staleness", 1), mode.get("compensation", "none")
    depth = 1 if mode["k"] == 0 else s + 1
    held = depth  # slots
    if mode["k"] != 0:
        held += (
            (comp in ("wp1", "wp3"))
            + (comp == "wp3")
            + (comp.startswith("wp") or comp == "t2")  # real weights
            + (comp == "t2")  # T2's velocity
            + (s + 1) * (comp == "dc")
        )
    kind = mode.get("compression")
    if kind is not None:
        per_value = 2.0 if kind in ("fp16", "bf16") else 1.0 + 4.0 / 64
        held += depth * (3 * world + 1) / world * per_value / 4.0
        if mode.get("error_feedback", kind == "int8"):
            held += 1.0 + 1.0 / world
    return held - 1.0 if mode.get("expose_gradients", True) else held


def _category(path: str) -> str:
    """What a tensor found at ``path`` (from the sapipe optimizer) is, by the attributes that lead
    to it."""
    if ".states[" in path:  # the updater's per-segment optimizer state
        return "update scratch" if ".scratch" in path else "optimizer state"
    if path.startswith(("opt.optimizer.state", "opt.state")):
        return "optimizer state"
    if ".codec." in path:
        return "residuals" if "residual" in path else "codec buffers"
    for attribute, category in (
        (".buffer.", "slots"),  # a bucket's StalenessBuffer (sapipe.runtime.gradients)
        (".prev_local", "local"),
        (".local", "local"),
        (".real", "real weights"),
        (".history.", "history"),
        (".velocity", "velocity"),
    ):
        if attribute in path:
            return category
    return "other"


def reachable_tensors(root, name: str = "opt") -> dict:
    """path -> tensor, for every tensor reachable from ``root`` through sapipe's objects and
    Python containers (the wrapped torch optimizer: its ``state`` only; modules: not entered)."""
    import torch

    found, seen, todo = {}, set(), [(name, root)]
    while todo:
        path, obj = todo.pop()
        if isinstance(obj, torch.Tensor):
            found[path] = (
                obj  # every path to it: the bucket's name for it is the one that says what it is
            )
            continue
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.nn.Module):
            continue
        elif isinstance(obj, torch.optim.Optimizer) and obj is not root:
            todo.append((path + ".state", obj.state))
        elif isinstance(obj, dict):
            todo += [(f"{path}[{key!r}]", value) for key, value in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            todo += [(f"{path}[{i}]", value) for i, value in enumerate(obj)]
        elif type(obj).__module__.startswith("sapipe") or obj is root:
            fields = dict(getattr(obj, "__dict__", {}))
            fields.update(
                {
                    slot: getattr(obj, slot)
                    for slot in getattr(type(obj), "__slots__", ())
                    if hasattr(obj, slot)
                }
            )
            todo += [(f"{path}.{key}", value) for key, value in fields.items()]
    return found


def _storage(tensor):
    """(data_ptr, nbytes) of ``tensor``'s storage, without running a tensor subclass's
    ``__torch_function__`` (sapipe's exposed ``p.grad`` waits and applies updates on any use)."""
    import torch

    with torch._C.DisableTorchFunctionSubclass():  # noqa: SLF001 - as sapipe.runtime.exposure does
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()


def account(params, internals: dict) -> dict:
    """Bytes held, by category, each storage once, claimed in this order: the parameters, the
    wrapper's tensors (``internals``: path -> (category, tensor); the optimizer state first),
    what else ``p.grad`` holds ("own p.grad"), the wrapper's tensors no category names ("other",
    their paths under "other paths")."""
    owner = {}  # storage -> (category, nbytes, path); the first to claim a storage keeps it

    def claim(tensor, category, path=""):
        ptr, nbytes = _storage(tensor)
        if ptr and ptr not in owner:
            owner[ptr] = (category, nbytes, path)

    for p in params:
        claim(p, "params")
    named = sorted(
        (item for item in internals.items() if item[1][0] != "other"),
        key=lambda item: item[1][0] != "optimizer state",
    )
    for path, (category, tensor) in named:
        claim(tensor, category, path)
    for p in params:
        if p.grad is not None:
            claim(p.grad, "own p.grad")
    for path, (category, tensor) in internals.items():
        claim(tensor, category, path)
    totals = {"other paths": {}}
    for category, nbytes, path in owner.values():
        totals[category] = totals.get(category, 0) + nbytes
        if category == "other":
            totals["other paths"][path] = nbytes
    return totals


def extra_of(totals: dict, grad_bytes: int) -> int:
    return (
        sum(v for k, v in totals.items() if k not in ("params", "optimizer state", "other paths"))
        - grad_bytes
    )


# ============================================================================ the job (each rank)


def rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class LastGradient:
    """Calls ``callback`` once, at the last gradient of the next armed backward (registered
    after the wrapper's hooks, so it runs after them)."""

    def __init__(self, params, callback):
        self._params, self._callback, self._left = params, callback, None
        self._handles = [p.register_post_accumulate_grad_hook(self._arrived) for p in params]

    def arm(self):
        self._left = len(self._params)

    def _arrived(self, _param):
        if self._left is not None:
            self._left -= 1
            if self._left == 0:
                self._left = None
                self._callback()

    def remove(self):
        for handle in self._handles:
            handle.remove()


def _ddp(model, base, mode, device):
    """DDP with a comm hook (torch's own all-reduce) that notes each bucket's buffer; its
    tensors by category: the buckets and the optimizer's state."""
    import torch
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    ddp = torch.nn.parallel.DistributedDataParallel(
        model,
        device_ids=[device.index] if device.type == "cuda" else None,
        gradient_as_bucket_view=mode["ddp"] == "view",
    )
    buckets = {}

    def hook(state, bucket):
        if bucket.index() == 0:  # a new backward (DDP launches its buckets in index order)
            buckets.clear()  # DDP rebuilds its buckets after the first iteration: keep this step's
        buckets[bucket.index()] = bucket.buffer()  # DDP's own flat buffer
        return default_hooks.allreduce_hook(state, bucket)

    ddp.register_comm_hook(None, hook)

    def internals():
        found = {f"ddp.bucket[{i}]": ("DDP buckets", t) for i, t in buckets.items()}
        found.update(
            {
                f"optimizer.state[{n}][{key!r}]": ("optimizer state", t)
                for n, state in enumerate(base.state.values())
                for key, t in state.items()
                if isinstance(t, torch.Tensor)
            }
        )
        return found

    return ddp, internals


def _sapipe(model, base, mode, layers):
    """sapipe over ``model`` in ``mode``; its tensors by category (found from the optimizer
    object)."""
    import sapipe

    settings = {k: v for k, v in mode.items() if k != "k"}
    opt = sapipe.DistributedOptimizer(
        base, model, stale_layers=0 if mode["k"] == 0 else layers, timeout=300, **settings
    )
    return opt, lambda: {path: (_category(path), t) for path, t in reachable_tensors(opt).items()}


def measure(spec, name: str, args, device, world: int) -> dict:
    """Train ``name`` for ``args.steps`` steps on a fresh model; what it holds, in and between
    steps."""
    import bench_models
    import torch

    mode = MODES[name]
    gc.collect()
    model = spec.make_model().to(device)
    x, y = spec.make_batch(spec.batch_size, device, torch.Generator().manual_seed(0))
    layers = len(bench_models.describe_layers(model, x))
    params = [p for p in model.parameters() if p.requires_grad]
    grad_bytes = sum(p.numel() * p.element_size() for p in params)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    cuda_start, rss_start = torch.cuda.memory_allocated(device) if cuda else 0, rss_bytes()
    base = spec.make_optimizer(model.parameters())
    if "ddp" in mode:
        (wrapped, internals), opt = _ddp(model, base, mode, device), base
    else:
        (opt, internals), wrapped = _sapipe(model, base, mode, layers), model
    seen = {}
    probe = LastGradient(params, lambda: seen.update(backward=account(params, internals())))
    for step in range(args.steps):
        if step == args.steps - 1:
            probe.arm()
        opt.zero_grad()
        spec.loss_fn(wrapped(x), y).backward()
        opt.step()
    if cuda:
        torch.cuda.synchronize(device)
    between = account(params, internals())
    out = {
        "mode": name,
        "grad_bytes": grad_bytes,
        "numel": sum(p.numel() for p in params),
        "params": len(params),
        "layers": layers,
        "between": between,
        "backward": seen.get("backward", {}),
        "rss_delta": rss_bytes() - rss_start,
        "model": model_multiple(mode, world),
        "cuda_peak_delta": torch.cuda.max_memory_allocated(device) - cuda_start if cuda else None,
    }
    if "ddp" not in mode:
        out["buckets"] = [
            {
                "numel": b.numel,
                "params": len(b.params),
                "stale": b.stale,
                "wire": [w.numel() for w in opt._runtime.pipeline.gradients(b).buffer.wire],
            }
            for b in opt.buckets
        ]
        opt.close()
    probe.remove()
    return out


def worker(args) -> None:
    import bench_models
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    cuda = torch.cuda.is_available() and args.device != "cpu"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", rank % torch.cuda.device_count()) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    spec = bench_models.build(args.model, args.size)
    names = args.modes.split(",")
    measure(
        spec, "km-wp3" if "km-wp3" in names else names[-1], args, device, world
    )  # one-off costs: not counted
    rows = [measure(spec, name, args, device, world) for name in names]
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump(
                {
                    "model": args.model,
                    "size": args.size,
                    "world": world,
                    "device": str(device),
                    "steps": args.steps,
                    "rows": rows,
                },
                f,
            )
    dist.barrier()
    dist.destroy_process_group()


# ============================================================================ report


def _mib(nbytes) -> str:
    return f"{nbytes / MiB:.2f}"


def table(result: dict) -> str:
    rows = result["rows"]
    g = rows[0]["grad_bytes"]
    cuda = rows[0]["cuda_peak_delta"] is not None
    lines = [
        (
            f"**{result['model']} ({result['size']})**: {rows[0]['numel']:,} parameters in "
            f"{rows[0]['params']} "
            f"tensors, {rows[0]['layers']} layers; G = {_mib(g)} MiB; {result['world']} ranks on "
            f"{result['device']}; counted after {result['steps']} steps, on rank 0. MiB, and "
            "multiples of G.\n"
        ),
        (
            "| mode | extra between steps | model | in backward | "
            + " | ".join(CATEGORIES)
            + " | optimizer state | RSS check |"
            + (" CUDA peak check |" if cuda else "")
        ),
        "| --- " * (5 + len(CATEGORIES) + 1 + cuda) + "|",
    ]
    for row in rows:
        between, backward = row["between"], row["backward"]
        extra, in_backward = (
            extra_of(between, g),
            extra_of(backward, g) if backward else float("nan"),
        )
        off = "" if abs(extra / g - row["model"]) <= MODEL_TOLERANCE else " !"
        state = between.get("optimizer state", 0)
        cells = [
            row["mode"],
            f"{_mib(extra)} (+{extra / g:.2f}x){off}",
            f"+{row['model']:.2f}x",
            f"{_mib(in_backward)} (+{in_backward / g:.2f}x)",
        ]
        cells += [_mib(between.get(c, 0)) if between.get(c) else "" for c in CATEGORIES]
        cells += [_mib(state), _mib(row["rss_delta"] - g - state)]
        if cuda:
            cells.append(_mib(row["cuda_peak_delta"] - g - state))
        lines.append("| " + " | ".join(cells) + " |")
    lines.append(
        "\n*extra*: held beyond the parameters and the optimizer state, less one gradient (G); "
        "*in backward*: the same at the last gradient of a step (DDP: the instant among its "
        "reducer's "
        "own hooks); *RSS check*: the process's RSS "
        "change over the mode less G and the optimizer state"
        + (
            "; *CUDA peak check*: max_memory_allocated over the mode less G and the optimizer state"
            if cuda
            else ""
        )
        + ". A `!` marks an extra more than 2% of G from the model."
    )
    return "\n".join(lines)


def launch(model: str, args) -> dict:
    """One job for ``model``, every mode in it; rank 0's counts. Killed whole if it overruns."""
    import torch

    ranks = (
        min(2, torch.cuda.device_count())
        if torch.cuda.is_available() and args.device != "cpu"
        else 2
    )
    with tempfile.TemporaryDirectory(prefix="sapipe-memory-") as tmp:
        out = os.path.join(tmp, "result.json")
        cmd = harness.torchrun(
            ranks,
            __file__,
            "--worker",
            "--model",
            model,
            "--size",
            args.size,
            "--modes",
            args.modes,
            "--steps",
            str(args.steps),
            "--device",
            args.device,
            "--result",
            out,
        )
        # glibc returns freed blocks of 64 KiB and more, so that RSS follows what is held
        env = harness.worker_env(
            OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536"
        )
        return harness.run_job(f"memory ({model})", cmd, env, args.timeout, out)


def main(argv=None) -> int:
    p = harness.Parser(
        __doc__,
        quick=dict(models="gpt2", size="tiny", modes="ddp,k0,km-none,km-wp1", steps=3),
        device=("auto", "cpu"),
        size="small",
        json=True,
        out=None,
        out_help="also write the report (or the JSON) to this file",
        timeout=1800.0,
        worker=True,
    )
    p.add_argument(
        "--models", default="gpt2,resnet50", help="bench_models families, comma-separated"
    )
    p.add_argument(
        "--modes", default=",".join(MODES), help=f"comma-separated, of: {', '.join(MODES)}"
    )
    p.add_argument(
        "--steps",
        type=int,
        default=5,
        help="steps before counting (s = 2 needs 4 for a full pipeline)",
    )
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.modes.split(",")) - set(MODES)
    if unknown:
        p.error(f"unknown modes {sorted(unknown)}; choose from {', '.join(MODES)}")
    if args.worker:
        worker(args)
        return 0
    results = [launch(model, args) for model in args.models.split(",")]
    command = harness.command(argv)
    text = (
        json.dumps({"command": command, "results": results})
        if args.json
        else f"`{command}`\n\n" + "\n\n".join(table(r) for r in results)
    )
    harness.emit(text, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
