"""The on-disk segment: one rank's pages of one snapshot, as a safetensors file.

Layout (plain safetensors, readable by the ``safetensors`` library)::

    u64 little-endian header length | JSON header (space padded) | data

The header is padded with spaces so that the data starts at a multiple of
:data:`DATA_ALIGN` bytes: the kernel copies a page-cache page into memory
aligned as it is (a KV cache, a bounce buffer) at memory speed, and up to
twice slower when the two differ within a cache line.

Tensors, in data order: ``layer.0`` ... ``layer.{L-1}`` with shape
``[n_blocks, *page_shape]`` in the engine's own KV-cache dtype, then ``tokens``
(``U32``, the token ids of the segment's range).  ``__metadata__`` holds one
key, ``sparkcache``: canonical JSON with the identity digest, rank, snapshot
key, token range, layout and the xxh3_128 digest of every ``CHUNK_BYTES``
chunk of every tensor.

The index records the xxh3_128 of the whole header (the *segment digest*).  A
read checks the header against that digest, then each chunk against its
digest *before* copying it out, so no unverified byte reaches the caller and
the data is touched once from memory while it is still in cache (a caller
whose destination nothing reads until the read returns may let each chunk land
there first and be verified in place: :class:`InPlace`).  A prefix
or ranged read verifies only the chunks it copies from (a chunk straddling the
start of the range is verified whole) and never reads the chunks below it.
Nothing here unpickles anything: the header is JSON and the payload raw bytes.
"""

from __future__ import annotations

import bisect
import json
import struct
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, cast, runtime_checkable

import numpy as np
import xxhash

from sparkcache.backends import Backend, Blob
from sparkcache.buffers import PAGE_ALIGN, aligned_empty, as_byte_view
from sparkcache.cpus import cache_bytes, vendor
from sparkcache.errors import CorruptSnapshot, InvalidArgument, NotFound, UnsafeName
from sparkcache.identity import DTYPE_SIZES, ModelIdentity, canonical_json

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "CHUNK_BYTES",
    "DATA_ALIGN",
    "FORMAT",
    "InPlace",
    "Landing",
    "Pieces",
    "ReadAt",
    "SegmentHeader",
    "Sink",
    "build_header",
    "check_header",
    "check_piece",
    "copy_verified",
    "open_segment",
    "parse_header",
    "verified_view",
]

FORMAT = "sparkcache-segment-1"
#: The data starts at a multiple of this in the file (the header is padded):
#: a memory page, as the buffers reads land in (``buffers.aligned_empty``).
DATA_ALIGN = PAGE_ALIGN
#: Verification granularity: small enough to stay in L2 between hash and copy.
CHUNK_BYTES = 1 << 20


def land_bytes(l2: int | None, cpu_vendor: str) -> int:
    """The size of the parts an :class:`InPlace` chunk is read and hashed in, so
    that a part just read is still in the core's cache when it is hashed:
    256 KiB on Intel (on a 2-core Xeon it halved the hashing's cost against
    whole 1 MiB chunks), else half
    the core's L2 within [256 KiB, :data:`CHUNK_BYTES`] (on a 2-core AMD EPYC
    with 1 MiB of L2, 512 KiB parts read 195 MB in 0.8x the time of 256 KiB
    ones: fewer reads, and the hashing no slower)."""
    if cpu_vendor == "GenuineIntel" or l2 is None:
        return 256 << 10
    return max(256 << 10, min(CHUNK_BYTES, l2 // 2))


#: This machine's :func:`land_bytes`.
LAND_BYTES = land_bytes(cache_bytes(2), vendor())
#: At most this many buffers in one vectored read (Linux takes up to 1024).
LAND_PARTS = 256
#: Refuse headers larger than this (safetensors itself caps at 100 MB).
MAX_HEADER_BYTES = 64 << 20
_DIGEST_HEX = 32


def _hexdigest(view: np.ndarray) -> str:
    # numpy arrays are buffers at runtime; 3.11's stubs do not say so.
    return xxhash.xxh3_128_hexdigest(cast("Buffer", view))


def _chunk_digests(view: np.ndarray) -> str:
    return "".join(_hexdigest(view[i : i + CHUNK_BYTES]) for i in range(0, view.size, CHUNK_BYTES))


@dataclass(frozen=True)
class SegmentHeader:
    """The parsed, validated header of a segment file."""

    meta: dict[str, Any]
    data_start: int
    tensors: dict[str, tuple[int, int]]  # name -> (offset from file start, nbytes)
    digest: str

    @property
    def n_layers(self) -> int:
        return int(self.meta["n_layers"])

    @property
    def token_start(self) -> int:
        return int(self.meta["token_start"])

    @property
    def token_end(self) -> int:
        return int(self.meta["token_end"])

    def chunk_digest(self, name: str, index: int) -> str:
        hexes: str = self.meta["chunks"][name]
        return hexes[index * _DIGEST_HEX : (index + 1) * _DIGEST_HEX]


def build_header(
    meta: dict[str, Any],
    layers: Sequence[np.ndarray],
    tokens: np.ndarray,
    page_shape: Sequence[int],
    dtype: str,
) -> tuple[bytes, str]:
    """Header bytes (length prefix included) and the segment digest.

    ``layers`` are flat uint8 views of whole pages (a layer that keeps only a
    window holds fewer than the token range's blocks); ``tokens`` is a
    little-endian uint32 array.  Hashes every chunk once (xxh3_128 runs at
    memory speed, far above fsync).
    """
    page_nbytes = DTYPE_SIZES[dtype]
    for dim in page_shape:
        page_nbytes *= int(dim)
    entries: dict[str, Any] = {}
    chunks: dict[str, str] = {}
    offset = 0
    for i, layer in enumerate(layers):
        if layer.size % page_nbytes:
            raise InvalidArgument(f"layer {i} holds {layer.size} bytes, not whole pages of "
                                  f"{page_nbytes} bytes")
        entries[f"layer.{i}"] = {
            "dtype": dtype,
            "shape": [layer.size // page_nbytes, *page_shape],
            "data_offsets": [offset, offset + layer.size],
        }
        chunks[f"layer.{i}"] = _chunk_digests(layer)
        offset += layer.size
    token_bytes = tokens.view(np.uint8)
    entries["tokens"] = {
        "dtype": "U32",
        "shape": [tokens.size],
        "data_offsets": [offset, offset + token_bytes.size],
    }
    chunks["tokens"] = _chunk_digests(token_bytes)
    full_meta = dict(meta, format=FORMAT, n_layers=len(layers), chunk_bytes=CHUNK_BYTES,
                     chunks=chunks, dtype=dtype, page_shape=list(page_shape))
    entries["__metadata__"] = {"sparkcache": canonical_json(full_meta)}
    text = json.dumps(entries, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % DATA_ALIGN)  # the data starts aligned
    header = struct.pack("<Q", len(text)) + text
    return header, xxhash.xxh3_128_hexdigest(header)


def _fail(message: str, reason: str) -> CorruptSnapshot:
    return CorruptSnapshot(message, reason)


def parse_header(buf: memoryview, expected_digest: str, size: int | None = None) -> SegmentHeader:
    """Check the header against the index digest and the file size; parse it.

    ``size``: the file's size when ``buf`` holds only its first bytes (at least
    the header: a streamed read).  Raises :class:`CorruptSnapshot` on any
    mismatch (never returns bad data).
    """
    size = buf.nbytes if size is None else size
    if buf.nbytes < 8:
        raise _fail(f"segment is {buf.nbytes} bytes, too short for a header", "truncated")
    (hlen,) = struct.unpack_from("<Q", buf, 0)
    if hlen > MAX_HEADER_BYTES or 8 + hlen > min(size, buf.nbytes):
        raise _fail(f"segment header length {hlen} does not fit a {size}-byte file", "truncated")
    header = buf[: 8 + hlen]
    digest = xxhash.xxh3_128_hexdigest(header)
    if digest != expected_digest:
        raise _fail("segment header digest differs from the index", "digest")
    try:
        entries = json.loads(bytes(header[8:]))
        meta = json.loads(entries.pop("__metadata__")["sparkcache"])
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise _fail(f"segment header is not valid JSON: {exc}", "header") from exc
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise _fail("segment header is not a sparkcache segment", "header")
    data_start = 8 + hlen
    tensors: dict[str, tuple[int, int]] = {}
    end = 0
    try:
        itemsize = DTYPE_SIZES[meta["dtype"]]
        ordered = sorted(entries.items(), key=lambda kv: kv[1]["data_offsets"][0])
        for name, info in ordered:
            lo, hi = (int(x) for x in info["data_offsets"])
            count = 1
            for dim in info["shape"]:
                count *= int(dim)
            width = 4 if name == "tokens" else itemsize
            if lo != end or hi - lo != count * width:
                raise _fail(f"tensor {name} has inconsistent offsets", "header")
            tensors[name] = (data_start + lo, hi - lo)
            end = hi
    except (KeyError, TypeError, ValueError) as exc:
        raise _fail(f"segment header is malformed: {exc}", "header") from exc
    if data_start + end != size:
        raise _fail(
            f"segment holds {size} bytes but its header describes {data_start + end}",
            "truncated",
        )
    expected_names = {f"layer.{i}" for i in range(int(meta.get("n_layers", -1)))} | {"tokens"}
    if set(tensors) != expected_names:
        raise _fail("segment tensors do not match its layer count", "header")
    return SegmentHeader(meta=meta, data_start=data_start, tensors=tensors, digest=digest)


def check_header(
    buf: memoryview, digest: str, identity: ModelIdentity, rank: int, snap_key: str,
    token_start: int, token_end: int, *, size: int | None = None,
) -> SegmentHeader:
    """The one verification of a segment's header, for every reader of a segment.

    Checks the header against the index ``digest`` and the file size
    (:func:`parse_header`), then that it says what the index expects: the
    model identity's digest, ``rank``, ``snap_key``, the token range, the block
    size, the KV dtype, the page shape and the layer count.  Raises :class:`CorruptSnapshot`
    (reason ``identity`` for a field that differs).  The payload chunks are
    checked as they are read (:func:`verified_view`, :func:`copy_verified`,
    :func:`check_piece`).  ``size``: see :func:`parse_header`.
    """
    header = parse_header(buf, digest, size)
    expected = {
        "model": identity.digest(), "rank": rank, "snap_key": snap_key,
        "token_start": token_start, "token_end": token_end,
        "block_size": identity.block_size, "dtype": identity.kv_cache_dtype,
        "page_shape": list(identity.page_shape), "n_layers": identity.num_layers,
    }
    for key, value in expected.items():
        if header.meta.get(key) != value:
            raise _fail(f"segment {key} is {header.meta.get(key)!r}, expected {value!r}",
                        "identity")
    bs = identity.block_size
    for i in range(identity.num_layers):
        first = identity.first_stored_block(i, token_start // bs, token_end // bs)
        want = (token_end // bs - first) * identity.page_nbytes
        if header.tensors[f"layer.{i}"][1] != want:
            raise _fail(f"segment layer.{i} holds {header.tensors[f'layer.{i}'][1]} bytes, "
                        f"expected {want}", "shape")
    return header


@contextmanager
def open_segment(backend: Backend, key: str) -> Iterator[Blob]:
    """Open a segment file; the one missing-file rule: a segment the index
    names and the backend lacks is corrupt (reason ``missing``), not a bug, and
    so is one whose key is not a valid key inside the store (reason ``key``)."""
    try:
        blob = backend.open(key)
    except NotFound as exc:
        raise _fail(f"segment file {key} is missing", "missing") from exc
    except UnsafeName as exc:  # a tampered row: the key escapes the root
        raise _fail(f"segment key {key!r} is not a valid key inside the store", "key") from exc
    try:
        yield blob
    finally:
        blob.close()


def verified_view(buf: memoryview, header: SegmentHeader, name: str, nbytes: int) -> np.ndarray:
    """The first ``nbytes`` of tensor ``name``, every chunk checked, as a uint8 view.

    The view aliases ``buf`` (an mmap where the backend allows); use
    :func:`copy_verified` to verify and copy in one pass.
    """
    offset, total = header.tensors[name]
    if nbytes > total:
        raise _fail(f"{name} holds {total} bytes, {nbytes} requested", "shape")
    view = np.frombuffer(buf, dtype=np.uint8, count=total, offset=offset)
    _check_chunks(view, header, name, nbytes)
    return view[:nbytes]


def _check_chunks(view: np.ndarray, header: SegmentHeader, name: str, nbytes: int) -> None:
    check_piece(header, name, 0, view[: -(-nbytes // CHUNK_BYTES) * CHUNK_BYTES])


def check_piece(header: SegmentHeader, name: str, start: int, piece: np.ndarray) -> None:
    """Verify ``piece``, the bytes of tensor ``name`` from its byte ``start`` (a
    multiple of :data:`CHUNK_BYTES`), chunk by chunk: whole chunks, the last
    one short only at the tensor's end (a streamed read checks each piece as it
    arrives).  Raises :class:`CorruptSnapshot` (``digest``, or ``truncated``
    for a piece that does not end on a chunk or the tensor's end)."""
    total = header.tensors[name][1]
    if start % CHUNK_BYTES or start + piece.size > total or (
            piece.size % CHUNK_BYTES and start + piece.size != total):
        raise _fail(f"{name}: {piece.size} bytes at {start} are not whole chunks of its "
                    f"{total}", "truncated")
    first = start // CHUNK_BYTES
    for index, at in enumerate(range(0, piece.size, CHUNK_BYTES), first):
        if _hexdigest(piece[at : at + CHUNK_BYTES]) != header.chunk_digest(name, index):
            raise _fail(f"{name} chunk {index} digest mismatch (payload corrupted)", "digest")


@runtime_checkable
class Sink(Protocol):
    """A destination that is not one buffer: ``size`` bytes written by ``put``.

    :class:`Pieces` is one; a staged restore's layers
    (:class:`sparkcache.cuda.staging.LayerSink`) are another, and take their
    writes in order from byte 0, as :func:`copy_verified` makes them.
    """

    size: int

    def put(self, at: int, data: np.ndarray) -> None: ...


class Pieces:
    """A destination made of several buffers written as if they were one.

    A restore into KV-cache blocks that are not consecutive: each piece is one
    run of consecutive blocks of a layer (a view of the cache's own memory), in
    the order of the pages they receive.  ``put`` splits a write across them.
    """

    __slots__ = ("_ends", "_pieces", "size")

    def __init__(self, pieces: Sequence[Any]) -> None:
        self._pieces = [as_byte_view(p, writable=True) for p in pieces]
        self._ends: list[int] = []
        total = 0
        for piece in self._pieces:
            total += piece.size
            self._ends.append(total)
        self.size = total

    def put(self, at: int, data: np.ndarray) -> None:
        """Write ``data`` at byte ``at`` of the concatenated pieces."""
        done = 0
        for span in self.spans(at, data.size):
            span[:] = data[done:done + span.size]
            done += span.size

    def spans(self, at: int, n: int) -> list[np.ndarray]:
        """Views of bytes ``[at, at + n)`` of the concatenated pieces, in order
        (one per piece they touch)."""
        if at < 0 or n < 0 or at + n > self.size:
            raise InvalidArgument(f"{n} bytes at {at} exceed {self.size} bytes")
        i = bisect.bisect_right(self._ends, at)
        out: list[np.ndarray] = []
        done = 0
        while done < n:
            piece = self._pieces[i]
            offset = at + done - (self._ends[i] - piece.size)
            count = min(n - done, piece.size - offset)
            out.append(piece[offset:offset + count])
            done += count
            i += 1
        return out


class InPlace:
    """A destination a positional read fills *before* verifying each chunk there.

    Only for memory nothing reads until the read returns: an asynchronous
    restore's own KV blocks, which vLLM leaves alone while the request waits
    for the load (WAITING_FOR_REMOTE_KVS).  A chunk copied whole is read
    straight into its place (no bounce buffer, one copy instead of two) and
    hashed there while still in cache; a chunk that fails its digest stays
    there, so after a failure the whole destination counts as unwritten: the
    connector reports every block of the load failed and vLLM recomputes them
    (docs/architecture.md, "Segment format and verification").  A chunk only
    partly copied goes through the bounce buffer as for any destination.
    """

    __slots__ = ("_pieces", "size")

    def __init__(self, dest: Any) -> None:
        self._pieces = dest if isinstance(dest, Pieces) else Pieces([dest])
        self.size = self._pieces.size

    def put(self, at: int, data: np.ndarray) -> None:
        self._pieces.put(at, data)

    def spans(self, at: int, n: int) -> list[np.ndarray]:
        """Views of the destination's bytes ``[at, at + n)``, in order."""
        return self._pieces.spans(at, n)


@runtime_checkable
class Landing(Sink, Protocol):
    """A :class:`Sink` that lends its own memory for the next bytes: a staging
    slot (:class:`sparkcache.cuda.staging.LayerSink`), never the KV cache.

    ``reserve(at, n)`` returns ``n`` bytes of scratch room that become bytes
    ``[at, at + n)`` of the destination only when ``commit(at, n)`` is called
    (or None when it cannot lend them: then ``put``); bytes reserved and not
    committed never reach the destination.  A positional read lands a chunk
    there and verifies it in place: no bounce buffer, no copy
    (:func:`copy_verified`).  The KV cache itself is never a Landing: it is a
    plain :class:`Sink`, or an :class:`InPlace` for blocks no forward reads
    before the restore reports (an asynchronous load's own).
    """

    def reserve(self, at: int, n: int) -> np.ndarray | None: ...

    def commit(self, at: int, n: int) -> None: ...


ReadAt = Callable[[int, "np.ndarray | list[np.ndarray]"], int]
"""A positional read of the segment file: fill the array, or the arrays one
after the other (one vectored read), from a byte offset (like ``os.preadv``)
and return the number of bytes read, fewer only at its end."""


def _read_into(read_at: ReadAt, offset: int, room: Any, name: str, start: int) -> Any:
    """``room`` (an array, or a list of arrays filled in order) filled from byte
    ``offset`` of the file (a short read: ``truncated``)."""
    got = read_at(offset, room)
    size = room.size if isinstance(room, np.ndarray) else sum(part.size for part in room)
    if got != size:
        raise _fail(f"{name} chunk at byte {start}: read {got} of {size} bytes "
                    "(the file was truncated)", "truncated")
    return room


#: ``chunk_at(start, size)``: a tensor's chunk, ready to hash; ``land(start, room)``:
#: that chunk read into ``room`` (an array, or a list of arrays filled in order)
#: instead (positional reads only).
ChunkAt = Callable[[int, int], np.ndarray]
LandAt = Callable[[int, Any], Any]


def _chunk_source(buf: memoryview, header: SegmentHeader, name: str, read_at: ReadAt | None,
                  bounce: np.ndarray | None) -> tuple[ChunkAt, LandAt | None]:
    """Where :func:`copy_verified` takes tensor ``name``'s chunks from: views of
    ``buf`` (no ``read_at``), or positional reads into ``bounce`` (or a room)."""
    offset, total = header.tensors[name]
    if read_at is None:
        view = np.frombuffer(buf, dtype=np.uint8, count=total, offset=offset)

        def chunk_at(start: int, size: int) -> np.ndarray:
            return view[start : start + size]
        return chunk_at, None
    reader = read_at
    scratch = bounce if bounce is not None else aligned_empty(CHUNK_BYTES)
    if scratch.size < CHUNK_BYTES:
        raise InvalidArgument(f"bounce must hold {CHUNK_BYTES} bytes, got {scratch.size}")

    def land(start: int, room: Any) -> Any:
        return _read_into(reader, offset + start, room, name, start)

    def read_chunk(start: int, size: int) -> np.ndarray:
        return cast("np.ndarray", land(start, scratch[:size]))
    return read_chunk, land


def _land_in_place(land: LandAt, start: int, spans: Sequence[np.ndarray], digest: str,
                   what: str) -> None:
    """Read one chunk from tensor byte ``start`` into ``spans`` (its place in an
    :class:`InPlace` destination) and check it there, :data:`LAND_BYTES` at a
    time (one vectored read across spans: a KV block may be smaller), each
    part hashed right after it was read, while still in L2."""
    hasher = xxhash.xxh3_128()
    group: list[np.ndarray] = []
    size = 0
    for span in spans:
        at = 0
        while at < span.size:
            part = span[at : at + LAND_BYTES - size]
            group.append(part)
            size += part.size
            at += part.size
            if size == LAND_BYTES or len(group) == LAND_PARTS:
                _land_group(land, start, group, hasher)
                start += size
                group, size = [], 0
    if group:
        _land_group(land, start, group, hasher)
    if hasher.hexdigest() != digest:
        raise _fail(f"{what} digest mismatch (payload corrupted)", "digest")


def _land_group(land: LandAt, start: int, group: list[np.ndarray], hasher: Any) -> None:
    """Read ``group`` (consecutive bytes from ``start``) in one call, then hash it."""
    land(start, group)
    for part in group:
        hasher.update(cast("Buffer", part))


def copy_verified(
    buf: memoryview, header: SegmentHeader, name: str, nbytes: int, dest: np.ndarray | Sink,
    *, skip: int = 0, at: int = 0, read_at: ReadAt | None = None,
    bounce: np.ndarray | None = None,
) -> None:
    """Verify and copy bytes ``[skip, nbytes)`` of tensor ``name`` into ``dest``.

    ``dest`` receives byte ``skip`` at its index ``at`` and needs ``at + nbytes -
    skip`` bytes.  Chunks are verified whole, each just before it is copied,
    while it is still in cache: a chunk lying wholly below ``skip`` is neither
    read nor verified, one straddling ``skip`` is verified in full and only its
    part at or after ``skip`` copied.  No unverified byte ever reaches ``dest``,
    unless it is an :class:`InPlace` (memory nothing reads before the read
    returns): with ``read_at``, a chunk copied whole is read into its place
    there and verified in place, and a failure leaves ``dest`` unusable.

    Without ``read_at`` each chunk is hashed where it lies in ``buf``.  With it
    (the backend's positional read), each chunk is read into ``bounce`` (a
    scratch array of at least ``CHUNK_BYTES``, one per thread) and verified
    there, or, when ``dest`` is a :class:`Landing` that has room for a chunk
    copied whole, into that room and verified there (committed once it
    passed: no copy at all), or straight into an :class:`InPlace`.  A short
    read (the file shrank) is then a ``truncated`` CorruptSnapshot and an I/O
    error the backend's error, where touching a mapping past the end of its
    file, or over a failing disk, raises SIGBUS.  The bounce costs one more
    copy (an :class:`InPlace` saves it), yet beats a mapping with two threads
    and on a cold page cache (no page faults, no unmapping).
    """
    total = header.tensors[name][1]
    if nbytes > total:
        raise _fail(f"{name} holds {total} bytes, {nbytes} requested", "shape")
    if not 0 <= skip <= nbytes:
        raise InvalidArgument(f"skip must be within [0, {nbytes}] bytes, got {skip}")
    if at < 0 or at + nbytes - skip > dest.size:
        raise InvalidArgument(
            f"the destination holds {dest.size} bytes; {nbytes - skip} are copied at {at}")
    chunk_at, land = _chunk_source(buf, header, name, read_at, bounce)
    plain = isinstance(dest, (np.ndarray, Pieces, InPlace))  # (a Protocol check is slow)
    landing = dest if land is not None and not plain and isinstance(dest, Landing) else None
    in_place = dest if land is not None and isinstance(dest, InPlace) else None
    first = skip // CHUNK_BYTES
    for index, start in enumerate(range(first * CHUNK_BYTES, nbytes, CHUNK_BYTES), first):
        size = min(CHUNK_BYTES, total - start)
        lo, stop = max(start, skip), min(start + CHUNK_BYTES, nbytes)
        where = at + lo - skip
        whole = lo == start and stop - start == size  # the chunk is copied whole
        if in_place is not None and land is not None and whole:
            _land_in_place(land, start, in_place.spans(where, size),
                           header.chunk_digest(name, index), f"{name} chunk {index}")
            continue
        room = landing.reserve(where, size) if landing is not None and whole else None
        chunk = chunk_at(start, size) if room is None or land is None else land(start, room)
        if _hexdigest(chunk) != header.chunk_digest(name, index):
            raise _fail(f"{name} chunk {index} digest mismatch (payload corrupted)", "digest")
        if landing is not None and room is not None:
            landing.commit(where, size)  # verified in the sink's own room: no copy
        elif isinstance(dest, np.ndarray):
            dest[where : where + stop - lo] = chunk[lo - start : stop - start]
        else:
            dest.put(where, chunk[lo - start : stop - start])
