"""The scheduler: how many layers to make stale (docs/design.md §4), and traces to check it.

* :func:`choose_k` simulates the runtime's pipeline for every k and picks the smallest k
  with no predicted stall; :func:`closed_form_k` is the paper's program, kept as reference.
* :func:`simulate` predicts the steady-state iteration of one k, with a timeline.
* :mod:`~sapipe.schedule.profiler` times the running job (per-layer compute, the link) and
  runs collectives to time the link and to combine the ranks' measurements.
* :mod:`~sapipe.schedule.predict` predicts DDP, Pipe-SGD and sapipe on other clusters from
  a saved profile (:mod:`~sapipe.schedule.saved_profile`) and a two-level link
  (:mod:`~sapipe.schedule.cluster_link`); ``python -m sapipe.schedule.predict``.

The simulator and the solver are pure Python (no torch, no torch.distributed) and are what
this package imports; only the profiler, imported on its own, needs torch and a process
group. The measured search on the running job is :mod:`sapipe.auto.search`; timelines for
Perfetto, simulated or recorded, are :mod:`sapipe.tracing.chrome_trace`.
"""

from sapipe.schedule.simulator import BucketPlan, SimResult, plan_buckets, simulate
from sapipe.schedule.solver import Decision, LayerProfile, brute_force_k, choose_k, closed_form_k

__all__ = [
    "LayerProfile",
    "Decision",
    "closed_form_k",
    "brute_force_k",
    "choose_k",
    "simulate",
    "SimResult",
    "BucketPlan",
    "plan_buckets",
]
