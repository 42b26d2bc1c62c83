"""Restores across TP sizes through the connector's two sides: the scheduler
offers a snapshot stored by an engine of another TP size, each worker reads
the heads it needs from the stored ranks holding them, and nothing is stored
twice.  Simulated workers over a real store (as tests/connector/test_ranks.py);
tests/vllm/test_tensor_parallel.py runs the same in real vLLM engines."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache import ModelIdentity, SnapshotStore
from sparkcache.connector.jobs import Counters, LoadJob
from sparkcache.connector.resharded import sibling_match
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.worker import WorkerIO

from .helpers import BS, LAYERS, FakePages, Req, blocks_of, finished, prompt

HEADS = 2
HEAD_NBYTES = BS * 8 * 4


def ident(tp: int) -> ModelIdentity:
    local = HEADS // tp
    return ModelIdentity(model="sim", revision="r1", num_layers=LAYERS, num_kv_heads=local,
                         head_size=4, dtype="float32", kv_cache_dtype="float32",
                         block_size=BS, page_shape=(local, BS, 8), tp_size=tp)


class Pages(FakePages):
    """A worker's KV cache of ``heads`` heads a page: ``[layers, blocks, bytes]``."""

    def __init__(self, blocks: int, heads: int, seed: int, direct: bool = True) -> None:
        super().__init__(blocks, seed, heads * HEAD_NBYTES)
        self.direct = direct

    def block_views(self, block_ids: Any) -> list[list[np.ndarray]] | None:
        # direct: host memory, written in place; else (a GPU cache) scattered.
        return super().block_views(block_ids) if self.direct else None

    def staged(self, block_ids: Any) -> Any:
        raise AssertionError("not used")


def publish(store: SnapshotStore, tp: int, p: list[int], kv: list[Pages]) -> None:
    sched = SchedulerSide(store, ident(tp), Counters(), min_tokens=BS, load_async=True)
    req = finished(Req("a", p))
    sched.finished(req, blocks_of(req))
    _loads, (save,) = sched.take_jobs()
    for rank in range(tp):
        io = WorkerIO(store, ident(tp), rank, kv[rank], Counters())  # type: ignore[arg-type]
        io.submit_save(save)
        assert io.flush()
        io.close()


def restore(store: SnapshotStore, tp: int, p: list[int],
            direct: bool) -> tuple[list[Pages], Counters]:
    counters = Counters()
    sched = SchedulerSide(store, ident(tp), counters, min_tokens=BS, load_async=True)
    sched.restores.total_kv_heads = sched.saves.total_kv_heads = HEADS
    req = Req("b", p)
    assert sched.matched_tokens(req, 0) == (len(p) - 1, True)
    sched.after_alloc(req, list(range(9, 16)), len(p) - 1)
    (load,), _ = sched.take_jobs()
    assert load.source == ident(3 - tp)
    fresh = [Pages(16, HEADS // tp, seed=50 + r, direct=direct) for r in range(tp)]
    for rank in range(tp):
        io = WorkerIO(store, ident(tp), rank, fresh[rank], Counters())  # type: ignore[arg-type]
        io.total_kv_heads = HEADS
        io.submit_load(load)
        assert io.flush()
        assert io.poll()[1] == {"b"} and not io.take_failed_blocks()
        assert io.counters.take().get("loads_direct", 0) == (1 if direct else 0)
        io.close()
    # Its save at the finish would copy the other TP size's snapshot: none.
    req = finished(Req("c", p))
    sched.finished(req, blocks_of(req))
    assert sched.take_jobs() == ([], [])
    return fresh, counters


@pytest.mark.parametrize("direct", [True, False])
def test_tp2_segments_restore_in_a_tp1_worker_and_are_not_stored_again(
        tmp_path: Path, direct: bool) -> None:
    store = SnapshotStore(tmp_path / "s")
    kv = [Pages(16, 1, seed=rank) for rank in (0, 1)]
    p = prompt(100, 1)
    publish(store, 2, p, kv)
    (one,), counters = restore(store, 1, p, direct)
    for layer in range(LAYERS):  # each page: rank 0's head, then rank 1's
        np.testing.assert_array_equal(one.arr[layer, 9:16, :HEAD_NBYTES], kv[0].arr[layer, :7])
        np.testing.assert_array_equal(one.arr[layer, 9:16, HEAD_NBYTES:], kv[1].arr[layer, :7])
    assert counters.take().get("saves_known") == 1
    assert len(store.snapshots()) == 1


@pytest.mark.parametrize("direct", [True, False])
def test_a_tp1_segment_restores_in_each_tp2_worker(tmp_path: Path, direct: bool) -> None:
    store = SnapshotStore(tmp_path / "s")
    kv = [Pages(16, 2, seed=7)]
    p = prompt(100, 2)
    publish(store, 1, p, kv)
    two, _counters = restore(store, 2, p, direct)
    for rank in (0, 1):
        heads = slice(rank * HEAD_NBYTES, (rank + 1) * HEAD_NBYTES)
        np.testing.assert_array_equal(two[rank].arr[:, 9:16], kv[0].arr[:, :7, heads])
    assert len(store.snapshots()) == 1


def test_a_sharding_that_cannot_be_resharded_is_not_offered(tmp_path: Path) -> None:
    """Another pipeline-parallel size: a miss at the scheduler, not a failed load."""
    store = SnapshotStore(tmp_path / "s")
    staged = ModelIdentity(model="sim", revision="r1", num_layers=LAYERS, num_kv_heads=1,
                           head_size=4, dtype="float32", kv_cache_dtype="float32",
                           block_size=BS, page_shape=(1, BS, 8), tp_size=2, pp_size=2)
    p = prompt(64, 3)
    for rank in range(4):
        store.publish(staged, rank, p, [np.zeros((4, HEAD_NBYTES), np.uint8)] * LAYERS)
    assert store.lookup(staged, p) is not None
    tokens = np.asarray(p, np.uint32)
    assert sibling_match(store, ident(1), HEADS, tokens, None) is None
    publish(store, 2, p, [Pages(16, 1, seed=rank) for rank in (0, 1)])  # tp=2, pp=1
    found = sibling_match(store, ident(1), HEADS, tokens, None)
    assert found is not None and found.identity == ident(2)


@pytest.mark.parametrize("direct", [True, False])
def test_a_split_in_step_restore_of_another_tp_size_is_one_hit(
        tmp_path: Path, direct: bool) -> None:
    """An in-step restore whose last block the forward shares is read in two
    parts, each from both stored ranks: the store counts one hit."""
    store = SnapshotStore(tmp_path / "s")
    kv = [Pages(16, 1, seed=rank) for rank in (0, 1)]
    p = prompt(100, 4)
    publish(store, 2, p, kv)
    match = store.lookup(ident(2), p)
    assert match is not None
    n = match.n_tokens
    ids = tuple(range(9, 9 + n // BS))
    job = LoadJob("b", match.snapshot_id, n, np.asarray(p[:n], np.uint32), 0, (ids,),
                  in_step=True, source=ident(2), computes_from=n - 2)
    split = job.split(BS)
    assert split is not None and split[1] is not None  # two parts
    one = Pages(16, HEADS, seed=50, direct=direct)
    io = WorkerIO(store, ident(1), 0, one, Counters())  # type: ignore[arg-type]
    io.total_kv_heads = HEADS
    before = store.stats()
    io.start_step_loads([job])
    io.finish_step_loads(all_layers_waited=True)
    assert io.take_failed_blocks() == set()
    io.close()
    for layer in range(LAYERS):
        np.testing.assert_array_equal(one.arr[layer, list(ids), :HEAD_NBYTES],
                                      kv[0].arr[layer, :len(ids)])
        np.testing.assert_array_equal(one.arr[layer, list(ids), HEAD_NBYTES:],
                                      kv[1].arr[layer, :len(ids)])
    assert store.stats()["hits"] - before.get("hits", 0) == 1


def test_an_engine_start_reads_another_tp_sizes_snapshot_and_counts_it_warm(
        tmp_path: Path) -> None:
    """``start_warm`` given the model's KV heads reads the snapshots stored by
    an engine of another TP size too (tests/store/test_warm.py checks the
    files' residency): the cost model then counts such a snapshot warm."""
    import time

    from sparkcache.connector.costs import PREFILL, bucket_of

    store = SnapshotStore(tmp_path / "s")
    p = prompt(100, 3)
    publish(store, 2, p, [Pages(16, 1, seed=rank) for rank in (0, 1)])
    (stored,) = store.snapshots()
    counters = Counters()
    sched = SchedulerSide(store, ident(1), counters, min_tokens=BS, load_async=True, costs=True)
    sched.restores.total_kv_heads = HEADS
    now = time.time()
    sched.costs.clock = lambda: now + 3600  # last used an hour ago: cold by its age
    sched.costs.set(PREFILL, 1e-4, bucket=bucket_of(len(p)))
    sched.costs.set("local_cold", 1e-5)  # a slow disk: a cold restore does not pay
    assert sched.matched_tokens(Req("cold", p), 0) == (0, False)
    sched.start_warm(1 << 30)  # without the KV heads: its own sharding only, none
    assert sched.warmer is not None and sched.warmer.join(30)
    assert sched.warmer.result is not None and sched.warmer.result.snapshots == frozenset()
    sched.start_warm(1 << 30, HEADS)
    assert sched.warmer.join(30)
    result = sched.warmer.result
    assert result is not None and result.snapshots == {stored.id} and result.files == 2
    assert counters.take()["warmed_bytes"] == result.nbytes > 0
    assert sched.matched_tokens(Req("warm", p), 0) == (len(p) - 1, True)
    sched.close()
    store.close()


def test_a_longer_match_of_another_tp_size_wins_over_a_shorter_one_of_its_own(
        tmp_path: Path) -> None:
    """Its own sharding holds the prompt's first blocks (a shared system prompt
    it saved), an engine of another TP size the whole prompt (the
    conversation, from before the TP size changed): the longer is restored."""
    store = SnapshotStore(tmp_path / "s")
    p = prompt(100, 4)
    publish(store, 2, p, [Pages(16, 1, seed=rank) for rank in (0, 1)])
    publish(store, 1, p[:40], [Pages(16, 2, seed=5)])
    sched = SchedulerSide(store, ident(1), Counters(), min_tokens=BS, load_async=True)
    own = sched.restores.store.lookup(ident(1), np.asarray(p, np.uint32))
    assert own is not None and 0 < own.n_tokens < len(p) - 1  # its own: a prefix
    # The KV heads unknown: no other TP size is looked at, its own prefix is offered.
    got, _ = sched.matched_tokens(Req("a", p), 0)
    assert 0 < got < len(p) - 1
    sched.restores.total_kv_heads = HEADS
    req = Req("b", p)
    assert sched.matched_tokens(req, 0) == (len(p) - 1, True)
    sched.after_alloc(req, list(range(9, 16)), len(p) - 1)
    (load,), _ = sched.take_jobs()
    assert load.source == ident(2)
    sched.close()
    store.close()


def test_the_other_shardings_are_read_from_the_index_every_few_seconds(
        tmp_path: Path) -> None:
    from sparkcache.connector.resharded import Siblings

    now = [0.0]
    stores = [SnapshotStore(tmp_path / name) for name in ("a", "b")]
    by_time, by_fetch = (Siblings(s, ident(1), seconds=5, clock=lambda: now[0]) for s in stores)
    assert by_time(HEADS) == [] and by_fetch(HEADS) == []
    for store in stores:
        publish(store, 2, prompt(100, 6), [Pages(16, 1, seed=rank) for rank in (0, 1)])
    now[0] = 4.9
    assert by_time(HEADS) == [] and by_fetch(HEADS) == []  # kept, not read again
    assert by_fetch(HEADS, fresh=True) == [ident(2)]  # a fetch landed: read now
    now[0] = 5.0
    assert by_time(HEADS) == [ident(2)]  # read again
    assert by_time(0) == []  # the KV heads unknown: none
    for store in stores:
        store.close()


def test_no_save_of_a_prompt_another_tp_size_holds_whole_though_its_own_holds_a_prefix(
        tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "s")
    p = prompt(100, 8)
    publish(store, 2, p, [Pages(16, 1, seed=rank) for rank in (0, 1)])
    publish(store, 1, p[:40], [Pages(16, 2, seed=5)])
    before = {s.id for s in store.snapshots()}
    counters = Counters()
    sched = SchedulerSide(store, ident(1), counters, min_tokens=BS, load_async=True)
    sched.saves.total_kv_heads = HEADS
    req = finished(Req("c", p))
    sched.finished(req, blocks_of(req))
    assert sched.take_jobs() == ([], [])
    assert counters.take().get("saves_known") == 1
    assert {s.id for s in store.snapshots()} == before
    sched.close()
    store.close()
