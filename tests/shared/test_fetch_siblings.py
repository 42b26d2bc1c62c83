"""Fetching what an engine of another TP size put in the shared tier.

Host a publishes a snapshot as a TP=1 engine and uploads it; host b, a TP=2
engine of the same model, finds nothing under its own model in the tier, so
its fetch asks the tier's other shardings of the same KV and makes the TP=1
snapshot local, where each of its ranks reads its heads of it (verified), as
from any local snapshot of another TP size.
"""

from __future__ import annotations

import json
from collections.abc import Callable

import numpy as np
import pytest

from sparkcache import SnapshotStore
from sparkcache.reshard import siblings
from sparkcache.shared import SharedTier, tier_siblings
from sparkcache.shared.layout import model_key, model_prefix

from ..store.test_reshard import HEADS, TOKENS, full_kv, ident, publish, rank_pages, read_pages
from .conftest import Tier

HostFactory = Callable[..., SnapshotStore]


def uploaded(host: HostFactory, tier: Tier, tp: int = 1) -> tuple[SnapshotStore, np.ndarray]:
    """Host a with a snapshot of ``TOKENS`` stored by a TP=``tp`` engine, in the tier."""
    a = host("a", tier)
    kv = full_kv()
    publish(a, tp, kv, TOKENS)
    report = a.upload()
    assert (len(report.uploaded), report.error) == (1, None)
    return a, kv


def test_an_engine_of_another_tp_size_fetches_and_restores_it(
    tier: Tier, host: HostFactory,
) -> None:
    _a, kv = uploaded(host, tier, tp=1)
    b = host("b", tier)
    engine = ident(2)
    assert b.fetch(engine, TOKENS).outcome == "miss"  # its own sharding only: nothing
    result = b.fetch(engine, TOKENS, total_kv_heads=HEADS)
    assert (result.outcome, result.n_tokens, len(result.fetched)) == ("fetched", len(TOKENS), 1)
    assert b.lookup(engine, TOKENS) is None  # local now, under the TP=1 identity
    assert siblings(b._core, engine, HEADS) == [ident(1)]
    match = b.lookup(ident(1), TOKENS)
    assert match is not None and match.n_tokens == len(TOKENS)
    for rank in range(2):
        for got, want in zip(read_pages(b._core, match, engine, rank), rank_pages(kv, 2, rank),
                             strict=True):
            np.testing.assert_array_equal(got, want)
    assert b.fetch(engine, TOKENS, total_kv_heads=HEADS).outcome == "local"


def test_a_miss_in_every_sharding_is_counted_once(tier: Tier, host: HostFactory) -> None:
    uploaded(host, tier, tp=1)
    b = host("b", tier)
    other = [7, *TOKENS[1:]]  # no prefix of it stored anywhere
    result = b.fetch(ident(2), other, total_kv_heads=HEADS)
    assert result.outcome == "miss" and result.requests >= 2  # both shardings asked
    assert b.stats().get("fetch_misses") == 1


def test_only_true_siblings_are_listed(tier: Tier, host: HostFactory,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """The TP=1 and TP=4 identities are siblings of TP=2; another model's is not,
    nor a folder whose ``model.json`` names another digest; the listing is made
    once per SIBLINGS_SECONDS."""
    a = host("a", tier)
    for tp in (1, 4):
        publish(a, tp, full_kv(), TOKENS)
    other_model = ident(1, model="another")
    a.publish(other_model, 0, TOKENS, rank_pages(full_kv(), 1, 0))
    assert a.upload().error is None
    tier_obj = SharedTier(tier.url, tier.options, alias_stride=16)
    try:
        # A folder named for the TP=8 identity whose model.json is the TP=1 one.
        forged = ident(8).digest()
        tier_obj.put_once(model_key(forged), json.dumps(ident(1).to_dict()).encode())
        listed = 0
        real = tier_obj.backend.folders

        def counted(prefix: str) -> object:
            nonlocal listed
            listed += 1
            return real(prefix)

        monkeypatch.setattr(tier_obj.backend, "folders", counted)
        found = tier_siblings(tier_obj, ident(2), HEADS)
        assert sorted(i.tp_size for i in found) == [1, 4]
        assert model_prefix(forged) not in {model_prefix(i.digest()) for i in found}
        assert tier_siblings(tier_obj, ident(2), HEADS) == found and listed == 1
        assert tier_siblings(tier_obj, ident(2), 0) == []  # the KV heads unknown
    finally:
        tier_obj.close()
