"""``read_into(in_place=True)``: chunks land in the destination, verified there.

For memory nothing reads before the read returns (an asynchronous restore's
own KV blocks): each chunk copied whole is read positionally straight into its
place and hashed there, no bounce buffer.  The bytes must be exactly those of
the bounce path, wherever the destination's pieces split a chunk; a damaged
chunk must still fail the read (the caller then treats the destination as
never written).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

from sparkcache import CorruptSnapshot, InvalidArgument, SnapshotStore
from sparkcache import segment as seg

from .helpers import LAYERS
from .test_ranged_read import SMALL_CHUNK, _flip, _publish_chain, _want


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> int:
    """1000-byte verification chunks (not a multiple of the 256-byte page)."""
    monkeypatch.setattr(seg, "CHUNK_BYTES", SMALL_CHUNK)
    return SMALL_CHUNK

def _tensor(size: int = 4096) -> tuple[memoryview, seg.SegmentHeader, np.ndarray]:
    data = np.random.default_rng(5).integers(0, 256, size, dtype=np.uint8)
    toks = np.arange(16, dtype="<u4")
    meta = {"token_start": 0, "token_end": 64, "block_size": 4}
    head, digest = seg.build_header(meta, [data], toks, (2, 8, 8), "F16")
    buf = memoryview(head + data.tobytes() + toks.tobytes())
    return buf, seg.parse_header(buf, digest), data


def _reads(buf: memoryview, log: list[int],
           calls: list[int] | None = None) -> Callable[[int, Any], int]:
    """A positional read over ``buf`` (into an array, or a list of arrays in
    order) that records each destination's address, and in ``calls`` how many
    destinations each call filled."""
    def read_at(offset: int, out: Any) -> int:
        parts = out if isinstance(out, list) else [out]
        if calls is not None:
            calls.append(len(parts))
        done = 0
        for room in parts:
            log.append(room.__array_interface__["data"][0])
            part = np.frombuffer(buf, np.uint8)[offset + done : offset + done + room.size]
            room[: part.size] = part
            done += int(part.size)
        return done
    return read_at


def _split(size: int, cuts: list[int]) -> tuple[np.ndarray, list[np.ndarray]]:
    """A backing array and pieces of it cut at ``cuts``, 8 bytes apart (runs of
    blocks that are not consecutive)."""
    backing = np.zeros(size + 64, np.uint8)
    bounds = [0, *cuts, size]
    return backing, [backing[lo + 8 * i : hi + 8 * i]
                     for i, (lo, hi) in enumerate(itertools.pairwise(bounds))]


@pytest.mark.parametrize("cuts", [[], [1000], [1], [999, 1001, 2500], [3000, 4095]])
@pytest.mark.parametrize("skip", [0, 1000, 1500])
@pytest.mark.parametrize("part", [None, 300], ids=["chunk-parts", "300-byte-parts"])
def test_chunks_land_in_place_across_pieces(
    small_chunks: int, cuts: list[int], skip: int, part: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Every whole chunk is read into the destination's own memory (never the
    bounce buffer), split where the pieces split it (and in parts of
    ``LAND_BYTES``); a chunk straddling ``skip`` goes through the bounce.  The
    bytes are the stored ones."""
    if part is not None:
        monkeypatch.setattr(seg, "LAND_BYTES", part)
    buf, header, data = _tensor()
    backing, pieces = _split(4096 - skip, [c for c in cuts if c < 4096 - skip])
    bounce = np.zeros(seg.CHUNK_BYTES, np.uint8)
    log: list[int] = []
    dest = seg.InPlace(seg.Pieces(pieces))
    seg.copy_verified(buf, header, "layer.0", 4096, dest, skip=skip,
                      read_at=_reads(buf, log), bounce=bounce)
    assert np.array_equal(np.concatenate(pieces), data[skip:])
    low = backing.__array_interface__["data"][0]
    in_place = [a for a in log if low <= a < low + backing.size]
    straddles = int(skip % SMALL_CHUNK > 0)
    assert len(log) - len(in_place) == straddles  # the rest read straight into place
    whole = 5 - skip // SMALL_CHUNK - straddles  # 1000-byte chunks of 4096 bytes
    assert len(in_place) >= whole


@pytest.mark.parametrize("part", [1000, 300])
def test_parts_across_pieces_are_read_in_one_call(
    small_chunks: int, part: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Pieces smaller than ``LAND_BYTES`` (KV blocks smaller than a part) are
    filled by one vectored read per part, not one read per piece."""
    monkeypatch.setattr(seg, "LAND_BYTES", part)
    monkeypatch.setattr(seg, "LAND_PARTS", 1000)
    buf, header, data = _tensor()
    backing = np.zeros(2 * 4096, np.uint8)
    pieces = [backing[2 * at : 2 * at + 100][: 4096 - at] for at in range(0, 4096, 100)]
    log: list[int] = []
    calls: list[int] = []
    seg.copy_verified(buf, header, "layer.0", 4096, seg.InPlace(seg.Pieces(pieces)),
                      read_at=_reads(buf, log, calls))
    assert np.array_equal(np.concatenate(pieces), data)
    per_chunk = [min(SMALL_CHUNK, 4096 - at) for at in range(0, 4096, SMALL_CHUNK)]
    assert len(calls) == sum(-(-size // part) for size in per_chunk)
    assert sum(calls) == len(log) and max(calls) > 1


def test_a_read_takes_at_most_land_parts_pieces(
    small_chunks: int, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Many tiny pieces (a 10-byte KV block): no vectored read takes more than
    ``LAND_PARTS`` buffers (the kernel refuses over 1024), the bytes are right."""
    monkeypatch.setattr(seg, "LAND_PARTS", 7)
    buf, header, data = _tensor()
    backing = np.zeros(2 * 4096, np.uint8)
    pieces = [backing[2 * at : 2 * at + 10][: 4096 - at] for at in range(0, 4096, 10)]
    calls: list[int] = []
    seg.copy_verified(buf, header, "layer.0", 4096, seg.InPlace(seg.Pieces(pieces)),
                      read_at=_reads(buf, [], calls))
    assert np.array_equal(np.concatenate(pieces), data)
    assert max(calls) == 7


def test_a_damaged_chunk_fails_in_place(small_chunks: int) -> None:
    """A flipped byte in chunk 1: the read fails with ``digest`` after the chunk
    landed (its bytes are in the destination, which the caller then treats as
    never written); chunk 0 is there and right, nothing after chunk 1 was read."""
    buf, header, data = _tensor()
    flipped = bytearray(buf)
    flipped[header.tensors["layer.0"][0] + 1500] ^= 1
    dest = np.zeros(4096, np.uint8)
    with pytest.raises(CorruptSnapshot) as exc:
        seg.copy_verified(buf, header, "layer.0", 4096, seg.InPlace(dest),
                          read_at=_reads(memoryview(flipped), []))
    assert exc.value.reason == "digest"
    assert np.array_equal(dest[:1000], data[:1000])
    assert dest[1000:2000].any() and not dest[2000:].any()


def test_without_positional_reads_nothing_lands_unverified(small_chunks: int) -> None:
    """A mapped segment (no ``read_at``): chunks are hashed where they lie and
    only then copied, so a damaged chunk never reaches even an InPlace."""
    buf, header, data = _tensor()
    flipped = bytearray(buf)
    flipped[header.tensors["layer.0"][0] + 1500] ^= 1
    dest = np.zeros(4096, np.uint8)
    with pytest.raises(CorruptSnapshot):
        seg.copy_verified(memoryview(flipped), header, "layer.0", 4096, seg.InPlace(dest))
    assert np.array_equal(dest[:1000], data[:1000]) and not dest[1000:].any()


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("start", [0, 4, 24])
def test_read_into_in_place_equals_the_bounce_path(
    store: SnapshotStore, small_chunks: int, threads: int, start: int,
) -> None:
    """Through the store (local files, ``preadv``): the same pages as the
    default read, into runs of blocks, from every link of a chain."""
    c = _publish_chain(store, (16, 40, 64))
    page, bs = c.ident.page_nbytes, c.ident.block_size
    n_blocks = (64 - start) // bs
    sizes = [1, 2, n_blocks - 3]
    out = [[np.zeros(k * page, np.uint8) for k in sizes] for _ in range(LAYERS)]
    seen: list[int] = []
    got = store.read_into(c.match, 0, out, start_tokens=start, threads=threads,
                          on_layer=seen.append, in_place=True)
    assert got == n_blocks and seen == list(range(LAYERS))
    for pieces, want in zip(out, _want(c, start), strict=True):
        assert np.array_equal(np.concatenate(pieces), want.reshape(-1))


def test_read_into_in_place_fails_on_damage(store: SnapshotStore, small_chunks: int) -> None:
    """A damaged chunk in the second link: CorruptSnapshot, the link
    quarantined, as without ``in_place``; layers before it were reported."""
    c = _publish_chain(store, (16, 40))
    _flip(c.files[1], "layer.1", 5)
    out = [np.zeros((10, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    seen: list[int] = []
    with pytest.raises(CorruptSnapshot):
        store.read_into(c.match, 0, out, on_layer=seen.append, in_place=True)
    assert seen == [0]
    assert np.array_equal(out[0], _want(c, 0)[0])
    assert store.lookup(c.ident, c.toks).n_tokens == 16  # type: ignore[union-attr]


def test_in_place_takes_buffers_only(store: SnapshotStore) -> None:
    c = _publish_chain(store, (16, 40))

    class Sink:
        size = 1 << 20

        def put(self, at: int, data: np.ndarray) -> None:
            raise AssertionError("never written")

    with pytest.raises(InvalidArgument, match="in_place"):
        store.read_into(c.match, 0, [Sink() for _ in range(LAYERS)], in_place=True)


def test_land_bytes_follow_the_cpu() -> None:
    """256 KiB parts on Intel or an unknown L2, else half the core's L2 within
    [256 KiB, one chunk]; this machine's value is one of those."""
    assert seg.land_bytes(2 << 20, "GenuineIntel") == 256 << 10
    assert seg.land_bytes(None, "AuthenticAMD") == 256 << 10
    assert seg.land_bytes(1 << 20, "AuthenticAMD") == 512 << 10
    assert seg.land_bytes(512 << 10, "AuthenticAMD") == 256 << 10
    assert seg.land_bytes(32 << 20, "AuthenticAMD") == seg.CHUNK_BYTES
    assert seg.land_bytes(1 << 20, "") == 512 << 10
    assert 256 << 10 <= seg.LAND_BYTES <= seg.CHUNK_BYTES


def test_a_hit_recorded_later_is_written_by_save_counts(store: SnapshotStore) -> None:
    """``record_later``: the read returns before its hit is written (another
    process's view of the index does not show it yet); ``save_counts``
    writes it, with the snapshot's use."""
    c = _publish_chain(store, (16, 40))
    out = [np.zeros((10, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    with SnapshotStore(store.root) as other:
        before = other.stats().get("hits", 0)
        used = {s.id: s.use_count for s in other.snapshots()}
        store.read_into(c.match, 0, out, record_later=True)
        assert other.stats().get("hits", 0) == before
        assert {s.id: s.use_count for s in other.snapshots()} == used
        store.save_counts()
        assert other.stats()["hits"] == before + 1
        assert all(s.use_count == used[s.id] + 1 for s in other.snapshots())
    store.read_into(c.match, 0, out)  # by default written before it returns
    with SnapshotStore(store.root) as other:
        assert other.stats()["hits"] == before + 2


def test_save_counts_of_a_closed_store_does_nothing(store: SnapshotStore) -> None:
    """A restore that lands while its store closes (an engine's shutdown) writes
    nothing more and raises nothing: closing saved what it could."""
    c = _publish_chain(store, (16, 40))
    out = [np.zeros((10, c.ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
    store.read_into(c.match, 0, out, record_later=True)
    store.close()  # saves the hit kept
    store.save_counts(wait=0.1)
    with SnapshotStore(store.root) as other:
        assert other.stats()["hits"] == 1
