"""Snapshots restored across TP sizes: each engine rank reads the heads it needs
from whichever stored ranks hold them, every chunk verified."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from sparkcache import CorruptSnapshot, ModelIdentity, SnapshotStore
from sparkcache.reshard import read_resharded, siblings
from sparkcache.sharding import ShardingRefused

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
        pages = read_resharded(store._core, match, engine, rank, HEADS)
        for got, want in zip(pages, rank_pages(kv, tp_to, rank), strict=True):
            np.testing.assert_array_equal(got, want)


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
        read_resharded(store._core, match, ident(1), 0, HEADS)
    assert store.lookup(ident(2), TOKENS) is None  # quarantined: never offered again


def test_other_kv_and_sliding_windows_are_refused(tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s")
    publish(store, 2, full_kv(), TOKENS)
    match = store.lookup(ident(2), TOKENS)
    assert match is not None
    with pytest.raises(ShardingRefused, match="other KV"):
        read_resharded(store._core, match, ident(1, revision="r2"), 0, HEADS)
    assert siblings(store._core, ident(1, revision="r2"), HEADS) == []
    windowed = ident(1, extra=(("window_blocks", "1,0"),))
    with pytest.raises(ShardingRefused):
        read_resharded(store._core, match, windowed, 0, HEADS)
