"""Agreement between ranks: what each rank checks alone, what all must share, and rank 0's state.

Construction must fail on every rank or on none: a rank that raised while the others went
on into a collective would leave them waiting forever. So each rank validates locally,
keeps its error, compares a fingerprint of its configuration with every other rank, and
only then raises (a difference between ranks first, since it explains a local error too).

The control channel reuses the tensors it hands to its group's collectives (one per kind
and size, kept as long as the channel) rather than allocating one per call and dropping it
after the wait. A Gloo worker thread still holds a finished work, and so its tensors, for a
moment after the wait returns; had the caller dropped its reference by then, the worker's
release would be the last, and if that came once the interpreter had begun finalising, the
worker would need the GIL Python no longer hands out, and the process would abort
(:mod:`sapipe.comm.groups`). ``close()`` destroys the group, joining those threads;
the kept tensors cover agreements made right before exit on a group that is not destroyed
(one over a subset of the world) and bound the allocations of per-step agreements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from sapipe import comm, config
from sapipe.comm import failures
from sapipe.comm.topology import Topology, node_name
from sapipe.errors import (
    CommunicationError,
    ConfigurationError,
    SapipeError,
    UnsupportedOptimizerError,
    UsageError,
)
from sapipe.kernels import ops
from sapipe.layout.layers import LayerRecorder, uncompiled
from sapipe.optim.fused import OptimizerRule
from sapipe.optim.generic import rule_for


def check_locally(
    optimizer: Any, model: Any, arguments: dict[str, Any], wrapper: type
) -> tuple[OptimizerRule, list[nn.Parameter], LayerRecorder, config.Settings]:
    """Everything that can be checked without the other ranks; raises :class:`SapipeError`.

    Returns the optimizer's update rule, the trainable parameters (optimizer order, each
    once), the recorder that will find the layer order, and the validated settings.

    ``model`` may be compiled (``torch.compile(model)``, an ``OptimizedModule``): the hooks on
    it then run outside the compiled graph, and the layers are found and named in the module
    it compiled (``_orig_mod``), as without compilation (docs/design.md §5.8).
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UnsupportedOptimizerError(
            f"optimizer must be a torch.optim.Optimizer instance; got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, wrapper):
        raise ConfigurationError(f"the optimizer is already a sapipe.{wrapper.__name__}")
    if not isinstance(model, nn.Module):
        raise ConfigurationError(f"model must be an nn.Module; got {type(model).__name__}")
    if isinstance(uncompiled(model), nn.parallel.DistributedDataParallel):
        raise ConfigurationError("pass the plain model, not a DistributedDataParallel wrapper")
    rule = rule_for(optimizer)
    params = _trainable_parameters(optimizer, model)
    recorder = LayerRecorder(model, params)
    settings = config.Settings.validate(num_layers=recorder.max_layers, **arguments)
    return rule, params, recorder, settings


def _trainable_parameters(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[nn.Parameter]:
    model_params = {id(p) for p in model.parameters()}
    params: list[nn.Parameter] = []
    seen = set()
    for group_index, group in enumerate(optimizer.param_groups):
        for p in group["params"]:
            if id(p) not in model_params:
                raise ConfigurationError(
                    f"the optimizer's param group {group_index} holds a parameter of shape "
                    f"{tuple(p.shape)} that is not a parameter of the model"
                )
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                params.append(p)
    if not params:
        raise ConfigurationError("the optimizer holds no trainable parameters of the model")
    kinds = {(p.dtype, p.device) for p in params}
    if len(kinds) > 1:
        raise ConfigurationError(
            "all trainable parameters must share one dtype and device; found "
            f"{sorted(map(str, kinds))}"
        )
    return params


def describe_job(optimizer: Any, model: Any) -> dict[str, Any]:
    """What must agree across ranks besides the arguments: the optimizer, the model's parameters
    (which train decides the buckets) and buffers (broadcast from rank 0 at construction), and
    the kernels that will update them (the compiled ones and their PyTorch reference round alike
    only to within float rounding)."""
    try:
        groups = [
            {k: v for k, v in g.items() if k != "params"}
            | {"shapes": [tuple(p.shape) for p in g["params"]]}
            for g in optimizer.param_groups
        ]
    except Exception:  # noqa: BLE001 - a broken optimizer is reported by local validation
        groups = []
    job: dict[str, Any] = {"optimizer": type(optimizer).__name__, "param_groups": groups}
    if isinstance(model, nn.Module):
        module = uncompiled(model)  # compiling is no configuration difference
        parameters = list(module.named_parameters())
        job["model_parameters"] = [
            (name, tuple(p.shape), str(p.dtype), p.requires_grad) for name, p in parameters
        ]
        job["model_buffers"] = [
            (name, tuple(b.shape), str(b.dtype)) for name, b in module.named_buffers()
        ]
        job["kernels"] = sorted({ops.backend(p.device) for _, p in parameters})
    return job


def agree(
    group, arguments: dict[str, Any], optimizer: Any, model: Any, local_error: SapipeError | None
) -> Topology:
    """Compare every rank's configuration (collective); raise on every rank if any differs,
    else raise this rank's ``local_error`` (every rank has one then: they agree). Returns the
    job's topology (which ranks share a node), learnt in the same exchange."""
    backend = arguments.get("backend")
    unavailable = comm.availability(backend) if backend in comm.BACKENDS else None
    if local_error is None and unavailable is not None:
        local_error = ConfigurationError(unavailable)
    job = dict(describe_job(optimizer, model), backend_available=unavailable is None)
    settings = {k: _by_value(v) for k, v in arguments.items()}
    # the format by name, error feedback as it acts, its constants (two sapipe versions' int8
    # blocks)
    settings.update(
        config.compression_identity(arguments.get("compression"), arguments.get("error_feedback"))
    )
    configuration = dict(settings, **job)
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, (config.describe(configuration), node_name()), group=group)
    differences = config.mismatches([fp for fp, _ in gathered])
    if differences:
        differences = _spelt_out(group, configuration, [fp for fp, _ in gathered], differences)
        raise ConfigurationError(
            "ranks were configured differently: " + "; ".join(differences[:10])
        )
    if local_error is not None:
        raise local_error
    return Topology.from_names([name for _, name in gathered])


def _spelt_out(
    group, configuration: dict[str, Any], fingerprints: list[dict[str, str]], differences: list[str]
) -> list[str]:
    """``differences`` with those of hashed items (param groups, the model's parameters)
    replaced by where they first differ: every rank sends those items whole, once, on this
    error path only (collective; every rank takes it, as every rank sees the same
    fingerprints)."""
    reference = fingerprints[0]
    hashed = sorted(
        {
            key
            for fp in fingerprints
            for key, text in fp.items()
            if text != reference.get(key)
            and (text.startswith("sha1:") or str(reference.get(key)).startswith("sha1:"))
        }
    )
    if not hashed:
        return differences
    whole: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(whole, {key: configuration.get(key) for key in hashed}, group=group)
    kept = [line for line in differences if not any(f" has {key}=" in line for key in hashed)]
    spelt = [
        f"rank {rank} has " + config.first_difference(key, items[key], whole[0][key])
        for rank, items in enumerate(whole[1:], start=1)
        for key in hashed
        if repr(items[key]) != repr(whole[0][key])
    ]
    return spelt + kept


def _by_value(value: Any) -> Any:
    """A number as its value (25 and 25.0 configure alike), anything else as it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


@torch.no_grad()
def broadcast_from_first_rank(model: nn.Module, group) -> None:
    """Copy rank 0's parameters and buffers to every rank (one collective per dtype and device)."""
    broadcast_coalesced(list(model.parameters()) + list(model.buffers()), group)


@torch.no_grad()
def broadcast_coalesced(
    tensors: list[torch.Tensor], group, scratch: dict[tuple, torch.Tensor] | None = None
) -> None:
    """Copy rank 0's ``tensors`` to every rank of ``group``, one broadcast per dtype and device.

    With ``scratch``, the flat tensor of each dtype and device is kept there and reused
    (see the module docstring); without, it is allocated for the call."""
    src = dist.get_global_rank(group, 0)
    by_kind: dict[tuple, list[torch.Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for (dtype, device), same in by_kind.items():
        if scratch is None:
            flat = _flatten_dense_tensors([t.detach() for t in same])
        else:
            flat = _scratch(
                scratch, ("broadcast", dtype, device), sum(t.numel() for t in same), dtype, device
            )
            if dist.get_rank() == src:  # the others' flat is overwritten by the broadcast
                torch.cat([t.detach().reshape(-1) for t in same], out=flat)
        dist.broadcast(flat, src=src, group=group)
        if dist.get_rank() != src:  # the source's own tensors hold these values already
            torch._foreach_copy_(same, _unflatten_dense_tensors(flat, same))


def _scratch(
    scratch: dict[tuple, torch.Tensor],
    key: tuple,
    numel: int,
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """``scratch[key]``, a flat tensor of ``numel`` elements, (re)allocated when it has another
    size."""
    flat = scratch.get(key)
    if flat is None or flat.numel() != numel:
        flat = scratch[key] = torch.empty(numel, dtype=dtype, device=device)
    return flat


@contextlib.contextmanager
def failure_named(what: str) -> Iterator[None]:
    """A failed collective outside the back-ends (the control group's, the scheduler's probes)
    raises :class:`CommunicationError` saying what it was (and, for a lost peer, which rank
    failed first and why, where it published that: :mod:`sapipe.comm.failures`). sapipe's own
    errors raised inside pass unchanged."""
    try:
        yield
    except SapipeError:
        raise
    except Exception as exc:  # noqa: BLE001 - re-raised with context
        if not isinstance(exc, (RuntimeError, TimeoutError, OSError)):  # raised on this rank
            raise CommunicationError(f"{what} failed: {exc}") from exc
        head = failures.with_first_failure(f"{what} failed")
        raise failures.symptom(CommunicationError(f"{head}: {exc}")) from exc


class ControlChannel:
    """Small agreements during training (a GradScaler verdict, the scheduler's measurements)
    on a process group of their own, so they never queue behind gradient traffic."""

    def __init__(self, group, timeout, device: torch.device):
        self.group = comm.new_group_like(group, timeout)
        self._device = device if device.type == "cuda" else torch.device("cpu")
        # The tensors handed to the group's collectives, reused (see the module docstring).
        self._scratch: dict[tuple, torch.Tensor] = {}

    def _open_group(self, what: str):
        if (
            self.group is None
        ):  # given group=None, torch would run the collective on the default group
            raise UsageError(f"{what} after close()")
        return self.group

    def agree_on_max(self, values: list[float], what: str) -> list[float]:
        """The maximum over ranks of each of ``values`` (float64); ``what`` names it in errors."""
        return self._all_reduce(values, dist.ReduceOp.MAX, "max", what)

    def agree_on_sum(self, values: list[float], what: str) -> list[float]:
        """The sum over ranks of each of ``values`` (float64); ``what`` names it in errors."""
        return self._all_reduce(values, dist.ReduceOp.SUM, "sum", what)

    def _all_reduce(self, values: list[float], op, name: str, what: str) -> list[float]:
        group = self._open_group(f"agreeing on {what}")
        tensor = _scratch(
            self._scratch, (name, len(values)), len(values), torch.float64, self._device
        )
        tensor.copy_(torch.tensor(values, dtype=torch.float64))
        with failure_named(f"agreeing on {what}"):
            dist.all_reduce(tensor, op=op, group=group)
        return tensor.cpu().tolist()

    def from_first_rank(self, value: Any, what: str) -> Any:
        """Rank 0's ``value`` (a small picklable object) on every rank."""
        group = self._open_group(f"taking rank 0's {what}")
        box = [value]
        with failure_named(f"taking rank 0's {what}"):
            dist.broadcast_object_list(
                box, src=dist.get_global_rank(group, 0), group=group, device=self._device
            )
        return box[0]

    def broadcast(self, tensors: list[torch.Tensor], what: str) -> None:
        """Rank 0's ``tensors`` into every rank's, in place (one collective per dtype and
        device)."""
        group = self._open_group(f"broadcasting {what}")
        with failure_named(f"broadcasting {what}"):
            broadcast_coalesced(tensors, group, self._scratch)

    def close(self) -> None:
        """Destroy the group now, joining its threads (:func:`sapipe.comm.release_group`);
        idempotent."""
        comm.release_group(self)


__all__ = [
    "check_locally",
    "describe_job",
    "agree",
    "broadcast_from_first_rank",
    "broadcast_coalesced",
    "ControlChannel",
    "failure_named",
]
