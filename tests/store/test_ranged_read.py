"""``read_into(start_tokens=)``: a ranged verified read.

Tokens ``[start_tokens, n_tokens)`` are copied to page 0 onwards; payload below
the range is never read (a damaged byte there is no failure), while a chunk
straddling the start is verified whole and every link's token ids are still
checked.  Every expectation is compared with the bytes that were published.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache import CorruptSnapshot, InvalidArgument, ModelIdentity, SnapshotStore
from sparkcache import segment as seg
from sparkcache.store import Match

from .helpers import LAYERS, identity, pages_for, tokens

#: Small verification chunks, so that a few pages span several chunks; 1000 is
#: not a multiple of the 256-byte page, so chunks straddle page boundaries.
SMALL_CHUNK = 1000


@pytest.fixture(params=["1MiB", "small"])
def chunk(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    """The verification chunk size, set before anything is published."""
    if request.param == "small":
        monkeypatch.setattr(seg, "CHUNK_BYTES", SMALL_CHUNK)
    return seg.CHUNK_BYTES


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(seg, "CHUNK_BYTES", SMALL_CHUNK)
    return SMALL_CHUNK


@dataclass
class Chain:
    ident: ModelIdentity
    toks: np.ndarray
    match: Match
    files: list[Path]  # one segment file per link, root first


def _publish_chain(store: SnapshotStore, ends: tuple[int, ...], ident: ModelIdentity | None = None,
                   ) -> Chain:
    """Publish a copy-on-write chain whose links end at ``ends`` (tokens)."""
    ident = ident or identity()
    toks = tokens(ends[-1])
    files: list[Path] = []
    parent: int | None = None
    start = 0
    for end in ends:
        before = set(store.backend.list("objects"))
        parent = store.publish(ident, 0, toks[:end], pages_for(ident, toks[:end], start=start),
                               parent=parent).snapshot_id
        (key,) = set(store.backend.list("objects")) - before
        files.append(store.root / key)
        start = end
    m = store.lookup(ident, toks)
    assert m is not None and m.n_tokens == ends[-1] and m.snapshot_id == parent
    assert [s.depth for s in store.snapshots()] == list(range(len(ends)))  # not compacted
    return Chain(ident, toks, m, files)


def _ranged(store: SnapshotStore, c: Chain, start: int, n: int | None = None,
            ) -> tuple[int, list[np.ndarray]]:
    n_blocks = ((n or c.match.n_tokens) - start) // c.ident.block_size
    out = [np.zeros((n_blocks, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    return store.read_into(c.match, 0, out, n_tokens=n, start_tokens=start), out


def _want(c: Chain, start: int, n: int | None = None) -> list[np.ndarray]:
    n = n or c.match.n_tokens
    return pages_for(c.ident, c.toks[:n], start=start)


def _flip(path: Path, tensor: str, offset: int) -> None:
    """Flip one bit of byte ``offset`` of ``tensor`` in a segment file."""
    data = bytearray(path.read_bytes())
    hlen = int.from_bytes(data[:8], "little")
    lo, hi = json.loads(bytes(data[8 : 8 + hlen]))[tensor]["data_offsets"]
    assert 0 <= offset < hi - lo
    data[8 + hlen + lo + offset] ^= 0x10
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def _flip_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[20] ^= 0x10
    os.chmod(path, 0o644)
    path.write_bytes(bytes(data))


def _assert_quarantined(store: SnapshotStore, c: Chain, reason: str, link: int = 0,
                        before: dict[str, int] | None = None) -> None:
    """As for a full read: a miss from now on, the failing link quarantined with
    ``reason`` (its descendants with ``parent``), the reason counted once, no hit."""
    snaps = sorted(store.snapshots(), key=lambda s: s.depth)
    m = store.lookup(c.ident, c.toks)  # at most a sound ancestor is offered again
    assert m is None if link == 0 else m is not None and m.snapshot_id == snaps[link - 1].id
    assert (snaps[link].state, snaps[link].reason) == ("quarantined", reason)
    assert all(s.reason == "parent" for s in snaps[link + 1 :])
    assert all(s.state == "ready" for s in snaps[:link])
    stats = store.stats()
    assert stats[f"quarantined.{reason}"] == 1
    if before is not None:
        for key in ("hits", "restored_tokens", "restored_bytes"):
            assert stats.get(key, 0) == before.get(key, 0)


# -- equal to the slice of a full read ------------------------------------------------

CASES = [
    # (link ends, start_tokens, n_tokens)
    ((64,), 0, None), ((64,), 4, None), ((64,), 28, None), ((64,), 60, None),
    ((64,), 8, 40),
    ((32, 64), 0, None), ((32, 64), 8, None), ((32, 64), 32, None), ((32, 64), 44, None),
    ((32, 64), 60, None), ((32, 64), 20, 48),
    ((16, 40, 64), 0, None), ((16, 40, 64), 4, None), ((16, 40, 64), 16, None),
    ((16, 40, 64), 28, None), ((16, 40, 64), 40, None), ((16, 40, 64), 52, None),
    ((16, 40, 64), 60, None), ((16, 40, 64), 16, 48), ((16, 40, 64), 40, 48),
    ((16, 40, 64), 44, 48), ((16, 40, 64), 4, 16),
]


@pytest.mark.parametrize(("ends", "start", "n"), CASES)
def test_ranged_read_equals_slice_of_full_read(
    store: SnapshotStore, chunk: int, ends: tuple[int, ...], start: int, n: int | None
) -> None:
    c = _publish_chain(store, ends)
    bs = c.ident.block_size
    full = store.read(c.match, 0, n_tokens=n)
    count, got = _ranged(store, c, start, n)
    assert count == ((n or ends[-1]) - start) // bs
    for g, f, w in zip(got, full, _want(c, start, n), strict=True):
        assert g.shape == w.shape
        assert np.array_equal(g, f[start // bs :])
        assert np.array_equal(g, w)


def test_start_zero_is_the_plain_read(store: SnapshotStore) -> None:
    c = _publish_chain(store, (16, 40))
    plain = [np.zeros((10, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    assert store.read_into(c.match, 0, plain) == 10
    count, ranged = _ranged(store, c, 0)
    assert count == 10
    for p, r, w in zip(plain, ranged, _want(c, 0), strict=True):
        assert p.tobytes() == r.tobytes() == w.tobytes()


def test_larger_destination_keeps_its_tail(store: SnapshotStore) -> None:
    c = _publish_chain(store, (16, 40))
    out = [np.full((10, c.ident.page_nbytes), 7, np.uint8) for _ in range(LAYERS)]
    assert store.read_into(c.match, 0, out, start_tokens=24) == 4
    for o, w in zip(out, _want(c, 24), strict=True):
        assert np.array_equal(o[:4], w)
        assert (o[4:] == 7).all()


def test_counters_count_the_copied_range(store: SnapshotStore) -> None:
    c = _publish_chain(store, (16, 40))
    before = store.stats()
    _ranged(store, c, 24)
    after = store.stats()
    assert after["hits"] - before.get("hits", 0) == 1
    assert after["restored_tokens"] - before.get("restored_tokens", 0) == 16
    assert after["restored_bytes"] - before.get("restored_bytes", 0) == (
        4 * c.ident.page_nbytes * LAYERS)


# -- what is read and verified ------------------------------------------------------

# One 64-token segment, 16 pages of 256 bytes = 4096 bytes per layer in chunks
# [0, 1000) [1000, 2000) [2000, 3000) [3000, 4000) [4000, 4096); start_tokens=32
# is byte 2048, inside chunk 2.
START = 32
DAMAGE = {
    "first_chunk": (500, True),
    "last_chunk_below": (1999, True),
    "straddling_below_start": (2010, False),  # the chunk is verified whole
    "straddling_at_start": (2048, False),
    "after_start": (3500, False),
    "last_byte": (4095, False),
}


@pytest.mark.parametrize("where", list(DAMAGE))
def test_damage_below_the_range_is_never_read(
    store: SnapshotStore, small_chunks: int, where: str
) -> None:
    offset, unread = DAMAGE[where]
    c = _publish_chain(store, (64,))
    assert c.ident.page_nbytes * 16 == 4096 and START * 256 // c.ident.block_size == 2048
    for layer in range(LAYERS):
        _flip(c.files[0], f"layer.{layer}", offset)
    before = store.stats()
    if unread:
        count, got = _ranged(store, c, START)
        assert count == 8
        assert all(np.array_equal(g, w) for g, w in zip(got, _want(c, START), strict=True))
        assert store.lookup(c.ident, c.toks) is not None  # nothing was quarantined
        with pytest.raises(CorruptSnapshot) as full:  # the damage is real
            store.read(c.match, 0)
        assert full.value.reason == "digest"
    else:
        with pytest.raises(CorruptSnapshot) as exc:
            _ranged(store, c, START)
        assert exc.value.reason == "digest"
        _assert_quarantined(store, c, "digest", before=before)


def test_a_failed_ranged_read_copies_only_verified_bytes(
    store: SnapshotStore, small_chunks: int
) -> None:
    c = _publish_chain(store, (64,))
    _flip(c.files[0], "layer.0", 3500)  # chunk 3 of layer 0
    out = [np.zeros((8, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    with pytest.raises(CorruptSnapshot):
        store.read_into(c.match, 0, out, start_tokens=START)
    flat = out[0].reshape(-1)
    want = _want(c, START)[0].reshape(-1)
    # bytes 2048..3000 (the straddling chunk, verified) were copied; chunk 3 was not
    assert np.array_equal(flat[: 3000 - 2048], want[: 3000 - 2048])
    assert not flat[3000 - 2048 :].any()
    assert not out[1].any()


def test_real_chunk_size_straddling(tmp_path: Path) -> None:
    # 4 KiB pages: 256 pages per 1 MiB chunk; 300 pages span two chunks per layer.
    ident = identity(block_size=64)
    assert ident.page_nbytes == 4096 and seg.CHUNK_BYTES == 1 << 20
    start = 260 * 64  # page 260, inside chunk 1 (pages 256..511)
    for offset, unread in ((10 * 4096, True), (257 * 4096, False), (290 * 4096, False)):
        with SnapshotStore(tmp_path / str(offset), alias_stride=4096) as store:
            c = _publish_chain(store, (300 * 64,), ident)
            _flip(c.files[0], "layer.1", offset)
            if unread:
                count, got = _ranged(store, c, start)
                assert count == 40
                assert all(np.array_equal(g, w) for g, w in zip(got, _want(c, start),
                                                                strict=True))
            else:
                with pytest.raises(CorruptSnapshot):
                    _ranged(store, c, start)
                _assert_quarantined(store, c, "digest")


@pytest.mark.parametrize("start", [16, 24])
def test_skipped_link_payload_is_not_read(
    store: SnapshotStore, chunk: int, start: int
) -> None:
    c = _publish_chain(store, (16, 40, 64))
    for layer in range(LAYERS):
        _flip(c.files[0], f"layer.{layer}", 0)
        _flip(c.files[0], f"layer.{layer}", 16 // 4 * c.ident.page_nbytes - 1)
    count, got = _ranged(store, c, start)
    assert count == (64 - start) // 4
    assert all(np.array_equal(g, w) for g, w in zip(got, _want(c, start), strict=True))
    with pytest.raises(CorruptSnapshot):  # the damage is real: the root goes
        _ranged(store, c, 12)
    _assert_quarantined(store, c, "digest", link=0)


@pytest.mark.parametrize("damage", ["tokens", "header"])
def test_skipped_links_are_still_checked(store: SnapshotStore, damage: str) -> None:
    c = _publish_chain(store, (16, 40, 64))
    if damage == "tokens":
        _flip(c.files[1], "tokens", 5)
    else:
        _flip_header(c.files[1])
    before = store.stats()
    with pytest.raises(CorruptSnapshot) as exc:
        _ranged(store, c, 40)
    assert exc.value.reason == "digest"
    _assert_quarantined(store, c, "digest", link=1, before=before)


def test_token_ids_of_skipped_links_are_compared(store: SnapshotStore) -> None:
    c = _publish_chain(store, (16, 40, 64))
    other = c.toks.copy()
    other[3] += 1  # a prompt that differs inside the skipped root link
    m = Match(c.match.snapshot_id, c.match.n_tokens, c.ident, other)
    out = [np.zeros((6, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    before = store.stats()
    with pytest.raises(InvalidArgument, match="other token ids"):
        store.read_into(m, 0, out, start_tokens=40)
    assert not any(o.any() for o in out)
    # The stored ids passed their digests: the match was wrong, not the data.
    assert {s.state for s in store.snapshots()} == {"ready"}
    assert store.stats() == before
    assert store.read_into(c.match, 0, out, start_tokens=40) == 6


# -- arguments ------------------------------------------------------------------------


@pytest.mark.parametrize(("start", "n"), [
    (2, None), (1, None), (-4, None), (64, None), (68, None), (16, 16), (20, 16), (-1, 16),
])
def test_bad_start_tokens(store: SnapshotStore, start: int, n: int | None) -> None:
    c = _publish_chain(store, (32, 64))
    before = store.stats()
    out = [np.zeros((16, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    with pytest.raises(InvalidArgument, match="start_tokens must be a multiple of"):
        store.read_into(c.match, 0, out, n_tokens=n, start_tokens=start)
    assert store.stats() == before
    assert not any(o.any() for o in out)


def test_destination_size_follows_the_range(store: SnapshotStore) -> None:
    c = _publish_chain(store, (32, 64))
    page = c.ident.page_nbytes
    short = [np.zeros((11, page), np.uint8) for _ in range(LAYERS)]
    with pytest.raises(InvalidArgument, match=r"needs at least 3072 bytes \(12 pages"):
        store.read_into(c.match, 0, short, start_tokens=16)
    mixed = [np.zeros((12, page), np.uint8), np.zeros((11, page), np.uint8)]
    with pytest.raises(InvalidArgument, match="needs at least"):
        store.read_into(c.match, 0, mixed, start_tokens=16)
    with pytest.raises(InvalidArgument, match="layers"):
        store.read_into(c.match, 0, short[:1], start_tokens=16)
    assert not any(o.any() for o in short + mixed)
    assert store.read_into(c.match, 0, short, start_tokens=20) == 11


# -- segment.copy_verified ------------------------------------------------------------


@pytest.fixture
def one_tensor(small_chunks: int) -> Iterator[tuple[memoryview, seg.SegmentHeader, np.ndarray]]:
    data = np.random.default_rng(3).integers(0, 256, 4096, dtype=np.uint8)
    toks = np.arange(16, dtype="<u4")
    meta = {"token_start": 0, "token_end": 64, "block_size": 4}
    head, digest = seg.build_header(meta, [data], toks, (2, 8, 8), "F16")
    buf = memoryview(head + data.tobytes() + toks.tobytes())
    yield buf, seg.parse_header(buf, digest), data


def _read_at(buf: memoryview) -> Callable[[int, np.ndarray], int]:
    """A positional read over ``buf``, as a file's ``preadv`` would do it."""
    def read_at(offset: int, out: np.ndarray) -> int:
        part = np.frombuffer(buf, np.uint8)[offset : offset + out.size]
        out[: part.size] = part
        return int(part.size)
    return read_at


@pytest.mark.parametrize("positional", [False, True], ids=["in-place", "read_at"])
@pytest.mark.parametrize("skip", [0, 1, 999, 1000, 1001, 2048, 4000, 4095, 4096])
@pytest.mark.parametrize("nbytes", [4096, 2500, 2000])
def test_copy_verified_skip(
    one_tensor: tuple[memoryview, seg.SegmentHeader, np.ndarray], skip: int, nbytes: int,
    positional: bool,
) -> None:
    buf, header, data = one_tensor
    read_at = _read_at(buf) if positional else None
    if skip > nbytes:
        with pytest.raises(InvalidArgument, match="skip"):
            seg.copy_verified(buf, header, "layer.0", nbytes, np.zeros(0, np.uint8), skip=skip,
                              read_at=read_at)
        return
    dest = np.zeros(nbytes - skip, np.uint8)
    seg.copy_verified(buf, header, "layer.0", nbytes, dest, skip=skip, read_at=read_at)
    assert np.array_equal(dest, data[skip:nbytes])


def test_copy_verified_read_at_checks_what_it_read(
    one_tensor: tuple[memoryview, seg.SegmentHeader, np.ndarray],
) -> None:
    """Positional reads are verified in the bounce buffer: a flipped byte or a
    short read (the file shrank) never reaches the destination."""
    buf, header, data = one_tensor
    flipped = bytearray(buf)
    offset = header.tensors["layer.0"][0]
    flipped[offset + 1500] ^= 1
    dest = np.zeros(4096, np.uint8)
    with pytest.raises(CorruptSnapshot) as exc:
        seg.copy_verified(buf, header, "layer.0", 4096, dest,
                          read_at=_read_at(memoryview(flipped)))
    assert exc.value.reason == "digest"
    assert np.array_equal(dest[:1000], data[:1000]) and not dest[1000:].any()
    short = memoryview(bytes(buf)[: offset + 2500])
    dest[:] = 0
    with pytest.raises(CorruptSnapshot) as exc:
        seg.copy_verified(buf, header, "layer.0", 4096, dest, read_at=_read_at(short))
    assert exc.value.reason == "truncated"
    assert not dest[2000:].any()
    with pytest.raises(InvalidArgument, match="bounce"):
        seg.copy_verified(buf, header, "layer.0", 4096, dest, read_at=_read_at(buf),
                          bounce=np.empty(10, np.uint8))


class _Room:
    """A :class:`~sparkcache.segment.Landing` like a staging slot: chunks land in
    its own scratch memory (``room`` bytes at most at a time) and reach ``dest``
    only when committed, as a slot's upload does."""

    def __init__(self, size: int, room: int) -> None:
        self.size, self.room = size, room
        self.dest = np.zeros(size, np.uint8)
        self.scratch = np.zeros(size, np.uint8)
        self.calls: list[str] = []

    def put(self, at: int, data: np.ndarray) -> None:
        self.calls.append("put")
        self.dest[at:at + data.size] = data

    def reserve(self, at: int, n: int) -> np.ndarray | None:
        return self.scratch[at:at + n] if n <= self.room else None

    def commit(self, at: int, n: int) -> None:
        self.calls.append("commit")
        self.dest[at:at + n] = self.scratch[at:at + n]


@pytest.mark.parametrize("skip", [0, 999, 1000, 2048])
@pytest.mark.parametrize("room", [1000, 999], ids=["chunks-fit", "copied-in"])
def test_copy_verified_lands_whole_chunks_in_the_sinks_room(
    one_tensor: tuple[memoryview, seg.SegmentHeader, np.ndarray], skip: int, room: int,
) -> None:
    """A chunk copied whole is read into the sink's room and committed once it
    passed; one that straddles ``skip`` (or finds no room) is copied in."""
    buf, header, data = one_tensor
    sink = _Room(4096 - skip, room)
    assert isinstance(sink, seg.Landing)
    seg.copy_verified(buf, header, "layer.0", 4096, sink, skip=skip, read_at=_read_at(buf))
    assert np.array_equal(sink.dest, data[skip:])
    chunks, straddles = 5 - skip // 1000, int(skip % 1000 > 0)  # chunks of 1000 bytes
    # Without room for 1000 bytes only the last chunk (96 bytes) lands in it.
    landed = chunks - straddles if room == 1000 else 1
    assert (sink.calls.count("commit"), sink.calls.count("put")) == (landed, chunks - landed)


def test_copy_verified_commits_only_what_passed(
    one_tensor: tuple[memoryview, seg.SegmentHeader, np.ndarray],
) -> None:
    """A flipped byte in a chunk read into the sink's room: that chunk is never
    committed, so the destination holds the chunks before it and nothing else."""
    buf, header, data = one_tensor
    flipped = bytearray(buf)
    flipped[header.tensors["layer.0"][0] + 1500] ^= 1
    sink = _Room(4096, 1000)
    with pytest.raises(CorruptSnapshot) as exc:
        seg.copy_verified(buf, header, "layer.0", 4096, sink,
                          read_at=_read_at(memoryview(flipped)))
    assert exc.value.reason == "digest"
    assert sink.calls == ["commit"]
    assert np.array_equal(sink.dest[:1000], data[:1000]) and not sink.dest[1000:].any()


# -- destinations in pieces, layer by layer ---------------------------------------------


@pytest.mark.parametrize("start", [0, 24])
def test_pieces_receive_the_pages_in_order(store: SnapshotStore, chunk: int, start: int) -> None:
    """A destination given as a list of buffers (runs of KV blocks, in page
    order) gets exactly the bytes a single buffer would, across chunk and link
    boundaries; ``on_layer`` reports each layer once it is complete."""
    c = _publish_chain(store, (16, 40))
    page = c.ident.page_nbytes
    n_blocks = (40 - start) // c.ident.block_size
    sizes = [1, 3, 2, n_blocks - 6] if start == 0 else [2, 1, 1]  # pages per piece
    assert sum(sizes) == n_blocks
    caches = [np.zeros(3 * n_blocks * page, np.uint8) for _ in range(LAYERS)]
    # Scattered and out of order (in pages): piece j starts at where[j].
    where = [n_blocks + 1, 0, 2 * n_blocks, n_blocks + 1 + sizes[0] + 2][:len(sizes)]
    out = [[cache[w * page:(w + k) * page] for w, k in zip(where, sizes, strict=True)]
           for cache in caches]
    seen: list[tuple[int, bool]] = []

    def landed(layer: int) -> None:
        # Layer i is complete when reported, later layers are still untouched.
        done = all(p.any() for p in out[layer])
        later = all(not cache.any() for cache in caches[layer + 1:])
        seen.append((layer, done and later))

    assert store.read_into(c.match, 0, out, start_tokens=start, on_layer=landed) == n_blocks
    assert seen == [(i, True) for i in range(LAYERS)]
    for pieces, want in zip(out, _want(c, start), strict=True):
        assert np.array_equal(np.concatenate(pieces), want.reshape(-1))


def test_pieces_too_small_are_refused(store: SnapshotStore) -> None:
    c = _publish_chain(store, (16, 40))
    page = c.ident.page_nbytes
    short = [[np.zeros(4 * page, np.uint8), np.zeros(5 * page, np.uint8)] for _ in range(LAYERS)]
    with pytest.raises(InvalidArgument, match="at least"):
        store.read_into(c.match, 0, short)
    pieces = seg.Pieces([np.zeros(3, np.uint8), np.zeros(2, np.uint8)])
    with pytest.raises(InvalidArgument, match="exceed"):
        pieces.put(4, np.ones(2, np.uint8))
    pieces.put(1, np.arange(1, 5, dtype=np.uint8))
    with pytest.raises(InvalidArgument, match="writable"):
        seg.Pieces([np.zeros(3, np.uint8), b"ab"])


def test_a_corrupt_layer_stops_before_its_bytes(store: SnapshotStore, small_chunks: int) -> None:
    """Layer 1 of the second link damaged: layer 0 lands and is reported, no
    byte of layer 1 from the damaged chunk reaches the destination."""
    c = _publish_chain(store, (16, 40))
    _flip(c.files[1], "layer.1", 5)
    out = [np.zeros((10, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    seen: list[int] = []
    with pytest.raises(CorruptSnapshot):
        store.read_into(c.match, 0, out, on_layer=seen.append)
    assert seen == [0]
    want = _want(c, 0)
    assert np.array_equal(out[0], want[0])
    root = 16 // c.ident.block_size  # layer 1's root link landed before the damaged link
    assert np.array_equal(out[1][:root], want[1][:root])
    assert not out[1][root:].any()


@pytest.mark.parametrize("start", [0, 24])
def test_threads_share_the_layers(store: SnapshotStore, small_chunks: int, start: int) -> None:
    """Several threads: the same bytes, every layer reported once, in order."""
    c = _publish_chain(store, (16, 40))
    n_blocks = (40 - start) // c.ident.block_size
    for threads in (2, 3, 8):
        out = [np.zeros((n_blocks, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
        seen: list[int] = []
        assert store.read_into(c.match, 0, out, start_tokens=start, on_layer=seen.append,
                               threads=threads) == n_blocks
        assert seen == list(range(LAYERS))
        for o, w in zip(out, _want(c, start), strict=True):
            assert np.array_equal(o, w)


def test_threads_raise_the_first_failure(store: SnapshotStore, small_chunks: int) -> None:
    c = _publish_chain(store, (16, 40))
    _flip(c.files[0], "layer.1", 5)
    out = [np.zeros((10, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    seen: list[int] = []
    with pytest.raises(CorruptSnapshot):
        store.read_into(c.match, 0, out, on_layer=seen.append, threads=2)
    assert 1 not in seen and seen in ([], [0])
    assert store.lookup(c.ident, c.toks) is None  # quarantined (and its descendant)


def test_a_slow_thread_takes_fewer_layers(store: SnapshotStore,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """Layers go to whichever thread is free: a helper on a busy core holds up
    the read by one layer at most, not by its fixed share."""
    ident = ModelIdentity(model="deep", revision="r1", num_layers=8, num_kv_heads=2, head_size=8,
                          dtype="float16", kv_cache_dtype="float16", block_size=4,
                          page_shape=(2, 8, 8))
    toks = tokens(16)
    rng = np.random.default_rng(5)
    pages = [rng.integers(0, 256, (4, ident.page_nbytes), np.uint8) for _ in range(8)]
    store.publish(ident, 0, toks, pages)
    m = store.lookup(ident, toks)
    assert m is not None
    took: dict[str, list[int]] = {}
    real = seg.copy_verified

    def slow_helper(buf: Any, header: Any, name: str, *args: Any, **kwargs: Any) -> None:
        if name.startswith("layer."):
            me = threading.current_thread().name
            took.setdefault(me, []).append(int(name.split(".")[1]))
            if me == "sparkcache-read-1":
                time.sleep(0.3)
        real(buf, header, name, *args, **kwargs)

    monkeypatch.setattr(seg, "copy_verified", slow_helper)
    out = [np.zeros((4, ident.page_nbytes), np.uint8) for _ in range(8)]
    seen: list[int] = []
    assert store.read_into(m, 0, out, on_layer=seen.append, threads=2) == 4
    assert seen == list(range(8))
    helper = took.get("sparkcache-read-1", [])  # none if it started after the last layer
    mine = took[threading.current_thread().name]
    assert len(helper) <= 2 < len(mine)
    assert sorted(helper + mine) == list(range(8))
    for got, want in zip(out, pages, strict=True):
        assert np.array_equal(got, want)
