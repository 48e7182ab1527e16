"""One rank of a benchmark job: its device, process groups, barriers and progress events."""

from __future__ import annotations

import datetime as _dt
import json
import os
import sys
from typing import Any

from . import PROGRESS_TAG


class Ctx:
    """Per-job state of one rank."""

    def __init__(self, args):
        import torch
        import torch.distributed as dist

        self.args = args
        self._node_first = None  # node_first_sum(), made on first use
        self.rank = int(os.environ.get("RANK", 0))
        self.world = int(os.environ.get("WORLD_SIZE", 1))
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available()):
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
            self.backend = "nccl"
        else:
            self.device = torch.device("cpu")
            self.backend = "gloo"
            torch.set_num_threads(args.threads)
        timeout = _dt.timedelta(seconds=args.timeout)
        dist.init_process_group(self.backend, timeout=timeout)
        # Control traffic (barriers, gathering results) on its own Gloo group.
        self.ctrl = (
            dist.new_group(backend="gloo", timeout=timeout)
            if self.backend != "gloo"
            else dist.group.WORLD
        )
        # The second group that `ceiling` all-reduces on, created once, in the same order on every
        # rank.
        self.side = dist.new_group(backend=self.backend, timeout=timeout)

    def node_first_sum(self):
        """sapipe's node-first sum (reduce-scatter in the node, all-reduce across nodes,
        all-gather in the node) over the side group, made once (collective on every rank)."""
        if self._node_first is None:
            import torch.distributed as dist

            from sapipe.comm.hierarchical import HierarchicalAllReduce
            from sapipe.comm.topology import Topology, node_name
            from sapipe.tracing.tracer import Tracer

            names = [None] * self.world
            dist.all_gather_object(names, node_name(), group=self.ctrl)
            self._node_first = HierarchicalAllReduce.create(
                self.side, Topology.from_names(names), "ceiling", None, Tracer()
            )
        return self._node_first

    def close(self):
        """Stop what this rank started beside the process groups (the node-first sum's worker)."""
        if self._node_first is not None:
            self._node_first.close()
            self._node_first = None

    def sync(self):
        import torch

        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self):
        import torch.distributed as dist

        dist.barrier(group=self.ctrl)

    def gather(self, obj) -> list:
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.ctrl)
        return out

    def say(self, event: dict[str, Any]):
        """Rank 0: a progress event (machine-readable for the sweep, readable by people)."""
        if self.rank != 0:
            return
        if os.environ.get("SAPIPE_BENCH_PROGRESS"):
            print(PROGRESS_TAG + json.dumps(event), flush=True)
        elif event.get("event") == "mode":
            r = event["result"]
            t = f"{1e3 * r['t']:8.1f} ms" if r.get("t") else "  skipped"
            print(
                f"[{event['model']}] {event['i']:3d}/{event['n']} round "
                f"{event['round']}/{event['rounds']} "
                f"{r['mode']:<14s} {t}  {r.get('note', '')}",
                file=sys.stderr,
                flush=True,
            )
