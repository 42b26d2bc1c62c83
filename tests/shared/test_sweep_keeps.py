"""What the tier's sweep must not read, and what it must not delete."""

from __future__ import annotations

import json

from sparkcache.shared import TierLimits, sweep_tier
from sparkcache.shared.layout import MAX_JSON_BYTES, TIER_VERSION, manifest_key

from ..s3server import s3_calls
from .conftest import Tier
from .test_sweep import MODEL, HostFactory, kinds, later, manifests, publish_chains, state_of


def test_an_object_too_large_for_a_manifest_is_not_read(
        s3_tier: Tier, host: HostFactory) -> None:
    """The listing gives each object's size: one under a manifest key that is
    larger than a manifest may be is ``invalid`` without a GET of its bytes."""
    store = host("a", s3_tier)
    publish_chains(store, [1])
    store.upload()
    shared = store.shared
    assert shared is not None
    big = manifest_key(MODEL, "ef" * 16)
    shared.put(big, [b"x" * (MAX_JSON_BYTES + 1)])
    fs = shared.backend.fs  # type: ignore[attr-defined]
    with s3_calls(fs) as calls:
        report = sweep_tier(shared, TierLimits(max_age_hours=0), dry_run=True)
    assert report.deleted == {"invalid": [big]}
    assert calls["GetObject"] == 2  # the two real manifests, not the large object
    assert sweep_tier(shared, TierLimits(max_age_hours=0)).deleted == {"invalid": [big]}
    assert not shared.exists(big)


def test_a_newer_sparkcaches_manifests_are_kept_with_what_they_name(
        tier: Tier, host: HostFactory) -> None:
    """A manifest of a newer layout (a host already upgraded, in a rolling
    upgrade) cannot be read here: it is kept, with its segments, its aliases,
    its use record and its children, even after the grace."""
    store = host("a", tier)
    chains = publish_chains(store, [1, 2])
    store.upload()
    shared = store.shared
    assert shared is not None
    root, child = chains[1]
    key = manifest_key(MODEL, root)
    doc = json.loads(shared.get(key) or b"")
    doc["version"] = TIER_VERSION + 1
    shared.put(key, [json.dumps(doc).encode()])
    before = {k: v for k, v in kinds(shared).items() if not k.startswith("sweep.")}
    report = sweep_tier(shared, TierLimits(max_age_hours=0), clock=later(3 * 3600))
    assert report.count == 0 and report.objects_deleted == 0, report.deleted
    assert report.newer == 1
    after = {k: v for k, v in kinds(shared).items() if not k.startswith("sweep.")}
    assert after == before and manifests(shared) == sorted([*chains[1], *chains[2]])
    # no age nor budget either: a readable leaf may be a newer snapshot's parent
    report = sweep_tier(shared, TierLimits(max_age_hours=1, mb=1e-6), clock=later(3 * 3600))
    assert report.count == 0 and report.objects_deleted == 0
    assert shared.exists(manifest_key(MODEL, child))
    assert state_of(shared, chains[2][1]) == "whole"
    # a model without newer manifests is swept as before
    shared.put(key, [json.dumps({**doc, "version": TIER_VERSION}).encode()])
    report = sweep_tier(shared, TierLimits(max_age_hours=1), clock=later(3 * 3600))
    assert report.counts() == {"age": 4} and manifests(shared) == []
