"""Layers in forward-execution order, and which layer owns each parameter.

docs/design.md §2: a layer is a module that directly owns parameters; layers are numbered
1..m in the order they first *execute* in forward, and a parameter registered in several
modules (tied weights) belongs to the first of them that runs. The order is recorded by
forward pre-hooks during the first forward pass after construction.

A module compiled with ``torch.compile`` (an ``OptimizedModule``) is named by the module it
compiled (``_orig_mod``): its layers are called ``embed``, ``block.fc1``, … as without
compilation, so checkpoints and traces do not depend on whether the model was compiled.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from sapipe.errors import ConfigurationError


@dataclass
class Layer:
    """One layer: its 0-based position in execution order and the parameters it owns."""

    index: int
    name: str
    module: nn.Module
    params: list[nn.Parameter] = field(default_factory=list)
    executed: bool = True  # False: never ran its own forward (its parent uses its parameters)
    host: nn.Module | None = None  # for those: the executed ancestor whose forward uses them

    @property
    def numel(self) -> int:
        return sum(p.numel() for p in self.params)


def uncompiled(model: nn.Module) -> nn.Module:
    """The module ``torch.compile(module)`` compiled (its ``_orig_mod``), else ``model`` itself."""
    dynamo = sys.modules.get("torch._dynamo.eval_frame")  # imported by torch.compile; not before
    while dynamo is not None and isinstance(model, dynamo.OptimizedModule):
        model = model._orig_mod
    return model


def owning_modules(model: nn.Module, trainable: set[int]) -> list[tuple]:
    """(name, module) of every module that directly registers a trainable parameter (named
    within the module ``torch.compile`` compiled, for a compiled one)."""
    return [
        (name, module)
        for name, module in uncompiled(model).named_modules(remove_duplicate=True)
        if any(id(p) in trainable for p in module.parameters(recurse=False))
    ]


class LayerRecorder:
    """Records the order in which the owning modules first execute during one forward."""

    def __init__(self, model: nn.Module, trainable_params: list[nn.Parameter]):
        self._trainable = {id(p) for p in trainable_params}
        self._owners = owning_modules(model, self._trainable)
        self._seen: dict[int, int] = {}  # id(module) -> execution rank
        self._handles: list = []
        self.compiled = False  # some owning module ran inside a torch.compile'd region

    @property
    def max_layers(self) -> int:
        """An upper bound of m known before any forward: modules owning trainable parameters.

        The exact m can be smaller when a module owns only parameters tied to an earlier
        layer; it is known once the first forward has run.
        """
        return len(self._owners)

    def start(self) -> None:
        for _, module in self._owners:
            self._handles.append(module.register_forward_pre_hook(self._on_pre_forward))

    def _on_pre_forward(self, module: nn.Module, args) -> None:
        if torch.compiler.is_compiling():
            self.compiled = True  # a side effect dynamo replays when the compiled code runs
        self._seen.setdefault(id(module), len(self._seen))

    def _executed_owners(self) -> list[tuple]:
        return sorted(
            (o for o in self._owners if id(o[1]) in self._seen), key=lambda o: self._seen[id(o[1])]
        )

    def executed(self) -> list[str]:
        """Names of the owning modules that have run, in the order they first ran."""
        return [name for name, _ in self._executed_owners()]

    def finish(self, order: Sequence[str] | None = None) -> list[Layer]:
        """Stop recording; layers in execution order (modules that never ran go last).

        ``order``: names of the modules that executed, in order, to use instead of what was
        recorded (restoring a checkpoint's layout before any forward has run).
        """
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if order is not None:
            known = {name for name, _ in self._owners}
            unknown = [name for name in order if name not in known]
            if unknown:
                raise ConfigurationError(
                    f"modules {unknown} of the saved layer order are not layers of this model"
                )
            self._seen = {id(dict(self._owners)[name]): i for i, name in enumerate(order)}
        executed = self._executed_owners()
        # A module that never ran (e.g. nn.MultiheadAttention.out_proj, whose parent calls
        # F.linear on its weight) is used during its nearest executed ancestor's forward:
        # it goes just before that ancestor, so it is updated (and, in the scheduler's
        # model, needed) when the ancestor starts. Without such an ancestor it goes last.
        by_name = dict(executed)
        hosted: dict[str, list[tuple]] = {}
        orphans = []
        for name, module in self._owners:
            if id(module) in self._seen:
                continue
            parts = name.split(".")
            host = next(
                (
                    ".".join(parts[:i])
                    for i in range(len(parts) - 1, 0, -1)
                    if ".".join(parts[:i]) in by_name
                ),
                None,
            )
            if host is None:
                orphans.append((name, module, None))
            else:
                hosted.setdefault(host, []).append((name, module, by_name[host]))
        ordered = []
        for name, module in executed:
            ordered += hosted.get(name, [])
            ordered.append((name, module, None))
        layers: list[Layer] = []
        claimed: set[int] = set()
        for name, module, host in ordered + orphans:
            layer = Layer(len(layers), name, module, executed=id(module) in self._seen, host=host)
            for p in module.parameters(recurse=False):
                if id(p) in self._trainable and id(p) not in claimed:
                    claimed.add(id(p))
                    layer.params.append(p)
            # A module whose parameters all belong to an earlier layer (tied) is no layer.
            if layer.params:
                layers.append(layer)
        return layers
