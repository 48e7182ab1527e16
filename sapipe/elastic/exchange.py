"""The sum over ranks of the elastic differences d_i = x_i − x̄, started at one sync point and
waited for at the next (or at once, ``overlap=False``): :mod:`sapipe.elastic.averaging` says
what is summed and why nothing needs it sooner.

Two carriers, on a process group of their own (made for the optimizer by
:func:`sapipe.comm.groups.new_group_like`), so the sum never interleaves with the job's own
collectives:

* :class:`FullPrecisionSum` — one ``dist.all_reduce(flat, async_op=True)`` of the differences
  in the parameters' dtype, in place.
* :class:`HalfPrecisionSum` (``compression="bf16"`` / ``"fp16"``) — each rank's differences
  cast to 16 bits (round to nearest even), summed shard by shard in the parameters' dtype:
  an all-to-all hands rank j shard j of every rank's 16-bit differences; rank j adds them up
  in rank order and casts the shard's sum to 16 bits; an all-gather gives every rank every
  shard's 16-bit sum. Each value is rounded exactly twice (a rank's difference, the shard's
  sum), whatever the number of ranks, every rank decodes the same gathered bytes (so the
  centre stays identical on every rank), and the link carries 2(n−1)/n of the 16-bit buffer
  each way, half of what the full-precision all-reduce of float32 carries. The sum itself is
  never taken in 16 bits (a 16-bit ring all-reduce rounds n − 1 partial sums). Gloo's
  all-to-all takes no 16-bit floats, so the messages travel as their bytes. The two
  collectives run one after the other on a thread of this object's own (the second needs the
  first's result), so the whole sum hides behind the period's local steps as the single
  all-reduce does; the thread only waits and casts, with the GIL released in both.

Both are deterministic: every rank starts the same sums in the same order, and Gloo's (and
NCCL's) all-reduce, all-to-all and all-gather hand every rank the same bits.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from sapipe.comm.worker import all_gather_single
from sapipe.rendezvous import failure_named

#: how long :meth:`HalfPrecisionSum.discard` waits for the thread of a sum whose group is gone
DISCARD_JOIN_SECONDS = 5.0
#: ``compression=`` values and the 16-bit type each puts on the wire
HALF_PRECISION: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16}


class FullPrecisionSum:
    """Sums of a flat buffer over the ranks of ``group``, one asynchronous all-reduce each."""

    def __init__(self, group: Any) -> None:
        self.group = group
        self._work: Any = None
        self._flat: torch.Tensor | None = None

    @property
    def in_flight(self) -> bool:
        return self._work is not None

    def start(self, flat: torch.Tensor) -> None:
        """Begin summing ``flat`` in place; it must not be touched until :meth:`wait`."""
        assert self._work is None, "a sum is already in flight"
        self._flat = flat
        self._work = dist.all_reduce(flat, group=self.group, async_op=True)

    def discard(self) -> None:
        """Forget the sum in flight without waiting (its group is gone)."""
        self._work = self._flat = None

    def wait(self, what: str) -> torch.Tensor:
        """Block until the sum started last is done; return it (the flat buffer)."""
        work, flat = self._work, self._flat
        assert work is not None and flat is not None, "no sum in flight"
        self._work = self._flat = None
        with failure_named(what):
            work.wait()
        return flat


class HalfPrecisionSum:
    """Sums of a flat buffer over the ranks of ``group``, 16 bits on the wire (module docstring).

    Buffers are allocated once: ``numel`` values of ``dtype`` (the parameters'), padded to a
    multiple of the world size so every rank sums an equal shard.
    """

    def __init__(
        self,
        group: Any,
        wire_dtype: torch.dtype,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.group = group
        self._n = dist.get_world_size(group)
        self._numel = numel
        self._shard = -(-numel // self._n)  # ceil
        padded = self._shard * self._n
        self._dtype, self._device = dtype, device
        self._send = torch.zeros(padded, dtype=wire_dtype, device=device)
        self._received = torch.empty(padded, dtype=wire_dtype, device=device)
        self._shard_sum = torch.empty(self._shard, dtype=dtype, device=device)
        self._shard_wire = torch.empty(self._shard, dtype=wire_dtype, device=device)
        self._gathered = torch.empty(padded, dtype=wire_dtype, device=device)
        self._result = torch.empty(numel, dtype=dtype, device=device)
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._stream: Any = None

    @property
    def in_flight(self) -> bool:
        return self._thread is not None

    def start(self, flat: torch.Tensor) -> None:
        """Cast ``flat`` to 16 bits into the outgoing buffer and begin the sum on this object's
        thread; ``flat`` itself is free again when this returns."""
        assert self._thread is None, "a sum is already in flight"
        self._send[: self._numel].copy_(flat)  # the cast: round to nearest even
        self._error = None
        cuda = self._device.type == "cuda"
        self._stream = torch.cuda.current_stream(self._device) if cuda else None
        self._thread = threading.Thread(target=self._run, name="sapipe-elastic-sum", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._stream is not None:  # the cast above was queued on the caller's stream
                with torch.cuda.device(self._device), torch.cuda.stream(self._stream):
                    self._sum()
            else:
                self._sum()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self._error = exc

    def _sum(self) -> None:
        as_bytes = torch.uint8
        dist.all_to_all_single(
            self._received.view(as_bytes), self._send.view(as_bytes), group=self.group
        )
        rows = self._received.view(self._n, self._shard)
        self._shard_sum.copy_(rows[0])
        for j in range(1, self._n):  # rank order, in the parameters' dtype
            self._shard_sum.add_(rows[j].to(self._dtype))
        self._shard_wire.copy_(self._shard_sum)  # the second rounding
        all_gather_single(
            self._gathered.view(as_bytes), self._shard_wire.view(as_bytes), group=self.group
        )
        self._result.copy_(self._gathered[: self._numel])

    def discard(self) -> None:
        """Forget the sum in flight (its group is gone: destroying it ends the thread's
        collective). The thread is given :data:`DISCARD_JOIN_SECONDS` to end, so that it is
        not inside a collective when the group's last reference goes; a daemon, it never
        holds up the exit beyond that."""
        thread, self._thread = self._thread, None
        if thread is not None:
            thread.join(DISCARD_JOIN_SECONDS)

    def wait(self, what: str) -> torch.Tensor:
        """Block until the sum started last is done; return it (in the parameters' dtype)."""
        thread = self._thread
        assert thread is not None, "no sum in flight"
        thread.join()  # bounded: each collective fails within the group's timeout
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            with failure_named(what):
                raise error
        return self._result


Exchange = FullPrecisionSum | HalfPrecisionSum


def timed_wait(exchange: Exchange, what: str) -> tuple[torch.Tensor, float]:
    """:meth:`wait` of ``exchange``, and the seconds this thread blocked on it."""
    start = time.perf_counter()
    result = exchange.wait(what)
    return result, time.perf_counter() - start


__all__ = ["HALF_PRECISION", "FullPrecisionSum", "HalfPrecisionSum", "Exchange", "timed_wait"]
