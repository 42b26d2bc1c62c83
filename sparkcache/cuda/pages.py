"""Copy whole KV blocks between vLLM's KV-cache tensors and host memory.

One :class:`KVPages` per worker holds every KV layer of that worker.  A block
of a layer is an opaque page: the tensor's ``[num_blocks, *page]`` view read
as bytes, page dimensions in the tensor's logical order, whatever the dtype
(bf16 and fp8 have no numpy dtype, bytes always do) and whatever the strides
(vLLM views layers into one shared allocation, layer- or block-major).

The copies are torch operations, so the same code runs on CPU and CUDA
tensors:

* ``gather(block_ids)`` copies blocks out into fresh host memory (pinned when
  the cache is on a GPU), one ``[n, page_nbytes]`` numpy array per layer;
* ``scatter(block_ids, pages)`` writes host pages into the blocks;
* ``staged(block_ids)`` is a restore through the worker's reused staging
  slots (:mod:`sparkcache.cuda.staging`): the verified read fills them chunk
  by chunk while earlier chunks are uploaded, so disk and bus overlap.

Runs of consecutive block ids (the usual case: vLLM hands out free blocks in
order) move as one slice copy each - a memcpy on CPU, one DMA transfer on a
GPU; ids scattered over many runs use one ``index_select`` / ``index_copy_``
per layer.  On a GPU the copies run on a private CUDA stream
(:class:`~sparkcache.cuda.staging.CopyStream`, nothing at all on CPU) that
is synchronized before a call returns, so a caller reports a block copied
(or restored) only once it is.  Nothing here runs on vLLM's forward stream.

On CPU, layers whose pages are dense also expose numpy views over the cache's
own memory: :meth:`KVPages.block_views` lets a verified read land straight in
the KV cache, and scattered ids use numpy's fancy indexing (2-6x faster than
torch's index ops on CPU, measured on this project's 2-core machine).

torch is imported lazily (``importlib``) so that ``import sparkcache`` needs
neither torch nor CUDA and mypy does not follow into torch.
"""

from __future__ import annotations

import contextlib
import importlib
import math
import re
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from sparkcache.cuda.staging import (
    DEFAULT_STAGING_BYTES,
    STAGING_CHUNK_BYTES,
    CopyStream,
    StagedRestore,
    StagingPool,
)
from sparkcache.errors import InvalidArgument

__all__ = ["MAX_RUNS", "KVPages", "block_runs", "byte_pages", "ordered_layers"]

#: Above this many runs of consecutive ids, one indexed copy per layer beats
#: a slice copy per run (each copy has a fixed cost: a kernel launch on a GPU).
MAX_RUNS = 16

_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def _layer_key(name: str) -> tuple[int, str]:
    found = _LAYER_INDEX.findall(f".{name}.")
    return (int(found[-1]) if found else -1, name)


def ordered_layers(kv_caches: Mapping[str, Any]) -> list[tuple[str, Any]]:
    """(name, tensor) in model layer order, each distinct tensor once.

    vLLM names layers ``model.layers.<i>.self_attn.attn``; the index orders
    them (dict order follows allocation, which need not be layer order).
    Layers that share another layer's KV cache (cross-layer sharing) are
    skipped: the shared pages are stored once, under the first name.
    """
    seen: set[tuple[int, int]] = set()
    out: list[tuple[str, Any]] = []
    for name in sorted(kv_caches, key=_layer_key):
        tensor = kv_caches[name]
        key = (int(tensor.data_ptr()), int(tensor.shape[0]))
        if key in seen:
            continue
        seen.add(key)
        out.append((name, tensor))
    return out


def block_runs(idx: np.ndarray) -> list[tuple[int, int, int]]:
    """``(offset, first, count)`` per run of consecutive ids in ``idx``:
    ``idx[offset:offset + count] == range(first, first + count)``."""
    if idx.size == 0:
        return []
    breaks = np.flatnonzero(np.diff(idx) != 1) + 1
    starts = [0, *breaks.tolist()]
    ends = [*breaks.tolist(), int(idx.size)]
    return [(s, int(idx[s]), e - s) for s, e in zip(starts, ends, strict=True)]


def byte_pages(tensor: Any) -> np.ndarray | None:
    """A ``uint8`` numpy view ``[num_blocks, page_nbytes]`` of a CPU KV tensor,
    or None when its pages are not dense runs of bytes in logical order.

    The tensor may be a strided view into a larger allocation (vLLM puts all
    layers in one buffer); each page must be one dense run.
    """
    if tensor.device.type != "cpu" or tensor.dim() < 2 or tensor.stride(-1) != 1:
        return None
    torch = importlib.import_module("torch")
    arr: np.ndarray = tensor.detach().view(torch.uint8).numpy()
    if not _pages_dense(arr):
        return None
    page_nbytes = math.prod(arr.shape[1:])
    # A view over the same memory: rows are blocks (the tensor's block stride),
    # each row one contiguous page.  np.reshape could silently copy instead.
    return np.lib.stride_tricks.as_strided(
        arr, shape=(arr.shape[0], page_nbytes), strides=(arr.strides[0], 1), writeable=True
    )


def _pages_dense(arr: np.ndarray) -> bool:
    """True when everything below the block dimension is one dense run of bytes."""
    expected = arr.itemsize
    for dim, stride in zip(reversed(arr.shape[1:]), reversed(arr.strides[1:]), strict=True):
        if dim > 1 and stride != expected:
            return False
        expected *= dim
    return True


class KVPages:
    """Every KV layer of one worker, with block copies in and out (module docstring).

    ``use_numpy=False`` forces the torch path on CPU tensors (what a GPU runs),
    for tests and measurements.  ``staging_bytes`` sizes the staging pool of
    :meth:`staged` (allocated at the first staged restore, then reused) and
    ``chunk_bytes`` its slots (whole pages, at least one).
    """

    def __init__(self, kv_caches: Mapping[str, Any], *, use_numpy: bool = True,
                 staging_bytes: int = DEFAULT_STAGING_BYTES,
                 chunk_bytes: int = STAGING_CHUNK_BYTES) -> None:
        self._torch = torch = importlib.import_module("torch")
        layers = ordered_layers(kv_caches)
        if not layers:
            raise InvalidArgument("no KV cache tensors were registered")
        self.names = [name for name, _t in layers]
        self.tensors = [t for _n, t in layers]
        devices = {str(t.device) for t in self.tensors}
        if len(devices) != 1:
            raise InvalidArgument(f"KV layers on several devices: {sorted(devices)}")
        self.device = self.tensors[0].device
        for name, t in layers:
            if t.dim() < 2 or t.stride(-1) != 1:
                raise InvalidArgument(
                    f"KV cache {name} of shape {tuple(t.shape)} and strides {tuple(t.stride())} "
                    "has no contiguous innermost dimension; its pages cannot be read as bytes"
                )
        self.views = [t.detach().view(torch.uint8) for t in self.tensors]
        shapes = {tuple(v.shape) for v in self.views}
        if len(shapes) != 1:
            raise InvalidArgument(f"KV layers differ in shape: {sorted(shapes)}")
        self.num_blocks = int(self.views[0].shape[0])
        self.page_dims = tuple(int(d) for d in self.views[0].shape[1:])
        self.page_nbytes = math.prod(self.page_dims)
        self.on_cpu = self.device.type == "cpu"
        self._np: list[np.ndarray] | None = None
        if self.on_cpu and use_numpy:
            arrays = [byte_pages(t) for t in self.tensors]
            dense = [a for a in arrays if a is not None]
            self._np = dense if len(dense) == len(arrays) else None
        # Saves (gather) and scatters on one stream, staged restores on their own:
        # a save's wait for the forward's fence never holds a restore's uploads.
        self.copies = CopyStream(torch, self.device)
        self.staging = StagingPool(torch, CopyStream(torch, self.device), self.page_nbytes,
                                   total_bytes=staging_bytes, chunk_bytes=chunk_bytes)

    def __len__(self) -> int:
        return len(self.views)

    @property
    def where(self) -> str:
        """How pages move, for the log: device and path."""
        path = "numpy views" if self._np is not None else "torch copies"
        return f"{self.device} ({path})"

    # -- helpers ------------------------------------------------------------------

    def _index(self, block_ids: Sequence[int]) -> np.ndarray:
        idx = np.asarray(block_ids, dtype=np.int64)
        if idx.ndim != 1 or (idx.size and (idx.min() < 0 or idx.max() >= self.num_blocks)):
            raise InvalidArgument(f"block ids out of range [0, {self.num_blocks})")
        return idx

    @contextlib.contextmanager
    def _copies(self, after: Any = None) -> Iterator[None]:
        """Run the body's copies on the private stream (after the ``after`` fence);
        wait for them on exit."""
        self.copies.wait(after)
        with self.copies.active():
            yield
        self.copies.synchronize()

    def fence(self) -> Any:
        """An alias of the work queued so far on the caller's CUDA stream (None on
        CPU, where the forward is done when it returns).  ``gather(after=fence)``
        from another thread then copies what that work wrote, not older bytes."""
        return self.copies.fence()

    def _device_index(self, idx: np.ndarray) -> Any:
        index = self._torch.from_numpy(idx)
        if self.on_cpu:
            return index
        # Pinned, so the copy queues on the stream instead of waiting for it.
        return index.pin_memory().to(self.device, non_blocking=True)

    def _upload(self, layer: int, idx: np.ndarray, host: Any) -> None:
        """Queue the copy of ``host`` (``[n, *page_dims]`` or its flat bytes) into
        blocks ``idx`` of ``layer`` on the current stream."""
        n = int(idx.size)
        host = host.view(n, *self.page_dims)
        view = self.views[layer]
        runs = block_runs(idx)
        if len(runs) <= MAX_RUNS:
            for at, first, count in runs:
                view[first:first + count].copy_(host[at:at + count], non_blocking=True)
        else:
            view.index_copy_(0, self._device_index(idx),
                             host.to(self.device, non_blocking=True))

    # -- the two verbs --------------------------------------------------------------

    def block_views(self, block_ids: Sequence[int]) -> list[list[np.ndarray]] | None:
        """Per layer, flat writable views of the cache's own memory holding
        ``block_ids`` in order: one view per run of consecutive ids.  None when
        the pages are not dense host bytes (a GPU cache, or a block-major
        layout: then pages go through a staging buffer and :meth:`scatter`).
        A restore writes through them straight into the KV cache (as
        :class:`~sparkcache.segment.Pieces`): no staging copy, no scatter,
        whether vLLM handed out consecutive blocks or not."""
        if self._np is None or not block_ids:
            return None
        runs = block_runs(self._index(block_ids))
        out: list[list[np.ndarray]] = []
        for view in self._np:
            pieces: list[np.ndarray] = []
            for _at, first, count in runs:
                run = view[first:first + count]
                if run.flags.c_contiguous:
                    pieces.append(run.reshape(-1))  # a view: the run is one span of bytes
                else:  # block-major: each page is dense, consecutive pages are not
                    pieces.extend(run)
            out.append(pieces)
        return out

    def gather(self, block_ids: Sequence[int], after: Any = None) -> list[np.ndarray]:
        """Copies of the given blocks, one ``[n, page_nbytes]`` array per layer
        (once the work before the ``after`` fence is done)."""
        idx = self._index(block_ids)
        runs = block_runs(idx)
        if self._np is not None and len(runs) > 1:
            return [np.take(view, idx, axis=0) for view in self._np]
        torch = self._torch
        n = int(idx.size)
        out = torch.empty((len(self.views), n, *self.page_dims), dtype=torch.uint8,
                          pin_memory=not self.on_cpu)
        with self._copies(after):
            if len(runs) <= MAX_RUNS:
                for layer, view in enumerate(self.views):
                    for at, first, count in runs:
                        out[layer, at:at + count].copy_(view[first:first + count],
                                                        non_blocking=True)
            else:
                dev_idx = self._device_index(idx)
                for layer, view in enumerate(self.views):
                    out[layer].copy_(view.index_select(0, dev_idx), non_blocking=True)
        host: np.ndarray = out.numpy()
        return list(host.reshape(len(self.views), n, self.page_nbytes))

    def scatter(self, block_ids: Sequence[int], pages: Sequence[np.ndarray]) -> None:
        """Write ``pages[layer][i]`` (``page_nbytes`` bytes) into block ``block_ids[i]``
        of every layer."""
        if len(pages) != len(self.views):
            raise InvalidArgument(f"{len(pages)} page buffers for {len(self.views)} layers")
        idx = self._index(block_ids)
        n = int(idx.size)
        for src in pages:
            if src.nbytes != n * self.page_nbytes:
                raise InvalidArgument(f"a page buffer of {src.nbytes} bytes for {n} blocks of "
                                      f"{self.page_nbytes} bytes")
        runs = block_runs(idx)
        if self._np is not None and len(runs) > 1:
            for layer, src in enumerate(pages):
                self._np[layer][idx] = src.reshape(n, self.page_nbytes)
            return
        with self._copies():
            for layer, src in enumerate(pages):
                host = self._torch.from_numpy(np.ascontiguousarray(src).reshape(-1))
                self._upload(layer, idx, host)

    def staged(self, block_ids: Sequence[int]) -> StagedRestore:
        """A restore into ``block_ids`` through the staging pool: pass its
        ``layers`` as the destinations of a verified read, call
        ``landed(layer)`` before using a layer, and leave the ``with`` block
        (which waits for every queued upload) before reporting the restore.
        Verified bytes reach the cache chunk by chunk, each chunk's upload
        overlapping the read of the next; a failed read leaves some of the
        blocks written with verified bytes: report them failed."""
        return StagedRestore(self.staging, self._index(block_ids), len(self.views),
                             self._upload)
