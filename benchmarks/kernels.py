"""Micro-benchmark of sapipe's fused kernels (csrc/) against the pure-PyTorch path.

The compression codec's stages (sapipe.kernels.codec) are timed too, on float32 buffers:
their rows count ideal bytes per value of the bucket (codec_cases).

For a flat buffer (16M elements by default) on CPU or on a CUDA GPU, times every kernel
through the dispatching entry point of sapipe.kernels.ops (the compiled extension: ``sapipe._C`` on
CPU, ``sapipe._C_cuda`` on CUDA) and through its ``reference_*`` function (pure PyTorch),
and converts the kernel's *ideal* memory traffic -- bytes read plus bytes written per
element, each input read once and each output written once -- into GB/s. Every tensor of a
call has the --dtype (the kernels take parameters, gradients and optimizer state all of one
dtype; only the per-tensor dot products are float64, a few values per segment, not counted),
so the bytes per element are a count of buffers times the dtype's element size. The
yardstick is the device's copy bandwidth, measured in the same run as a large same-dtype
``dst.copy_(src)`` (2 x element size bytes per element: one read, one write). The torch path
moves more than the ideal bytes (temporaries); its GB/s column is on the same ideal-bytes
basis, so the two columns compare times.

    python benchmarks/kernels.py [--n 16777216] [--reps 10] [--threads T] [--only update|codec]
    python benchmarks/kernels.py --device cuda [--dtype {float32,bfloat16,float16}] [--reps 50]
    ... [--json] [--out FILE]   # the rows as JSON instead of the table; also write it to FILE

Prints a markdown table. The copy bandwidth is re-measured next to each kernel and each row
is compared with its neighbouring copy. Timings come after a warm-up call:

* CPU: the best of --reps (default 10) wall-clock runs. On a noisy shared CPU the best run is
  the least disturbed by other load; run it on an otherwise idle machine (the load average
  is printed with the table). Only float32 is timed: sapipe._C takes float32/float64.
* CUDA: the median of --reps (default 50) calls, each timed by a pair of CUDA events, after a
  ``torch.cuda.synchronize()``: on a GPU, the median of many event-timed launches is the
  standard measure (stable, and not fooled by the host running ahead of the device). The
  inputs are not rotated among buffer sets: at the default n a float32 buffer (64 MiB) is
  larger than an H100's L2 (50 MiB) and every call touches several buffers, so little stays
  cached between calls; the L2 size is printed, with a warning when one buffer fits in it
  (then raise --n: a 16-bit dtype at the default n has 32 MiB buffers, so pass
  --n 33554432 on an H100).

A case that raises for the chosen device/dtype is printed as n/a with the reason.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from typing import Callable

import harness
import torch

from sapipe.kernels import codec as codec_kernels
from sapipe.kernels import ops
from sapipe.kernels.gradient_spec import GradientSpec

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def best_of(fn: Callable[[], object], reps: int) -> float:
    """CPU: best wall-clock time (s) of ``reps`` runs after a warm-up (the least disturbed)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def median_cuda(fn: Callable[[], object], reps: int) -> float:
    """CUDA: median device time (s) of ``reps`` calls, each between two CUDA events."""
    fn()
    torch.cuda.synchronize()
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for start, end in events:
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events) / 1e3


def codec_cases(
    n: int, device: torch.device, world: int = 2
) -> dict[str, tuple[float, Callable[[], object], Callable[[], object]]]:
    """The compression codec's stages (sapipe.kernels.codec) on a float32 bucket of ``n`` values
    sent as ``world`` rows, with and without error feedback: name -> (ideal bytes per bucket
    value, kernel call, torch call). encode reads the gradient (and the residual) and writes the
    compressed rows (and the residual); the sum reads the W received rows of a shard (n / W
    values each) and writes one (and reads and writes the shard's residual); decode reads the
    rows and writes the gradient."""
    gen = torch.Generator(device=device).manual_seed(1)
    grad = torch.randn(n, generator=gen, device=device)
    width = -(-n // world // codec_kernels.BLOCK) * codec_kernels.BLOCK
    cases = {}
    for kind, dtype in (("fp16", torch.float16), ("bf16", torch.bfloat16), ("int8", torch.int8)):
        value = dtype.itemsize + (4 / codec_kernels.BLOCK if kind == "int8" else 0)
        rows = torch.zeros(world, width, dtype=dtype, device=device)
        own = torch.zeros(1, width, dtype=dtype, device=device)
        scales = (
            torch.ones(world, width // codec_kernels.BLOCK, device=device)
            if kind == "int8"
            else None
        )
        own_scales = scales[:1].clone() if scales is not None else None
        codec_kernels.reference_encode(grad, None, rows, scales, 1.0)
        out = torch.empty(n, device=device)
        for feedback in (False, True):
            residual = torch.zeros(n, device=device) if feedback else None
            server = torch.zeros(width, device=device) if feedback else None
            ef = ", error feedback" if feedback else ""
            cases[f"codec {kind}: encode{ef}"] = (
                4 + value + (8 if feedback else 0),
                lambda r=residual, rows=rows, s=scales: codec_kernels.encode(grad, r, rows, s, 1.0),
                lambda r=residual, rows=rows, s=scales: codec_kernels.reference_encode(
                    grad, r, rows, s, 1.0
                ),
            )
            cases[f"codec {kind}: sum of {world} rows{ef}"] = (
                value + (value + (8 if feedback else 0)) / world,
                lambda r=server, a=(rows, scales, own, own_scales): codec_kernels.sum_encode(
                    a[0], a[1], r, a[2], a[3], world, torch.float32
                ),
                lambda r=server, a=(rows, scales, own, own_scales): (
                    codec_kernels.reference_sum_encode(
                        a[0], a[1], r, a[2], a[3], world, torch.float32
                    )
                ),
            )
        cases[f"codec {kind}: decode"] = (
            value + 4,
            lambda rows=rows, s=scales, o=out: codec_kernels.decode(rows, s, o, world),
            lambda rows=rows, s=scales, o=out: codec_kernels.reference_decode(rows, s, o, world),
        )
    return cases


@dataclass
class Row:
    name: str
    bytes_per_elem: float
    copy_gbps: float
    torch_ms: float | None = None
    ext_ms: float | None = None
    ext_gbps: float | None = None
    speedup: float | None = None  # torch ms / ext ms
    ext_over_copy: float | None = None  # ext GB/s / copy GB/s
    error: str | None = None  # why the case could not run


def fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "n/a" if x is None else f"{x:{spec}}{suffix}"


def check_device(device: torch.device, dtype: torch.dtype) -> None:
    """SystemExit unless sapipe's extension for ``device`` is built and takes ``dtype``."""
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device")
    # ops runs the reference for what its kernels do not take: the ext column would time it
    why = ops.kernel_unavailable(device, dtype)
    if why is not None:
        raise SystemExit(f"{why}; nothing to compare")


def _cpu_isa() -> str:
    """ ", instruction set X" of the compiled CPU kernels in use (SAPIPE_CPU_ISA caps it), if
    built."""
    from sapipe.kernels import _ext

    return f", instruction set {_ext.cpu.cpu_isa()}" if _ext.cpu is not None else ""


def main() -> None:
    ap = harness.Parser(
        __doc__,
        quick=dict(n=1 << 20, reps=3),
        device=("cpu", "cuda"),
        json=True,
        out=None,
        out_help="also write the table (or the JSON) to this file",
    )
    ap.add_argument("--n", type=int, default=16 * 1024 * 1024, help="elements per buffer")
    ap.add_argument("--dtype", choices=tuple(DTYPES), default="float32")
    ap.add_argument(
        "--reps", type=int, default=None, help="timed runs (default: 10 on CPU, 50 on CUDA)"
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    ap.add_argument(
        "--only",
        choices=("all", "update", "codec"),
        default="all",
        help="time only the update kernels or only the compression codec's stages (which run on "
        "one thread by design: time them with --threads 1, so the copy beside them has one too)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    check_device(device, dtype)
    cuda = device.type == "cuda"
    n = args.n
    reps = args.reps or (50 if cuda else 10)
    timeit = median_cuda if cuda else best_of
    E = dtype.itemsize  # bytes per element of every buffer
    new = dict(device=device, dtype=dtype)
    gen = torch.Generator(device=device).manual_seed(0)

    def buf(positive: bool = False) -> torch.Tensor:
        x = torch.randn(n, generator=gen, **new)
        return x.abs_().add_(0.1) if positive else x

    g, p, x_old, prev, local, mom = buf(), buf(), buf(), buf(), buf(), buf()
    m, v = buf(), buf(positive=True)
    delta = p - x_old
    out = torch.empty(n, **new)
    # tensor layout of the bucket segment: a few big and many small tensors
    lengths: list[int] = [n // 2, n // 4, n // 8]
    small = [min(4096, n // 4096)] * 64
    lengths += small + [n - sum(lengths) - sum(small)]

    src, dst = buf(), torch.empty(n, **new)

    sgd_hp = dict(
        lr=0.1,
        momentum=0.9,
        dampening=0.0,
        nesterov=True,
        weight_decay=1e-4,
        maximize=False,
        first=False,
    )
    adam_hp = dict(
        step=10,
        lr=1e-3,
        beta1=0.9,
        beta2=0.999,
        eps=1e-8,
        weight_decay=1e-2,
        decoupled=True,
        maximize=False,
    )
    dc_out = dict(delta=p, delta_ref=x_old, lam=0.04, form="outer", lengths=lengths)
    dc_diag = dict(dc_out, form="diagonal")
    wp3 = dict(dc_out, prev_local=prev, local=local, world_size=4)
    wp3_diag = dict(wp3, form="diagonal")
    hist = x_old.clone()  # a history slot (overwritten by the dc-with-history case)
    step_dots = torch.empty(len(lengths), dtype=torch.float64, device=device)
    wp3_terms = GradientSpec(
        g, prev_local=prev, world_size=4, delta_is_step=True, lengths=lengths, dots=step_dots
    )
    wp3_second = dict(
        prev_local=prev,
        local=local,
        world_size=4,
        lam=0.04,
        form="outer",
        lengths=lengths,
        dots=ops.dc_dots(GradientSpec(g, delta=delta, lengths=lengths)),
    )
    wp3_diag_peek = GradientSpec(
        g, prev_local=prev, local=local, form="diagonal", lam=0.04, world_size=4, delta_is_step=True
    )
    sgd_h, adam_h = ops.SGDHyperParams(**sgd_hp), ops.AdamHyperParams(**adam_hp)
    plain, from_local = GradientSpec.plain(g), GradientSpec.plain(local)
    dots_spec = GradientSpec(g, delta=delta, lengths=lengths)
    spec_dc_diag, spec_dc_out = GradientSpec(g, **dc_diag), GradientSpec(g, **dc_out)
    spec_wp3, spec_wp3_diag = GradientSpec(g, **wp3), GradientSpec(g, **wp3_diag)
    spec_wp3_second = GradientSpec(g, **wp3_second)
    spec_dc_hist = GradientSpec(g, **dict(dc_out, delta_ref=hist), hist=hist)

    # name -> (bytes per element, ext call, torch call)
    # In-place kernels run repeatedly on the same buffers (values drift; the timing does not).
    cases: dict[str, tuple[float, Callable[[], object], Callable[[], object]]] = {
        "DC diagonal (g, Δ → out)": (
            3 * E,
            lambda: ops.delay_compensate(g, delta, 0.04, "diagonal", lengths, out=out),
            lambda: ops.reference_delay_compensate(g, delta, 0.04, "diagonal", lengths, out=out),
        ),
        "DC outer: dots pass + apply pass": (
            (2 + 2) * E,
            lambda: ops.delay_compensate(g, delta, 0.04, "outer", lengths, out=out),
            lambda: ops.reference_delay_compensate(g, delta, 0.04, "outer", lengths, out=out),
        ),
        "per-tensor dots only": (
            2 * E,
            lambda: ops.dc_dots(dots_spec),
            lambda: ops.reference_dc_dots(dots_spec),
        ),
        "SGD momentum+Nesterov+wd, in place": (
            5 * E,
            lambda: ops.sgd(p, g, mom, **sgd_hp),
            lambda: ops.reference_sgd(p, g, mom, **sgd_hp),
        ),
        "SGD peek (OPT_peek → out)": (
            4 * E,
            lambda: ops.sgd(p, g, mom, out=out, **sgd_hp),
            lambda: ops.reference_sgd(p, g, mom, out=out, **sgd_hp),
        ),
        "SGD + DC diagonal (Δ = x − x_old), in place": (
            6 * E,
            lambda: ops.sgd_fused(p, mom, sgd_h, spec_dc_diag),
            lambda: ops.reference_sgd_fused(p, mom, sgd_h, spec_dc_diag),
        ),
        "SGD + DC outer (Δ = x − x_old), in place": (
            (3 + 5) * E,
            lambda: ops.sgd_fused(p, mom, sgd_h, spec_dc_out),
            lambda: ops.reference_sgd_fused(p, mom, sgd_h, spec_dc_out),
        ),
        "Adam (AdamW), in place": (
            7 * E,
            lambda: ops.adam(p, g, m, v, **adam_hp),
            lambda: ops.reference_adam(p, g, m, v, **adam_hp),
        ),
        "Adam peek (OPT_peek → out)": (
            5 * E,
            lambda: ops.adam(p, g, m, v, out=out, **adam_hp),
            lambda: ops.reference_adam(p, g, m, v, out=out, **adam_hp),
        ),
        "AdamW + DC outer (Δ = x − x_old), in place": (
            (3 + 7) * E,
            lambda: ops.adam_fused(p, m, v, adam_h, spec_dc_out),
            lambda: ops.reference_adam_fused(p, m, v, adam_h, spec_dc_out),
        ),
        "WP3 peek, SGD, DC outer": (
            (4 + 6) * E,
            lambda: ops.sgd_fused(p, mom, sgd_h, spec_wp3, out=out),
            lambda: ops.reference_sgd_fused(p, mom, sgd_h, spec_wp3, out=out),
        ),
        "WP3 peek, SGD, DC diagonal": (
            7 * E,
            lambda: ops.sgd_fused(p, mom, sgd_h, spec_wp3_diag, out=out),
            lambda: ops.reference_sgd_fused(p, mom, sgd_h, spec_wp3_diag, out=out),
        ),
        "WP3 peek, Adam, DC outer": (
            (4 + 7) * E,
            lambda: ops.adam_fused(p, m, v, adam_h, spec_wp3, out=out),
            lambda: ops.reference_adam_fused(p, m, v, adam_h, spec_wp3, out=out),
        ),
        # An update's extras (sapipe.kernels.ops module doc), as the engine runs them per step:
        "dc: SGD + DC outer, x_t also into the history slot": (
            (3 + 5 + 1) * E,
            lambda: ops.sgd_fused(p, mom, sgd_h, spec_dc_hist),
            lambda: ops.reference_sgd_fused(p, mom, sgd_h, spec_dc_hist),
        ),
        "wp2: SGD update + fused peek (same g)": (
            (5 + 1) * E,
            lambda: ops.sgd_fused(p, mom, sgd_h, plain, peek=plain, out=out),
            lambda: ops.reference_sgd_fused(p, mom, sgd_h, plain, peek=plain, out=out),
        ),
        "wp1: SGD update + fused peek from l_t": (
            (5 + 2) * E,
            lambda: ops.sgd_fused(p, mom, sgd_h, plain, peek=from_local, out=out),
            lambda: ops.reference_sgd_fused(p, mom, sgd_h, plain, peek=from_local, out=out),
        ),
        "wp2: Adam update + fused peek (same g)": (
            (7 + 1) * E,
            lambda: ops.adam_fused(p, m, v, adam_h, plain, peek=plain, out=out),
            lambda: ops.reference_adam_fused(p, m, v, adam_h, plain, peek=plain, out=out),
        ),
        "wp1: Adam update + fused peek from l_t": (
            (7 + 2) * E,
            lambda: ops.adam_fused(p, m, v, adam_h, plain, peek=from_local, out=out),
            lambda: ops.reference_adam_fused(p, m, v, adam_h, plain, peek=from_local, out=out),
        ),
        "wp3 outer, pass 1: SGD update + the step's dots": (
            (5 + 1) * E,
            lambda: ops.sgd_fused(p, mom, sgd_h, plain, peek=wp3_terms),
            lambda: ops.reference_sgd_fused(p, mom, sgd_h, plain, peek=wp3_terms),
        ),
        "wp3 outer, pass 2: SGD peek with those dots": (
            (5 + 1) * E,
            lambda: ops.sgd_fused(p, mom, sgd_h, spec_wp3_second, out=out),
            lambda: ops.reference_sgd_fused(p, mom, sgd_h, spec_wp3_second, out=out),
        ),
        "wp3 diagonal: Adam update + fused peek": (
            (7 + 3) * E,
            lambda: ops.adam_fused(p, m, v, adam_h, plain, peek=wp3_diag_peek, out=out),
            lambda: ops.reference_adam_fused(p, m, v, adam_h, plain, peek=wp3_diag_peek, out=out),
        ),
    }
    if args.only == "codec":
        if dtype != torch.float32:
            sys.exit("kernels.py: the codec's stages take float32 gradients here (--dtype float32)")
        cases = {}
    if dtype == torch.float32 and args.only != "update":  # the codec's gradients are float32
        cases.update(codec_cases(n, device))
    report: list[str] = []

    mib = n * E / 2**20
    if cuda:
        l2: int | None = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", None)
        l2_text = f"L2 {l2 / 2**20:.0f} MiB" if l2 else "L2 size unknown"
        report.append(
            f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, backend "
            f"{ops.backend('cuda')}, {args.dtype}, n = {n:,} ({mib:.0f} MiB per buffer), "
            f"{l2_text}, median of {reps} CUDA-event-timed calls"
        )
        if l2 and n * E <= l2:
            report.append(
                f"WARNING: a buffer ({mib:.0f} MiB) fits in L2; raise --n to time DRAM traffic"
            )
    else:
        load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
        report.append(
            f"n = {n:,} {args.dtype} ({mib:.0f} MiB per buffer), torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average {load:.1f}, "
            f"backend {ops.backend('cpu')}{_cpu_isa()}"
        )
    rows: list[Row] = []
    for name, (bpe, ext_fn, ref_fn) in cases.items():
        # the yardstick is re-measured next to every kernel, so that load from elsewhere on a
        # shared machine affects both alike
        copy_gbps = 2 * E * n / timeit(lambda: dst.copy_(src), reps) / 1e9
        try:
            torch_s, ext_s = timeit(ref_fn, reps), timeit(ext_fn, reps)
        except Exception as exc:  # a case this device/dtype does not support
            rows.append(
                Row(name, bpe, copy_gbps, error=f"{type(exc).__name__}: {exc}".splitlines()[0])
            )
            continue
        ext_gbps = bpe * n / ext_s / 1e9
        rows.append(
            Row(
                name,
                bpe,
                copy_gbps,
                torch_s * 1e3,
                ext_s * 1e3,
                ext_gbps,
                torch_s / ext_s,
                ext_gbps / copy_gbps,
            )
        )
    copy_bws = sorted(r.copy_gbps for r in rows)
    report.append(
        f"copy bandwidth (torch copy_, {2 * E} bytes/elem read+write), measured next to each "
        f"kernel: best {copy_bws[-1]:.1f} GB/s, median {copy_bws[len(copy_bws) // 2]:.1f} GB/s\n"
    )
    report.append(
        "| kernel | bytes/elem | torch ms | ext ms | speed-up | ext GB/s | copy GB/s | ext / copy |"
    )
    report.append("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        ratio = fmt(None if r.ext_over_copy is None else 100 * r.ext_over_copy, ".0f", "%")
        report.append(
            f"| {r.name} | {r.bytes_per_elem:g} | {fmt(r.torch_ms, '.3f')} "
            f"| {fmt(r.ext_ms, '.3f')} | {fmt(r.speedup, '.1f', 'x')} | {fmt(r.ext_gbps, '.1f')} "
            f"| {r.copy_gbps:.1f} | {ratio}{f' ({r.error})' if r.error else ''} |"
        )
    if not args.json:
        harness.emit("\n".join(report), args.out)
        return
    meta = dict(
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        torch=torch.__version__,
        backend=ops.backend(device),
        dtype=args.dtype,
        n=n,
        reps=reps,
        timing="median of CUDA events" if cuda else "best wall clock",
        header=report[: -2 - len(rows)],
    )
    harness.emit(
        json.dumps(dict(meta=meta, rows=[asdict(r) for r in rows]), indent=1, ensure_ascii=False),
        args.out,
    )


if __name__ == "__main__":
    main()
