"""A segment file the store writes is a plain safetensors file.

Loaded with the real ``safetensors`` library (not our parser), it holds
``layer.i`` with shape ``[n_blocks, *page_shape]`` in the KV-cache dtype and
``tokens`` as uint32, with exactly the bytes that were published.  Its data
starts at a multiple of ``segment.DATA_ALIGN`` (the header is padded).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy as safetensors_numpy
from safetensors import safe_open

from sparkcache import SnapshotStore
from sparkcache import segment as seg
from sparkcache.identity import ModelIdentity

from .helpers import LAYERS, identity, pages_for, tokens

NUMPY_DTYPES = {"float32": np.float32, "float16": np.float16}


def _segment(store: SnapshotStore, snapshot_id: int) -> Path:
    with store.db.read() as conn:
        rows = conn.execute(
            "SELECT object_key FROM segments WHERE snapshot_id = ?", (snapshot_id,)
        ).fetchall()
    (key,) = (str(r[0]) for r in rows)
    return store.root / key


def _check(path: Path, ident: ModelIdentity, dtype: type, toks: np.ndarray,
           pages: list[np.ndarray], start: int, end: int) -> None:
    data = path.read_bytes()
    hlen = int.from_bytes(data[:8], "little")
    assert (8 + hlen) % seg.DATA_ALIGN == 0  # every layer's data starts page-aligned
    assert data[8:8 + hlen].rstrip(b" ").endswith(b"}")  # padded with spaces only
    loaded = safetensors_numpy.load_file(str(path))
    n_blocks = (end - start) // ident.block_size
    assert set(loaded) == {*(f"layer.{i}" for i in range(LAYERS)), "tokens"}
    for i in range(LAYERS):
        layer = loaded[f"layer.{i}"]
        assert layer.dtype == dtype and layer.shape == (n_blocks, *ident.page_shape)
        assert np.array_equal(layer.view(np.uint8).reshape(n_blocks, -1), pages[i])
    assert loaded["tokens"].dtype == np.uint32
    assert np.array_equal(loaded["tokens"], toks[start:end])
    with safe_open(str(path), framework="numpy") as f:
        meta = json.loads(f.metadata()["sparkcache"])
    assert (meta["token_start"], meta["token_end"]) == (start, end)
    assert meta["model"] == ident.digest() and meta["rank"] == 0
    assert meta["n_layers"] == LAYERS and meta["page_shape"] == list(ident.page_shape)


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_segment_loads_with_safetensors(tmp_path: Path, dtype: str) -> None:
    ident = identity(dtype=dtype)
    toks = tokens(40)
    with SnapshotStore(tmp_path / "s", alias_stride=16) as store:
        head = pages_for(ident, toks[:24])
        first = store.publish(ident, 0, toks[:24], head)
        _check(_segment(store, first.snapshot_id), ident, NUMPY_DTYPES[dtype], toks, head, 0, 24)
        # A copy-on-write extend writes only its tail, still a plain safetensors file.
        tail = pages_for(ident, toks, start=24)
        child = store.publish(ident, 0, toks, tail, parent=first.snapshot_id)
        _check(_segment(store, child.snapshot_id), ident, NUMPY_DTYPES[dtype], toks, tail, 24, 40)


def test_float32_values_survive_the_roundtrip(tmp_path: Path) -> None:
    """Real float32 KV values (not random bytes) come back bit for bit."""
    ident = identity(dtype="float32")
    toks = tokens(8)
    n_blocks = len(toks) // ident.block_size
    values = [np.linspace(-1e3 * (i + 1), 1e3, n_blocks * int(np.prod(ident.page_shape)),
                          dtype=np.float32).reshape(n_blocks, *ident.page_shape)
              for i in range(LAYERS)]
    values[0].flat[0] = np.float32(np.nan)
    values[1].flat[-1] = -np.inf
    with SnapshotStore(tmp_path / "s") as store:
        sid = store.publish(ident, 0, toks, values).snapshot_id
        loaded = safetensors_numpy.load_file(str(_segment(store, sid)))
        for i in range(LAYERS):
            assert loaded[f"layer.{i}"].tobytes() == values[i].tobytes()
        m = store.lookup(ident, toks)
        assert m is not None
        for got, want in zip(store.read(m, 0), values, strict=True):
            assert np.array_equal(got.view(np.float32).reshape(want.shape), want, equal_nan=True)
