"""KV events for stored snapshots (sparkcache.connector.events), without an engine:
the hashes against vLLM's own block pool, the reference counting, and the
thread that reads a real store.  The engine test is tests/vllm/test_kv_events.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm")

from vllm import SamplingParams
from vllm.distributed.kv_events import BlockRemoved, BlockStored
from vllm.lora.request import LoRARequest
from vllm.utils.hashing import get_hash_fn_by_name
from vllm.v1.core import kv_cache_utils
from vllm.v1.core.block_pool import BlockPool
from vllm.v1.request import Request

from sparkcache import SnapshotStore
from sparkcache.connector.events import (
    MEDIUM,
    Announcer,
    Chain,
    StorageEvents,
    request_chain,
    stored_chain,
)
from sparkcache.connector.jobs import Counters, SaveJob
from sparkcache.identity import RequestScope
from sparkcache.serve.tenants import tenant_salt

from ..store.helpers import identity, pages_for, tokens

BS = 16
HASH = get_hash_fn_by_name("sha256")


@pytest.fixture(autouse=True)
def none_hash() -> None:
    kv_cache_utils.init_none_hash(HASH)  # what vLLM's engine core does at start


def vllm_request(toks: list[int], *, salt: str | None = None,
                 lora: LoRARequest | None = None, req_id: str = "r") -> Request:
    return Request(req_id, toks, SamplingParams(max_tokens=1), None, cache_salt=salt,
                   lora_request=lora,
                   block_hasher=kv_cache_utils.get_request_block_hasher(BS, HASH))


def pool_event(request: Request) -> BlockStored:
    """What vLLM's own block pool announces when it caches the request's full blocks."""
    n = request.num_tokens // BS
    pool = BlockPool(n + 2, True, BS, enable_kv_cache_events=True)
    pool.cache_full_blocks(request, pool.get_new_blocks(n), 0, n, BS, 0)
    (event,) = pool.take_events()
    assert isinstance(event, BlockStored)
    return event


def same_blocks(chain: Chain | None, event: BlockStored) -> None:
    assert chain is not None
    assert list(chain.hashes) == event.block_hashes
    assert list(chain.token_ids) == event.token_ids
    assert list(chain.extra_keys) == (event.extra_keys or [])
    assert (chain.lora_id, chain.lora_name) == (event.lora_id, event.lora_name)


@pytest.mark.parametrize("salt", [None, "client-salt", tenant_salt("acme", None),
                                  tenant_salt("acme", "client-salt")])
def test_a_stored_snapshot_hashes_as_vllms_pool_does(salt: str | None) -> None:
    toks = [int(t) for t in tokens(5 * BS + 3, seed=1)]
    event = pool_event(vllm_request(toks, salt=salt))
    scope = None if salt is None else RequestScope(cache_salt=salt, tenant="acme")
    same_blocks(stored_chain(toks, scope, BS, BS, HASH), event)
    # The salt is in the hash: another salt names other blocks.
    other = stored_chain(toks, RequestScope(cache_salt="other"), BS, BS, HASH)
    assert other is not None and not set(other.hashes) & set(event.block_hashes)


def test_a_live_requests_chain_is_vllms_with_its_lora() -> None:
    toks = [int(t) for t in tokens(4 * BS, seed=2)]
    request = vllm_request(toks, salt="s", lora=LoRARequest("adapter", 7, "/adapters/a"))
    event = pool_event(request)
    same_blocks(request_chain(request, 4 * BS, BS, BS), event)
    assert event.lora_id == 7
    plain = stored_chain(toks, RequestScope(cache_salt="s"), BS, BS, HASH)
    assert plain is not None and plain.hashes[0] != event.block_hashes[0]
    # The adapter's path is not stored: a LoRA snapshot is not hashed from its scope.
    assert stored_chain(toks, RequestScope(lora="adapter:7"), BS, BS, HASH) is None
    assert stored_chain(toks, RequestScope(mm_hashes=("img",)), BS, BS, HASH) is None
    assert request_chain(request, 5 * BS, BS, BS) is None  # more than it has hashes of


def test_a_block_is_stored_with_its_first_snapshot_and_removed_with_its_last() -> None:
    toks = [int(t) for t in tokens(8 * BS, seed=3)]
    a = stored_chain(toks[:5 * BS], None, BS, BS, HASH)
    b = stored_chain(toks[:3 * BS] + toks[6 * BS:8 * BS], None, BS, BS, HASH)
    assert a is not None and b is not None and a.hashes[:3] == b.hashes[:3]
    ann = Announcer(BS)
    (first,) = ann.add(1, a)
    assert first.block_hashes == list(a.hashes) and first.parent_block_hash is None
    assert first.medium == MEDIUM == "STORAGE" and first.block_size == BS
    (second,) = ann.add(2, b)  # only its own two blocks, after the shared three
    assert second.block_hashes == list(b.hashes[3:])
    assert second.parent_block_hash == a.hashes[2]
    assert second.token_ids == toks[6 * BS:8 * BS]
    assert ann.add(2, b) == [] and ann.add(3, a) == []  # held already / all blocks held
    assert ann.remove(3) == []  # a's blocks are still held by snapshot 1
    (gone,) = ann.remove(1)
    assert isinstance(gone, BlockRemoved) and gone.block_hashes == list(a.hashes[3:])
    (last,) = ann.remove(2)
    assert last.block_hashes == list(b.hashes) and last.medium == MEDIUM
    assert ann.held == set()
    assert Announcer(BS, max_blocks=4).add(1, a) == []  # over the bound: not announced


def collect(events: StorageEvents, want: int, timeout: float = 10) -> list[Any]:
    got: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(got) < want and time.monotonic() < deadline:
        got += events.take()
        time.sleep(0.01)
    return got


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SnapshotStore]:
    with SnapshotStore(tmp_path / "store", alias_stride=BS) as s:
        yield s


def events_of(store: SnapshotStore, counters: Counters, digest: int = 64) -> StorageEvents:
    return StorageEvents(store.root, identity(block_size=BS), counters, hash_fn=HASH, digest=digest,
                         poll_seconds=0.02)


def test_the_store_is_announced_at_start_then_as_it_changes(store: SnapshotStore) -> None:
    ident, counters = identity(block_size=BS), Counters()
    old, new = tokens(3 * BS, seed=4), tokens(2 * BS, seed=5)
    first = store.publish(ident, 0, old, pages_for(ident, old)).snapshot_id
    second = store.publish(ident, 0, new, pages_for(ident, new)).snapshot_id
    store.delete(first)  # gone before the engine starts: never announced
    events = events_of(store, counters)
    try:
        (digest,) = collect(events, 1)
        assert digest.block_hashes == list(stored_chain(new, None, BS, BS, HASH).hashes)
        salted = tokens(4 * BS, seed=6)
        scope = RequestScope(cache_salt=tenant_salt("t", None), tenant="t")
        third = store.publish(ident, 0, salted, pages_for(ident, salted), scope=scope)
        (stored,) = collect(events, 1)
        expect = stored_chain(salted, scope, BS, BS, HASH)
        assert stored.block_hashes == list(expect.hashes)
        assert stored.token_ids == [int(t) for t in salted]
        store.delete(second)
        store.delete(third.snapshot_id)
        removed = collect(events, 2)
        assert {tuple(e.block_hashes) for e in removed} == {
            tuple(digest.block_hashes), tuple(expect.hashes)}
        assert all(isinstance(e, BlockRemoved) and e.medium == MEDIUM for e in removed)
        assert collect(events, 1, timeout=0.2) == []
    finally:
        events.close()


def test_the_digest_at_start_is_bounded_most_recently_used_first(
        store: SnapshotStore) -> None:
    ident = identity(block_size=BS)
    toks = [tokens(2 * BS, seed=10 + i) for i in range(3)]
    for t in toks:
        store.publish(ident, 0, t, pages_for(ident, t))
    events = events_of(store, Counters(), digest=2)
    try:
        got = collect(events, 2)
        got += collect(events, 1, timeout=0.5)  # the bound: no third
        assert [e.token_ids for e in got] == [[int(x) for x in t] for t in toks[:0:-1]]
    finally:
        events.close()


def test_a_save_is_announced_with_its_requests_hashes_lora_included(
        store: SnapshotStore) -> None:
    ident, counters = identity(block_size=BS), Counters()
    toks = tokens(3 * BS, seed=20)
    scope = RequestScope(lora="adapter:7")
    events = events_of(store, counters)
    try:
        assert collect(events, 1, timeout=0.2) == []  # an empty store: no digest
        request = vllm_request([int(t) for t in toks], lora=LoRARequest("adapter", 7, "/a"))
        events.admitted(request)
        events.finished(request)
        events.planned([SaveJob("r", toks, ((1, 2, 3),), None, scope, ())])
        store.publish(ident, 0, toks, pages_for(ident, toks), scope=scope)
        (stored,) = collect(events, 1)
        same_blocks(request_chain(request, toks.size, BS, BS), stored)
        assert stored.block_hashes == pool_event(request).block_hashes
        assert stored.lora_id == 7 and stored.lora_name == "adapter"
        # The same kind of snapshot that no request of this engine saved: not
        # announced (its adapter's path is not stored), and counted.
        other = tokens(2 * BS, seed=21)
        store.publish(ident, 0, other, pages_for(ident, other), scope=scope)
        unannounced, deadline = 0, time.monotonic() + 10
        while not unannounced and time.monotonic() < deadline:  # the poller's count
            unannounced += counters.take().get("events_unannounced", 0)
            time.sleep(0.01)
        assert unannounced == 1
        assert collect(events, 1, timeout=0.2) == []
    finally:
        events.close()


def test_no_events_from_a_store_of_another_model(store: SnapshotStore) -> None:
    other = identity(model="other", block_size=BS)
    toks = tokens(2 * BS, seed=30)
    store.publish(other, 0, toks, pages_for(other, toks))
    events = events_of(store, Counters())
    try:
        assert collect(events, 1, timeout=0.3) == []
        assert np.array_equal(store.catalog.tokens(1), toks)
    finally:
        events.close()


def test_a_snapshot_is_announced_once_every_rank_published_it(store: SnapshotStore) -> None:
    ident = identity(world=2, block_size=BS)  # one engine of TP 2: one announcement
    toks = tokens(2 * BS, seed=40)
    store.publish(ident, 0, toks, pages_for(ident, toks, rank=0))
    events = StorageEvents(store.root, ident, Counters(), hash_fn=HASH, poll_seconds=0.02)
    try:
        assert collect(events, 1, timeout=0.3) == []  # pending at start: not in the digest
        assert store.publish(ident, 1, toks, pages_for(ident, toks, rank=1)).state == "ready"
        (stored,) = collect(events, 1)
        assert stored.block_hashes == list(stored_chain(toks, None, BS, BS, HASH).hashes)
        assert collect(events, 1, timeout=0.3) == []
    finally:
        events.close()


def test_another_tp_sizes_snapshots_are_announced_given_the_kv_heads(tmp_path: Path) -> None:
    """A TP=1 engine restores a TP=2 engine's snapshot of the same KV
    (tests/connector/test_resharded.py): with the model's KV heads in all, it
    announces it, and its removal; without them, nothing."""
    from ..store.test_reshard import BS as TP_BS
    from ..store.test_reshard import HEADS, TOKENS, full_kv, ident, publish

    with SnapshotStore(tmp_path / "tp") as tp_store:
        publish(tp_store, 2, full_kv(), TOKENS)
        (stored_id,) = [s.id for s in tp_store.snapshots()]
        blind = StorageEvents(tp_store.root, ident(1), Counters(), hash_fn=HASH,
                              poll_seconds=0.02)
        events = StorageEvents(tp_store.root, ident(1), Counters(), hash_fn=HASH,
                               poll_seconds=0.02, total_kv_heads=HEADS)
        try:
            assert collect(blind, 1, timeout=0.3) == []
            (stored,) = collect(events, 1)
            assert isinstance(stored, BlockStored) and stored.medium == MEDIUM
            chain = stored_chain(np.asarray(TOKENS, np.uint32), None, TP_BS, TP_BS, HASH)
            assert stored.block_hashes == list(chain.hashes)
            tp_store.delete(stored_id)
            (removed,) = collect(events, 1)
            assert isinstance(removed, BlockRemoved)
            assert removed.block_hashes == stored.block_hashes
        finally:
            blind.close()
            events.close()
