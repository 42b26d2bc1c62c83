"""What the tier holds but cannot serve this engine is a counted refusal, found
before any download, and the next candidate is tried."""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from sparkcache.shared.layout import (
    Alias,
    SegmentEntry,
    alias_bytes,
    alias_key,
    manifest_bytes,
    manifest_key,
    parse_manifest,
    segment_key,
)

from .conftest import Tier
from .test_fetch import IDENT, MODEL, HostFactory, prompt, uploaded
from .test_upload import publish_chain


def test_a_snapshot_of_another_world_size_is_a_counted_refusal(
        tier: Tier, host: HostFactory) -> None:
    """The tier's root of the prompt says it was sharded over two ranks (a tp=2
    engine's, in a tier where engines of several sizes share a model): a
    counted refusal before any download, never an exception out of ``fetch``."""
    a = uploaded(host, tier)
    shared = a.shared
    assert shared is not None
    root_key = a.snapshot(1).snap_key
    key = manifest_key(MODEL, root_key)
    m = parse_manifest(shared.get(key) or b"", MODEL, root_key)
    g = m.segments[0]
    other = SegmentEntry(1, segment_key(MODEL, root_key, 1, g.digest), g.nbytes, g.digest,
                         g.token_start, g.token_end)
    shared.put(key, [manifest_bytes(replace(m, world_size=2, segments=(g, other)))])
    b = host("b", tier)
    toks = prompt(32)
    result = b.fetch(IDENT, toks)
    assert result.outcome == "miss" and result.fetched == [] and result.nbytes == 0
    assert result.reason is not None and "world size 2" in result.reason
    assert b.stats()["fetch_refused"] >= 1
    assert b.lookup(IDENT, toks) is None


def test_an_alias_naming_a_snapshot_without_its_prefix_is_passed_over(
        tier: Tier, host: HostFactory) -> None:
    """The alias at a prompt's end names another conversation's snapshot (of the
    right length): refused before its download, and the next stride's alias,
    which names the prompt's own chain, is fetched instead."""
    a = uploaded(host, tier)  # chain 1: a root of 32 tokens, its child of 64
    other = publish_chain(a, seed=2)
    assert a.upload().error is None
    shared = a.shared
    assert shared is not None
    toks = prompt(64)
    end_hash = a.snapshot(2).snap_key  # the prefix hash at 64 tokens of chain 1
    wrong = a.snapshot(other[1]).snap_key
    shared.put(alias_key(MODEL, end_hash), [alias_bytes(Alias(end_hash, 64, wrong, 64))])
    b = host("b", tier)
    result = b.fetch(IDENT, toks)
    assert result.outcome == "fetched" and result.n_tokens == 48
    assert {b.snapshot(s).snap_key for s in result.fetched} == {a.snapshot(1).snap_key,
                                                                end_hash}
    assert b.stats()["fetch_refused"] == 1
    match = b.lookup(IDENT, toks)
    assert match is not None and match.n_tokens >= 48
    assert np.array_equal(b.read(match, 0)[0], a.read(a.lookup(IDENT, toks[:match.n_tokens]),
                                                      0)[0])
