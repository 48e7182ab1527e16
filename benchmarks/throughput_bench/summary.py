"""What the report and the plots read of a sweep's jobs: the reference modes, the
headline sapipe result, and one summary row per job."""

from __future__ import annotations

from typing import Any

from .stats import paired_ratio


def result_of(job, mode):
    for r in job["results"]:
        if r["mode"] == mode and r.get("t"):
            return r
    return None


def is_deferred(r: dict[str, Any]) -> bool:
    """A ``deferred`` twin: sapipe run with ``expose_gradients=False`` (only the exposure table
    reads it)."""
    return r.get("expose_gradients") is False


def fixed_k_results(results) -> list[dict[str, Any]]:
    """The measured ``sapipe k=K`` modes (compensation none, the default ``expose_gradients``),
    without their ``deferred`` twins."""
    return [
        r
        for r in results
        if r["mode"].startswith("sapipe k=")
        and r.get("t")
        and isinstance(r.get("k"), int)
        and not is_deferred(r)
    ]


def derived(job) -> dict[str, float | None]:
    loc, comm, ceil, ddp = (result_of(job, m) for m in ("local", "comm", "ceiling", "ddp"))
    d = {
        "t_local": loc and loc["t"],
        "t_comm": comm and comm["t"],
        "t_ceiling": ceil and ceil["t"],
        "t_ddp": ddp and ddp["t"],
    }
    d["ratio"] = d["t_comm"] / d["t_local"] if d["t_comm"] and d["t_local"] else None
    d["possible"] = d["t_ddp"] / d["t_ceiling"] if d["t_ddp"] and d["t_ceiling"] else None
    return d


def headline(job) -> dict[str, Any] | None:
    """The sapipe result a user would get: auto when it ran, else the oracle-k run."""
    auto = result_of(job, "sapipe-auto")
    if auto:
        return auto
    k = job.get("oracle_k")
    for r in job["results"]:
        if (
            isinstance(k, int)
            and r.get("t")
            and r.get("k") == k
            and r["mode"] in (f"sapipe k={k}", "pipesgd")
        ):
            return r
    return None


def summary_rows(jobs) -> list[dict[str, Any]]:
    return [_summary_row(job) for job in jobs]


def _summary_row(job) -> dict[str, Any]:
    d = derived(job)
    h = headline(job)
    pipe = result_of(job, "pipesgd")
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
    sap = [
        r
        for r in job["results"]
        if r.get("t")
        and (r["mode"].startswith("sapipe") or r["mode"] == "pipesgd")
        and not is_deferred(r)
    ]
    row["best_speedup"] = (
        max((d["t_ddp"] / r["t"] for r in sap), default=None) if d["t_ddp"] else None
    )
    hv = result_of(job, "horovod")
    row["horovod"] = d["t_ddp"] / hv["t"] if hv and d["t_ddp"] else None
    row["comps"] = {
        r["mode"]: d["t_ddp"] / r["t"]
        for r in sap
        if r.get("compensation") not in (None, "none") and d["t_ddp"]
    }
    return row
