"""A job's profile as a file: what ``stale_layers="auto"`` measured, kept for offline prediction.

``opt.save_profile(path)`` writes one (JSON) once ``auto`` has decided;
:mod:`sapipe.schedule.predict` reads it to predict the same model at other scales. A
profile holds what the simulator needs (per-layer compute, the optimizer's update cost,
the link as the job measured it) and what it was measured on (ranks, nodes, back-end,
compression, device), so a prediction can say which parts it keeps and which it replaces.

Pure Python, like the simulator: a profile can be read anywhere.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sapipe.errors import ConfigurationError
from sapipe.schedule.solver import LayerProfile

__all__ = ["FORMAT", "SavedProfile"]

#: The ``format`` field of a profile file; a reader refuses any other.
FORMAT = "sapipe-profile/1"


@dataclass(frozen=True)
class SavedProfile:
    """One job's measured profile (times in seconds, per rank; layers in forward order)."""

    layers: tuple[str, ...]  # names, as ``opt.layers`` gives them
    numel: tuple[int, ...]  # parameters per layer
    element_size: int  # bytes per gradient element, as the buckets hold them
    forward: tuple[float, ...]  # u_i
    backward: tuple[float, ...]  # b_i
    step_time: float  # serial compute between backward and the next forward
    update_time: float  # the optimizer's updates per iteration, all layers together
    alpha: float  # seconds per sum of a bucket, as measured (one level, or the two-level sum)
    beta: float  # seconds per byte of gradient, as measured (compression included)
    # σ: compute runs at 1/(1+σ) while the link is busy (fitted by auto's trials; 0 if none)
    slowdown: float
    world_size: int
    nodes: int
    ranks_per_node: int  # of the first node
    hierarchical: bool  # the job summed node first
    backend: str
    compression: str | None
    wire_ratio: float  # bytes on the wire per byte of gradient (1 without compression)
    codec_per_byte: (
        float  # seconds of local (de)compression per byte of a bucket compressed whole (0 without)
    )
    bucket_cap_bytes: int
    sync_at_step: bool  # the script read p.grad before step() (clipping, GradScaler.unscale_)
    device: str  # "cpu" or the GPU's name
    stale_layers: int  # the k auto settled on
    iteration_time: float  # the model's prediction at that k on the profiled job
    #: seconds per byte of the full-precision sum the link probes timed (a compressed job's β mixes
    #: in the codec and what its compressed sums were seen to take); 0: not recorded
    wire_beta: float = 0.0

    # ------------------------------------------------------------------ derived

    @property
    def layer_bytes(self) -> list[int]:
        return [n * self.element_size for n in self.numel]

    @property
    def compute_time(self) -> float:
        """One iteration's compute without communication: forward, backward, step and updates."""
        return (
            math.fsum(self.forward) + math.fsum(self.backward) + self.step_time + self.update_time
        )

    def layer_profiles(self, alpha: float, beta: float) -> list[LayerProfile]:
        """The simulator's per-layer inputs under a link of ``alpha`` + ``beta`` × bytes."""
        return [
            LayerProfile(name, u, b, alpha + beta * nbytes, n)
            for name, u, b, nbytes, n in zip(
                self.layers, self.forward, self.backward, self.layer_bytes, self.numel
            )
        ]

    def check_model(self, layers: Sequence[str], numel: Sequence[int]) -> None:
        """Raise unless ``layers``/``numel`` (a model's, in forward order) are this profile's."""
        if list(layers) == list(self.layers) and list(numel) == list(self.numel):
            return
        if len(layers) != len(self.layers):
            raise ConfigurationError(
                f"the profile is of another model: it has {len(self.layers)} layers, "
                f"the model {len(layers)}"
            )
        for i, (mine, theirs, a, b) in enumerate(zip(self.layers, layers, self.numel, numel)):
            if mine != theirs or a != b:
                raise ConfigurationError(
                    f"the profile is of another model: its layer {i} is {mine!r} "
                    f"({a} parameters), the model's is {theirs!r} ({b} parameters)"
                )

    # ------------------------------------------------------------------ files

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, **dataclasses.asdict(self)}

    def save(self, path: str) -> None:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(self.to_dict(), f, indent=1)

    @classmethod
    def from_dict(cls, data: dict[str, Any], source: str = "the profile") -> SavedProfile:
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            found = data.get("format") if isinstance(data, dict) else type(data).__name__
            raise ConfigurationError(
                f"{source} is not a sapipe profile ({FORMAT!r}); found format {found!r}"
            )
        fields = dataclasses.fields(cls)
        missing = [
            f.name for f in fields if f.name not in data and f.default is dataclasses.MISSING
        ]
        if missing:
            raise ConfigurationError(f"{source} lacks {', '.join(missing)}")
        present = [f.name for f in fields if f.name in data]
        values = {
            name: tuple(data[name]) if isinstance(data[name], list) else data[name]
            for name in present
        }
        profile = cls(**values)
        profile._check(source)
        return profile

    @classmethod
    def load(cls, path: str) -> SavedProfile:
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise ConfigurationError(f"cannot read the profile {path}: {exc}") from exc
        return cls.from_dict(data, path)

    def _check(self, source: str) -> None:
        m = len(self.layers)
        if not (len(self.numel) == len(self.forward) == len(self.backward) == m) or m == 0:
            raise ConfigurationError(
                f"{source} is inconsistent: {m} layers, {len(self.numel)} sizes, "
                f"{len(self.forward)} forward and {len(self.backward)} backward times"
            )
        times = (
            list(self.forward)
            + list(self.backward)
            + [self.step_time, self.update_time, self.alpha, self.beta]
        )
        if any(not math.isfinite(t) or t < 0 for t in times) or self.slowdown < 0:
            raise ConfigurationError(f"{source} holds a negative or non-finite time")
        if not 1 <= self.nodes <= self.world_size or self.ranks_per_node < 1:
            raise ConfigurationError(
                f"{source} is inconsistent: {self.world_size} ranks on {self.nodes} "
                f"node(s) of {self.ranks_per_node}"
            )
