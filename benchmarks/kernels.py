"""Micro-benchmark of sapipe's fused kernels (csrc/) against the pure-PyTorch path.

For a flat float32 buffer (16M elements by default) on CPU, times every kernel through the
dispatching entry point of sapipe.ops (the compiled extension) and through its
``reference_*`` function (pure PyTorch), and converts the kernel's *ideal* memory traffic --
bytes read plus bytes written per element, each input read once and each output written once
-- into GB/s. The yardstick is the machine's copy bandwidth, measured in the same run as a
large ``torch`` copy (2 x 4 bytes per element: one read, one write). The torch path moves more
than the ideal bytes (temporaries); its GB/s column is on the same ideal-bytes basis, so the
two columns compare times.

    python benchmarks/kernels.py [--n 16777216] [--reps 10] [--threads T]

Prints a markdown table. Timings are the best of --reps runs after a warm-up; run it on an
otherwise idle machine (the load average is printed with the table). The copy bandwidth is
re-measured next to each kernel and each row is compared with its neighbouring copy.
"""
from __future__ import annotations

import argparse
import os
import time
from typing import Callable, Dict, List

import torch

from sapipe import _ext, ops

F = 4  # bytes per float32


def timeit(fn: Callable[[], object], reps: int) -> float:
    """Best time of ``reps`` runs after a warm-up (the least disturbed by other load)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=16 * 1024 * 1024, help="elements (float32)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if _ext.cpu is None:
        raise SystemExit(f"sapipe._C is not built ({_ext.errors.get('_C')}); nothing to compare")
    n, reps = args.n, args.reps
    gen = torch.Generator().manual_seed(0)

    def buf(positive=False):
        x = torch.randn(n, generator=gen)
        return x.abs_().add_(0.1) if positive else x

    g, p, x_old, prev, local, mom = buf(), buf(), buf(), buf(), buf(), buf()
    m, v = buf(), buf(positive=True)
    delta = p - x_old
    out = torch.empty(n)
    # tensor layout of the bucket segment: a few big and many small tensors
    lengths: List[int] = [n // 2, n // 4, n // 8]
    small = [4096] * 64
    lengths += small + [n - sum(lengths) - sum(small)]

    src, dst = torch.randn(n), torch.empty(n)

    sgd_hp = dict(lr=0.1, momentum=0.9, dampening=0.0, nesterov=True, weight_decay=1e-4,
                  maximize=False, first=False)
    adam_hp = dict(step=10, lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=1e-2,
                   decoupled=True, maximize=False)
    dc_out = dict(delta=p, delta_ref=x_old, lam=0.04, form="outer", lengths=lengths)
    dc_diag = dict(dc_out, form="diagonal")
    wp3 = dict(dc_out, prev_local=prev, local=local, world_size=4)
    wp3_diag = dict(wp3, form="diagonal")
    hist = x_old.clone()  # a history slot (overwritten by the dc-with-history case)
    step_dots = torch.empty(len(lengths), dtype=torch.float64)
    wp3_terms = ops.FusedPeek(None, g, prev_local=prev, world_size=4)
    wp3_second = dict(prev_local=prev, local=local, world_size=4, lam=0.04, form="outer",
                      lengths=lengths, dots=ops.dc_dots(g, delta, lengths))
    wp3_diag_peek = ops.FusedPeek(out, g, prev_local=prev, local=local, form="diagonal", lam=0.04,
                                  world_size=4)

    # name -> (bytes per element, ext call, torch call)
    # In-place kernels run repeatedly on the same buffers (values drift; the timing does not).
    cases: Dict[str, tuple] = {
        "DC diagonal (g, Δ → out)": (
            3 * F,
            lambda: ops.delay_compensate(g, delta, 0.04, "diagonal", lengths, out=out),
            lambda: ops.reference_delay_compensate(g, delta, 0.04, "diagonal", lengths, out=out),
        ),
        "DC outer: dots pass + apply pass": (
            (2 + 2) * F,
            lambda: ops.delay_compensate(g, delta, 0.04, "outer", lengths, out=out),
            lambda: ops.reference_delay_compensate(g, delta, 0.04, "outer", lengths, out=out),
        ),
        "per-tensor dots only": (
            2 * F,
            lambda: ops.dc_dots(g, delta, lengths),
            lambda: ops.reference_dc_dots(g, delta, lengths),
        ),
        "SGD momentum+Nesterov+wd, in place": (
            5 * F,
            lambda: ops.sgd(p, g, mom, **sgd_hp),
            lambda: ops.reference_sgd(p, g, mom, **sgd_hp),
        ),
        "SGD peek (OPT_peek → out)": (
            4 * F,
            lambda: ops.sgd(p, g, mom, out=out, **sgd_hp),
            lambda: ops.reference_sgd(p, g, mom, out=out, **sgd_hp),
        ),
        "SGD + DC diagonal (Δ = x − x_old), in place": (
            6 * F,
            lambda: ops.sgd_fused(p, g, mom, **sgd_hp, **dc_diag),
            lambda: ops.reference_sgd_fused(p, g, mom, **sgd_hp, **dc_diag),
        ),
        "SGD + DC outer (Δ = x − x_old), in place": (
            (3 + 5) * F,
            lambda: ops.sgd_fused(p, g, mom, **sgd_hp, **dc_out),
            lambda: ops.reference_sgd_fused(p, g, mom, **sgd_hp, **dc_out),
        ),
        "Adam (AdamW), in place": (
            7 * F,
            lambda: ops.adam(p, g, m, v, **adam_hp),
            lambda: ops.reference_adam(p, g, m, v, **adam_hp),
        ),
        "Adam peek (OPT_peek → out)": (
            5 * F,
            lambda: ops.adam(p, g, m, v, out=out, **adam_hp),
            lambda: ops.reference_adam(p, g, m, v, out=out, **adam_hp),
        ),
        "AdamW + DC outer (Δ = x − x_old), in place": (
            (3 + 7) * F,
            lambda: ops.adam_fused(p, g, m, v, **adam_hp, **dc_out),
            lambda: ops.reference_adam_fused(p, g, m, v, **adam_hp, **dc_out),
        ),
        "WP3 peek, SGD, DC outer": (
            (4 + 6) * F,
            lambda: ops.sgd_fused(p, g, mom, out=out, **sgd_hp, **wp3),
            lambda: ops.reference_sgd_fused(p, g, mom, out=out, **sgd_hp, **wp3),
        ),
        "WP3 peek, SGD, DC diagonal": (
            7 * F,
            lambda: ops.sgd_fused(p, g, mom, out=out, **sgd_hp, **wp3_diag),
            lambda: ops.reference_sgd_fused(p, g, mom, out=out, **sgd_hp, **wp3_diag),
        ),
        "WP3 peek, Adam, DC outer": (
            (4 + 7) * F,
            lambda: ops.adam_fused(p, g, m, v, out=out, **adam_hp, **wp3),
            lambda: ops.reference_adam_fused(p, g, m, v, out=out, **adam_hp, **wp3),
        ),
        # An update's extras (sapipe.ops module doc), as the engine runs them per step:
        "dc: SGD + DC outer, x_t also into the history slot": (
            (3 + 5 + 1) * F,
            lambda: ops.sgd_fused(p, g, mom, **sgd_hp, **dict(dc_out, delta_ref=hist), hist=hist),
            lambda: ops.reference_sgd_fused(p, g, mom, **sgd_hp, **dict(dc_out, delta_ref=hist), hist=hist),
        ),
        "wp2: SGD update + fused peek (same g)": (
            (5 + 1) * F,
            lambda: ops.sgd_fused(p, g, mom, **sgd_hp, peek=ops.FusedPeek(out, g)),
            lambda: ops.reference_sgd_fused(p, g, mom, **sgd_hp, peek=ops.FusedPeek(out, g)),
        ),
        "wp1: SGD update + fused peek from l_t": (
            (5 + 2) * F,
            lambda: ops.sgd_fused(p, g, mom, **sgd_hp, peek=ops.FusedPeek(out, local)),
            lambda: ops.reference_sgd_fused(p, g, mom, **sgd_hp, peek=ops.FusedPeek(out, local)),
        ),
        "wp3 outer, pass 1: SGD update + the step's dots": (
            (5 + 1) * F,
            lambda: ops.sgd_fused(p, g, mom, **sgd_hp, lengths=lengths, peek=wp3_terms, step_dots=step_dots),
            lambda: ops.reference_sgd_fused(p, g, mom, **sgd_hp, lengths=lengths, peek=wp3_terms,
                                            step_dots=step_dots),
        ),
        "wp3 outer, pass 2: SGD peek with those dots": (
            (5 + 1) * F,
            lambda: ops.sgd_fused(p, g, mom, out=out, **sgd_hp, **wp3_second),
            lambda: ops.reference_sgd_fused(p, g, mom, out=out, **sgd_hp, **wp3_second),
        ),
        "wp3 diagonal: Adam update + fused peek": (
            (7 + 3) * F,
            lambda: ops.adam_fused(p, g, m, v, **adam_hp, peek=wp3_diag_peek),
            lambda: ops.reference_adam_fused(p, g, m, v, **adam_hp, peek=wp3_diag_peek),
        ),
    }

    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"n = {n:,} float32 ({n * F / 2**20:.0f} MiB per buffer), torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, {os.cpu_count()} CPUs, load average {load:.1f}, "
          f"backend {ops.backend('cpu')}")
    rows = []
    for name, (bpe, ext_fn, ref_fn) in cases.items():
        # the yardstick is re-measured next to every kernel, so that load from elsewhere on a
        # shared machine affects both alike
        copy_s = timeit(lambda: dst.copy_(src), reps)
        t_ref = timeit(ref_fn, reps)
        t_ext = timeit(ext_fn, reps)
        rows.append((name, bpe, t_ref, t_ext, 2 * F * n / copy_s))
    copy_bws = [r[-1] for r in rows]
    print(f"copy bandwidth (torch copy_, 8 bytes/elem read+write), measured next to each "
          f"kernel: best {max(copy_bws) / 1e9:.1f} GB/s, median "
          f"{sorted(copy_bws)[len(copy_bws) // 2] / 1e9:.1f} GB/s\n")
    print("| kernel | bytes/elem | torch ms | ext ms | speed-up | ext GB/s | copy GB/s | ext / copy |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for name, bpe, t_ref, t_ext, copy_bw in rows:
        bw = bpe * n / t_ext
        print(f"| {name} | {bpe} | {t_ref * 1e3:.1f} | {t_ext * 1e3:.1f} | "
              f"{t_ref / t_ext:.1f}x | {bw / 1e9:.1f} | {copy_bw / 1e9:.1f} | {100 * bw / copy_bw:.0f}% |")

if __name__ == "__main__":
    main()
