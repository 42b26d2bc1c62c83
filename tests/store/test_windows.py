"""Layers that keep a window of blocks (sliding-window attention).

An identity whose ``extra`` names ``window_blocks`` has layers that store only
the blocks ending at a segment's end: a snapshot holds every block of its
full-attention layers and the last few of its sliding-window ones.  The
segment records each layer's own block count, a read takes one start per
layer, and a read of a window that was not stored is a miss (NotFound),
never bytes of another window.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from sparkcache import ModelIdentity, SnapshotStore
from sparkcache import segment as seg
from sparkcache.errors import CorruptSnapshot, InvalidArgument, NotFound
from sparkcache.identity import WINDOW_BLOCKS_KEY

from .helpers import BLOCK, LAYERS, identity, pages_for, tokens

KEEP = 2  # blocks layer 0 keeps; layer 1 keeps every block


def windowed() -> ModelIdentity:
    return dataclasses.replace(identity(), extra=((WINDOW_BLOCKS_KEY, f"{KEEP},0"),))


def window_pages(ident: ModelIdentity, toks: np.ndarray) -> list[np.ndarray]:
    full = pages_for(ident, toks)
    return [full[0][-KEEP:], full[1]]


def test_the_window_is_part_of_the_identity() -> None:
    assert windowed().digest() != identity().digest()
    other = dataclasses.replace(identity(), extra=((WINDOW_BLOCKS_KEY, f"{KEEP + 1},0"),))
    assert other.digest() != windowed().digest()
    assert windowed().window_blocks == (KEEP, 0) and identity().window_blocks == ()
    with pytest.raises(InvalidArgument, match="names 1 layers"):
        dataclasses.replace(identity(), extra=((WINDOW_BLOCKS_KEY, "2"),))


def test_a_window_layer_stores_only_its_window_and_restores_it(store: SnapshotStore) -> None:
    ident = windowed()
    toks = tokens(10 * BLOCK)
    full = pages_for(ident, toks)
    result = store.publish(ident, 0, toks, window_pages(ident, toks))
    match = store.lookup(ident, toks)
    assert match is not None and match.n_tokens == toks.size
    # Bytes on disk: 10 blocks of layer 1, 2 of layer 0 (plus tokens and header).
    assert result.bytes_written < (10 + KEEP + 1) * ident.page_nbytes + toks.size * 4 + 4096
    # One start per layer: layer 0 from its window, layer 1 from block 3.
    out = [np.zeros(KEEP * ident.page_nbytes, np.uint8),
           np.zeros(7 * ident.page_nbytes, np.uint8)]
    n = store.read_into(match, 0, out, start_tokens=[(10 - KEEP) * BLOCK, 3 * BLOCK])
    assert n == 7
    assert out[0].tobytes() == full[0][-KEEP:].tobytes()
    assert out[1].tobytes() == full[1][3:].tobytes()
    assert store.stats()["restored_bytes"] == (KEEP + 7) * ident.page_nbytes


def test_a_window_below_what_was_stored_is_a_miss(store: SnapshotStore) -> None:
    ident = windowed()
    toks = tokens(10 * BLOCK, seed=1)
    store.publish(ident, 0, toks, window_pages(ident, toks))
    match = store.lookup(ident, toks)
    assert match is not None
    out = [np.zeros(3 * ident.page_nbytes, np.uint8) for _ in range(LAYERS)]
    with pytest.raises(NotFound, match="was not stored"):
        store.read_into(match, 0, out, start_tokens=(10 - KEEP - 1) * BLOCK)
    # A shorter prefix of the snapshot: its window lies below the stored one.
    shorter = dataclasses.replace(match, n_tokens=6 * BLOCK)
    with pytest.raises(NotFound):
        store.read_into(shorter, 0, out, n_tokens=6 * BLOCK, start_tokens=3 * BLOCK)
    assert not any(k.startswith("quarantined") for k in store.stats())


def test_ends_only_finds_the_longest_snapshot_end(store: SnapshotStore) -> None:
    """Snapshots of 2, 4, 6 and 10 blocks of one prompt (a stride is 4 blocks) and
    one of 7 blocks that is not a prefix: a prompt sharing 8 blocks with the
    long one matches its stride aliases, but ``ends_only`` offers only where a
    snapshot ends - past the first stride (the 6-block one), at it (the 4-block
    one) and below it (the 2-block one, which has no stride row); an
    unrestorable end is skipped for a shorter one."""
    ident = windowed()
    toks = tokens(10 * BLOCK, seed=2)
    other = tokens(7 * BLOCK, seed=3)
    for t in (toks[:2 * BLOCK], toks[:4 * BLOCK], toks[:6 * BLOCK], toks, other):
        store.publish(ident, 0, t, window_pages(ident, t), breakpoints=[5 * BLOCK])

    def ends(shared: int, **kw: object) -> int | None:
        prompt = np.concatenate([toks[:shared * BLOCK], tokens(3 * BLOCK, seed=4)])
        m = store.lookup(ident, prompt, **kw)  # type: ignore[arg-type]
        return None if m is None else m.n_tokens // BLOCK

    assert ends(8) == 8  # an alias of the 10-block one, where no window is stored
    assert ends(8, ends_only=True) == 6
    assert ends(5, ends_only=True) == 4  # not the breakpoints at 5
    assert ends(10, ends_only=True) == 10
    assert ends(3, ends_only=True) == 2
    assert ends(1, ends_only=True) is None
    assert store.lookup(ident, other[:5 * BLOCK], ends_only=True) is None  # a breakpoint
    (six,) = [s for s in store.snapshots() if s.n_tokens == 6 * BLOCK]
    store.quarantine(six.id, "test")
    assert ends(8, ends_only=True) == 4


def test_window_pages_must_be_the_window(store: SnapshotStore) -> None:
    ident = windowed()
    toks = tokens(10 * BLOCK, seed=2)
    with pytest.raises(InvalidArgument, match="layer 0 holds"):
        store.publish(ident, 0, toks, pages_for(ident, toks))
    store.publish(ident, 0, toks[: 6 * BLOCK], window_pages(ident, toks[: 6 * BLOCK]))
    parent = store.lookup(ident, toks[: 6 * BLOCK])
    assert parent is not None
    with pytest.raises(InvalidArgument, match="whole snapshots"):
        store.publish(ident, 0, toks, window_pages(ident, toks), parent=parent.snapshot_id)


def test_a_segment_whose_layer_sizes_do_not_match_its_identity_is_corrupt() -> None:
    """A header that passes its digest and names the windowed identity, but
    holds every block of the layer that keeps a window, fails its check."""
    ident = windowed()
    toks = tokens(8 * BLOCK, seed=3)
    meta = {"model": ident.digest(), "rank": 0, "snap_key": "k", "token_start": 0,
            "token_end": toks.size, "block_size": BLOCK}

    def check(layers: list[np.ndarray]) -> None:
        header, digest = seg.build_header(meta, [a.reshape(-1) for a in layers], toks,
                                          ident.page_shape, ident.kv_cache_dtype)
        data = b"".join([header, *(a.tobytes() for a in layers), toks.tobytes()])
        seg.check_header(memoryview(data), digest, ident, 0, "k", 0, toks.size)

    check(window_pages(ident, toks))
    with pytest.raises(CorruptSnapshot, match=r"layer\.0 holds") as caught:
        check(pages_for(ident, toks))
    assert caught.value.reason == "shape"
