"""Head slices of stored pages on every KV layout vLLM 0.32 hands a worker.

A snapshot stored by a TP=1 engine restores in each rank of a TP=2 engine,
and the two segments of a TP=2 engine restore in a TP=1 engine, when each
rank copies the byte ranges :func:`sparkcache.sharding.plan_reads` names out
of the stored pages (what :class:`KVPages` gathers: the logical ``[heads,
tokens, content]`` bytes of a block, whatever the physical layout).  Checked
here against plain torch slicing of the heads dimension, for the six
layouts (layer- or block-outermost, heads before or after tokens) and the
CPU backend's ``[blocks, heads, block_size, 2 * head_size]`` tensors.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import numpy as np
import pytest

from sparkcache.sharding import Sharding, copy_heads, plan_reads

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_CUDA = HAS_TORCH and __import__("torch").cuda.is_available()

pytestmark = pytest.mark.skipif(not HAS_TORCH, reason="needs torch (bash scripts/install-vllm.sh)")

LAYERS, BLOCKS, TOKENS, CONTENT = 2, 12, 4, 6
#: KVCacheLayout values: the physical order of the logical axes (L, B, H, N, C).
LAYOUTS = {
    "LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "LHBNC": (0, 2, 1, 3, 4),
    "BLHNC": (1, 0, 2, 3, 4), "BLNHC": (1, 0, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4),
}
IDS = [3, 4, 5, 9, 1]
#: (KV heads, stored tp, engine tp): TP 1 -> 2, 2 -> 1, replicated heads.
PAIRS = [(4, 1, 2), (4, 2, 1), (4, 2, 4), (8, 4, 2), (2, 4, 1), (2, 1, 4)]


def cache(layout: str, heads: int, device: str, fill: Any = None) -> dict[str, Any]:
    """A layer -> ``[B, H, N, C]`` view of one allocation in ``layout``'s physical order."""
    import torch

    logical = (LAYERS, BLOCKS, heads, TOKENS, CONTENT)
    order = LAYOUTS[layout]
    raw = torch.zeros([logical[i] for i in order], dtype=torch.bfloat16, device=device)
    view = raw.permute([order.index(i) for i in range(5)])
    if fill is not None:
        view.copy_(fill)
    return {f"model.layers.{i}.self_attn.attn": view[i] for i in range(LAYERS)}


def restore(stored: list[list[np.ndarray]], s_from: Sharding, s_to: Sharding, rank: int,
            dst_page: int, head_nbytes: int) -> list[np.ndarray]:
    """Engine ``rank``'s pages (per layer) assembled from every stored rank's pages."""
    out = [np.zeros((len(IDS), dst_page), np.uint8) for _ in range(LAYERS)]
    for read in plan_reads(s_from, s_to, rank):
        for layer in range(LAYERS):
            copy_heads(stored[read.src_rank][layer], out[layer], read, head_nbytes)
    return out


def devices() -> list[Any]:
    return ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not HAS_CUDA, reason="needs a CUDA device")])]


@pytest.mark.parametrize("device", devices())
@pytest.mark.parametrize(("heads", "tp_from", "tp_to"), PAIRS)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_snapshot_restores_across_tp_sizes(layout: str, heads: int, tp_from: int,
                                             tp_to: int, device: str) -> None:
    import torch

    from sparkcache.cuda import KVPages

    full = torch.empty((LAYERS, BLOCKS, heads, TOKENS, CONTENT), dtype=torch.bfloat16)
    full.view(torch.uint8).random_(0, 256)
    full = full.to(device)
    s_from, s_to = Sharding(heads, tp_from), Sharding(heads, tp_to)

    def shard(s: Sharding, rank: int) -> Any:
        lo, hi = s.heads_of(rank)
        return full[:, :, lo:hi]

    stored = [KVPages(cache(layout, s_from.local_heads, device, shard(s_from, r))).gather(IDS)
              for r in range(tp_from)]
    head_nbytes = TOKENS * CONTENT * 2
    for rank in range(tp_to):
        engine = KVPages(cache(layout, s_to.local_heads, device))
        pages = restore(stored, s_from, s_to, rank, engine.page_nbytes, head_nbytes)
        engine.scatter(IDS, pages)
        for i, tensor in enumerate(engine.tensors):
            # Bytes, not values: random bf16 bytes hold NaNs.
            want = shard(s_to, rank)[i][IDS].contiguous().view(torch.uint8)
            assert torch.equal(tensor[IDS].contiguous().view(torch.uint8), want), (layout, rank)
            others = [b for b in range(BLOCKS) if b not in IDS]
            assert not tensor[others].view(torch.uint8).any()  # nothing else written


def test_on_cpu_heads_are_the_outer_dimension_of_a_page() -> None:
    """vLLM's CPU backend registers ``[blocks, heads, block_size, 2 * head_size]``
    (K and V halves inside each head's slot, ``cpu_attn.py``): the bytes of
    head ``h`` of a page are one run, ``[h * head_nbytes, (h + 1) * head_nbytes)``."""
    import torch

    from sparkcache.cuda import KVPages

    heads, block_size, head_size = 4, 32, 8
    kv = torch.zeros((BLOCKS, heads, block_size, 2 * head_size), dtype=torch.float32)
    kv[:, 2] = 1.0  # head 2 only
    (pages,) = KVPages({"model.layers.0.self_attn.attn": kv}).gather([0, 1])[:1]
    head_nbytes = block_size * 2 * head_size * 4
    nonzero = np.flatnonzero(pages[0])
    assert nonzero.min() >= 2 * head_nbytes and nonzero.max() < 3 * head_nbytes
