"""sparkcache.cuda.KVPages: block copies over every KV layout vLLM can hand a worker.

vLLM 0.32 gives each layer a logical ``[B, H, N, C]`` view whose strides follow
one of six physical layouts (``vllm.v1.kv_cache_layout.KVCacheLayout``): layer-
or block-outermost, heads before or after tokens.  The tensors here are built
the same way (one physical allocation, permuted to the logical order), and
both paths of the mover - numpy views (CPU, dense pages) and torch copies
(what a GPU runs) - must copy exactly the bytes plain torch indexing sees.

Torch is needed (every test skips without it); the tests marked ``gpu`` also
need a CUDA device (``pytest -m gpu`` selects them, and they skip without one).
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from sparkcache.errors import InvalidArgument

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_CUDA = HAS_TORCH and __import__("torch").cuda.is_available()

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="needs torch (bash scripts/install-vllm.sh)")

LAYERS, BLOCKS, HEADS, TOKENS, CONTENT = 3, 40, 2, 4, 6
#: KVCacheLayout values: the physical order of the logical axes (L, B, H, N, C).
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
#: Runs and scattered ids: one run, a few runs, more runs than MAX_RUNS.
IDS = [list(range(5, 17)), [30, 31, 32, 2, 3, 9], list(range(0, 40, 2))]


def caches(layout: str, dtype: Any = None, device: str = "cpu") -> dict[str, Any]:
    import torch

    logical = (LAYERS, BLOCKS, HEADS, TOKENS, CONTENT)
    order = LAYOUTS[layout]
    raw = torch.empty([logical[i] for i in order], dtype=dtype or torch.bfloat16, device=device)
    raw.view(torch.uint8).random_(0, 256)
    view = raw.permute([order.index(i) for i in range(5)])  # back to logical order
    assert tuple(view.shape) == logical
    # Allocation order is not layer order: KVPages sorts by the layer index.
    return {f"model.layers.{i}.self_attn.attn": view[i] for i in reversed(range(LAYERS))}


def expected(tensor: Any, ids: list[int]) -> np.ndarray:
    """Plain torch indexing: the bytes of blocks ``ids`` in logical page order."""
    import torch

    out: np.ndarray = tensor[ids].contiguous().view(torch.uint8).cpu().numpy()
    return out.reshape(len(ids), -1)


@pytest.mark.parametrize("use_numpy", [True, False], ids=["numpy", "torch"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_gather_and_scatter_match_torch_indexing(layout: str, use_numpy: bool) -> None:
    from sparkcache.cuda import KVPages

    kv = caches(layout)
    pages = KVPages(kv, use_numpy=use_numpy)
    tensors = [kv[name] for name in pages.names]
    assert pages.names == [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    assert (pages.num_blocks, pages.page_nbytes) == (BLOCKS, HEADS * TOKENS * CONTENT * 2)
    rng = np.random.default_rng(1)
    for ids in IDS:
        got = pages.gather(ids)
        for tensor, layer in zip(tensors, got, strict=True):
            np.testing.assert_array_equal(layer, expected(tensor, ids))
        before = [expected(t, list(range(BLOCKS))) for t in tensors]
        new = [rng.integers(0, 256, (len(ids), pages.page_nbytes), np.uint8)
               for _ in tensors]
        pages.scatter(ids, new)
        for tensor, src, old in zip(tensors, new, before, strict=True):
            np.testing.assert_array_equal(expected(tensor, ids), src)
            others = [b for b in range(BLOCKS) if b not in ids]
            np.testing.assert_array_equal(expected(tensor, others), old[others])


def test_both_paths_store_the_same_bytes() -> None:
    """A snapshot written through one path restores through the other."""
    from sparkcache.cuda import KVPages

    for layout in LAYOUTS:
        kv = caches(layout)
        fast, generic = KVPages(kv), KVPages(kv, use_numpy=False)
        for ids in IDS:
            for a, b in zip(fast.gather(ids), generic.gather(ids), strict=True):
                np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["LBHNC", "BLHNC"])
def test_block_views_write_into_exactly_those_blocks(layout: str) -> None:
    from sparkcache.cuda import KVPages
    from sparkcache.segment import Pieces

    dense = KVPages(caches(layout))
    assert "numpy" in dense.where
    ids = [5, 2, 3, 4, 0]  # runs [5], [2, 3, 4], [0], in the order of the pages
    views = dense.block_views(ids)
    assert views is not None and len(views) == LAYERS
    assert sum(v.size for v in views[1]) == len(ids) * dense.page_nbytes
    others = [b for b in range(BLOCKS) if b not in ids]
    before = dense.gather(others)
    layer0 = dense.gather(ids)[0]
    pages = np.arange(len(ids) * dense.page_nbytes, dtype=np.uint64).astype(np.uint8)
    Pieces(views[1]).put(0, pages)
    np.testing.assert_array_equal(dense.gather(ids)[1].reshape(-1), pages)
    np.testing.assert_array_equal(dense.gather(ids)[0], layer0)
    for a, b in zip(before, dense.gather(others), strict=True):
        np.testing.assert_array_equal(a, b)


def test_block_views_only_where_pages_are_host_bytes() -> None:
    from sparkcache.cuda import KVPages

    assert KVPages(caches("LBHNC")).block_views([]) is None
    # Heads before tokens swapped: pages are not dense in logical order.
    assert KVPages(caches("LBNHC")).block_views([0, 1]) is None
    assert KVPages(caches("LBHNC"), use_numpy=False).block_views([0, 1]) is None
    with pytest.raises(InvalidArgument):
        KVPages(caches("LBHNC")).block_views([BLOCKS])


def test_bad_input_is_refused() -> None:
    import torch

    from sparkcache.cuda import KVPages

    pages = KVPages(caches("LBHNC"))
    with pytest.raises(InvalidArgument, match="out of range"):
        pages.gather([BLOCKS])
    with pytest.raises(InvalidArgument, match="out of range"):
        pages.scatter([-1], [np.zeros(pages.page_nbytes, np.uint8)] * LAYERS)
    with pytest.raises(InvalidArgument, match="layers"):
        pages.scatter([0], [np.zeros(pages.page_nbytes, np.uint8)])
    with pytest.raises(InvalidArgument, match="bytes"):
        pages.scatter([0, 1], [np.zeros(pages.page_nbytes, np.uint8)] * LAYERS)
    with pytest.raises(InvalidArgument, match="no KV cache"):
        KVPages({})
    odd = torch.zeros(4, 6, 2).transpose(1, 2)  # innermost dimension strided
    with pytest.raises(InvalidArgument, match="innermost"):
        KVPages({"model.layers.0.attn": odd})
    with pytest.raises(InvalidArgument, match="differ in shape"):
        KVPages({"model.layers.0.attn": torch.zeros(4, 2, 8),
                 "model.layers.1.attn": torch.zeros(5, 2, 8)})


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_cuda_pages_equal_cpu_pages(layout: str) -> None:
    """On a GPU: the same bytes as the CPU path, through pinned host memory."""
    import torch

    from sparkcache.cuda import KVPages

    kv_cpu = caches(layout)
    kv_gpu = {name: t.to("cuda") for name, t in kv_cpu.items()}
    cpu, gpu = KVPages(kv_cpu), KVPages(kv_gpu)
    assert gpu.block_views([0]) is None and "cuda" in gpu.where
    for ids in IDS:
        for a, b in zip(cpu.gather(ids), gpu.gather(ids), strict=True):
            np.testing.assert_array_equal(a, b)
    rng = np.random.default_rng(2)
    staging = torch.empty(LAYERS * len(IDS[2]) * gpu.page_nbytes, dtype=torch.uint8,
                          pin_memory=True).numpy()
    staging[:] = rng.integers(0, 256, staging.size, np.uint8)
    layers = list(staging.reshape(LAYERS, len(IDS[2]), gpu.page_nbytes))
    gpu.scatter(IDS[2], layers)
    cpu.scatter(IDS[2], layers)
    torch.cuda.synchronize()
    for name in gpu.names:
        assert torch.equal(kv_gpu[name].cpu(), kv_cpu[name])
