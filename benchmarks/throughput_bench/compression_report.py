"""The compressed modes (``sapipe-auto-<compression>``) against the *full-precision* ceiling.

Compression makes fewer bytes travel, so where the link is the limit a compressed run can
beat the ceiling of overlapping full-precision communication with compute; where compute is
the limit it can only cost (the codec's work). The targets:

* link-bound (T_comm/T_compute ≥ LINK_BOUND): T(bf16) ≤ 0.80 and T(int8) ≤ 0.70 × the job's
  full-precision T_ceiling;
* compute-bound (T_comm/T_compute ≤ COMPUTE_BOUND): each compressed mode within 3 % of
  full-precision ``sapipe-auto`` (the median over rounds of the ratio within a round).
"""

from __future__ import annotations

from typing import Any

from sapipe.compression.codec import COMPRESSIONS

from .stats import paired_ratio

PREFIX = "sapipe-auto-"
CEILING_TARGETS = {
    "bf16": 0.80,
    "int8": 0.70,
}  # T / full-precision T_ceiling where the link is the limit
LINK_BOUND = 1.3
COMPUTE_BOUND = 0.35
COMPUTE_BOUND_COST = 0.03


def _result(job, mode) -> dict[str, Any] | None:
    return next((r for r in job["results"] if r["mode"] == mode and r.get("t")), None)


def compressions(jobs) -> list[str]:
    """The compressions that ran, in the order of the first job that ran them."""
    seen: list[str] = []
    for job in jobs:
        for r in job["results"]:
            name = r["mode"][len(PREFIX) :]
            if r["mode"].startswith(PREFIX) and name in COMPRESSIONS and name not in seen:
                seen.append(name)
    return seen


def rows(jobs) -> list[dict[str, Any]]:
    """Per job and compression: T, its ratio to the full-precision ceiling, and its cost
    against full-precision sapipe-auto (overall and per round)."""
    out = []
    for job in jobs:
        local, comm, ceiling = (_result(job, m) for m in ("local", "comm", "ceiling"))
        auto = _result(job, "sapipe-auto")
        ratio = comm["t"] / local["t"] if comm and local else None
        for name in compressions([job]):
            r = _result(job, PREFIX + name)
            if r is None:  # it did not finish (the job's notes say why)
                continue
            out.append(
                dict(
                    model=job["model"],
                    rate=job["rate"],
                    ratio=ratio,
                    compression=name,
                    k=r.get("k"),
                    t=r["t"],
                    wait=r.get("wait"),
                    t_ceiling=ceiling and ceiling["t"],
                    t_auto=auto and auto["t"],
                    k_auto=auto and auto.get("k"),
                    of_ceiling=r["t"] / ceiling["t"] if ceiling else None,
                    vs_auto=r["t"] / auto["t"] - 1 if auto else None,
                    vs_auto_paired=paired_ratio(r, auto) if auto else None,
                )
            )
    return out


def _f(value, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def format_table(jobs) -> str | None:
    """One row per job and compression (None when no compressed mode ran)."""
    table = rows(jobs)
    if not table:
        return None
    lines = [
        "| model | rate | T_comm/T_compute | compression | k | step ms | × full-precision "
        "T_ceiling "
        "| vs full-precision sapipe-auto (k) | per round | waits ms/step |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in table:
        lines.append(
            f"| {r['model']} | {r['rate']} | {_f(r['ratio'], '.2f')} | {r['compression']} | "
            f"{_f(r['k'], '')} | {_f(r['t'] * 1e3, '.1f')} | {_f(r['of_ceiling'], '.2f')} | "
            f"{_f(r['vs_auto'], '+.1%')} ({_f(r['k_auto'], '')}) | "
            f"{_f(r['vs_auto_paired'], '+.1%')} | "
            f"{_f(r['wait'] and r['wait'] * 1e3, '.1f')} |"
        )
    return "\n".join(lines) + "\n"


def format_targets(jobs) -> str | None:
    """The two targets, judged on every job they apply to (None when no compressed mode ran)."""
    table = rows(jobs)
    if not table:
        return None
    lines = []
    link = [
        r
        for r in table
        if r["ratio"] is not None
        and r["ratio"] >= LINK_BOUND
        and r["of_ceiling"] is not None
        and r["compression"] in CEILING_TARGETS
    ]
    if link:
        met = [r for r in link if r["of_ceiling"] <= CEILING_TARGETS[r["compression"]]]
        lines.append(
            "* **Past the full-precision ceiling where the link is the limit** (T_comm/T_compute "
            "≥ "
            f"{LINK_BOUND}; bf16 ≤ 0.80×, int8 ≤ 0.70× T_ceiling): {len(met)}/{len(link)} met. "
            + "; ".join(
                f"{r['model']} @ {r['rate']} (ratio {r['ratio']:.2f}) {r['compression']} "
                f"{r['of_ceiling']:.2f}×"
                for r in link
            )
            + "."
        )
    bound = [r for r in table if r["ratio"] is not None and r["ratio"] <= COMPUTE_BOUND]
    if bound:
        cost = {
            id(r): r["vs_auto_paired"] if r["vs_auto_paired"] is not None else r["vs_auto"]
            for r in bound
        }
        met = [r for r in bound if cost[id(r)] is not None and cost[id(r)] <= COMPUTE_BOUND_COST]
        lines.append(
            "* **At most 3 % cost where compute is the limit** (T_comm/T_compute ≤ "
            f"{COMPUTE_BOUND}; "
            f"against full-precision sapipe-auto, per round): {len(met)}/{len(bound)} met. "
            + "; ".join(
                f"{r['model']} @ {r['rate']} {r['compression']} {_f(cost[id(r)], '+.1%')}"
                for r in bound
            )
            + "."
        )
    return "\n".join(lines) + "\n" if lines else None


def markdown(jobs) -> list[str]:
    """The report's "Compression" section (empty when no compressed mode ran)."""
    table = format_table(jobs)
    if table is None:
        return []
    return [
        "## Compression on the wire",
        "",
        'Each `sapipe-auto-<compression>` mode is `stale_layers="auto"` with `compression=` that '
        "format "
        "(error feedback at its default: on for int8), interleaved in the same rounds as every "
        "other mode. "
        "The yardstick is the *full-precision* ceiling of the same job: overlap alone cannot beat "
        "it, fewer "
        "bytes can. Targets (module docstring of `throughput_bench/compression_report.py`):",
        "",
        format_targets(jobs) or "",
        table,
    ]


__all__ = ["compressions", "rows", "format_table", "format_targets", "markdown"]
