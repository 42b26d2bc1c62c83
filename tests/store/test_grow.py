"""SnapshotStore.grow: a match reaches the last whole block a prompt shares with
its snapshot, not only the last boundary row (stride alias) below it.

Measured before: a 1440-token shared system prompt restored 1280 tokens after a
restart (the 256-token stride below), while vLLM's own prefix cache served 1440.
"""

from __future__ import annotations

import numpy as np
import pytest

from sparkcache import CorruptSnapshot, InvalidArgument, SnapshotStore

from .helpers import LAYERS, identity, pages_for, tokens
from .test_ranged_read import _flip, _publish_chain


def _diverging(toks: np.ndarray, at: int, n: int) -> np.ndarray:
    """A prompt of ``n`` tokens sharing exactly the first ``at`` with ``toks``."""
    prompt = np.concatenate([toks[:at], tokens(n - at, seed=99)])
    prompt[at] = toks[at] + 1 if at < toks.size else prompt[at]
    return prompt


def test_a_shared_prefix_grows_past_the_stride_alias(store: SnapshotStore) -> None:
    ident, toks = identity(), tokens(64)
    store.publish(ident, 0, toks, pages_for(ident, toks))  # stride 16: rows at 16, 32, 48
    prompt = _diverging(toks, 42, 60)  # shares 42 tokens: blocks up to 40
    match = store.lookup(ident, prompt[:60])
    assert match is not None and match.n_tokens == 32  # the stride alias below 42
    grown = store.grow(match, prompt[:60])
    assert (grown.snapshot_id, grown.n_tokens) == (match.snapshot_id, 40)
    np.testing.assert_array_equal(grown.token_ids, prompt[:40])
    pages = store.read(grown, 0)  # the grown match restores, verified
    for got, want in zip(pages, pages_for(ident, toks[:40]), strict=True):
        np.testing.assert_array_equal(got, want)


def test_growth_stops_at_the_prompt_and_at_the_snapshot(store: SnapshotStore) -> None:
    ident, toks = identity(), tokens(40)
    store.publish(ident, 0, toks, pages_for(ident, toks))
    longer = np.concatenate([toks, tokens(30, seed=5)])  # goes on past the snapshot
    match = store.lookup(ident, longer[:68])
    assert match is not None and match.n_tokens == 40  # its end row
    assert store.grow(match, longer[:68]) is match  # nothing stored past the end
    short = store.lookup(ident, toks[:38])
    assert short is not None and short.n_tokens == 32
    assert store.grow(short, toks[:38]).n_tokens == 36  # whole blocks of the prompt only
    same = _diverging(toks, 33, 40)  # differs inside the block after the alias
    alias = store.lookup(ident, same)
    assert alias is not None and store.grow(alias, same) is alias


def test_growth_reads_a_parent_links_tokens(store: SnapshotStore) -> None:
    c = _publish_chain(store, (24, 64))  # links [0,24) [24,64): stride rows at 16, 32, 48
    prompt = _diverging(c.toks, 22, 48)
    match = store.lookup(c.ident, prompt)
    assert match is not None and (match.snapshot_id, match.n_tokens) == (c.match.snapshot_id, 16)
    grown = store.grow(match, prompt)  # tokens [16, 20) lie in the parent's segment
    assert grown.n_tokens == 20
    pages = store.read(grown, 0)
    for got, want in zip(pages, pages_for(c.ident, c.toks[:20]), strict=True):
        np.testing.assert_array_equal(got, want)


def test_damaged_stored_tokens_are_a_quarantining_miss(store: SnapshotStore) -> None:
    c = _publish_chain(store, (16, 64))
    prompt = _diverging(c.toks, 40, 60)
    match = store.lookup(c.ident, prompt)
    assert match is not None and match.n_tokens == 32
    _flip(c.files[1], "tokens", 4 * 20)  # token 36: in the part grow reads
    with pytest.raises(CorruptSnapshot):
        store.grow(match, prompt)
    assert store.snapshot(c.match.snapshot_id).state == "quarantined"


def test_bad_arguments(store: SnapshotStore) -> None:
    ident, toks = identity(), tokens(32)
    store.publish(ident, 0, toks, pages_for(ident, toks))
    match = store.lookup(ident, toks[:20])
    assert match is not None
    with pytest.raises(InvalidArgument, match="begin with"):
        store.grow(match, tokens(24, seed=3))
    assert len(store.read(match, 0)) == LAYERS
