"""Snapshots restored across TP sizes: each engine rank reads the heads it needs
from whichever stored ranks hold them, every chunk verified."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sparkcache import CorruptSnapshot, ModelIdentity, SnapshotStore
from sparkcache.core import Core, Match
from sparkcache.reshard import HeadSink, read_resharded, siblings
from sparkcache.sharding import HeadRead, ShardingRefused, copy_heads

HEADS, LAYERS, BS, HEAD_ELEMS = 4, 2, 32, 32 * 8  # one head's page: 32 tokens x 8 floats
N_BLOCKS = 5


def ident(tp: int, **kw: object) -> ModelIdentity:
    local = max(1, HEADS // tp)
    args: dict[str, object] = {
        "model": "tiny", "revision": "r", "num_layers": LAYERS, "num_kv_heads": local,
        "head_size": 4, "dtype": "float32", "kv_cache_dtype": "float32", "block_size": BS,
        "page_shape": (local, BS, 8), "tp_size": tp, **kw}
    return ModelIdentity(**args)  # type: ignore[arg-type]


def full_kv(seed: int = 0) -> np.ndarray:
    """The whole model's KV: [layers, blocks, heads, one head's page bytes]."""
    rng = np.random.default_rng(seed)
    return rng.integers(0, 256, (LAYERS, N_BLOCKS, HEADS, HEAD_ELEMS * 4), dtype=np.uint8)


def rank_pages(kv: np.ndarray, tp: int, rank: int) -> list[np.ndarray]:
    lo, hi = ident(tp).sharding(HEADS).heads_of(rank)
    return [kv[layer][:, lo:hi].reshape(N_BLOCKS, -1).copy() for layer in range(LAYERS)]


def publish(store: SnapshotStore, tp: int, kv: np.ndarray, tokens: list[int]) -> None:
    for rank in range(tp):
        store.publish(ident(tp), rank, tokens, rank_pages(kv, tp, rank))


TOKENS = list(range(100, 100 + N_BLOCKS * BS))


def read_pages(core: Core, match: Match, engine: ModelIdentity, rank: int) -> list[np.ndarray]:
    """Engine rank ``rank``'s pages of the whole match, in fresh arrays."""
    out = [np.zeros((N_BLOCKS, engine.page_nbytes), np.uint8) for _ in range(LAYERS)]
    read_resharded(core, match, engine, rank, HEADS, [[layer.reshape(-1)] for layer in out])
    return out


@pytest.mark.parametrize(("tp_from", "tp_to"), [(2, 1), (1, 2), (1, 4), (4, 2), (2, 4)])
def test_a_snapshot_restores_in_an_engine_of_another_tp_size(
        tmp_path: Path, tp_from: int, tp_to: int) -> None:
    store = SnapshotStore(tmp_path / "s")
    kv = full_kv()
    publish(store, tp_from, kv, TOKENS)
    engine = ident(tp_to)
    assert store.lookup(engine, TOKENS) is None  # its own sharding has nothing
    (other,) = siblings(store._core, engine, HEADS)
    assert other == ident(tp_from)
    match = store.lookup(other, TOKENS)
    assert match is not None and match.n_tokens == len(TOKENS)
    for rank in range(tp_to):
        pages = read_pages(store._core, match, engine, rank)
        for got, want in zip(pages, rank_pages(kv, tp_to, rank), strict=True):
            np.testing.assert_array_equal(got, want)
        # Straight into the engine's pages: blocks 1.. in two runs (3, then 1 apart).
        cache = np.zeros((LAYERS, N_BLOCKS + 3, engine.page_nbytes), np.uint8)
        runs = [(2, 5), (6, 7)]
        out = [[cache[i, a:b].reshape(-1) for a, b in runs] for i in range(LAYERS)]
        read_resharded(store._core, match, engine, rank, HEADS, out, start_tokens=BS)
        for i, want in enumerate(rank_pages(kv, tp_to, rank)):
            np.testing.assert_array_equal(cache[i, [2, 3, 4, 6]], want[1:])
            assert not cache[i, [0, 1, 5, 7]].any()  # nothing written beside the runs


@pytest.mark.parametrize("cut", [1, 7, 1000, 4096, 5000])
def test_a_head_sink_keeps_its_heads_of_pages_cut_anywhere(cut: int) -> None:
    """Writes cut at any byte (a verified chunk is no whole number of pages)
    land as a copy of whole pages would."""
    head, src_heads, n = 1024, 4, 6
    stored = np.random.default_rng(cut).integers(0, 256, (n, src_heads * head), np.uint8)
    reads = [HeadRead(0, 1, 0, 2), HeadRead(0, 3, 2, 1)]  # heads 1-2 and 3 of 4
    want = np.zeros((n, 3 * head), np.uint8)
    for read in reads:
        copy_heads(stored, want, read, head)
    got = np.zeros((n + 1, 3 * head), np.uint8)
    sink = HeadSink([got[0:2].reshape(-1), got[3:].reshape(-1)],
                    [r.byte_range(head) for r in reads], src_heads * head, 3 * head)
    assert sink.size == stored.size
    flat = stored.reshape(-1)
    for at in range(0, flat.size, cut):
        sink.put(at, flat[at:at + cut])
    np.testing.assert_array_equal(got[[0, 1, 3, 4, 5, 6]], want)
    assert not got[2].any()


def test_a_flipped_byte_is_refused_before_any_head_reaches_the_pages(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s")
    publish(store, 1, full_kv(), TOKENS)
    (path,) = (tmp_path / "s").glob("objects/**/*.r0.safetensors")
    data = bytearray(path.read_bytes())
    data[-100] ^= 1  # the last chunk of the last layer
    path.write_bytes(bytes(data))
    match = store.lookup(ident(1), TOKENS)
    assert match is not None
    cache = np.zeros((LAYERS, N_BLOCKS, ident(2).page_nbytes), np.uint8)
    with pytest.raises(CorruptSnapshot):
        read_resharded(store._core, match, ident(2), 1, HEADS,
                            [[cache[i].reshape(-1)] for i in range(LAYERS)])
    assert not cache[-1].any()  # the damaged layer's chunk: nothing of it written
    assert store.lookup(ident(1), TOKENS) is None


def test_a_flipped_byte_in_one_stored_rank_is_a_corrupt_snapshot(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s")
    publish(store, 2, full_kv(), TOKENS)
    (path,) = (tmp_path / "s").glob("objects/**/*.r1.safetensors")
    data = bytearray(path.read_bytes())
    data[8 + int.from_bytes(data[:8], "little") + 100] ^= 1
    path.write_bytes(bytes(data))
    match = store.lookup(ident(2), TOKENS)
    assert match is not None
    with pytest.raises(CorruptSnapshot):
        read_pages(store._core, match, ident(1), 0)
    assert store.lookup(ident(2), TOKENS) is None  # quarantined: never offered again


def test_other_kv_and_sliding_windows_are_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s")
    publish(store, 2, full_kv(), TOKENS)
    match = store.lookup(ident(2), TOKENS)
    assert match is not None
    with pytest.raises(ShardingRefused, match="other KV"):
        read_pages(store._core, match, ident(1, revision="r2"), 0)
    assert siblings(store._core, ident(1, revision="r2"), HEADS) == []
    windowed = ident(1, extra=(("window_blocks", "1,0"),))
    with pytest.raises(ShardingRefused):
        read_pages(store._core, match, windowed, 0)



def test_a_cross_tp_restore_counts_one_hit(tmp_path: Path) -> None:
    """A TP 2 -> 1 restore reads both stored ranks but is one hit (none with
    hit=False, a restore's first part); its restored amounts count either way."""
    store = SnapshotStore(tmp_path / "s")
    kv = full_kv()
    publish(store, 2, kv, TOKENS)
    match = store.lookup(ident(2), TOKENS)
    assert match is not None
    grown: list[dict[str, int]] = []
    for hit in (True, False):
        before = store.stats()
        out = [np.zeros((N_BLOCKS, ident(1).page_nbytes), np.uint8) for _ in range(LAYERS)]
        dests = [[o.reshape(-1)] for o in out]
        if hit:  # the default
            store.read_resharded(match, ident(1), 0, HEADS, dests)
        else:
            store.read_resharded(match, ident(1), 0, HEADS, dests, hit=False)
        after = store.stats()
        grown.append({k: after.get(k, 0) - before.get(k, 0)
                      for k in ("hits", "restored_tokens", "restored_bytes")})
        assert grown[-1].pop("hits") == int(hit)
        for got, want in zip(out, rank_pages(kv, 1, 0), strict=True):
            np.testing.assert_array_equal(got, want)
    assert grown[0] == grown[1] and grown[0]["restored_bytes"] > 0  # amounts as before
