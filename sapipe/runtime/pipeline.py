"""Gradient intake and communication: backward's gradients into buckets, buckets onto the wire.

Every trainable parameter's gradient is copied into its bucket's slot as soon as backward
produces it; a full bucket starts its all-reduce, strictly in bucket order, so every rank
issues the same collectives in the same sequence whatever order its hooks fire in. Stale
buckets rotate through ``staleness + 1`` slots (a gradient of iteration t is consumed at
t + s while newer ones fill the other slots); sync and stale traffic run on separate
back-end instances, each with process groups of its own (docs/design.md §5).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from sapipe import comm
from sapipe.comm.topology import Topology
from sapipe.config import Settings
from sapipe.errors import UsageError
from sapipe.layout.buckets import Bucket
from sapipe.runtime import unused
from sapipe.runtime.layout import Layout
from sapipe.runtime.nonfinite import NonFiniteGradients
from sapipe.schedule.profiler import LayerTimer
from sapipe.tracing.tracer import Tracer

#: Mean elements per parameter from which backward writes a kept local gradient into both
#: ``bucket.local`` and the communication slot (a second copy per parameter, its source still in
#: cache) rather than copying the flat ``local`` into the slot at launch (one call, one more read
#: of the bucket). Measured on this project's CPU models: a torch copy call costs ~4 µs, the
#: read it saves ~0.12 ns per float32 element, so the second copy pays from ~32K elements on.
#: On CUDA it never pays: each copy is a kernel launch, and the flat copy's extra read runs at
#: device bandwidth (ResNet-50 on an H100, wp1 at k = m: +8.8% / +6.3% per step with the
#: per-parameter copies, +0.1% / -6.3% with the flat one; benchmarks/RESULTS.md).
MIRROR_LOCAL_MIN_MEAN_NUMEL = 32768


def mirrors_local(bucket: Bucket) -> bool:
    """Whether backward writes a kept local gradient into the communication slot too."""
    return bucket.device.type == "cpu" and bucket.numel >= MIRROR_LOCAL_MIN_MEAN_NUMEL * len(
        bucket.params
    )


class GradientPipeline:
    """Backward's gradients in, all-reduces out, and the waits for them counted.

    ``before_reuse(bucket)`` is called when a bucket's first gradient of an iteration arrives
    while the bucket still has a deferred update pending (its buffer is about to be reused).
    ``nonfinite`` judges each gradient as it is launched and counts the non-finite ones as their
    sums are consumed (:mod:`sapipe.runtime.nonfinite`).
    """

    def __init__(
        self,
        settings: Settings,
        group,
        world_size: int,
        tracer: Tracer,
        before_reuse: Callable[[Bucket], None],
        topology: Topology | None = None,
        nonfinite: NonFiniteGradients | None = None,
    ):
        self._world_size = world_size
        self._tracer = tracer
        self._before_reuse = before_reuse
        self._nonfinite = nonfinite
        self._topology = topology  # hierarchical sums over these nodes (None: flat)
        self.sync_comm = self._new_comm(settings, group, "sync")
        needs_stale = settings.auto or settings.stale_layers > 0
        self.stale_comm = self._new_comm(settings, group, "stale") if needs_stale else None
        self.layout: Layout | None = None
        self.origin = settings.effective_warmup  # the pipeline starts after this iteration
        self.timer: LayerTimer | None = None  # the scheduler's profiler, while it profiles
        self.waited = 0.0  # seconds this iteration waited for all-reduces so far
        self.waited_total = 0.0  # seconds waited since construction
        self._next_launch = 0
        # With expose_gradients=False: (parameter, its .grad, that tensor's version) as each
        # gradient was taken in, for check_gradients_untouched
        self._keeps_taken = not settings.expose_gradients
        self._taken: list[tuple[torch.Tensor, torch.Tensor, int]] = []
        self._missing: dict[
            int, list[int]
        ] = {}  # bucket index -> parameters flush found without a gradient

    def _new_comm(self, settings: Settings, group, name: str) -> comm.CommBackend:
        request = comm.BackendRequest(
            group,
            name,
            settings.timeout,
            self._tracer,
            partition_bytes=settings.partition_bytes,
            compression=settings.compression,
            topology=self._topology,
        )
        return comm.create(settings.backend, request)

    @property
    def buckets(self) -> list[Bucket]:
        return self.layout.buckets if self.layout is not None else []

    @property
    def in_backward(self) -> bool:
        """Some gradient of the current iteration has arrived (backward has begun)."""
        return any(b.num_ready for b in self.buckets)

    def in_pipeline(self, bucket: Bucket, iteration: int) -> bool:
        """Whether ``bucket``'s gradient of ``iteration`` is stale (consumed ``staleness``
        later)."""
        return bucket.stale and iteration > self.origin

    def slot(self, bucket: Bucket, iteration: int) -> int:
        if not self.in_pipeline(bucket, iteration):
            return 0
        assert bucket.grads is not None
        return bucket.grads.index(iteration - self.origin)

    def gradient_targets(self, bucket: Bucket, iteration: int) -> list[torch.Tensor]:
        """Where backward's gradient of ``bucket`` goes: its communication slot, or, when this
        rank's own l_t is kept (wp1, wp3), ``bucket.local`` — and then also the slot if the
        bucket's parameters are large on average (:func:`mirrors_local`); else :meth:`_launch`
        copies the whole flat ``local`` into the slot in one call."""
        assert bucket.grads is not None
        slot = bucket.grads.slots[self.slot(bucket, iteration)]
        if self._keeps_local(bucket, iteration):
            return [bucket.local, slot] if mirrors_local(bucket) else [bucket.local]
        return [slot]

    def _keeps_local(self, bucket: Bucket, iteration: int) -> bool:
        """Whether this rank's own l_t of ``bucket`` is kept at full precision (wp1, wp3)."""
        return self.in_pipeline(bucket, iteration) and bucket.local is not None

    def encodes_on_intake(self, bucket: Bucket, iteration: int) -> bool:
        """Whether backward writes ``bucket``'s gradients straight into its outgoing compressed
        messages (the codec's ``encodes_on_intake``: fp16/bf16 without error feedback), so that
        stage 1 has no encode left. Where l_t is kept (wp1, wp3), only if backward writes it to
        the slot as well anyway (:func:`mirrors_local`): the messages take the slot's place.
        Else l_t goes to ``local`` alone, and the launch copies it to the slot to be encoded."""
        codec = bucket.grads.codec if bucket.grads is not None else None
        return (
            codec is not None
            and codec.encodes_on_intake
            and (not self._keeps_local(bucket, iteration) or mirrors_local(bucket))
        )

    def intake_views(self, bucket: Bucket, iteration: int) -> list[list[object]]:
        """Per target of backward's gradients of ``bucket``, each parameter's place there (a
        view shaped like it, or its pieces across messages): the flat buffers of
        :meth:`gradient_targets`, or the outgoing messages (:meth:`encodes_on_intake`), after
        ``local`` where l_t is kept."""
        if not self.encodes_on_intake(bucket, iteration):
            return [bucket.param_views(t) for t in self.gradient_targets(bucket, iteration)]
        messages = bucket.message_views(self.slot(bucket, iteration))
        return (
            [bucket.param_views(bucket.local), messages]
            if self._keeps_local(bucket, iteration)
            else [messages]
        )

    def take(self, param: torch.Tensor, iteration: int) -> None:
        """``param.grad`` of ``iteration`` into its bucket; launch what is complete."""
        if torch.is_grad_enabled():  # backward(create_graph=True): record none of this
            with torch.no_grad():
                return self.take(param, iteration)
        assert self.layout is not None
        bucket, i = self.layout.slot_of[id(param)]
        if bucket.ready[i]:
            raise UsageError(
                "a parameter received a second gradient before step(). For gradient "
                "accumulation, run every backward but the last inside `with opt.no_sync():`"
            )
        if bucket.num_ready == 0:  # the bucket's first gradient of this iteration
            if bucket.pending_update is not None:
                self._before_reuse(bucket)
            bucket.intake = self.intake_views(bucket, iteration)
        grad = param.grad
        for views in bucket.intake:  # the 2nd read hits cache
            views[i].copy_(grad)
        bucket.ready[i] = True
        bucket.num_ready += 1
        if self._keeps_taken:
            # a tensor's version counter, bumped by every in-place op: how autograd itself tells a
            # tensor changed; torch has no public equivalent (tests/unit/test_torch_internals.py)
            self._taken.append((param, grad, grad._version))
        if self.timer is not None:
            self.timer.gradient_released(self.layout.layer_of[id(param)])
        if bucket.num_ready == len(bucket.params):
            self._launch_ready(iteration)

    def _launch_ready(self, iteration: int) -> None:
        """Start the complete buckets, strictly in index order."""
        buckets = self.buckets
        while self._next_launch < len(buckets):
            bucket = buckets[self._next_launch]
            if bucket.num_ready < len(bucket.params):
                return
            self._launch(bucket, iteration)
            self._next_launch += 1

    def _launch(self, bucket: Bucket, iteration: int) -> None:
        assert bucket.grads is not None
        slot = self.slot(bucket, iteration)
        buffer = bucket.grads.slots[slot]
        pipelined = self.in_pipeline(bucket, iteration)
        if pipelined and bucket.local is not None and not mirrors_local(bucket):
            buffer.copy_(bucket.local)  # backward wrote l_t into local only
        backend = self.stale_comm if pipelined else self.sync_comm
        assert backend is not None
        missing = bucket.grads.unused_here[slot] = self._missing.pop(bucket.index, [])
        unused.write_flags(bucket.grads.flags[slot], missing)  # they travel behind the gradient
        codec = bucket.grads.codec
        encoded = codec is not None and self.encodes_on_intake(bucket, iteration)
        if self._nonfinite is not None:  # so does this rank's verdict on what it sends
            self._nonfinite.launched(
                bucket.grads, slot, codec.intake_values(slot) if encoded else [buffer]
            )
        # Priority: the forward index of the bucket's first layer (needed soonest when lowest).
        what, priority = f"{bucket.describe()} of iteration {iteration}", bucket.first_layer
        # the gradient's values arrive as their mean, the flags behind them as their sum
        options = {} if codec is None else {"codec": codec.at(slot, encoded=encoded)}
        bucket.grads.in_flight[slot] = backend.start(
            bucket.grads.wire[slot], what, priority=priority, values=bucket.numel, **options
        )
        if self.timer is not None:
            self.timer.comm_started(bucket.index, bucket.nbytes, bucket.grads.in_flight[slot])

    @torch.no_grad()
    def flush(self, iteration: int) -> None:
        """Start the buckets backward did not complete (parameters without gradients).

        A parameter whose hook did not fire but that holds a gradient (accumulated inside
        ``no_sync()``, or kept by ``zero_grad(set_to_none=False)``) contributes it, as in DDP;
        one with ``p.grad`` None contributes zeros and is flagged unused here (docs/design.md
        §3.9). Starting them here, in index order, keeps the collective sequence identical on
        every rank.
        """
        for bucket in self.buckets[self._next_launch :]:
            if bucket.num_ready == 0 and bucket.pending_update is not None:
                self._before_reuse(bucket)
            targets = self.intake_views(bucket, iteration)
            for i, p in enumerate(bucket.params):
                if not bucket.ready[i]:
                    if p.grad is None:
                        self._missing.setdefault(bucket.index, []).append(i)
                    for views in targets:
                        if p.grad is None:
                            views[i].zero_()
                        else:
                            views[i].copy_(p.grad)
                    bucket.ready[i] = True
            bucket.num_ready = len(bucket.params)
        self._launch_ready(iteration)

    def end_iteration(self) -> None:
        """Every bucket empty again, for the next backward."""
        for bucket in self.buckets:
            bucket.ready = [False] * len(bucket.params)
            bucket.num_ready = 0
        self._next_launch = 0
        self._missing.clear()
        self.waited = 0.0
        self._taken.clear()

    def check_gradients_untouched(self) -> None:
        """With ``expose_gradients=False``: raise if a gradient changed after backward handed it
        over (clipping, unscaling, or an assignment to ``p.grad`` between ``backward()`` and
        ``step()``): the change could not reach the update, and applying the gradient as taken
        would silently differ from DDP."""
        for param, grad, version in self._taken:
            if param.grad is not grad or grad._version != version:
                layer = self.layout.layers[self.layout.layer_of[id(param)]]
                raise UsageError(
                    f"the gradient of a parameter of layer {layer.name or '<root>'!r} (shape "
                    f"{tuple(param.shape)}) was changed between backward() and step() "
                    "(clip_grad_norm_, "
                    "clip_grad_value_, GradScaler.unscale_ or an assignment to p.grad). With "
                    "expose_gradients=False p.grad is this rank's own gradient, already sent to "
                    "its "
                    "all-reduce, so the change cannot reach the update; construct the optimizer "
                    "with "
                    "expose_gradients=True (the default) for p.grad to hold the averaged gradient "
                    "step() applies"
                )

    def take_mean(self, bucket: Bucket, slot: int, iteration: int) -> tuple[torch.Tensor, float]:
        """(the gradient of ``iteration`` in ``bucket``'s ``slot`` averaged over the ranks, seconds
        blocked on it); the slot is free after, its flags still counts of ranks."""
        assert bucket.grads is not None
        handle, bucket.grads.in_flight[slot] = bucket.grads.in_flight[slot], None
        start = self.clock()
        handle.wait()  # averaged in place (the back-end contract), the flags behind it summed
        mean = bucket.grads.slots[slot]
        waited = self.clock() - start
        self.waited += waited
        self.waited_total += waited
        if self._nonfinite is not None:
            self._nonfinite.arrived(bucket, slot, iteration)  # how many ranks sent NaN or inf
        return mean, waited

    def clock(self) -> float:
        """The time; in a profiled iteration on a GPU, once the device caught up
        (:meth:`LayerTimer.now`), so that a wait or an update is timed as the GPU spends it."""
        timer = self.timer
        return timer.now() if timer is not None else time.perf_counter()

    def wait_for_communication(self) -> None:
        """Block until every all-reduce in flight has arrived (each stays pending for its
        consumer)."""
        for bucket in self.buckets:
            if bucket.grads is not None:
                for handle in bucket.grads.in_flight:
                    if handle is not None:
                        handle.wait()

    def close(self) -> None:
        """Wait for what is in flight (the last stale all-reduces are never consumed), then
        release the back-ends and their process groups. A wait that fails (a dead peer; each is
        bounded by the groups' timeout) abandons that result but not the rest: everything is
        waited for and released, then the first failure is raised."""
        failure: Exception | None = None
        for bucket in self.buckets:
            if bucket.grads is not None:
                for i, handle in enumerate(bucket.grads.in_flight):
                    bucket.grads.in_flight[i] = None
                    try:
                        if handle is not None:
                            handle.wait()
                    except Exception as exc:  # noqa: BLE001 - raised below, after the release
                        failure = failure or exc
            bucket.pending_update = None
        for backend in (self.sync_comm, self.stale_comm):
            if backend is not None:
                backend.close()
        if failure is not None:
            raise failure


__all__ = ["GradientPipeline", "MIRROR_LOCAL_MIN_MEAN_NUMEL", "mirrors_local"]
