"""``sapipe-launch``: a thin layer over ``torchrun`` for sapipe jobs.

* passes every torchrun option and the training script through unchanged;
* ``--emulate-net RATE[,LATENCY]`` runs a single-node job inside a network namespace whose
  loopback is rate-limited (docs/design.md §6; :mod:`sapipe.launch.netns`, which the
  benchmarks use too);
* maps BytePS-style job specs (``DMLC_*``, ``BYTEPS_LOCAL_SIZE``) to torchrun flags;
* ``--dry-run`` prints the command instead of running it.

Run ``sapipe-launch --help`` (or ``python -m sapipe.launch --help``) for all options.
"""

from sapipe.launch import netns
from sapipe.launch.main import LaunchError, Plan, byteps_flags, main, plan

__all__ = ["LaunchError", "Plan", "byteps_flags", "main", "netns", "plan"]
