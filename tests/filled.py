"""A small filled store that the admin, catalog, maintenance and transfer tests share."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from sparkcache import SnapshotStore, admin
from sparkcache.identity import ModelIdentity

from .store.helpers import identity, pages_for, tokens


@dataclass
class Filled:
    """A store holding a root (32 tokens) and its child (64), plus a second model."""

    store: SnapshotStore
    ident: ModelIdentity
    toks: np.ndarray
    root: int
    child: int
    other: int


def fill(store: SnapshotStore) -> Filled:
    ident, toks = identity(), tokens(64)
    root = store.publish(ident, 0, toks[:32], pages_for(ident, toks[:32])).snapshot_id
    child = store.publish(ident, 0, toks, pages_for(ident, toks, start=32),
                          parent=root).snapshot_id
    other_ident, other_toks = identity(model="other"), tokens(16, seed=1)
    other = store.publish(other_ident, 0, other_toks,
                          pages_for(other_ident, other_toks)).snapshot_id
    return Filled(store, ident, toks, root, child, other)


@pytest.fixture
def filled(tmp_path: Path) -> Iterator[Filled]:
    """The filled store (import it into a test module, or use it from tests/conftest.py)."""
    with SnapshotStore(tmp_path / "store", alias_stride=16) as store:
        yield fill(store)


def segment_path(store: SnapshotStore, snapshot_id: int, rank: int = 0) -> Path:
    (seg,) = [g for g in admin.show(store, snapshot_id).segments if g.rank == rank]
    return store.root / seg.object_key


def flip_byte(path: Path, from_end: int = 300) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - from_end] ^= 0x40
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def restored(store: SnapshotStore, ident: ModelIdentity, toks: np.ndarray,
             rank: int = 0) -> list[np.ndarray]:
    match = store.lookup(ident, toks)
    assert match is not None and match.n_tokens == toks.size
    return store.read(match, rank)
