"""The one verified read of a whole segment (``verification.read_segment``) and
the checks a whole snapshot passes with it (``same_tokens``, ``check_key``),
shared by an import, a fetch from the shared tier, an upload, an export and
``verify``.  Each damage below is one that only the check under test can see."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import pytest

from sparkcache import ModelIdentity, RequestScope, SnapshotStore
from sparkcache.errors import CorruptSnapshot
from sparkcache.hashing import prefix_hashes, prefix_seed
from sparkcache.segment import CHUNK_BYTES
from sparkcache.verification import VerifiedSegment, check_key, read_segment, same_tokens

from .helpers import identity, tokens

BLOCK = 64
#: 640 blocks of 4 KiB pages: each layer 2.5 MiB, three verification chunks.
N_TOKENS = 640 * BLOCK


@dataclass
class Stored:
    """One published segment: what the index says of it, and its file's bytes."""

    ident: ModelIdentity
    toks: np.ndarray
    pages: list[np.ndarray]
    snap_key: str
    digest: str
    data: bytes

    def read(self, buf: memoryview | None = None, **kwargs: object) -> VerifiedSegment:
        buf = memoryview(self.data) if buf is None else buf
        return read_segment(buf, self.digest, self.ident, 0, self.snap_key, 0, N_TOKENS,
                            **kwargs)  # type: ignore[arg-type]

    def damaged(self, name: str, at: int) -> memoryview:
        """The file with one bit of tensor ``name``'s byte ``at`` flipped."""
        offset, _ = self.read(layers=False).header.tensors[name]
        data = bytearray(self.data)
        data[offset + at] ^= 0x01
        return memoryview(data)


@pytest.fixture
def stored(store: SnapshotStore) -> Stored:
    ident, toks = identity(block_size=BLOCK), tokens(N_TOKENS)
    rng = np.random.default_rng(7)
    pages = [rng.integers(0, 256, (N_TOKENS // BLOCK, ident.page_nbytes), np.uint8)
             for _ in range(ident.num_layers)]
    sid = store.publish(ident, 0, toks, pages).snapshot_id
    with store._core.read() as conn:
        (g,) = store._core.segments(conn, sid)
    assert g.digest is not None
    return Stored(ident, toks, pages, store.snapshot(sid).snap_key, g.digest,
                  (store.root / g.object_key).read_bytes())


def test_a_whole_segment_reads_back_verified(stored: Stored) -> None:
    buf = memoryview(stored.data)
    read = stored.read(buf)
    assert read.tokens.dtype == np.uint32 and np.array_equal(read.tokens, stored.toks)
    assert not np.shares_memory(read.tokens, np.frombuffer(buf, np.uint8))  # outlives buf
    assert [len(x) for x in read.layers] == [p.nbytes for p in stored.pages]
    assert all(np.array_equal(x, p.reshape(-1))
               for x, p in zip(read.layers, stored.pages, strict=True))
    assert read.header.n_layers == stored.ident.num_layers
    bare = stored.read(buf, layers=False)
    assert bare.layers == () and np.array_equal(bare.tokens, stored.toks)
    ticks: list[int] = []
    stored.read(buf, nbytes=len(stored.data), tick=ticks.append)
    assert sum(ticks) == len(stored.data)  # every byte counted once


@pytest.mark.parametrize(("name", "at"), [
    ("tokens", 4 * 1000),  # a token id: its chunk's digest, nothing else, tells
    ("layer.0", CHUNK_BYTES + 5),  # a middle chunk of the first layer
    ("layer.1", 5 * CHUNK_BYTES // 2 - 1),  # the last (short) chunk of the last layer
])
@pytest.mark.parametrize("layers", [True, False])
def test_a_flipped_bit_anywhere_is_a_digest_failure(stored: Stored, name: str, at: int,
                                                    layers: bool) -> None:
    """``layers=False`` keeps no view of the layers but verifies them all the same."""
    with pytest.raises(CorruptSnapshot, match=f"{name} chunk {at // CHUNK_BYTES} digest") as exc:
        stored.read(stored.damaged(name, at), layers=layers)
    assert exc.value.reason == "digest"


def test_the_size_and_the_header_are_checked_first(stored: Stored) -> None:
    cases: list[tuple[dict[str, object], str]] = [
        ({"nbytes": len(stored.data) + 1}, "truncated"),
        ({"buf": memoryview(stored.data[:-1])}, "truncated"),
    ]
    for kwargs, reason in cases:
        with pytest.raises(CorruptSnapshot) as exc:
            stored.read(**kwargs)  # type: ignore[arg-type]
        assert exc.value.reason == reason
    buf = memoryview(stored.data)
    for args, reason in [
        ((stored.digest[::-1], stored.ident, 0, stored.snap_key, 0, N_TOKENS), "digest"),
        ((stored.digest, stored.ident, 1, stored.snap_key, 0, N_TOKENS), "identity"),
        ((stored.digest, stored.ident, 0, "0" * 32, 0, N_TOKENS), "identity"),
        ((stored.digest, stored.ident, 0, stored.snap_key, 0, N_TOKENS - BLOCK), "identity"),
        ((stored.digest, identity(block_size=BLOCK, model="other"), 0, stored.snap_key, 0,
          N_TOKENS), "identity"),
    ]:
        with pytest.raises(CorruptSnapshot) as exc:
            read_segment(buf, *args)
        assert exc.value.reason == reason, args


def test_ranks_must_agree_on_the_token_ids(stored: Stored) -> None:
    toks = stored.toks
    same_tokens(None, toks, stored.snap_key)  # the first rank
    same_tokens(toks, toks.copy(), stored.snap_key)
    other = toks.copy()
    other[-1] += 1
    with pytest.raises(CorruptSnapshot, match=f"ranks of {stored.snap_key} disagree") as exc:
        same_tokens(toks, other, stored.snap_key)
    assert exc.value.reason == "tokens"


def test_the_key_must_be_the_hash_of_the_token_ids(stored: Stored) -> None:
    ident, toks, key = stored.ident, stored.read(layers=False).tokens, stored.snap_key
    default = RequestScope()
    hashes = check_key(ident, toks, key, scope=default, parent_key=None, reason="x", message="m")
    assert hashes == prefix_hashes(prefix_seed(ident, default), toks, BLOCK)
    assert hashes[-1].hex() == key
    # a child continues from its parent's key, not from the scope's seed
    cut = 8 * BLOCK
    parent_key = hashes[cut // BLOCK - 1].hex()
    tail = check_key(ident, toks[cut:], key, scope=default, parent_key=parent_key,
                     reason="x", message="m")
    assert tail == hashes[cut // BLOCK:]
    other = toks.copy()
    other[3] += 1  # verified bytes that are not this key's tokens (an edited manifest)
    for args, kwargs in [
        ((ident, other, key), {"scope": default, "parent_key": None}),
        ((ident, toks, key), {"scope": RequestScope(cache_salt="s"), "parent_key": None}),
        ((ident, toks[cut:], key), {"scope": default, "parent_key": None}),
        ((ident, toks[cut:], key), {"scope": default, "parent_key": hashes[0].hex()}),
        ((ident, toks[:0], key), {"scope": default, "parent_key": None}),  # no block at all
    ]:
        with pytest.raises(CorruptSnapshot, match=r"^wrong key$") as exc:
            check_key(*args, reason="scope", message="wrong key", **kwargs)  # type: ignore[arg-type]
        assert exc.value.reason == "scope"
