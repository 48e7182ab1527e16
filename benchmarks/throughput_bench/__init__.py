"""sapipe throughput benchmark: samples/s of sapipe vs DDP (and Horovod) under an emulated network.

Two ways to run it (the entry point is ``benchmarks/throughput.py``):

* **Sweep (one host, emulated network)** — ``python benchmarks/throughput.py`` (``make bench``).
  For every model and bandwidth it starts one ``torchrun`` job (``--nproc`` ranks, Gloo, CPU)
  with all ranks inside a fresh network namespace whose loopback is rate-limited with
  ``tc tbf`` (:mod:`sapipe.launch.netns`, docs/design.md §6). Bandwidths are given explicitly
  (``--bandwidths 1gbit,300mbit``) or, by default, calibrated per model to hit target
  ratios T_comm / T_compute (``--ratios 0.3,0.65,1.6``) from a short probe job. Results go
  to ``benchmarks/results/throughput.md`` and ``throughput_*.png``. Then, for ``--cluster-models``
  (gpt2), one job per ``--clusters`` topology (2x2, 4x1) on emulated nodes
  (``sapipe-launch --emulate-cluster``, root only) with ``--inter-node`` (1 Gbit/s) between
  them; those run the baselines, k = 0, k = m and sapipe-auto (summing node first, and flat).
* **Directly under torchrun** (any device, any number of nodes, no emulation) — e.g.
  ``torchrun --nnodes 2 --nproc_per_node 8 ... benchmarks/throughput.py --model gpt2 --size full``.
  Each rank uses ``cuda:LOCAL_RANK`` with NCCL when CUDA is available (Gloo on CPU
  otherwise), and rank 0 prints the same table.

Every job runs, in the same namespace and process group, these modes (each: warm-up, then
``--steps`` timed steps; per rank the median step time, the job's T = the slowest rank's
median, spread = interquartile range / median):

* ``local``: each rank trains alone with the plain optimizer: compute only (T_compute);
* ``comm``: one all-reduce of a buffer the size of all gradients, alone (T_comm);
* ``ceiling``: the local step while that buffer is all-reduced on a second process group,
  started at the top of the step and waited for at its end: perfect overlap (T_ceiling);
* ``ddp``: ``torch.nn.parallel.DistributedDataParallel``;
* ``sapipe k=K``: ``sapipe.DistributedOptimizer(stale_layers=K, compensation="none")`` for
  each ``--k``;
* ``pipesgd``: sapipe with k = m (all layers stale), ``none``;
* ``sapipe k=K deferred``, ``pipesgd deferred``: the same fixed-k mode, identical but for
  ``expose_gradients=False`` (sync updates deferred to each layer's next forward instead of
  ``p.grad`` holding the averaged gradient once backward ends); run next to its twin in the
  same rounds, so T(exposed) / T(deferred) is what the default costs at that k (``--skip
  deferred`` leaves them out). They take no part in the oracle k, the summary or the plots;
* ``sapipe-auto``: ``stale_layers="auto"`` (skipped with a note while sapipe refuses it);
* ``sapipe-<comp>``: each ``--compensations`` mode at the auto k, or, without auto, at the
  *oracle* k: the smallest measured k within 3 % of pipesgd;
* ``horovod``: ``horovod.torch.DistributedOptimizer`` over Gloo (skipped with a note when
  not installed; ``make peers``);
* ``sapipe-auto-flat``: on a job whose ranks span several nodes of several ranks (1 <
  torchrun's ``LOCAL_WORLD_SIZE`` < world; e.g. ``--clusters 2x2``): ``stale_layers="auto"``
  with ``hierarchical=False``, one flat all-reduce per bucket, where every other sapipe mode
  sums node first;
* ``ceiling-node-first``: on such a job, ``ceiling`` with the buffer summed as sapipe sums
  across nodes (``HierarchicalAllReduce``: inside the node, across nodes, inside again): the
  bound for node-first schedules;
* ``sapipe-auto-<compression>``: ``stale_layers="auto"`` with ``compression=`` each
  ``--compressions`` format (default bf16, int8), judged against the job's *full-precision*
  ceiling;
* ``sapipe-auto-<compression>-flat``: on such a job, ``sapipe-auto-<compression>`` with
  ``hierarchical=False``: each bucket's compressed sum over all ranks at once, where
  ``sapipe-auto-<compression>`` compresses only the sum across nodes.

Every mode's optimizer is torch's ``fused=True`` SGD / Adam (``bench_models``), so that the
baselines step with the fastest update torch has, as their best users would run them; sapipe
wraps the same optimizer and updates with its own fused kernels.

Reported per mode: samples/s, speedup over DDP (T_ddp / T), efficiency T_ceiling / T, k and
κ (the fraction of parameters that are stale), and for sapipe modes the time per step blocked on
communication (``DistributedOptimizer.communication_wait``); per job: possible speedup
T_ddp / T_ceiling. sapipe-auto against pipesgd is also given per round (the median of the
ratios within each round), which cancels the host's drifts between rounds. The "p.grad exposure
cost" table gives, per job and fixed k, T(exposed) / T(deferred), and the targets its median and
max over all jobs and k (target: ≤ 1.02, the overlap lost within 2 % at the same k). The
"Compression on the wire" table gives each compressed mode's T against the full-precision
T_ceiling and against full-precision sapipe-auto (:mod:`.compression_report`).

Modules, one job each:

* :mod:`.cli`: the command line and ``main()`` (worker, sweep or re-render)
* :mod:`.rank`: one rank's process groups, barriers and progress events
* :mod:`.stats`: step-time statistics (median, IQR, per-round medians, paired ratios)
* :mod:`.runners`: one mode each: set up, step, pause between rounds, describe
* :mod:`.job`: all modes of one model in one process group, interleaved in rounds; the
  worker
* :mod:`.orchestration`: the sweep: calibration probes and one ``torchrun`` job per model ×
  bandwidth
* :mod:`.summary`: what the report and the plots read of a job: references, headline,
  summary rows
* :mod:`.report`: tables and ``throughput.md``
* :mod:`.compression_report`: the compressed modes against the full-precision ceiling, and
  their targets
* :mod:`.plots`: ``throughput_speedup.png`` and ``throughput_efficiency.png``
"""

import os

#: benchmarks/ (on sys.path: ``bench_models`` and ``harness`` are imported from it)
BENCH_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(BENCH_DIR)
#: the script torchrun runs on every rank
ENTRY = os.path.join(BENCH_DIR, "throughput.py")
RESULTS_DIR = os.path.join(BENCH_DIR, "results")
#: a worker's progress events on stdout start with this (see :meth:`rank.Ctx.say`)
PROGRESS_TAG = "@@bench "
