"""Shared builders for store tests: a small identity and deterministic pages."""

from __future__ import annotations

import json
import struct

import numpy as np
import xxhash

from sparkcache import ModelIdentity, SnapshotStore
from sparkcache import segment as seg

BLOCK = 4
LAYERS = 2


def identity(*, world: int = 1, dtype: str = "float16", model: str = "tiny-llama",
             block_size: int = BLOCK) -> ModelIdentity:
    return ModelIdentity(
        model=model, revision="r1", num_layers=LAYERS, num_kv_heads=2, head_size=8,
        dtype="float16", kv_cache_dtype=dtype, block_size=block_size,
        page_shape=(2, 2 * block_size, 8), tp_size=world,
    )


def pages_for(ident: ModelIdentity, tokens: np.ndarray | list[int], rank: int = 0,
              start: int = 0) -> list[np.ndarray]:
    """Pages whose bytes are a function of (layer, rank, token ids so far): the
    same prefix always yields the same rows, as a real KV cache does."""
    toks = np.asarray(tokens, dtype=np.int64)
    bs = ident.block_size
    n_blocks = len(toks) // bs
    weighted = np.cumsum(toks[: n_blocks * bs] * np.arange(1, n_blocks * bs + 1)) % 2**31
    out = []
    for layer in range(LAYERS):
        arr = np.empty((n_blocks - start // bs, ident.page_nbytes), np.uint8)
        for b in range(start // bs, n_blocks):
            seed = int(weighted[(b + 1) * bs - 1])
            rng = np.random.default_rng([seed, layer, rank])
            arr[b - start // bs] = rng.integers(0, 256, ident.page_nbytes, dtype=np.uint8)
        out.append(arr)
    return out


def tokens(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n).astype(np.uint32)


class Clock:
    """An injectable clock the tests move by hand (``clock.now += seconds``)."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def forge_tokens(store: SnapshotStore, snapshot_id: int, other: np.ndarray) -> None:
    """Rewrite the snapshot's segment with ``other`` token ids, internally
    consistent (chunk digests, header) and recorded in the index (the header
    digest): only its boundary rows still say the published ids."""
    with store._core.read() as conn:
        (key,) = {g.object_key for g in store._core.segments(conn, snapshot_id)}
    path = store.root / key
    data = bytearray(path.read_bytes())
    (hlen,) = struct.unpack_from("<Q", data, 0)
    entries = json.loads(bytes(data[8:8 + hlen]))
    meta = json.loads(entries["__metadata__"]["sparkcache"])
    lo, hi = entries["tokens"]["data_offsets"]
    ids = other.astype("<u4").tobytes()
    assert len(ids) == hi - lo and len(ids) < 1 << 20  # one chunk
    data[8 + hlen + lo:8 + hlen + hi] = ids
    meta["chunks"]["tokens"] = xxhash.xxh3_128_hexdigest(ids)
    entries["__metadata__"]["sparkcache"] = json.dumps(meta, sort_keys=True,
                                                       separators=(",", ":"))
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % seg.DATA_ALIGN)
    assert len(text) == hlen
    data[8:8 + hlen] = text
    path.write_bytes(bytes(data))
    digest = xxhash.xxh3_128_hexdigest(bytes(data[:8 + hlen]))
    with store._core.write() as conn:
        conn.execute("UPDATE segments SET digest = ? WHERE snapshot_id = ?", (digest, snapshot_id))
