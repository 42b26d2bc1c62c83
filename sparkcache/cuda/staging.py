"""Restores through reused staging slots, overlapping the disk read with the upload.

A verified read cannot land straight in a GPU's KV cache: it lands in host
memory first.  :class:`StagingPool` holds a few fixed *slots* of host memory
(pinned when the cache is on a GPU), allocated once, at the first staged
restore, and reused by every restore after it.  A restore writes each layer
into a :class:`LayerSink`, which fills one slot at a time with whole pages;
once a slot is full (or the layer complete) its pages are queued for upload on
the copy stream, an event is recorded behind them, and the next verified bytes
go into the next free slot.  A slot is written again only after its event says
the upload that read it is done.  So while the GPU copies chunk *i*, the
reader thread reads and verifies chunk *i + 1*: with two or more slots the
disk read and the bus transfer overlap.

:class:`CopyStream` is the one place that knows about CUDA streams and events.
On a CPU cache it has none: copies are synchronous, events are ``None`` and
every wait returns at once, so the same code runs (and is tested) on CPU
tensors.

Nothing here knows about storage: a sink is any destination with ``size`` and
``put(at, data)`` (:class:`sparkcache.segment.Sink`), written in order from
byte 0, as the verified reader does.  A layer's sink also lends the slot
itself (:class:`sparkcache.segment.Landing`): the reader then reads a chunk
straight into the slot and verifies it there, with no bounce buffer and no
copy into the slot; the slot is staging memory, not the KV cache, and only
committed (verified) bytes are ever uploaded.
"""

from __future__ import annotations

import collections
import contextlib
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from sparkcache.errors import InvalidArgument

__all__ = [
    "DEFAULT_STAGING_BYTES",
    "STAGING_CHUNK_BYTES",
    "CopyStream",
    "LayerSink",
    "StagedRestore",
    "StagingPool",
]

#: Bytes of one staging slot (rounded down to whole pages, at least one page):
#: large enough that one upload runs near the bus's speed, small enough that
#: the first upload starts soon after the read does.
STAGING_CHUNK_BYTES = 4 << 20
#: Host memory of a worker's staging pool (the ``staging_mb`` setting).
DEFAULT_STAGING_BYTES = 64 << 20


class CopyStream:
    """A private CUDA stream and its events; on a CPU device, nothing at all.

    ``fence()`` marks the work queued so far on the caller's stream,
    ``wait(event)`` makes this stream's next copies wait for it, ``record()``
    marks this stream's copies queued so far, ``done(event)`` blocks the host
    until an event's work is complete.  On CPU every event is ``None`` and
    every wait returns at once (a CPU copy is complete when it returns).
    """

    def __init__(self, torch: Any, device: Any) -> None:
        self._torch = torch
        self.device = device
        self.stream = None if device.type == "cpu" else torch.cuda.Stream(device=device)

    def fence(self) -> Any:
        if self.stream is None:
            return None
        event = self._torch.cuda.Event()
        event.record(self._torch.cuda.current_stream(self.device))
        return event

    def wait(self, event: Any) -> None:
        if self.stream is not None and event is not None:
            self.stream.wait_event(event)

    def record(self) -> Any:
        if self.stream is None:
            return None
        event = self._torch.cuda.Event()
        event.record(self.stream)
        return event

    @staticmethod
    def done(event: Any) -> None:
        if event is not None:
            event.synchronize()

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        """Copies queued in the body run on this stream."""
        if self.stream is None:
            yield
            return
        with self._torch.cuda.stream(self.stream):
            yield

    def synchronize(self) -> None:
        if self.stream is not None:
            self.stream.synchronize()


@dataclass
class _Slot:
    host: Any  # torch uint8 tensor, pinned for a GPU cache
    array: np.ndarray  # the same memory, for numpy writes
    event: Any = None  # the upload that last read it


#: ``upload(layer, block_ids, host)``: queue the copy of ``host`` (uint8
#: ``[len(block_ids) * page_nbytes]``) into those blocks of ``layer`` on the
#: copy stream; the caller records the event behind it.
Upload = Callable[[int, np.ndarray, Any], None]


class StagingPool:
    """Fixed host slots shared by every staged restore of one worker.

    ``total_bytes`` (at least two slots) is allocated in one piece at the first
    :meth:`acquire` and never grows: ``allocations`` stays 1.  Thread-safe: a
    writer holds at most one slot at a time and never waits while holding
    one, so concurrent restores cannot deadlock on the pool.
    """

    def __init__(self, torch: Any, stream: CopyStream, page_nbytes: int, *,
                 total_bytes: int = DEFAULT_STAGING_BYTES,
                 chunk_bytes: int = STAGING_CHUNK_BYTES) -> None:
        if page_nbytes <= 0 or total_bytes < 0 or chunk_bytes <= 0:
            raise InvalidArgument("staging needs positive page and chunk sizes")
        self._torch = torch
        self.stream = stream
        self.page_nbytes = page_nbytes
        self.slot_bytes = max(1, chunk_bytes // page_nbytes) * page_nbytes
        self.n_slots = max(2, total_bytes // self.slot_bytes)
        self.allocations = 0
        self._free: collections.deque[_Slot] = collections.deque()
        self._cond = threading.Condition()

    @property
    def nbytes(self) -> int:
        """Host bytes the pool holds once allocated."""
        return self.n_slots * self.slot_bytes

    @property
    def free_slots(self) -> int:
        """Slots no restore holds (all of them between restores)."""
        with self._cond:
            return len(self._free) if self.allocations else self.n_slots

    def _allocate(self) -> None:
        torch = self._torch
        pinned = self.stream.stream is not None
        memory = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=pinned)
        self.allocations += 1
        for i in range(self.n_slots):
            host = memory[i * self.slot_bytes:(i + 1) * self.slot_bytes]
            self._free.append(_Slot(host, host.numpy()))

    def acquire(self) -> _Slot:
        """The slot released longest ago, once the upload that read it is done."""
        with self._cond:
            if not self.allocations:
                self._allocate()
            while not self._free:
                self._cond.wait()
            slot = self._free.popleft()
        self.stream.done(slot.event)
        slot.event = None
        return slot

    def release(self, slot: _Slot, event: Any = None) -> None:
        """Give a slot back; it is reused once ``event`` (its upload) is done."""
        slot.event = event
        with self._cond:
            self._free.append(slot)
            self._cond.notify()


class LayerSink:
    """One layer's destination in a staged restore: ``size`` bytes of pages in
    the order of the restore's block ids, written in order through the pool."""

    __slots__ = ("_restore", "_slot", "_slot_start", "filled", "last_upload", "layer", "size")

    def __init__(self, restore: StagedRestore, layer: int, size: int) -> None:
        self._restore = restore
        self.layer = layer
        self.size = size
        self._slot: _Slot | None = None
        self._slot_start = 0
        self.filled = 0  # bytes written so far
        self.last_upload: Any = None  # the event behind this layer's last upload

    @property
    def complete(self) -> bool:
        return self.filled == self.size

    def _check(self, at: int, n: int) -> None:
        if at != self.filled:
            raise InvalidArgument(f"staged writes of layer {self.layer} must come in order: "
                                  f"{self.filled} bytes written, a write at {at}")
        if at + n > self.size:
            raise InvalidArgument(f"{n} bytes at {at} exceed {self.size} bytes")

    def _room(self) -> tuple[_Slot, int]:
        """The slot being filled (one acquired if none) and the bytes of it used."""
        if self._slot is None:
            self._slot = self._restore.pool.acquire()
            self._slot_start = self.filled
        return self._slot, self.filled - self._slot_start

    def _advance(self, used: int, n: int) -> None:
        """``n`` more bytes are in the slot after its first ``used``: upload it once full
        (or the layer complete)."""
        self.filled += n
        if used + n == self._restore.pool.slot_bytes or self.filled == self.size:
            self._submit()

    def put(self, at: int, data: np.ndarray) -> None:
        """Write ``data`` at byte ``at``: the bytes written so far must end there."""
        self._check(at, data.size)
        done = 0
        while done < data.size:
            slot, used = self._room()
            n = min(data.size - done, self._restore.pool.slot_bytes - used)
            slot.array[used:used + n] = data[done:done + n]
            done += n
            self._advance(used, n)

    def reserve(self, at: int, n: int) -> np.ndarray | None:
        """Scratch room in the slot for bytes ``[at, at + n)`` (``at``: the bytes
        written so far), or None when the slot being filled has less room left:
        a verified read lands a chunk there and checks it in place, and
        :meth:`commit` makes it part of the layer; nothing is uploaded before."""
        self._check(at, n)
        slot, used = self._room()
        if used + n > self._restore.pool.slot_bytes:
            return None
        view: np.ndarray = slot.array[used:used + n]
        return view

    def commit(self, at: int, n: int) -> None:
        """The first ``n`` bytes of the room :meth:`reserve` lent for ``at`` are verified:
        they are the layer's bytes ``[at, at + n)`` (uploaded once the slot is full)."""
        self._check(at, n)
        if self._slot is None or self.filled - self._slot_start + n > self._restore.pool.slot_bytes:
            raise InvalidArgument(f"commit of {n} bytes at {at} without room reserved for them")
        self._advance(self.filled - self._slot_start, n)

    def _submit(self) -> None:
        slot, self._slot = self._slot, None
        assert slot is not None
        restore = self._restore
        page = restore.pool.page_nbytes
        first, end = self._slot_start // page, self.filled // page
        event = None
        try:
            with restore.pool.stream.active():
                restore.upload(self.layer, restore.block_ids[first:end],
                               slot.host[:(end - first) * page])
        finally:
            # Recorded even after a failed upload: whatever was queued must be
            # done before the slot is written again.
            event = restore.pool.stream.record()
            restore.pool.release(slot, event)
        self.last_upload = event

    def drop(self) -> None:
        """Give back a slot still being filled (the restore failed)."""
        slot, self._slot = self._slot, None
        if slot is not None:
            self._restore.pool.release(slot)


class StagedRestore:
    """The sinks of one restore (``layers``, the ``out`` of a verified read) and
    the wait for a layer's uploads (:meth:`landed`).  Use as a context
    manager: leaving it waits for every upload queued, failed or not, and
    gives back the slots."""

    def __init__(self, pool: StagingPool, block_ids: np.ndarray, n_layers: int,
                 upload: Upload) -> None:
        self.pool = pool
        self.block_ids = block_ids
        self.upload = upload
        size = int(block_ids.size) * pool.page_nbytes
        self.layers = [LayerSink(self, i, size) for i in range(n_layers)]

    def landed(self, layer: int) -> None:
        """Block until every page of ``layer`` is in the KV cache (the layer's
        bytes must all have been written)."""
        sink = self.layers[layer]
        if not sink.complete:
            raise InvalidArgument(f"layer {layer} of the restore is not complete "
                                  f"({sink.filled} of {sink.size} bytes)")
        self.pool.stream.done(sink.last_upload)

    def __enter__(self) -> StagedRestore:
        return self

    def __exit__(self, *exc: object) -> None:
        for sink in self.layers:
            sink.drop()
        self.pool.stream.synchronize()
