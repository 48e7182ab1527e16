"""sapipe's partial staleness for users who keep DDP: a communication hook.

    ddp = DistributedDataParallel(model)
    state = sapipe.StaleHook(ddp, stale_layers=4)
    ddp.register_comm_hook(state, sapipe.stale_hook)

A parameter of the first ``stale_layers`` layers is *stale*: the hook hands DDP the previous
iteration's average of its gradient and averages the current one in the background, to be
used one step later (a DDP bucket of stale parameters only returns at once). Every other
parameter is averaged synchronously, as DDP's own all-reduce does. The rule is the optimizer
path's with ``compensation="none"`` (docs/design.md §3.2), with one difference DDP imposes:
DDP's optimizer steps every parameter, so at the first iteration a stale parameter, which has
no average yet, gets zeros (the optimizer path skips that update). With plain SGD the two
agree; with momentum, weight decay or Adam the first stale step differs.

Layers are the modules that directly own parameters, in registration order (a DDP hook sees
no forward, so it cannot record the execution order the optimizer path uses). Staleness is
per parameter, whatever DDP's buckets: a bucket that mixes stale and synchronous parameters
is averaged synchronously and its stale parameters get their previous averages, their
current slices averaged apart for the next iteration. The previous averages are kept per
parameter, because DDP rebuilds its buckets after the first iteration. The state is
checkpointable (:meth:`StaleHook.state_dict`), unlike torch's own hooks' states.

``compression="fp16"`` or ``"bf16"`` (or ``FP16()``, ``BF16()``) sends and sums every bucket
in 16 bits, as DDP's ``fp16_compress_hook`` / ``bf16_compress_hook`` do, stale or not; int8
and error feedback are the optimizer path's (``DistributedOptimizer(compression=...)``).
"""

# no `from __future__ import annotations`: DDP's register_comm_hook checks the hook's
# annotations as objects (dist.GradBucket, torch.futures.Future[torch.Tensor])
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from sapipe.compression.codec import Compression
from sapipe.errors import ConfigurationError, UsageError
from sapipe.layout.layers import owning_modules


class StaleHook:
    """The state of :func:`stale_hook`: which parameters are stale, the averages of their
    last iteration's gradients, and those of the current one in flight."""

    def __init__(
        self,
        ddp: nn.Module,
        stale_layers: int,
        process_group: Any = None,
        compression: str | Compression | None = None,
    ):
        module = getattr(ddp, "module", ddp)
        params = {id(p): p for p in module.parameters() if p.requires_grad}
        layers = owning_modules(module, set(params))
        if not isinstance(stale_layers, int) or not 0 <= stale_layers <= len(layers):
            raise ConfigurationError(
                f"stale_layers must be an int from 0 to the model's {len(layers)} layers "
                f"(modules that directly own trainable parameters); got {stale_layers!r}"
            )
        chosen = Compression.of(compression)
        if chosen is not None and not chosen.casts_on_intake:
            raise ConfigurationError(
                f"StaleHook's compression must be a cast to 16 bits (fp16, bf16, without error "
                f"feedback); got {compression!r} (int8 and error feedback are the optimizer "
                "path's: sapipe.DistributedOptimizer(compression=...))"
            )
        #: the dtype gradients travel and are summed in (None: their own), as DDP's
        #: fp16_compress_hook and bf16_compress_hook send them
        self.wire_dtype = None if chosen is None else chosen.value_dtype
        self.process_group = process_group
        self.world_size = dist.get_world_size(process_group)
        self.stale_layers = stale_layers
        #: id(param) -> its name, for every parameter of the first ``stale_layers`` layers
        self._names: dict[int, str] = {}
        seen: set[int] = set()
        for index, (name, layer) in enumerate(layers):
            for pname, p in layer.named_parameters(recurse=False):
                if id(p) in params and id(p) not in seen:
                    seen.add(id(p))
                    if index < stale_layers:
                        self._names[id(p)] = f"{name}.{pname}" if name else pname
        #: id(param) -> its averaged gradient of the last iteration (None: still in flight)
        self._previous: dict[int, Tensor] = {}
        #: this iteration's launches: (its params, its averaged buffer, the work averaging it)
        self._launched: list[tuple[list[nn.Parameter], Tensor, Any]] = []
        self._waiting: list[tuple[list[nn.Parameter], Tensor, Any]] = []

    def _settle(self) -> None:
        """The last iteration's averages, waited for, as each parameter's previous gradient."""
        for params, averaged, work in self._waiting:
            work.wait()
            offset = 0
            for p in params:
                self._previous[id(p)] = averaged[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
        self._waiting = []

    def _previous_of(self, params: list[nn.Parameter], like: Tensor) -> Tensor:
        """The flat previous averages of ``params`` (zeros where there is none yet)."""
        self._settle()
        out = torch.zeros_like(like)
        offset = 0
        for p in params:
            prev = self._previous.get(id(p))
            if prev is not None:
                out[offset : offset + p.numel()].copy_(prev.reshape(-1))
            offset += p.numel()
        return out

    def _launch(self, params: list[nn.Parameter], buffer: Tensor) -> None:
        """Average a copy of this iteration's ``buffer`` in the background."""
        averaged = self._on_wire(buffer, copy=True)  # DDP reuses its buffer: a copy
        work = dist.all_reduce(averaged, group=self.process_group, async_op=True)
        self._launched.append((params, averaged, work))

    def _on_wire(self, buffer: Tensor, copy: bool = False) -> Tensor:
        """``buffer`` divided by the world size, in the wire's dtype (a new tensor where it
        casts, or where ``copy``; else ``buffer`` itself)."""
        if self.wire_dtype is not None and self.wire_dtype != buffer.dtype:
            return buffer.to(self.wire_dtype).div_(self.world_size)
        return buffer.div(self.world_size) if copy else buffer.div_(self.world_size)

    def _average(self, buffer: Tensor) -> torch.futures.Future[Tensor]:
        """``buffer`` averaged over the ranks in place (through the wire's dtype)."""
        wire = self._on_wire(buffer)
        work = dist.all_reduce(wire, group=self.process_group, async_op=True)

        def arrived(fut: torch.futures.Future) -> Tensor:
            value = fut.value()[0]
            return buffer if value is buffer else buffer.copy_(value)

        return work.get_future().then(arrived)

    def _end_iteration(self) -> None:
        """DDP's last bucket of an iteration: what was launched becomes the next one's
        previous gradients."""
        self._settle()
        self._waiting, self._launched = self._launched, []

    def state_dict(self) -> dict[str, Any]:
        """The averages the next iteration applies, by parameter name (in-flight ones waited
        for); call between ``optimizer.step()`` and the next backward."""
        if self._launched:
            raise UsageError("save the StaleHook's state between step() and the next backward")
        self._settle()
        return {
            "stale_layers": self.stale_layers,
            "previous": {self._names[i]: t.clone() for i, t in self._previous.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` into a fresh job's hook (same ``stale_layers``)."""
        if state["stale_layers"] != self.stale_layers:
            raise ConfigurationError(
                f"the StaleHook state was saved with stale_layers={state['stale_layers']}; "
                f"this one has {self.stale_layers}"
            )
        by_name = {name: i for i, name in self._names.items()}
        self._waiting, self._launched = [], []
        self._previous = {by_name[name]: t.clone() for name, t in state["previous"].items()}


def stale_hook(state: StaleHook, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """DDP communication hook (``ddp.register_comm_hook(state, sapipe.stale_hook)``): a stale
    parameter's gradient is the previous iteration's average, its current one averaged in the
    background; any other parameter's is averaged synchronously, as DDP does. A bucket of
    stale parameters only returns at once; a bucket mixing both (DDP's first iteration puts
    a small model in one bucket) is averaged synchronously, its stale parameters' slices
    then replaced by their previous averages."""
    params = list(bucket.parameters())
    buffer = bucket.buffer()
    stale = [id(p) in state._names for p in params]
    result: torch.futures.Future[torch.Tensor]
    if all(stale):
        result = torch.futures.Future()
        result.set_result(state._previous_of(params, buffer))
        state._launch(params, buffer)
    elif not any(stale):
        result = state._average(buffer)
    else:
        previous = state._previous_of(params, buffer)
        slices, offset = [], 0
        for p, is_stale in zip(params, stale):
            if is_stale:
                slices.append((offset, p.numel()))
            offset += p.numel()
        state._launch(
            [p for p, is_stale in zip(params, stale) if is_stale],
            torch.cat([buffer[lo : lo + n] for lo, n in slices]),
        )

        def mixed(fut: torch.futures.Future) -> torch.Tensor:
            averaged = fut.value()
            for lo, n in slices:
                averaged[lo : lo + n].copy_(previous[lo : lo + n])
            return averaged

        result = state._average(buffer).then(mixed)
    if bucket.is_last():
        state._end_iteration()
    return result


__all__ = ["StaleHook", "stale_hook"]
