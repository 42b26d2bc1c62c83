"""Restores without vLLM: what the scheduler side offers, and how a worker loads it.

Simulated requests and KV caches (numpy pages) over a real store; the
asynchronous path (the request waits while the loader thread reads).
In-step loads are in test_in_step.py, tensor parallelism in test_ranks.py.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache import SnapshotStore
from sparkcache.connector.jobs import Counters, LoadJob
from sparkcache.connector.restores import Leases
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.worker import WorkerIO
from sparkcache.errors import StoreClosed

from ..store.helpers import forge_tokens
from .helpers import BS, FakePages, Req, identity, prompt, save


def test_the_block_holding_the_prompts_end_is_restored(one_rank: Any) -> None:
    """A stored answer goes on past the prompt: the block holding the prompt's
    last tokens is restored too, so vLLM computes only the last token - also
    after a hit in vLLM's own prefix cache on the whole blocks before it."""
    store, sched, io, counters = one_rank
    p = prompt(100, 31)
    save(sched, io, Req("a", p))  # 112 tokens stored: p and 12 answer tokens
    (snap,) = store.snapshots()
    assert snap.n_tokens == 112
    again = Req("b", p)  # 99 offered: the 100th is the one vLLM computes
    # 96 were a local hit; one block past it is read in the step, not waited for
    assert sched.matched_tokens(again, 96) == (3, False)
    sched.after_alloc(again, [40, 41, 42, 43, 44, 45, 50], 3)
    (load,), _ = sched.take_jobs()
    assert (load.start_block, load.blocks, load.n_tokens) == (6, ((50,),), 112)
    # The job's token ids: the prompt, then the stored answer tokens of that block.
    np.testing.assert_array_equal(load.token_ids, [*p, *prompt(16, 999)[:12]])
    fresh = FakePages(64, seed=9)
    untouched = fresh.arr.copy()
    restorer = WorkerIO(store, identity(), 0, fresh, counters)
    try:
        restorer.submit_load(load)
        assert restorer.flush()
        assert restorer.poll()[1] == {"b"} and not restorer.take_failed_blocks()
        np.testing.assert_array_equal(fresh.arr[:, 50], io.pages.arr[:, 6])  # a's block 6
        np.testing.assert_array_equal(np.delete(fresh.arr, 50, axis=1),
                                      np.delete(untouched, 50, axis=1))
    finally:
        restorer.close()
    sched.on_output({"b"}, ())
    # The tail leaves the stored tokens at 98: restored up to there.
    assert sched.matched_tokens(Req("c", [*p[:98], 7, 8]), 0) == (98, True)
    # It leaves them at the block's first token: whole blocks only.
    assert sched.matched_tokens(Req("c2", [*p[:96], p[96] + 1, 7, 8, 9]), 0) == (96, True)
    # The prompt ends where the snapshot does: nothing past it to restore.
    assert sched.matched_tokens(Req("d", [*p, *prompt(16, 999)[:12], 5]), 0) == (112, True)
    # A prompt under one block: nothing to match, not even looked up.
    counters.take()
    assert sched.matched_tokens(Req("s", p[:BS - 2]), 0) == (0, False)
    assert "lookups" not in counters.take()
    # Switched off: whole blocks only, and nothing past a local hit on all of them.
    whole = SchedulerSide(store, identity(), Counters(), min_tokens=BS, publish=False,
                          tail_block=False)
    assert whole.matched_tokens(Req("e", p), 0) == (96, True)
    assert whole.matched_tokens(Req("f", p), 96) == (0, False)
    # A snapshot whose file is found missing when its tail block is checked is
    # quarantined and not offered at all (not even its whole blocks).
    gone = Req("g", p)
    store.backend.delete(next(iter(store.backend.list("objects"))))
    assert sched.matched_tokens(gone, 0) == (0, False)
    assert [(s.state, s.reason) for s in store.snapshots()] == [("quarantined", "missing")]


def test_compute_tokens_leaves_the_prompts_last_tokens_to_vllm(one_rank: Any) -> None:
    """``compute_tokens=2`` (the CPU backend's default, where a lone token
    takes vLLM's split-KV path): a restore supplies all but the prompt's last
    two tokens, through the stored block holding them, and a prompt one token
    past a block boundary restores into the block before it."""
    store, sched, io, _counters = one_rank
    p = prompt(100, 32)
    save(sched, io, Req("a", p))  # 112 tokens stored: p and 12 answer tokens
    two = SchedulerSide(store, identity(), Counters(), min_tokens=BS, publish=False,
                        compute_tokens=2)
    assert two.matched_tokens(Req("b", p), 0) == (98, True)  # vLLM computes 98 and 99
    assert two.matched_tokens(Req("c", p), 96) == (2, False)
    assert sched.matched_tokens(Req("d", p), 0) == (99, True)  # the default: one token
    # A prompt one token past a block boundary (97): saved under the same rule,
    # its prompt-end alias is at 80, and a resend restores 95 tokens through the
    # stored block 80..95 (the default restores the 96 whole ones, computes one).
    saver = SchedulerSide(store, identity(), Counters(), min_tokens=BS, compute_tokens=2)
    q = prompt(97, 33)
    save(saver, io, Req("q", q))  # its whole blocks: q and answer tokens
    assert two.matched_tokens(Req("e", q), 0) == (95, True)
    assert two.matched_tokens(Req("f", q), 80) == (15, False)
    whole = SchedulerSide(store, identity(), Counters(), min_tokens=BS, publish=False,
                          tail_block=False, compute_tokens=2)
    assert whole.matched_tokens(Req("g", q), 0) == (80, True)


def test_concurrent_requests_wait_for_one_load(one_rank: Any) -> None:
    _store, sched, io, counters = one_rank
    p = prompt(100, 4)
    save(sched, io, Req("a", p))
    leader, follower = Req("b", [*p, 1, 2]), Req("c", [*p, 3, 4])
    # The stored block after 96 holds p's last 4 tokens, then the answer's.
    assert sched.matched_tokens(leader, 0) == (100, True)
    sched.after_alloc(leader, list(range(7)), 100)
    # The follower shares the base being loaded: "ask again" (None), no lookup.
    lookups = counters.take().get("lookups", 0)
    assert sched.matched_tokens(follower, 0) == (None, False)
    assert sched.matched_tokens(follower, 0) == (None, False)
    assert counters.take().get("lookups", 0) == 0
    sched.on_output({"b"}, ())
    # Landed: vLLM's own prefix cache now covers the follower's 96 tokens (its
    # whole blocks); the stored block offers the 4 after them.
    assert sched.matched_tokens(follower, 96) == (4, False)
    assert sched.matched_tokens(follower, 100) == (0, False)
    # A request not sharing the base is never held back.
    assert sched.matched_tokens(Req("d", prompt(100, 5)), 0) == (0, False)
    assert lookups == 1


def test_a_corrupt_snapshot_reports_its_blocks(one_rank: Any, tmp_path: Path) -> None:
    _store, sched, io, counters = one_rank
    p = prompt(100, 10)
    save(sched, io, Req("a", p))
    (segment,) = (tmp_path / "s").glob("objects/*/*/*.safetensors")
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF  # in a layer's payload: found on the worker
    segment.write_bytes(bytes(data))
    req = Req("b", p)
    assert sched.matched_tokens(req, 32) == (67, True)  # 32 tokens are a local hit
    sched.after_alloc(req, [20, 21, 22, 23, 24, 25, 26], 67)
    (load,), _ = sched.take_jobs()
    assert load.start_block == 2 and load.blocks == ((22, 23, 24, 25, 26),)
    io.submit_load(load)
    assert io.flush()
    assert io.poll()[1] == {"b"}
    assert io.take_failed_blocks() == {22, 23, 24, 25, 26}
    assert counters.take()["load_failures"] == 1
    assert sched.matched_tokens(Req("c", p), 0) == (None, False)  # b's load in flight
    sched.on_output({"b"}, ())
    assert sched.matched_tokens(Req("c", p), 0) == (0, False)  # quarantined: a miss


@pytest.mark.parametrize("in_step", [False, True], ids=["async", "in-step"])
def test_an_asynchronous_load_lands_in_place(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch, in_step: bool,
) -> None:
    """An asynchronous load's blocks are read by no forward before it reports,
    so its chunks land in them and are verified there (``in_place``); a load
    read under the forward (in-step) goes through the bounce buffer.  Either
    way the request's blocks receive the stored pages and nothing else."""
    store, sched, io, _counters = one_rank
    p = prompt(100, 12)
    save(sched, io, Req("a", p))
    req = Req("b", p)
    assert sched.matched_tokens(req, 32) == (67, True)
    sched.after_alloc(req, [20, 21, 22, 23, 24, 25, 26], 67)
    (load,), _ = sched.take_jobs()
    seen: list[bool] = []
    real = store.read_into

    def spy(*args: Any, **kwargs: Any) -> int:
        seen.append(kwargs["in_place"])
        return real(*args, **kwargs)

    monkeypatch.setattr(store, "read_into", spy)
    fresh = FakePages(64, seed=9)
    untouched = fresh.arr.copy()
    restorer = WorkerIO(store, identity(), 0, fresh, Counters())
    try:
        restorer.submit_load(dataclasses.replace(load, in_step=in_step))
        assert restorer.flush()
        assert restorer.poll()[1] == {"b"} and not restorer.take_failed_blocks()
    finally:
        restorer.close()
    assert seen and set(seen) == {not in_step}  # (in-step: its last block read first)
    np.testing.assert_array_equal(fresh.arr[:, 22:27], io.pages.arr[:, 2:7])  # a's blocks
    np.testing.assert_array_equal(np.delete(fresh.arr, range(22, 27), axis=1),
                                  np.delete(untouched, range(22, 27), axis=1))


def _planned_load(one_rank: Any, p: list[int]) -> LoadJob:
    """``p`` saved by request "a", then request "b" of the same prompt planned:
    its load (of whatever the scheduler offered) into blocks 20-26."""
    _store, sched, io, _counters = one_rank
    save(sched, io, Req("a", p))
    req = Req("b", p)
    claim, _ = sched.matched_tokens(req, 0)
    sched.after_alloc(req, list(range(20, 27)), claim)
    (load,), _ = sched.take_jobs()
    return load


@pytest.mark.parametrize("in_step", [False, True])
def test_a_landed_loads_hit_is_written_after_it_reports(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch, in_step: bool,
) -> None:
    """The hit's index write waits until the load has reported (vLLM may use
    the blocks then), and is made by the loading thread right after: another
    process sees it once the load ended."""
    store = one_rank[0]
    load = _planned_load(one_rank, prompt(100, 13))
    with SnapshotStore(store.root) as other:
        before = other.stats().get("hits", 0)
        unsaved: list[int] = []
        real = store.save_counts

        def spy(**kwargs: Any) -> None:  # the hit is not in the index before the save
            unsaved.append(other.stats().get("hits", 0) - before)
            real(**kwargs)

        monkeypatch.setattr(store, "save_counts", spy)
        restorer = WorkerIO(store, identity(), 0, FakePages(64, seed=9), Counters())
        try:
            if in_step:
                restorer.start_step_loads([dataclasses.replace(load, in_step=True)])
                restorer.finish_step_loads(all_layers_waited=True)
            else:
                restorer.submit_load(load)
                assert restorer.flush() and restorer.poll()[1] == {"b"}
            assert unsaved == [0]
            assert other.stats()["hits"] == before + 1
        finally:
            restorer.close()


def test_a_hit_that_cannot_be_written_does_not_stop_the_loader(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The hit's write after a load landed may meet a store closed at shutdown:
    the load still reports landed, and the loader thread goes on to the next."""
    store = one_rank[0]
    load = _planned_load(one_rank, prompt(100, 14))
    loads = [load, dataclasses.replace(load, req_id="c", blocks=(tuple(range(30, 37)),))]

    def closed(**kwargs: Any) -> None:
        raise StoreClosed("this SnapshotStore was closed")

    monkeypatch.setattr(store, "save_counts", closed)
    restorer = WorkerIO(store, identity(), 0, FakePages(64, seed=9), Counters())
    try:
        for load in loads:
            restorer.submit_load(load)
        assert restorer.flush(timeout=10)
        assert restorer.poll()[1] == {"b", "c"} and not restorer.take_failed_blocks()
    finally:
        restorer.close()


def test_stored_ids_unlike_the_index_are_offered_once(one_rank: Any) -> None:
    """A snapshot whose file is consistent in itself but holds other token ids
    than its index rows were made from: the worker's load fails and the
    snapshot is quarantined, so it is not offered again (was: a caller's
    mistake, nothing quarantined, offered and failed on every request)."""
    store, sched, io, counters = one_rank
    p = prompt(100, 12)
    save(sched, io, Req("a", p))
    (snap,) = store.snapshots()
    forge_tokens(store, snap.id, np.asarray(prompt(snap.n_tokens, 13), np.uint32))
    req = Req("b", p)
    offered, _ = sched.matched_tokens(req, 0)
    assert offered == 96  # not the tail block: its stored ids differ from the prompt
    sched.after_alloc(req, list(range(20, 27)), offered)
    (load,), _ = sched.take_jobs()
    io.submit_load(load)
    assert io.flush()
    assert io.poll()[1] == {"b"} and io.take_failed_blocks() == set(range(20, 26))
    assert counters.take()["load_failures"] == 1
    sched.on_output({"b"}, ())
    assert [(s.state, s.reason) for s in store.snapshots()] == [("quarantined", "tokens")]
    assert sched.matched_tokens(Req("c", p), 0) == (0, False)


def test_a_planned_restore_leases_its_snapshot(one_rank: Any) -> None:
    """Between the lookup and the read nothing may evict the snapshot."""
    store, sched, io, _counters = one_rank
    p = prompt(100, 16)
    save(sched, io, Req("a", p))
    (snap,) = store.snapshots()
    req = Req("b", [*p, 1])
    assert sched.matched_tokens(req, 0) == (100, True)
    assert store.evict(count=None) == [snap.id]  # not yet planned: evictable
    save(sched, io, Req("a2", p))
    (snap,) = store.snapshots()
    assert sched.matched_tokens(req, 0) == (100, True)
    sched.after_alloc(req, list(range(7)), 100)
    assert store.evict(count=None) == []  # leased until the load lands
    with pytest.raises(Exception, match="leased"):
        store.delete(snap.id)
    (load,), _ = sched.take_jobs()
    io.submit_load(load)
    assert io.flush()
    sched.on_output(io.poll()[1], ())
    assert sched.restores.leases.flush()  # (released on a thread of its own)
    assert store.evict(count=None) == [snap.id]
    # A synchronous load (never reported) holds its lease until the request finishes.
    sync = SchedulerSide(store, identity(), Counters(), min_tokens=BS, load_async=False,
                         publish=False)
    save(sched, io, Req("a3", p))
    req = Req("c", [*p, 2])
    assert sync.matched_tokens(req, 0) == (100, False)
    sync.after_alloc(req, list(range(7)), 100)
    assert store.evict(count=None) == []
    sync.finished(req, list(range(7)))
    assert sync.restores.leases.flush()
    assert len(store.evict(count=None)) == 1


def test_a_lease_is_released_off_the_callers_thread(tmp_path: Path) -> None:
    """An acquire is written before it returns; a release returns at once and
    the lease thread writes it; a lease on a snapshot that went is counted;
    a second acquire for a request releases its first; close releases all."""
    with SnapshotStore(tmp_path / "s") as store:
        io = WorkerIO(store, identity(), 0, FakePages(32, 1), Counters())
        sched = SchedulerSide(store, identity(), Counters(), min_tokens=BS, load_async=True)
        save(sched, io, Req("a", prompt(100, 31)))
        (snap,) = store.snapshots()

        def held() -> int:
            with store._core.read() as conn:
                return len(store._core.leases(conn, snap.id))

        counters = Counters()
        leases = Leases(store, counters)
        leases.acquire("r1", snap.id)
        assert held() == 1
        gate = threading.Event()
        real = store.release_lease

        def slow(lease: int) -> bool:
            gate.wait(10)
            return real(lease)

        store.release_lease = slow  # type: ignore[method-assign]
        started = time.monotonic()
        leases.release("r1")
        assert time.monotonic() - started < 1.0  # (the write waits for the gate)
        assert not leases.flush(timeout=0.2) and held() == 1
        gate.set()
        assert leases.flush() and held() == 0
        store.release_lease = real  # type: ignore[method-assign]
        leases.release("r1")  # nothing held: nothing queued
        assert leases.flush(timeout=0)
        leases.acquire("r2", snap.id)
        leases.acquire("r2", snap.id)  # its first lease goes
        assert leases.flush() and held() == 1
        leases.acquire("r3", 10**9)  # no such snapshot
        assert counters.take()["lease_failures"] == 1
        leases.close()
        assert held() == 0
        assert store.evict(count=None) == [snap.id]
        io.close()


def test_asking_again_changes_nothing_but_the_offer(one_rank: Any) -> None:
    """vLLM may ask ``get_num_new_matched_tokens`` several times for one request
    (its blocks did not fit; another load was in flight): each answer stands
    alone, and only the last offer is planned once blocks are allocated."""
    _store, sched, io, counters = one_rank
    p = prompt(100, 17)
    save(sched, io, Req("a", p))
    req = Req("b", [*p, 1])
    counters.take()
    assert sched.matched_tokens(req, 0) == (100, True)
    assert sched.matched_tokens(req, 0) == (100, True)
    assert sched.matched_tokens(req, 32) == (68, True)  # now 32 are a local hit
    assert sched.take_jobs() == ([], [])  # nothing planned before the allocation
    sched.after_alloc(req, list(range(7)), 68)
    (load,), _ = sched.take_jobs()
    assert (load.start_block, load.blocks) == (2, ((2, 3, 4, 5, 6),))
    got = counters.take()
    assert (got["lookups"], got["hits"], got["hit_tokens"]) == (3, 1, 68)
    assert "misses" not in got


def test_a_full_load_queue_fails_the_load_at_once(tmp_path: Path) -> None:
    ident = identity()
    with SnapshotStore(tmp_path / "s") as store:
        counters = Counters()
        io = WorkerIO(store, ident, 0, FakePages(8, 1), counters, max_queued_loads=1)
        started, release = threading.Event(), threading.Event()

        def slow(job: LoadJob, on_layer: Any = None) -> None:
            started.set()
            release.wait(10)

        io._load = slow  # type: ignore[method-assign]
        tokens = np.zeros(BS, np.uint32)
        jobs = [LoadJob(f"r{i}", 1, BS, tokens, 0, ((i,),)) for i in range(3)]
        io.submit_load(jobs[0])
        assert started.wait(10)
        io.submit_load(jobs[1])  # queued
        io.submit_load(jobs[2])  # queue full: failed at once, its block reported
        assert io.poll()[1] == {"r2"} and io.take_failed_blocks() == {2}
        release.set()
        assert io.flush()
        assert io.poll()[1] == {"r0", "r1"}
        assert counters.take()["loads_dropped"] == 1
        io.close()


def test_idle_steps_wait_for_a_landing_load(tmp_path: Path) -> None:
    """An engine step with nothing to compute sleeps until the load lands
    (instead of spinning), and never longer than asked."""
    with SnapshotStore(tmp_path / "s") as store:
        io = WorkerIO(store, identity(), 0, FakePages(8, 1), Counters())
        started = time.monotonic()
        io.wait_for_loads(60.0)  # nothing in flight: returns at once
        assert time.monotonic() - started < 30
        loading, gate = threading.Event(), threading.Event()

        def slow(job: LoadJob, on_layer: Any = None) -> None:
            loading.set()
            assert gate.wait(30)

        io._load = slow  # type: ignore[method-assign]
        io.submit_load(LoadJob("r", 1, BS, np.zeros(BS, np.uint32), 0, ((0,),)))
        assert loading.wait(10)
        started = time.monotonic()
        io.wait_for_loads(0.2)  # still loading: the full timeout
        assert time.monotonic() - started > 0.15
        assert io.poll() == (set(), set())
        # A step waiting with a long timeout is woken by the landing load.
        waiter = threading.Thread(target=io.wait_for_loads, args=(60.0,))
        waiter.start()
        waiter.join(0.1)
        assert waiter.is_alive()  # the load has not landed: the step waits
        gate.set()
        waiter.join(30)
        assert not waiter.is_alive()
        assert io.poll()[1] == {"r"}
        io.close()


def test_a_shared_prefix_restores_past_the_stride_alias(one_rank: Any) -> None:
    """A prompt sharing 600 tokens of a stored 700-token one, then going its own
    way: the offer reaches the last whole shared block (592), as vLLM's own
    prefix cache would, not only the 512-token stride alias below the divergence
    (256-token stride), and the 8 tokens of the next stored block it shares;
    the load restores exactly the stored pages."""
    store, sched, io, counters = one_rank
    p = prompt(700, 41)
    save(sched, io, Req("a", p))
    other = [*p[:600], *prompt(100, 42)]
    req = Req("b", other)
    assert sched.matched_tokens(req, 0) == (600, True)
    blocks = list(range(10, 10 + 700 // BS))
    sched.after_alloc(req, blocks, 600)
    (load,), _ = sched.take_jobs()
    assert load.n_tokens == 608 and load.blocks == (tuple(blocks[:38]),)
    fresh = FakePages(64, seed=11)
    restorer = WorkerIO(store, identity(), 0, fresh, counters)
    try:
        restorer.submit_load(load)
        assert restorer.flush()
        assert restorer.poll()[1] == {"b"} and not restorer.take_failed_blocks()
        for i in range(38):
            np.testing.assert_array_equal(fresh.arr[:, blocks[i]], io.pages.arr[:, i])
    finally:
        restorer.close()
