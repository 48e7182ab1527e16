"""The sweep's plots: speedup over DDP per bandwidth, and efficiency per T_comm/T_compute."""

from __future__ import annotations

import os
import sys

from .summary import summary_rows


def plot(jobs, out_dir) -> list[str]:
    """``throughput_speedup.png`` and ``throughput_efficiency.png`` in ``out_dir`` (none without
    matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        print(f"no plots: matplotlib unavailable ({exc})", file=sys.stderr)
        return []
    rows = summary_rows(jobs)
    models = list(dict.fromkeys(r["model"] for r in rows))
    return [_speedup(plt, rows, models, out_dir), _efficiency(plt, rows, models, out_dir)]


def _speedup(plt, rows, models, out_dir) -> str:
    fig, axes = plt.subplots(1, len(models), figsize=(4.2 * len(models), 3.6), squeeze=False)
    for ax, model in zip(axes[0], models):
        rs = sorted(
            [r for r in rows if r["model"] == model and r["rate_bits"]],
            key=lambda r: r["rate_bits"],
        )
        if rs:
            _speedup_panel(ax, model, rs)
    axes[0][0].set_ylabel("speedup over DDP (T_ddp / T)\n(grey: T_comm/T_compute)")
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7, loc="best")
    fig.tight_layout()
    p = os.path.join(out_dir, "throughput_speedup.png")
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def _speedup_panel(ax, model, rs) -> None:
    """One model's speedups over DDP against the emulated bandwidth."""
    x = [r["rate_bits"] / 1e6 for r in rs]
    series = [
        ("possible (T_ddp/T_ceiling)", [r["possible"] for r in rs], "k^--"),
        ("sapipe: auto (oracle k where auto failed)", [r["speedup"] for r in rs], "o-"),
        ("pipesgd (k=m)", [r["pipe_speedup"] for r in rs], "s-"),
    ]
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
            ax.annotate(
                f"{r['ratio']:.2f}",
                (xv, 1.0),
                textcoords="offset points",
                xytext=(0, -12),
                ha="center",
                fontsize=7,
                color="grey",
            )


def _efficiency(plt, rows, models, out_dir) -> str:
    fig, ax = plt.subplots(figsize=(5.5, 3.8))
    for model in models:
        rs = sorted(
            [r for r in rows if r["model"] == model and r["ratio"] and r["eff"]],
            key=lambda r: r["ratio"],
        )
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
    return p
