"""Fetching a sliding-window model's snapshots from the shared tier (moto's S3).

A layer that keeps a window stores it only at its snapshot's end, so such a
snapshot restores only a prompt that reaches exactly its end.  The fetch asks
for the manifests ending at the prompt's last whole block, at the end of the
snapshot its best stride alias names (when the prompt holds it whole) and at
its breakpoints; what it finds is local afterwards as a whole snapshot,
restored at its end.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from sparkcache import ModelIdentity, SnapshotStore
from sparkcache.hashing import prefix_hashes, prefix_seed
from sparkcache.identity import WINDOW_BLOCKS_KEY
from sparkcache.shared import parse_manifest
from sparkcache.shared.fetch import MAX_BREAKPOINT_PROBES
from sparkcache.shared.layout import alias_key, manifest_bytes, manifest_key, used_key

from ..s3server import s3_calls
from ..store.helpers import BLOCK, identity, pages_for, tokens
from ..store.test_windows import KEEP, window_pages, windowed
from .conftest import Tier

HostFactory = Callable[..., SnapshotStore]
IDENT = windowed()
MODEL = IDENT.digest()
TOKS = tokens(40, seed=11)  # the snapshot host a publishes: 10 blocks
N = TOKS.size
#: A snapshot's fetch: its manifest (our HEAD and the GET), its segment (a HEAD,
#: its header, its token ids, its layers) and the use record's PUT.
HIT = 2 + 4 + 1


def uploaded(host: HostFactory, tier: Tier) -> SnapshotStore:
    """Host ``a`` with one windowed snapshot of :data:`TOKS`, in the tier."""
    a = host("a", tier)
    assert a.publish(IDENT, 0, TOKS, window_pages(IDENT, TOKS)).state == "ready"
    report = a.upload()
    assert (len(report.uploaded), report.error) == (1, None)
    return a


def restored(store: SnapshotStore, toks: np.ndarray) -> list[np.ndarray]:
    """The local lookup finds the whole snapshot (at its end) and reads it."""
    match = store.lookup(IDENT, toks, whole_first=True)
    assert match is not None and match.n_tokens == N
    assert store.snapshot(match.snapshot_id).n_tokens == N  # its end: its window is there
    nblocks = N // BLOCK
    out = [np.zeros(KEEP * IDENT.page_nbytes, np.uint8),
           np.zeros(nblocks * IDENT.page_nbytes, np.uint8)]
    assert store.read_into(match, 0, out, start_tokens=[(nblocks - KEEP) * BLOCK, 0]) == nblocks
    return out


def test_a_snapshot_ending_at_the_prompts_last_block_is_fetched(s3_tier: Tier,
                                                                host: HostFactory) -> None:
    a = uploaded(host, s3_tier)
    b = host("b", s3_tier)
    assert b.shared is not None
    prompt = np.concatenate([TOKS, tokens(3, seed=5)])  # the prompt: 40 tokens and a partial block
    with s3_calls(b.shared.backend.fs) as calls:
        result = b.fetch(IDENT, prompt)
    assert (result.outcome, result.n_tokens, len(result.fetched)) == ("fetched", N, 1)
    assert result.requests == HIT
    # never an alias, never a listing: the manifest (our HEAD, one ranged GET),
    # the segment (our HEAD, three ranged GETs), the use record's PUT
    assert calls == {"HeadObject": 1 + 1, "GetObject": 1 + 3, "PutObject": 1}
    pages = restored(b, TOKS)
    assert [p.tobytes() for p in pages] == [p.tobytes() for p in window_pages(IDENT, TOKS)]
    assert [p.tobytes() for p in pages] == [p.tobytes() for p in restored(a, TOKS)]
    assert b.shared.exists(used_key(MODEL, a.snapshot(1).snap_key))
    assert b.stats()["fetches"] == 1
    again = b.fetch(IDENT, prompt)
    assert (again.outcome, again.fetched) == ("local", [])


def test_a_snapshot_ending_at_a_breakpoint_is_fetched(s3_tier: Tier, host: HostFactory) -> None:
    """Host a uploads a longer snapshot first (the aliases at 16 and 32 name
    it: the first upload's alias stays), then :data:`TOKS`'s: a prompt that
    goes on past :data:`TOKS` another way finds its end only by its breakpoint."""
    a = host("a", s3_tier)
    longer = np.concatenate([TOKS, tokens(20, seed=12)])
    for toks in (longer, TOKS):
        assert a.publish(IDENT, 0, toks, window_pages(IDENT, toks)).state == "ready"
    assert len(a.upload().uploaded) == 2
    b = host("b", s3_tier)
    prompt = np.concatenate([TOKS, tokens(30, seed=6)])  # goes on past the snapshot
    # breakpoints are rounded down to a block, probed longest first: 41 -> 40
    result = b.fetch(IDENT, prompt, breakpoints=[20, 41])
    assert (result.outcome, result.n_tokens) == ("fetched", N), result
    # the prompt's end (none); the aliases at 16, 48 (none) and 32, a GET of the one at
    # 32 (naming the longer one); the breakpoint at 40
    assert result.requests == 1 + 3 + 2 + HIT
    restored(b, prompt[:N])


def test_a_new_turn_fetches_the_snapshot_its_stride_alias_names(
    s3_tier: Tier, host: HostFactory,
) -> None:
    """A prompt that goes on past the snapshot without a breakpoint at its end
    (the next turn of a stored conversation): the prompt's best stride alias
    names the snapshot, whose key is the prompt's prefix hash at its end, so
    that end is fetched."""
    uploaded(host, s3_tier)
    b = host("b", s3_tier)
    prompt = np.concatenate([TOKS, tokens(4000, seed=7)])
    result = b.fetch(IDENT, prompt)
    assert (result.outcome, result.n_tokens) == ("fetched", N), result
    # the last block's manifest (none); the aliases of the first stride and of
    # a bisection of 1010 blocks' 252 strides; the best alias's GET; the fetch
    assert result.requests == 1 + 9 + 2 + HIT, result.requests
    restored(b, prompt[:N])


def test_a_miss_costs_two_heads_and_one_per_breakpoint(s3_tier: Tier,
                                                       host: HostFactory) -> None:
    """A prompt the tier holds nothing of costs the last block's manifest HEAD
    and the first stride's alias HEAD; one that shares part of the snapshot
    (its aliases at 16 and 32 name it) but not its end (where its window is)
    reads the best alias too, and is a miss."""
    uploaded(host, s3_tier)
    b = host("b", s3_tier)
    assert b.shared is not None
    other = tokens(4000, seed=8)
    with s3_calls(b.shared.backend.fs) as calls:
        result = b.fetch(IDENT, other)
    assert result.outcome == "miss" and result.requests == 2
    assert calls == {"HeadObject": 2}
    # one HEAD more per breakpoint, at most MAX_BREAKPOINT_PROBES
    marks = [8, 12, 16, 20, 24, 28, 36]
    result = b.fetch(IDENT, other, breakpoints=marks)
    assert result.outcome == "miss" and result.requests == 2 + MAX_BREAKPOINT_PROBES
    # shares 36 tokens: the aliases at 16 and 32 are the snapshot's, its end is not
    diverging = np.concatenate([TOKS[:36], tokens(4000, seed=9)])
    hashes = prefix_hashes(prefix_seed(IDENT, None), TOKS, BLOCK)
    assert b.shared.exists(alias_key(MODEL, hashes[32 // BLOCK - 1].hex()))
    result = b.fetch(IDENT, diverging)
    assert result.outcome == "miss", result
    assert result.requests == 1 + 9 + 2  # as for a hit above, but no fetch
    assert b.lookup(IDENT, diverging) is None
    # inside the snapshot (its window is not stored there): a miss
    assert b.fetch(IDENT, TOKS[:32]).outcome == "miss"
    assert b.stats()["fetch_misses"] == 4 and "fetches" not in b.stats()


def test_another_window_layout_is_a_miss(s3_tier: Tier, host: HostFactory) -> None:
    uploaded(host, s3_tier)
    b = host("b", s3_tier)
    other = dataclasses.replace(identity(), extra=((WINDOW_BLOCKS_KEY, f"{KEEP + 1},0"),))
    for ident in (other, identity()):  # another window; no window (full attention)
        result = b.fetch(ident, TOKS)
        assert result.outcome == "miss" and b.lookup(ident, TOKS) is None, ident


def _rewrite_manifest(a: SnapshotStore, **changes: object) -> None:
    assert a.shared is not None
    key = a.snapshot(1).snap_key
    m = parse_manifest(a.shared.get(manifest_key(MODEL, key)) or b"", MODEL, key)
    if "start_token" in changes:
        start = changes["start_token"]
        changes["segments"] = tuple(dataclasses.replace(g, token_start=start)
                                    for g in m.segments)
    a.shared.put(manifest_key(MODEL, key), [manifest_bytes(dataclasses.replace(m, **changes))])


def test_a_manifest_with_a_parent_is_a_clean_miss(s3_tier: Tier, host: HostFactory) -> None:
    """A windowed snapshot never has a parent: one that names one is refused
    before a byte of its segment is read, and nothing becomes local."""
    a = uploaded(host, s3_tier)
    _rewrite_manifest(a, parent="ab" * 16, start_token=20)
    b = host("b", s3_tier)
    result = b.fetch(IDENT, TOKS)
    assert result.outcome == "miss" and "has a parent" in (result.reason or "")
    # the manifest's HEAD and GET; the aliases of strides 16 and 32, and a GET
    # of the one at 32 (naming that snapshot): no segment
    assert result.requests == 2 + 2 + 2
    assert b.lookup(IDENT, TOKS) is None and b.stats()["fetch_refused"] == 1


def _flip(ident: ModelIdentity, a: SnapshotStore, layer: int) -> None:
    """Flip a byte in the middle of ``layer``'s rows of a's segment in the tier."""
    assert a.shared is not None
    key = a.snapshot(1).snap_key
    m = parse_manifest(a.shared.get(manifest_key(MODEL, key)) or b"", MODEL, key)
    seg_key = m.segments[0].key
    with a.shared.backend.open(seg_key) as blob:
        data = bytearray(blob.buffer)
    rows = pages_for(ident, TOKS)[layer]
    if ident.window_blocks[layer]:
        rows = rows[-ident.window_blocks[layer]:]
    at = bytes(data).find(rows.tobytes())
    assert at > 0
    data[at + rows.nbytes // 2] ^= 0x01
    a.shared.put(seg_key, [bytes(data)])


def test_a_flipped_byte_of_the_window_is_refused(s3_tier: Tier, host: HostFactory) -> None:
    """Only the chunk digest can tell: the fetch is refused, nothing is local,
    the prompt is recomputed (a miss), never restored with the flipped row."""
    a = uploaded(host, s3_tier)
    _flip(IDENT, a, 0)  # layer 0 keeps its window: the sliding-window rows
    b = host("b", s3_tier)
    result = b.fetch(IDENT, TOKS)
    assert result.outcome == "refused" and result.n_tokens == N, result
    assert b.lookup(IDENT, TOKS) is None
    assert b.stats()["fetch_refused"] == 1 and "fetches" not in b.stats()
