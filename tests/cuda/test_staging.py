"""Staged restores (sparkcache.cuda.staging): the path a GPU cache takes, run here on
CPU tensors through the same code (the copy stream's events are no-ops on CPU).

A real store, real segments and the worker's own load path: every restored
block holds the published bytes, every other block keeps its poison, for
contiguous and scattered block ids, ranged reads and a chain of two links,
with reader chunks, staging slots, blocks and layers all on different
boundaries, and with slots large enough that chunks are read into them and
checked there (a corrupt one is never uploaded).  A corrupt chunk in the
middle of the pipeline is a failed load (a miss), and the staging pool is
allocated once, whatever the restores.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache import ModelIdentity, SnapshotStore
from sparkcache.connector.jobs import Counters, LoadJob
from sparkcache.connector.worker import WorkerIO
from sparkcache.errors import InvalidArgument
from sparkcache.segment import CHUNK_BYTES

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                                reason="needs torch (bash scripts/install-vllm.sh)")

#: Pages of 5120 bytes: a reader chunk (1 MiB) ends inside a page, a staging
#: slot of 3 pages ends inside a reader chunk, and a layer of BLOCKS pages is
#: no multiple of either.
LAYERS, BLOCKS, HEADS, BS, CONTENT = 3, 340, 4, 16, 40
PAGE = HEADS * BS * CONTENT * 2
N_BLOCKS = 300  # published blocks: 1.5 MB per layer, more than one reader chunk
#: KVCacheLayout values (L, B, H, N, C): a dense one and two strided ones.
LAYOUTS = {"LBHNC": (0, 1, 2, 3, 4), "LBNHC": (0, 1, 3, 2, 4), "BHLNC": (1, 2, 0, 3, 4)}


def ident() -> ModelIdentity:
    return ModelIdentity(model="staged", revision="r1", num_layers=LAYERS, num_kv_heads=HEADS,
                         head_size=CONTENT // 2, dtype="bfloat16", kv_cache_dtype="bfloat16",
                         block_size=BS, page_shape=(HEADS, BS, CONTENT))


def caches(layout: str, seed: int, device: str = "cpu") -> dict[str, Any]:
    """vLLM's per-layer ``[B, H, N, C]`` views of one allocation, poisoned with
    random bytes."""
    import torch

    logical = (LAYERS, BLOCKS, HEADS, BS, CONTENT)
    order = LAYOUTS[layout]
    raw = torch.empty([logical[i] for i in order], dtype=torch.bfloat16)
    gen = torch.Generator().manual_seed(seed)
    raw.view(torch.uint8).random_(0, 256, generator=gen)
    raw = raw.to(device)
    view = raw.permute([order.index(i) for i in range(5)])
    return {f"model.layers.{i}.self_attn.attn": view[i] for i in range(LAYERS)}


def blocks(kv: dict[str, Any], ids: list[int]) -> list[np.ndarray]:
    """Per layer, the bytes of blocks ``ids`` in logical page order (plain torch)."""
    import torch

    return [t[ids].contiguous().view(torch.uint8).cpu().numpy().reshape(len(ids), PAGE)
            for t in kv.values()]


def publish(store: SnapshotStore, tokens: list[int]) -> tuple[int, list[np.ndarray]]:
    """The snapshot of ``tokens`` as a chain of two links (the parent ends mid-layer of
    the child's reads), and its pages ``[N_BLOCKS, PAGE]`` per layer."""
    rng = np.random.default_rng(5)
    pages = [rng.integers(0, 256, (N_BLOCKS, PAGE), np.uint8) for _ in range(LAYERS)]
    half = 110
    parent = store.publish(ident(), 0, tokens[:half * BS], [p[:half] for p in pages])
    child = store.publish(ident(), 0, tokens, [p[half:] for p in pages],
                          parent=parent.snapshot_id)
    assert child.state == "ready"
    return child.snapshot_id, pages


def published_child(store: SnapshotStore, tokens: Any) -> tuple[int, list[np.ndarray], Path,
                                                                  bytearray]:
    """``tokens`` published in ``store`` (:func:`publish`): the snapshot, its
    pages, the file of its segment and that file's bytes."""
    snap, pages = publish(store, [int(t) for t in tokens])
    (child,) = [f for f in store.root.rglob("*.safetensors")
                if f.stat().st_size > 190 * LAYERS * PAGE]
    return snap, pages, child, bytearray(child.read_bytes())


@pytest.fixture(scope="module")
def stored(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("staged")
    tokens = [int(t) for t in np.random.default_rng(3).integers(0, 30000, N_BLOCKS * BS)]
    with SnapshotStore(root / "s") as store:
        snap, pages = publish(store, tokens)
        yield store, snap, pages, np.asarray(tokens, np.uint32)


def job(snap: int, tokens: np.ndarray, ids: list[int], start_block: int = 0) -> LoadJob:
    n = (start_block + len(ids)) * BS
    return LoadJob("r", snap, n, tokens[:n], start_block, (tuple(ids),))


IDS = {
    "contiguous": list(range(20, 20 + N_BLOCKS)),
    "scattered": [int(b) for b in np.random.default_rng(8).permutation(BLOCKS)[:N_BLOCKS]],
    "ranged": list(range(300, 340)) + list(range(0, 100, 5)),  # from block 240: 60 blocks
}


HAS_CUDA = importlib.util.find_spec("torch") is not None and __import__("torch").cuda.is_available()
DEVICES = ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")])]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("kind", sorted(IDS))
def test_staged_restore_writes_exactly_its_blocks(stored: Any, layout: str, kind: str,
                                                  device: str) -> None:
    from sparkcache.cuda import KVPages

    store, snap, pages, tokens = stored
    ids = IDS[kind]
    start = N_BLOCKS - len(ids)
    kv = caches(layout, seed=len(ids), device=device)
    others = [b for b in range(BLOCKS) if b not in set(ids)]
    poison = blocks(kv, others)
    # Slots of 3 pages, 4 of them: far less than a restore, so they are reused.
    kvp = KVPages(kv, use_numpy=False, staging_bytes=12 * PAGE, chunk_bytes=3 * PAGE + 7)
    assert kvp.staging.slot_bytes == 3 * PAGE and CHUNK_BYTES % PAGE
    counters = Counters()
    io = WorkerIO(store, ident(), 0, kvp, counters, load_threads=2)
    try:
        assert io.load_now(job(snap, tokens, ids, start))
    finally:
        io.close()
    assert "loads_direct" not in counters.take()
    for got, want in zip(blocks(kv, ids), pages, strict=True):
        np.testing.assert_array_equal(got, want[start:])
    for got, want in zip(blocks(kv, others), poison, strict=True):
        np.testing.assert_array_equal(got, want)
    assert kvp.staging.allocations == 1


def counted_sinks(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Counts of the chunks landed in a slot's room (``commit``) and copied in (``put``)."""
    from sparkcache.cuda import staging

    counts = {"commit": 0, "put": 0}
    commit, put = staging.LayerSink.commit, staging.LayerSink.put

    def counted_commit(sink: Any, at: int, n: int) -> None:
        counts["commit"] += 1
        commit(sink, at, n)

    def counted_put(sink: Any, at: int, data: np.ndarray) -> None:
        counts["put"] += 1
        put(sink, at, data)

    monkeypatch.setattr(staging.LayerSink, "commit", counted_commit)
    monkeypatch.setattr(staging.LayerSink, "put", counted_put)
    return counts


#: Slots of 400 pages take every link's chunk of a layer whole; slots of 200
#: take the parent's chunk, and the child's (972,800 bytes) no longer fits.
ROOMS = {"every-chunk": (400, {"commit": 2 * LAYERS, "put": 0}),
         "some-chunks": (200, {"commit": LAYERS, "put": LAYERS})}


@pytest.mark.parametrize("rooms", sorted(ROOMS))
def test_chunks_land_in_the_slots_and_are_checked_there(stored: Any, rooms: str,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk copied whole is read straight into the slot (no bounce, no copy)
    where it fits, else copied in: either way the blocks get the published bytes."""
    from sparkcache.cuda import KVPages

    store, snap, pages, tokens = stored
    slot_pages, expected = ROOMS[rooms]
    counts = counted_sinks(monkeypatch)
    kv = caches("LBNHC", seed=6)
    kvp = KVPages(kv, use_numpy=False, staging_bytes=2 * slot_pages * PAGE,
                  chunk_bytes=slot_pages * PAGE)
    ids = IDS["scattered"]
    io = WorkerIO(store, ident(), 0, kvp, Counters(), load_threads=2)
    try:
        assert io.load_now(job(snap, tokens, ids))
    finally:
        io.close()
    assert counts == expected
    for got, want in zip(blocks(kv, ids), pages, strict=True):
        np.testing.assert_array_equal(got, want)


def test_a_corrupt_chunk_in_a_slot_never_reaches_the_cache(
        stored: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Layer 1's child chunk, read straight into the slot, fails its digest: the
    slot is given back without an upload, so layer 1's blocks keep their old
    bytes (neither its verified parent chunk nor the corrupt one); layer 0 landed."""
    import json
    import struct

    from sparkcache.cuda import KVPages

    _store, _snap, _pages, tokens = stored
    with SnapshotStore(tmp_path / "s") as store:
        snap, pages, child, data = published_child(store, tokens)
        (hlen,) = struct.unpack_from("<Q", data, 0)
        lo, _hi = json.loads(bytes(data[8:8 + hlen]))["layer.1"]["data_offsets"]
        data[8 + hlen + lo + 1000] ^= 0xFF
        child.write_bytes(bytes(data))
        counts = counted_sinks(monkeypatch)
        kv = caches("LBNHC", seed=7)
        ids = IDS["contiguous"]
        before = blocks(kv, ids)
        kvp = KVPages(kv, use_numpy=False, staging_bytes=800 * PAGE, chunk_bytes=400 * PAGE)
        io = WorkerIO(store, ident(), 0, kvp, Counters(), load_threads=1)
        try:
            assert not io.load_now(job(snap, tokens, ids))
            assert io.take_failed_blocks() == set(ids)
        finally:
            io.close()
        assert counts == {"commit": 3, "put": 0}  # layer 0's two chunks, layer 1's parent's
        assert kvp.staging.free_slots == kvp.staging.n_slots
        after = blocks(kv, ids)
        np.testing.assert_array_equal(after[0], pages[0])
        for layer in (1, 2):
            np.testing.assert_array_equal(after[layer], before[layer])


def test_in_step_staged_restore_lands_layer_by_layer(stored: Any) -> None:
    """The forward's wait for a layer returns once that layer's uploads are done."""
    from sparkcache.cuda import KVPages

    store, snap, pages, tokens = stored
    kv = caches("LBNHC", seed=1)
    kvp = KVPages(kv, staging_bytes=8 * PAGE, chunk_bytes=PAGE)
    assert "torch" in kvp.where  # heads after tokens: not host-dense pages
    ids = IDS["scattered"]
    io = WorkerIO(store, ident(), 0, kvp, Counters(), load_threads=1)
    try:
        io.start_step_loads([job(snap, tokens, ids)])
        for layer in range(LAYERS):
            io.wait_layer(layer)
            np.testing.assert_array_equal(blocks(kv, ids)[layer], pages[layer])
        io.finish_step_loads(all_layers_waited=True)
        assert io.take_failed_blocks() == set()
    finally:
        io.close()


@pytest.mark.parametrize("in_step", [False, True], ids=["async", "in-step"])
def test_a_corrupt_chunk_mid_pipeline_is_a_miss(stored: Any, tmp_path: Path,
                                                in_step: bool) -> None:
    """Layer 0 uploaded, layer 1's second reader chunk corrupt: the load fails, every
    block is reported failed, every slot is back in the pool."""
    from sparkcache.cuda import KVPages

    _store, _snap, pages, tokens = stored
    with SnapshotStore(tmp_path / "s") as store:
        snap, pages, child, data = published_child(store, tokens)
        layer_bytes = (N_BLOCKS - 110) * PAGE
        at = len(data) - N_BLOCKS * BS * 4 - 2 * layer_bytes + CHUNK_BYTES + 100
        data[at] ^= 0xFF
        child.write_bytes(bytes(data))
        kv = caches("LBNHC", seed=2)
        kvp = KVPages(kv, staging_bytes=4 * PAGE, chunk_bytes=PAGE)
        counters = Counters()
        io = WorkerIO(store, ident(), 0, kvp, counters, load_threads=1)
        ids = IDS["contiguous"]
        try:
            if in_step:
                io.start_step_loads([job(snap, tokens, ids)])
                io.wait_layer(0)  # landed before the failure
                io.wait_layer(None)
                io.finish_step_loads(all_layers_waited=True)
            else:
                assert not io.load_now(job(snap, tokens, ids))
            assert io.take_failed_blocks() == set(ids)
        finally:
            io.close()
        assert counters.take()["load_failures"] == 1
        assert kvp.staging.free_slots == kvp.staging.n_slots  # every slot back
        # Layer 0 had landed (verified bytes in the request's own, failed, blocks).
        np.testing.assert_array_equal(blocks(kv, ids)[0], pages[0])


def test_the_pool_is_allocated_once(stored: Any) -> None:
    from sparkcache.cuda import KVPages

    store, snap, _pages, tokens = stored
    kvp = KVPages(caches("BHLNC", seed=3), staging_bytes=5 * PAGE, chunk_bytes=2 * PAGE)
    assert kvp.staging.allocations == 0  # nothing until the first staged restore
    io = WorkerIO(store, ident(), 0, kvp, Counters(), load_threads=2)
    try:
        for n in (1, 7, 40, N_BLOCKS):
            assert io.load_now(job(snap, tokens, list(range(n))))
    finally:
        io.close()
    assert (kvp.staging.allocations, kvp.staging.n_slots) == (1, 2)
    assert kvp.staging.nbytes == 4 * PAGE


def test_sinks_take_writes_in_order_only() -> None:
    from sparkcache.cuda import KVPages

    kvp = KVPages(caches("LBNHC", seed=4), staging_bytes=4 * PAGE, chunk_bytes=PAGE)
    with kvp.staged([3, 4]) as staged:
        sink = staged.layers[0]
        sink.put(0, np.zeros(PAGE // 2, np.uint8))
        with pytest.raises(InvalidArgument, match="in order"):
            sink.put(PAGE, np.zeros(10, np.uint8))
        with pytest.raises(InvalidArgument, match="exceed"):
            sink.put(PAGE // 2, np.zeros(2 * PAGE, np.uint8))
        with pytest.raises(InvalidArgument, match="not complete"):
            staged.landed(0)
