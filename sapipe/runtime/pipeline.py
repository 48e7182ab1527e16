"""Gradient intake and communication: backward's gradients into buckets, buckets onto the wire.

Every trainable parameter's gradient is copied into its bucket's slot as soon as backward
produces it (by the intake's hooks, sapipe.runtime.intake: in C++ with no Python call per
parameter, or here in :meth:`GradientPipeline.take`); a full bucket starts its all-reduce,
strictly in bucket order, so every rank issues the same collectives in the same sequence
whatever order its hooks fire in. Stale buckets rotate through ``staleness + 1`` slots (a
gradient of iteration t is consumed at t + s while newer ones fill the other slots); sync and
stale traffic run on separate back-end instances, each with process groups of its own
(docs/design.md §5).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch

from sapipe import comm
from sapipe.comm.topology import Topology
from sapipe.config import Settings
from sapipe.errors import UsageError
from sapipe.layout.buckets import Bucket
from sapipe.runtime import unused
from sapipe.runtime.gradients import BucketGradients, GradientBuffers, move_residuals
from sapipe.runtime.intake import Intake, hook_parameters
from sapipe.runtime.layout import Layout
from sapipe.runtime.nonfinite import NonFiniteGradients
from sapipe.schedule.profiler import LayerTimer
from sapipe.tracing.tracer import Tracer

#: Mean elements per parameter from which backward writes a kept local gradient into both
#: ``bucket.local`` and the communication slot (a second copy per parameter, its source still in
#: cache) rather than copying the flat ``local`` into the slot at launch (one call, one more read
#: of the bucket). On the CPU the second copy pays once the read it saves costs more than a
#: copy call's fixed cost, from about 32K elements. On CUDA it never pays: each copy is a
#: kernel launch, and the flat copy's extra read runs at device bandwidth.
MIRROR_LOCAL_MIN_MEAN_NUMEL = 32768


def mirrors_local(bucket: Bucket) -> bool:
    """Whether backward writes a kept local gradient into the communication slot too."""
    return bucket.device.type == "cpu" and bucket.numel >= MIRROR_LOCAL_MIN_MEAN_NUMEL * len(
        bucket.params
    )


class GradientPipeline:
    """Backward's gradients in, all-reduces out, and the waits for them counted.

    Each bucket's gradient side (:class:`sapipe.runtime.gradients.BucketGradients`, made as
    ``buffers`` says) is this object's alone: :meth:`lay_out` builds it for a layout.
    ``before_reuse(bucket)`` is called as a bucket's first gradient of an iteration arrives,
    before its slot is written: a deferred update still reading the slot is applied then.
    ``nonfinite`` judges each gradient as it is launched and counts the non-finite ones as their
    sums are consumed (:mod:`sapipe.runtime.nonfinite`).
    """

    def __init__(
        self,
        settings: Settings,
        group,
        world_size: int,
        tracer: Tracer,
        buffers: GradientBuffers,
        before_reuse: Callable[[Bucket], object],
        topology: Topology | None = None,
        nonfinite: NonFiniteGradients | None = None,
    ):
        self._world_size = world_size
        self._tracer = tracer
        self._buffers = buffers
        self._before_reuse = before_reuse
        self._nonfinite = nonfinite
        self._topology = topology  # hierarchical sums over these nodes (None: flat)
        self.sync_comm = self._new_comm(settings, group, "sync")
        needs_stale = settings.auto or settings.stale_layers > 0
        self.stale_comm = self._new_comm(settings, group, "stale") if needs_stale else None
        self.layout: Layout | None = None  # the current one (lay_out)
        self._gradients: list[BucketGradients] = []  # per bucket of the layout
        #: the hooks backward hands gradients to, and which have arrived (None: not hooked yet)
        self.intake: Intake | None = None
        self._hooked: list[torch.Tensor] = []  # the parameters hooked, in the intake's order
        self._iteration: Callable[[], int] = lambda: 0
        self._backward_began: Callable[[int], None] | None = None
        self._per_gradient = False
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

    def hook(
        self,
        params: Sequence[torch.Tensor],
        on_slow: Callable[[torch.Tensor], None],
        iteration: Callable[[], int],
        backward_began: Callable[[int], None] | None = None,
        per_gradient: bool = False,
    ) -> None:
        """Hook ``params`` for the optimizer's life (sapipe.runtime.intake).

        ``on_slow(param)`` takes a gradient in Python (it calls :meth:`take`); ``iteration()``
        gives the iteration backward's gradients belong to; ``backward_began(iteration)`` is
        called as gradients of an iteration arrive; ``per_gradient``: the caller needs every
        gradient through ``on_slow`` (tracing records each).
        """
        self._hooked = list(params)
        self._iteration = iteration
        self._backward_began = backward_began
        self._per_gradient = per_gradient
        self.intake = hook_parameters(params, on_slow, self._first_of_bucket, self._complete)
        self._lay_out_intake()

    def unhook(self) -> None:
        """Remove the intake's hooks (``close()``); backward then hands sapipe nothing."""
        if self.intake is not None:
            self.intake.remove()

    def _lay_out_intake(self) -> None:
        if self.intake is None:
            return
        bucket_of, position = [-1] * len(self._hooked), [0] * len(self._hooked)
        if self.layout is not None:
            for j, param in enumerate(self._hooked):
                place = self.layout.slot_of.get(id(param))
                if place is not None:
                    bucket_of[j], position[j] = place[0].index, place[1]
        self.intake.lay_out(bucket_of, position, [len(b.params) for b in self.buckets])

    def _first_of_bucket(self, index: int) -> list[list[torch.Tensor]] | None:
        """The intake's call as bucket ``index``'s first gradient of the iteration arrives: the
        views each gradient is copied into (per target), once what still reads the slot is
        applied; None where this bucket's gradients go through :meth:`take` this iteration."""
        if self.timer is not None or self._keeps_taken or self._per_gradient:
            return None  # per-gradient work: the profiler's times, the taken gradients, tracing
        iteration = self._iteration()
        gradients = self._gradients[index]
        if self.encodes_on_intake(gradients, iteration) and any(
            not isinstance(view, torch.Tensor)
            for view in gradients.message_views(self.slot(gradients.bucket, iteration))
        ):
            return None  # a gradient spans messages (SpanningGradient)
        self._begin_bucket(gradients, iteration)
        if self._backward_began is not None:
            self._backward_began(iteration)
        return gradients.intake  # type: ignore[return-value]  # tensors, checked above

    def _begin_bucket(self, gradients: BucketGradients, iteration: int) -> None:
        """A bucket's first gradient of ``iteration`` is here: what still reads its slot is
        applied, and where each gradient goes is set (``gradients.intake``)."""
        self._before_reuse(gradients.bucket)
        gradients.intake = self.intake_views(gradients, iteration)

    def _complete(self, index: int) -> None:
        """The intake's call once bucket ``index`` holds every gradient of the iteration."""
        self._launch_ready(self._iteration())

    def lay_out(self, layout: Layout) -> None:
        """Gradient buffers for ``layout``'s buckets, which become the ones backward fills;
        error-feedback residuals move over from the previous layout's (nothing may be in
        flight)."""
        gradients = [self._buffers.build(bucket) for bucket in layout.buckets]
        if self._gradients and self._buffers.compression is not None:
            move_residuals(self._gradients, gradients)
        self.layout, self._gradients = layout, gradients
        self._lay_out_intake()
        for backend in (self.sync_comm, self.stale_comm):
            if backend is not None:
                backend.new_buffers()

    def check_state_dict(self, bucket: Bucket, state: dict) -> None:
        """Raise, naming why, where a checkpoint's ``state`` of a bucket of the same layers
        cannot be restored into ``bucket`` laid out anew (residuals of another compression)."""
        if self._buffers.compression is not None and state.get("codec") is not None:
            self._buffers.build(bucket).check_state_dict(state)

    def gradients(self, bucket: Bucket) -> BucketGradients:
        """``bucket``'s gradient side (a bucket of the current layout)."""
        return self._gradients[bucket.index]

    @property
    def in_backward(self) -> bool:
        """Some gradient of the current iteration has arrived (backward has begun)."""
        return self.intake is not None and self.intake.any_ready()

    def in_pipeline(self, bucket: Bucket, iteration: int) -> bool:
        """Whether ``bucket``'s gradient of ``iteration`` is stale (consumed ``staleness``
        later)."""
        return bucket.stale and iteration > self.origin

    def slot(self, bucket: Bucket, iteration: int) -> int:
        if not self.in_pipeline(bucket, iteration):
            return 0
        return self._gradients[bucket.index].buffer.index(iteration - self.origin)

    def gradient_targets(self, gradients: BucketGradients, iteration: int) -> list[torch.Tensor]:
        """Where backward's gradient of a bucket goes: its communication slot, or, when this
        rank's own l_t is kept (wp1, wp3), ``local`` — and then also the slot if the bucket's
        parameters are large on average (:func:`mirrors_local`); else :meth:`_launch` copies
        the whole flat ``local`` into the slot in one call."""
        bucket = gradients.bucket
        slot = gradients.buffer.slots[self.slot(bucket, iteration)]
        if self._keeps_local(gradients, iteration):
            return [gradients.local, slot] if mirrors_local(bucket) else [gradients.local]
        return [slot]

    def _keeps_local(self, gradients: BucketGradients, iteration: int) -> bool:
        """Whether this rank's own l_t of a bucket is kept at full precision (wp1, wp3)."""
        return gradients.local is not None and self.in_pipeline(gradients.bucket, iteration)

    def encodes_on_intake(self, gradients: BucketGradients, iteration: int) -> bool:
        """Whether backward writes a bucket's gradients straight into its outgoing compressed
        messages (the codec's ``encodes_on_intake``: fp16/bf16 without error feedback), so that
        stage 1 has no encode left. Where l_t is kept (wp1, wp3), only if backward writes it to
        the slot as well anyway (:func:`mirrors_local`): the messages take the slot's place.
        Else l_t goes to ``local`` alone, and the launch copies it to the slot to be encoded."""
        codec = gradients.buffer.codec
        return (
            codec is not None
            and codec.encodes_on_intake
            and (not self._keeps_local(gradients, iteration) or mirrors_local(gradients.bucket))
        )

    def intake_views(self, gradients: BucketGradients, iteration: int) -> list[list[object]]:
        """Per target of backward's gradients of a bucket, each parameter's place there (a
        view shaped like it, or its pieces across messages): the flat buffers of
        :meth:`gradient_targets`, or the outgoing messages (:meth:`encodes_on_intake`), after
        ``local`` where l_t is kept."""
        bucket = gradients.bucket
        if not self.encodes_on_intake(gradients, iteration):
            return [bucket.param_views(t) for t in self.gradient_targets(gradients, iteration)]
        messages = gradients.message_views(self.slot(bucket, iteration))
        return (
            [bucket.param_views(gradients.local), messages]
            if self._keeps_local(gradients, iteration)
            else [messages]
        )

    def take(self, param: torch.Tensor, iteration: int) -> None:
        """``param.grad`` of ``iteration`` into its bucket; launch what is complete."""
        if torch.is_grad_enabled():  # backward(create_graph=True): record none of this
            with torch.no_grad():
                return self.take(param, iteration)
        assert self.layout is not None
        intake = self.intake
        assert intake is not None
        bucket, i = self.layout.slot_of[id(param)]
        gradients = self._gradients[bucket.index]
        if intake.is_ready(bucket.index, i):
            raise UsageError(
                "a parameter received a second gradient before step(). For gradient "
                "accumulation, run every backward but the last inside `with opt.no_sync():`"
            )
        if intake.num_ready(bucket.index) == 0:  # the bucket's first gradient of this iteration
            self._begin_bucket(gradients, iteration)
        grad = param.grad
        for views in gradients.intake:  # the 2nd read hits cache
            views[i].copy_(grad)
        num_ready = intake.mark(bucket.index, i)
        if self._keeps_taken:
            # a tensor's version counter, bumped by every in-place op: how autograd itself tells a
            # tensor changed; torch has no public equivalent (tests/unit/test_torch_internals.py)
            self._taken.append((param, grad, grad._version))
        if self.timer is not None:
            self.timer.gradient_released(self.layout.layer_of[id(param)])
        if num_ready == len(bucket.params):
            self._launch_ready(iteration)

    def _launch_ready(self, iteration: int) -> None:
        """Start the complete buckets, strictly in index order."""
        all_gradients, intake = self._gradients, self.intake
        assert intake is not None
        while self._next_launch < len(all_gradients):
            gradients = all_gradients[self._next_launch]
            if intake.num_ready(self._next_launch) < len(gradients.bucket.params):
                return
            self._launch(gradients, iteration)
            self._next_launch += 1

    def _launch(self, gradients: BucketGradients, iteration: int) -> None:
        bucket, buffers = gradients.bucket, gradients.buffer
        slot = self.slot(bucket, iteration)
        buffer = buffers.slots[slot]
        pipelined = self.in_pipeline(bucket, iteration)
        if pipelined and gradients.local is not None and not mirrors_local(bucket):
            buffer.copy_(gradients.local)  # backward wrote l_t into local only
        backend = self.stale_comm if pipelined else self.sync_comm
        assert backend is not None
        missing = buffers.unused_here[slot] = self._missing.pop(bucket.index, [])
        unused.write_flags(buffers.flags[slot], missing)  # they travel behind the gradient
        codec = buffers.codec
        encoded = codec is not None and self.encodes_on_intake(gradients, iteration)
        if self._nonfinite is not None:  # so does this rank's verdict on what it sends
            self._nonfinite.launched(
                buffers, slot, codec.intake_values(slot) if encoded else [buffer]
            )
        # Priority: the forward index of the bucket's first layer (needed soonest when lowest).
        what, priority = (f"{bucket.describe()} of iteration {iteration}", bucket.first_layer)
        # the gradient's values arrive as their mean, the flags behind them as their sum
        options = {} if codec is None else {"codec": codec.at(slot, encoded=encoded)}
        buffers.in_flight[slot] = backend.start(
            buffers.wire[slot], what, priority=priority, values=bucket.numel, **options
        )
        if self.timer is not None:
            self.timer.comm_started(bucket.index, bucket.nbytes, buffers.in_flight[slot])

    @torch.no_grad()
    def flush(self, iteration: int) -> None:
        """Start the buckets backward did not complete (parameters without gradients).

        A parameter whose hook did not fire but that holds a gradient (accumulated inside
        ``no_sync()``, or kept by ``zero_grad(set_to_none=False)``) contributes it, as in DDP;
        one with ``p.grad`` None contributes zeros and is flagged unused here (docs/design.md
        §3.9). Starting them here, in index order, keeps the collective sequence identical on
        every rank.
        """
        intake = self.intake
        assert intake is not None
        for gradients in self._gradients[self._next_launch :]:
            bucket = gradients.bucket
            if intake.num_ready(bucket.index) == 0:
                self._before_reuse(bucket)
            targets = self.intake_views(gradients, iteration)
            for i, p in enumerate(bucket.params):
                if not intake.is_ready(bucket.index, i):
                    if p.grad is None:
                        self._missing.setdefault(bucket.index, []).append(i)
                    for views in targets:
                        if p.grad is None:
                            views[i].zero_()
                        else:
                            views[i].copy_(p.grad)
                    intake.mark(bucket.index, i)
        self._launch_ready(iteration)

    def end_iteration(self) -> None:
        """Every bucket empty again, for the next backward."""
        if self.intake is not None:
            self.intake.clear()
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
        buffer = self._gradients[bucket.index].buffer
        handle, buffer.in_flight[slot] = buffer.in_flight[slot], None
        start = self.clock()
        handle.wait()  # averaged in place (the back-end contract), the flags behind it summed
        mean = buffer.slots[slot]
        waited = self.clock() - start
        self.waited += waited
        self.waited_total += waited
        if self._nonfinite is not None:
            self._nonfinite.arrived(bucket, buffer, slot, iteration)  # ranks that sent NaN/inf
        return mean, waited

    def clock(self) -> float:
        """The time; in a profiled iteration on a GPU, once the device caught up
        (:meth:`LayerTimer.now`), so that a wait or an update is timed as the GPU spends it."""
        timer = self.timer
        return timer.now() if timer is not None else time.perf_counter()

    def wait_for_communication(self) -> None:
        """Block until every all-reduce in flight has arrived (each stays pending for its
        consumer)."""
        for gradients in self._gradients:
            for handle in gradients.buffer.in_flight:
                if handle is not None:
                    handle.wait()

    def close(self) -> None:
        """Wait for what is in flight (the last stale all-reduces are never consumed), then
        release the back-ends and their process groups. A wait that fails (a dead peer; each is
        bounded by the groups' timeout) abandons that result but not the rest: everything is
        waited for and released, then the first failure is raised."""
        failure: Exception | None = None
        for gradients in self._gradients:
            in_flight = gradients.buffer.in_flight
            for i, handle in enumerate(in_flight):
                in_flight[i] = None
                try:
                    if handle is not None:
                        handle.wait()
                except Exception as exc:  # noqa: BLE001 - raised below, after the release
                    failure = failure or exc
        for backend in (self.sync_comm, self.stale_comm):
            if backend is not None:
                backend.close()
        if failure is not None:
            raise failure


__all__ = ["MIRROR_LOCAL_MIN_MEAN_NUMEL", "GradientPipeline", "mirrors_local"]
