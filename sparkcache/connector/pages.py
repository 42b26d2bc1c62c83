"""Copy whole blocks between vLLM's CPU KV-cache tensors and host buffers.

Each layer's KV cache is viewed once, at registration, as a numpy ``uint8``
array ``[num_blocks, page_nbytes]`` over the tensor's own memory (no copy):
blocks are opaque pages in the engine's layout, whatever its dtype (bf16 and
fp8 have no numpy dtype, bytes always do).  A save gathers ``view[block_ids]``
into fresh host memory; a restore scatters a verified staging buffer into
``view[block_ids]``.

CPU tensors only: on a GPU the same two verbs move pages over PCIe and belong
in :mod:`sparkcache.cuda`.  torch is reached through the tensors' own methods
and ``importlib`` so that this module imports (and type-checks) without it.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from sparkcache.errors import InvalidArgument

__all__ = ["LayerPages", "byte_pages", "ordered_layers"]

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


def byte_pages(tensor: Any) -> np.ndarray:
    """A ``uint8`` numpy view ``[num_blocks, page_nbytes]`` of a CPU KV tensor.

    The tensor may be a strided view into a larger allocation (vLLM puts all
    layers in one buffer); only the innermost dimension must be contiguous.
    """
    if tensor.device.type != "cpu":
        raise InvalidArgument(f"KV cache tensor on {tensor.device}; byte_pages needs a CPU tensor")
    torch = importlib.import_module("torch")
    if tensor.dim() < 2 or tensor.stride(-1) != 1:
        raise InvalidArgument(f"KV cache tensor of shape {tuple(tensor.shape)} and strides "
                              f"{tuple(tensor.stride())} has no contiguous innermost dimension")
    arr: np.ndarray = tensor.detach().view(torch.uint8).numpy()
    page_nbytes = int(np.prod(arr.shape[1:]))
    if not _pages_contiguous(arr):
        raise InvalidArgument(
            f"KV cache pages are not contiguous (shape {arr.shape}, strides {arr.strides}); "
            "this layout needs a per-page gather (not supported yet)"
        )
    # A view over the same memory: rows are blocks (the tensor's block stride),
    # each row one contiguous page.  np.reshape could silently copy instead.
    return np.lib.stride_tricks.as_strided(
        arr, shape=(arr.shape[0], page_nbytes), strides=(arr.strides[0], 1), writeable=True
    )


def _pages_contiguous(arr: np.ndarray) -> bool:
    """True when everything below the block dimension is one dense run of bytes."""
    expected = arr.itemsize
    for dim, stride in zip(reversed(arr.shape[1:]), reversed(arr.strides[1:]), strict=True):
        if dim > 1 and stride != expected:
            return False
        expected *= dim
    return True


class LayerPages:
    """The byte views of every KV layer of one worker, in layer order."""

    def __init__(self, kv_caches: Mapping[str, Any]) -> None:
        layers = ordered_layers(kv_caches)
        if not layers:
            raise InvalidArgument("no KV cache tensors were registered")
        self.names = [name for name, _t in layers]
        self.tensors = [t for _n, t in layers]
        self.views = [byte_pages(t) for t in self.tensors]
        sizes = {v.shape for v in self.views}
        if len(sizes) != 1:
            raise InvalidArgument(f"KV layers differ in shape: {sorted(sizes)}")
        self.num_blocks, self.page_nbytes = self.views[0].shape

    def __len__(self) -> int:
        return len(self.views)

    def _index(self, block_ids: Sequence[int]) -> np.ndarray:
        idx = np.asarray(block_ids, dtype=np.int64)
        if idx.ndim != 1 or (idx.size and (idx.min() < 0 or idx.max() >= self.num_blocks)):
            raise InvalidArgument(f"block ids out of range [0, {self.num_blocks})")
        return idx

    def run_views(self, first: int, count: int) -> list[np.ndarray] | None:
        """Flat writable views of blocks ``[first, first + count)`` of every layer,
        or None when a layer's blocks are not one dense run of bytes (then pages
        go through a staging buffer).  A restore into a fresh run of blocks reads
        straight into the KV cache this way: no staging copy, no scatter."""
        if first < 0 or count <= 0 or first + count > self.num_blocks:
            return None
        runs = [view[first:first + count] for view in self.views]
        if not all(run.flags.c_contiguous for run in runs):
            return None
        return [run.reshape(-1) for run in runs]

    def gather(self, block_ids: Sequence[int]) -> list[np.ndarray]:
        """Copies of the given blocks, one ``[n, page_nbytes]`` array per layer."""
        idx = self._index(block_ids)
        return [np.take(view, idx, axis=0) for view in self.views]

    def scatter(self, block_ids: Sequence[int], pages: Sequence[np.ndarray]) -> None:
        """Write ``pages[layer][i]`` into block ``block_ids[i]`` of every layer."""
        idx = self._index(block_ids)
        if len(pages) != len(self.views):
            raise InvalidArgument(f"{len(pages)} page buffers for {len(self.views)} layers")
        for view, src in zip(self.views, pages, strict=True):
            view[idx] = src.reshape(idx.size, self.page_nbytes)
