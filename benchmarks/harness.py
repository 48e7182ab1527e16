"""What the benchmarks share: paths, the common options, the environment of their worker
processes, and launching a job of ranks.

Every benchmark is a script, run by path (``python benchmarks/soak.py``, or under torchrun)
or through the entry point (``python -m benchmarks soak``, which runs it by path). Python puts
a script's folder first on ``sys.path``, so the scripts in ``benchmarks/`` import this module,
:mod:`bench_models` and each other by name; the studies in ``benchmarks/studies/`` import
``_on_path`` first, which adds ``benchmarks/``.

**The environment.** glibc's malloc serves large blocks (a layer's activations, its
gradients) with mmap and returns them on free, and it raises that threshold only as it sees
such blocks freed. A CPU training step therefore page-faults its big tensors afresh for an
unpredictable number of iterations, or for good, and a job's early iterations run at a
different speed from its later ones. Fixing the threshold (which also turns off glibc's
adjustment) and not trimming the heap makes every mode, and every phase of a job, run on
the same allocator footing -- what PyTorch's CPU performance guides get by preloading
jemalloc or tcmalloc.
sapipe itself sets nothing: this is the benchmarks' host hygiene, not the library's business.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
from typing import Any

BENCH_DIR = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH_DIR)
#: where a benchmark writes its report by default (only what RESULTS.md cites is committed)
RESULTS = os.path.join(BENCH_DIR, "results")
EXAMPLES = os.path.join(REPO, "examples")


def result_path(name: str) -> str:
    """``benchmarks/results/<name>``."""
    return os.path.join(RESULTS, name)


# ----------------------------------------------------------------------------- command line


class Parser(argparse.ArgumentParser):
    """A benchmark's command line: its docstring as the help, and the shared options asked for.

    * ``quick``: ``--quick``, a smoke run of seconds to a minute: these option values, for the
      options left at their defaults (the help lists them); or, a string, the help of a
      ``--quick`` the benchmark applies itself;
    * ``device``: ``--device``, of these choices, the first the default;
    * ``size``: ``--size`` (``bench_models``: tiny, small or full), this the default;
    * ``json``: ``--json``, the result printed as JSON instead of tables;
    * ``out``: ``--out PATH`` (alias ``--output``): where the report goes, this the default
      (``None``: printed only; a ``--quick`` run writes only where ``--out`` is given);
      ``out_help`` says what is written there;
    * ``timeout``: ``--timeout`` seconds before a job is killed, this the default;
    * ``worker``: a hidden ``--worker`` flag (the process a benchmark starts for itself).
    """

    def __init__(
        self,
        doc: str | None,
        *,
        quick: dict[str, Any] | str | None = None,
        device: tuple[str, ...] | None = None,
        size: str | None = None,
        json: bool = False,
        out: str | None | bool = False,
        out_help: str = "also write the report to this file",
        timeout: float | None = None,
        worker: bool = False,
    ):
        super().__init__(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
        self.quick = quick if isinstance(quick, dict) else None
        if isinstance(quick, str):
            self.add_argument("--quick", action="store_true", help=f"a smoke run: {quick}")
        elif quick is not None:
            settings = " ".join(
                f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}")
                for k, v in quick.items()
            )
            self.add_argument("--quick", action="store_true", help=f"a smoke run: {settings}")
        if device:
            self.add_argument("--device", choices=device, default=device[0])
        if size is not None:
            self.add_argument("--size", default=size, help="bench_models size: tiny, small, full")
        if json:
            self.add_argument(
                "--json", action="store_true", help="print the result as JSON, not tables"
            )
        if out is not False:
            default = out if isinstance(out, str) else None
            self.add_argument("--out", "--output", default=default, help=out_help)
        if timeout is not None:
            self.add_argument(
                "--timeout", type=float, default=timeout, help="seconds before a job is killed"
            )
        if worker:
            self.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)

    def parse_args(self, args=None, namespace=None):  # type: ignore[override]
        ns = super().parse_args(args, namespace)
        if getattr(ns, "quick", False):
            for key, value in (self.quick or {}).items():
                if getattr(ns, key) == self.get_default(key):
                    setattr(ns, key, value)
            if getattr(ns, "out", None) is not None and ns.out == self.get_default("out"):
                ns.out = None  # a smoke run leaves the results alone
        return ns


def command(argv: list[str] | None = None) -> str:
    """This run's command line, as a report states it: ``python benchmarks/X.py ARGS``."""
    script = os.path.relpath(os.path.abspath(sys.argv[0]), REPO)
    args = sys.argv[1:] if argv is None else argv
    return " ".join(["python", script, *args])


def emit(text: str, out: str | None) -> None:
    """Print ``text`` and, with ``out``, write it there too."""
    print(text)
    if out:
        os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
        with open(out, "w") as f:
            f.write(text + "\n")


# ----------------------------------------------------------------------------- environment

STEADY_MALLOC = {
    # glibc's largest: blocks below it come from the heap
    "MALLOC_MMAP_THRESHOLD_": str(32 * 1024 * 1024),
    # keep freed heap memory instead of giving it back
    "MALLOC_TRIM_THRESHOLD_": str(1024 * 1024 * 1024),
}


def worker_env(**extra: str) -> dict[str, str]:
    """``os.environ`` plus the allocator settings above (unless the caller set its own) and
    ``extra``."""
    env = dict(os.environ)
    for key, value in STEADY_MALLOC.items():
        env.setdefault(key, value)
    env.update(extra)
    return env


def load_example(name: str):
    """The module ``examples/<name>.py`` (imported once, under ``name``)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(EXAMPLES, f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


# ----------------------------------------------------------------------------- launching


def torchrun(nproc: int, script: str, *args: str, standalone: bool = True) -> list[str]:
    """The command line of a torchrun job of ``nproc`` ranks running ``script`` (by path)."""
    exe = os.path.join(os.path.dirname(sys.executable), "torchrun")
    exe = exe if os.path.exists(exe) else "torchrun"
    return [
        exe,
        *(["--standalone"] if standalone else []),
        f"--nproc_per_node={nproc}",
        os.path.abspath(script),
        *args,
    ]


def run_job(name: str, cmd: list[str], env: dict[str, str], timeout: float, result: str) -> Any:
    """Run a benchmark's job (``cmd``, e.g. a torchrun line, in a process group of its own,
    killed whole past ``timeout`` seconds) and return the JSON it wrote to ``result``; exit
    with the job's output on a failure or a timeout."""
    proc = subprocess.Popen(
        cmd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        sys.exit(f"{name}: the job ran past --timeout {timeout} s and was killed\n{output[-3000:]}")
    if proc.returncode != 0:
        sys.exit(f"{name}: the job failed (exit {proc.returncode}):\n{output[-5000:]}")
    with open(result) as f:
        return json.load(f)


def fork_ranks(rank_main, *args: Any, world_size: int = 2) -> list[int]:
    """Fork ``world_size`` ranks that run ``rank_main(rank, port, *args)``, host their
    ``TCPStore`` here (created after the forks, so no rank holds it), wait for them; their exit
    codes (0 where ``rank_main`` returned, 1 where it raised, its traceback printed)."""
    import gc
    import traceback

    import torch.distributed as dist

    read_end, write_end = os.pipe()
    pids = []
    for rank in range(world_size):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                rank_main(rank, int.from_bytes(os.read(read_end, 4), "little"), *args)
                code = 0
            except BaseException:  # noqa: BLE001 - said, then the exit status says it
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    store = dist.TCPStore("127.0.0.1", 0, world_size, True, wait_for_workers=False)
    for _ in pids:
        os.write(write_end, store.port.to_bytes(4, "little"))
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    del store
    gc.collect()
    return codes


def synchronize(device) -> None:
    """Wait for the device's queued work (a no-op on CPU), so a host clock times it."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def init_one_rank_group(device) -> None:
    """A process group of this process alone, on a free loopback port: NCCL for a GPU, Gloo
    for the CPU (sapipe's optimizer runs in a group, even of one rank)."""
    import socket

    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
    )
