"""sparkcache.catalog through the admin API: models, snapshots, naming a model."""

from __future__ import annotations

import json

import pytest

from sparkcache import admin
from sparkcache.errors import InvalidArgument, NotFound

from ..filled import Filled, restored
from .helpers import identity, pages_for

# -- listing ---------------------------------------------------------------------------


def test_list_models_counts_from_model_usage(filled: Filled) -> None:
    rows = admin.list_models(filled.store)
    assert [(r.name, r.snapshots, r.deleted_at) for r in rows] == [
        ("tiny-llama", 2, None), ("other", 1, None)]
    sizes = {s.model_id: 0 for s in filled.store.snapshots()}
    for s in filled.store.snapshots():
        sizes[s.model_id] += s.nbytes
    assert {r.id: r.nbytes for r in rows} == sizes
    assert rows[0].folder == f"objects/m-{filled.ident.digest()}"
    json.dumps(admin.to_dict(rows))


def test_resolve_model_by_name_id_and_digest_prefix(filled: Filled) -> None:
    store = filled.store
    (row,) = [r for r in admin.list_models(store) if r.name == "tiny-llama"]
    for spec in ("tiny-llama", row.id, str(row.id), row.digest[:6], row.digest.upper()):
        assert admin.resolve_model(store, spec).id == row.id
    with pytest.raises(NotFound, match="known: 1:tiny-llama, 2:other"):
        admin.resolve_model(store, "llama-9")
    assert admin.resolve_model(store, "LLAMA").id == row.id  # a unique part of a name
    with pytest.raises(InvalidArgument, match="ambiguous"):
        admin.resolve_model(store, "t")  # part of both names
    with pytest.raises(NotFound):
        admin.resolve_model(store, row.digest[:3])  # too short to be a digest prefix


def test_a_name_shared_by_two_identities_is_ambiguous(filled: Filled) -> None:
    twin = identity(dtype="bfloat16")  # same name, another identity
    filled.store.publish(twin, 0, filled.toks[:16], pages_for(twin, filled.toks[:16]))
    with pytest.raises(InvalidArgument, match=r"ambiguous.*id 1 tiny-llama.*id 3 tiny-llama"):
        admin.resolve_model(filled.store, "tiny-llama")
    assert admin.resolve_model(filled.store, twin.digest()[:8]).name == "tiny-llama"


def test_list_snapshots_and_show(filled: Filled) -> None:
    store = filled.store
    restored(store, filled.ident, filled.toks)
    store.pin(filled.root)
    rows = admin.list_snapshots(store, "tiny-llama")
    assert [(r.id, r.tokens, r.parent, r.pinned, r.state) for r in rows] == [
        (filled.root, 32, None, True, "ready"), (filled.child, 64, filled.root, False, "ready")]
    assert all(r.hits == 1 for r in rows)  # a restore touches the whole chain
    assert len(admin.list_snapshots(store)) == 3

    lease = store.acquire_lease(filled.child, kind="read", ttl=60)
    detail = admin.show(store, filled.child)
    assert [(c.id, c.start_token, c.n_tokens) for c in detail.chain] == [
        (filled.root, 0, 32), (filled.child, 32, 64)]
    (seg,) = detail.segments
    assert (seg.rank, seg.token_start, seg.token_end, seg.state) == (0, 32, 64, "ready")
    assert [x.id for x in detail.leases] == [lease]
    assert admin.show(store, filled.root).children == [filled.child]
    assert detail.model_digest == filled.ident.digest()
    json.dumps(admin.to_dict(detail))
    with pytest.raises(NotFound):
        admin.show(store, 999)
