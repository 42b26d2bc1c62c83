"""The connector's scheduler and worker sides without vLLM: simulated requests,
simulated KV caches (numpy pages), a real store.

Two ranks (5f): tensor parallelism 2 on this 2-core CPU machine would need two
vLLM CPU workers bound to one core each besides the engine core and the test
process, and TP on vLLM's CPU backend is not part of this project's supported
set yet; the rank logic - every rank publishes its own segment, the scheduler
offers only snapshots that every rank of the topology can restore, each rank
restores its own bytes - lives in the store and in WorkerIO/SchedulerSide,
which run here exactly as in vLLM's processes, with two WorkerIO instances
standing in for the two workers.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache.connector.scheduler import SchedulerSide, breakpoints_of
from sparkcache.connector.worker import Counters, LoadJob, SaveJob, WorkerIO
from sparkcache.identity import ModelIdentity
from sparkcache.store import SnapshotStore

BS = 16
LAYERS = 2
PAGE_SHAPE = (1, BS, 8)  # one KV head per rank, K and V of head size 4
PAGE_NBYTES = 1 * BS * 8 * 4


def identity(tp_size: int = 1) -> ModelIdentity:
    return ModelIdentity(model="sim", revision="r1", num_layers=LAYERS, num_kv_heads=1,
                         head_size=4, dtype="float32", kv_cache_dtype="float32",
                         block_size=BS, page_shape=PAGE_SHAPE, tp_size=tp_size)


class FakePages:
    """A worker's KV cache: ``[layers, blocks, page bytes]`` of random bytes."""

    def __init__(self, blocks: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        self.arr = rng.integers(0, 255, (LAYERS, blocks, PAGE_NBYTES), dtype=np.uint8)
        self.num_blocks, self.page_nbytes = blocks, PAGE_NBYTES
        self.on_cpu = True

    def __len__(self) -> int:
        return LAYERS

    def host_buffer(self, nbytes: int) -> np.ndarray:
        return np.empty(nbytes, np.uint8)

    def block_views(self, block_ids: Any) -> list[list[np.ndarray]] | None:
        # One piece per block (views of the rows), whatever the ids' order.
        return [[self.arr[i, b] for b in block_ids] for i in range(LAYERS)] if block_ids else None

    def fence(self) -> object:
        return None

    def gather(self, block_ids: Any, after: object = None) -> list[np.ndarray]:
        return [self.arr[i, list(block_ids)].copy() for i in range(LAYERS)]

    def scatter(self, block_ids: Any, pages: Any) -> None:
        for i in range(LAYERS):
            self.scatter_layer(i, block_ids, pages[i])

    def scatter_layer(self, layer: int, block_ids: Any, src: Any) -> None:
        self.arr[layer, list(block_ids)] = np.asarray(src).reshape(-1, PAGE_NBYTES)


@dataclass
class Req:
    request_id: str
    prompt_token_ids: list[int]
    output: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    kv_transfer_params: dict[str, Any] | None = None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


def prompt(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 30000, n)]


def finished(req: Req, n_out: int = 16) -> Req:
    """The request after generating ``n_out`` tokens (the last one's KV not computed)."""
    req.output = prompt(n_out, 999)
    req.num_computed_tokens = len(req.all_token_ids) - 1
    return req


def blocks_of(req: Req) -> list[int]:
    return list(range(len(req.all_token_ids) // BS + 1))


def test_two_ranks_publish_restore_and_availability(tmp_path: Path) -> None:
    ident = identity(tp_size=2)
    store = SnapshotStore(tmp_path / "s")
    sched = SchedulerSide(store, ident, Counters(), min_tokens=BS, load_async=True)
    kv = [FakePages(16, seed=rank) for rank in (0, 1)]
    workers = [WorkerIO(store, ident, rank, kv[rank], Counters()) for rank in (0, 1)]
    p = prompt(100, 1)
    try:
        held, _ = sched.finished(finished(Req("a", p)), blocks_of(Req("a", p, prompt(16, 999))))
        assert held  # blocks kept until every worker copied them out
        _loads, (save,) = sched.take_jobs()
        assert len(save.token_ids) == 112 and save.block_ids == list(range(7))
        workers[0].submit_save(save)
        assert workers[0].flush()
        assert workers[0].poll()[0] == {"a"}
        # Rank 1 has not published: the snapshot is not offered to anyone.
        assert sched.matched_tokens(Req("b", p), 0) == (0, False)
        workers[1].submit_save(save)
        assert workers[1].flush()
        # Every rank ready: all but the prompt's last token are offered, async: the
        # prompt-end alias (96 tokens) and the stored block holding tokens 96..99.
        req = Req("c", p)
        assert sched.matched_tokens(req, 0) == (99, True)
        sched.after_alloc(req, [9, 10, 11, 12, 13, 14, 15], 99)
        (load,), _ = sched.take_jobs()
        fresh = [FakePages(16, seed=7 + rank) for rank in (0, 1)]
        for rank in (0, 1):
            io = WorkerIO(store, ident, rank, fresh[rank], Counters())
            io.submit_load(load)
            assert io.flush()
            assert io.poll()[1] == {"c"} and not io.take_failed_blocks()
            # Each rank restored its own bytes into the blocks vLLM allocated.
            np.testing.assert_array_equal(fresh[rank].arr[:, 9:16], kv[rank].arr[:, 0:7])
            io.close()
    finally:
        for w in workers:
            w.close()
        store.close()


def test_a_snapshot_missing_one_rank_is_not_offered_after_a_restart(tmp_path: Path) -> None:
    """Only rank 0 ever published (rank 1 crashed): a new scheduler offers nothing."""
    ident = identity(tp_size=2)
    p = prompt(64, 2)
    with SnapshotStore(tmp_path / "s") as store:
        store.publish(ident, 0, p, [np.zeros(4 * PAGE_NBYTES, np.uint8)] * LAYERS)
        sched = SchedulerSide(store, ident, Counters(), load_async=True)
        assert sched.matched_tokens(Req("x", [*p, 5]), 0) == (0, False)
        store.publish(ident, 1, p, [np.ones(4 * PAGE_NBYTES, np.uint8)] * LAYERS)
        assert sched.matched_tokens(Req("y", [*p, 5]), 0) == (64, True)


@pytest.fixture
def one_rank(tmp_path: Path) -> Any:
    ident = identity()
    store = SnapshotStore(tmp_path / "s")
    counters = Counters()
    sched = SchedulerSide(store, ident, counters, min_tokens=BS, load_async=True)
    pages = FakePages(64, seed=3)
    io = WorkerIO(store, ident, 0, pages, counters)
    yield store, sched, io, counters
    io.close()
    store.close()


def _save(sched: SchedulerSide, io: WorkerIO, req: Req) -> Any:
    held, _ = sched.finished(finished(req), blocks_of(req))
    assert held
    _, (job,) = sched.take_jobs()
    io.submit_save(job)
    assert io.flush()
    sent, _ = io.poll()
    assert req.request_id in sent
    assert io.poll() == (set(), set())  # reported exactly once (vLLM asserts otherwise)
    sched.on_output((), sent)
    return job


def test_the_block_holding_the_prompts_end_is_restored(one_rank: Any) -> None:
    """A stored answer goes on past the prompt: the block holding the prompt's
    last tokens is restored too, so vLLM computes only the last token - also
    after a hit in vLLM's own prefix cache on the whole blocks before it."""
    store, sched, io, counters = one_rank
    p = prompt(100, 31)
    _save(sched, io, Req("a", p))  # 112 tokens stored: p and 12 answer tokens
    (snap,) = store.snapshots()
    assert snap.n_tokens == 112
    again = Req("b", p)  # 99 offered: the 100th is the one vLLM computes
    assert sched.matched_tokens(again, 96) == (3, True)  # 96 were a local hit
    sched.after_alloc(again, [40, 41, 42, 43, 44, 45, 50], 3)
    (load,), _ = sched.take_jobs()
    assert (load.start_block, load.block_ids, load.n_tokens) == (6, [50], 112)
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
    # The tail differs from the stored tokens: whole blocks only.
    assert sched.matched_tokens(Req("c", [*p[:98], 7, 8]), 0) == (96, True)
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


def test_concurrent_requests_wait_for_one_load(one_rank: Any) -> None:
    _store, sched, io, counters = one_rank
    p = prompt(100, 4)
    _save(sched, io, Req("a", p))
    leader, follower = Req("b", [*p, 1, 2]), Req("c", [*p, 3, 4])
    assert sched.matched_tokens(leader, 0) == (96, True)
    sched.after_alloc(leader, list(range(7)), 96)
    # The follower shares the base being loaded: "ask again" (None), no lookup.
    lookups = counters.take().get("lookups", 0)
    assert sched.matched_tokens(follower, 0) == (None, False)
    assert sched.matched_tokens(follower, 0) == (None, False)
    assert counters.take().get("lookups", 0) == 0
    sched.on_output({"b"}, ())
    # Landed: vLLM's own prefix cache now covers the follower's 96 tokens.
    assert sched.matched_tokens(follower, 96) == (0, False)
    # A request not sharing the base is never held back.
    assert sched.matched_tokens(Req("d", prompt(100, 5)), 0) == (0, False)
    assert lookups == 1


def test_a_grown_context_publishes_only_its_tail(one_rank: Any) -> None:
    store, sched, io, _counters = one_rank
    p = prompt(95, 6)
    first = _save(sched, io, Req("a", p))
    assert len(first.token_ids) == 96  # 95 + 15 computed tokens, whole blocks
    (snap,) = store.snapshots()
    turn2 = Req("b", list(first.token_ids) + prompt(40, 7))
    second = _save(sched, io, turn2)
    assert second.parent == snap.id
    assert second.block_ids[0] == snap.n_tokens // BS  # only the tail's blocks
    tail = store.snapshot(max(s.id for s in store.snapshots()))
    assert tail.parent_id == snap.id and tail.start_token == snap.n_tokens


def test_breakpoints_from_kv_transfer_params(one_rank: Any) -> None:
    _store, sched, io, _counters = one_rank
    p = prompt(120, 8)
    req = Req("a", p, kv_transfer_params={"sparkcache": {"breakpoints": [40, 70]}})
    assert breakpoints_of(req) == (40, 70)
    assert breakpoints_of(Req("z", p, kv_transfer_params={"sparkcache": {"breakpoints": "x"}}))\
        == ()
    job = _save(sched, io, req)
    assert job.breakpoints == (119, 40, 70)
    # A prompt sharing 70 tokens restores the 64-token breakpoint alias (the
    # stride alias would give 0: the store's stride is 256 tokens).
    assert sched.matched_tokens(Req("b", p[:70] + prompt(30, 9)), 0) == (64, True)


def test_dropped_work_is_counted_and_never_blocks(tmp_path: Path) -> None:
    ident = identity()
    with SnapshotStore(tmp_path / "s") as store:
        counters = Counters()
        io = WorkerIO(store, ident, 0, FakePages(8, 1), counters, max_queued_loads=1,
                      max_pending_bytes=0)
        started, release = threading.Event(), threading.Event()

        def slow(job: LoadJob, on_layer: Any = None) -> None:
            started.set()
            release.wait(10)

        io._load = slow  # type: ignore[method-assign]
        tokens = np.zeros(BS, np.uint32)
        jobs = [LoadJob(f"r{i}", 1, BS, tokens, 0, [i]) for i in range(3)]
        io.submit_load(jobs[0])
        assert started.wait(10)
        io.submit_load(jobs[1])  # queued
        io.submit_load(jobs[2])  # queue full: failed at once, its block reported
        assert io.poll()[1] == {"r2"} and io.take_failed_blocks() == {2}
        release.set()
        assert io.flush()
        assert io.poll()[1] == {"r0", "r1"}
        # Saves over the pending-bytes bound are dropped and reported sent at once.
        from sparkcache.connector.worker import SaveJob

        io.submit_save(SaveJob("s", np.zeros(BS, np.uint32), [0], None, None, ()))
        assert io.poll()[0] == {"s"}
        data = counters.take()
        assert data["loads_dropped"] == 1 and data["saves_dropped"] == 1
        io.close()


def test_a_corrupt_snapshot_reports_its_blocks(one_rank: Any, tmp_path: Path) -> None:
    _store, sched, io, counters = one_rank
    p = prompt(100, 10)
    _save(sched, io, Req("a", p))
    (segment,) = (tmp_path / "s").glob("objects/*/*/*.safetensors")
    data = bytearray(segment.read_bytes())
    data[len(data) // 2] ^= 0xFF  # in a layer's payload: found on the worker
    segment.write_bytes(bytes(data))
    req = Req("b", p)
    assert sched.matched_tokens(req, 32) == (67, True)  # 32 tokens are a local hit
    sched.after_alloc(req, [20, 21, 22, 23, 24, 25, 26], 67)
    (load,), _ = sched.take_jobs()
    assert load.start_block == 2 and load.block_ids == [22, 23, 24, 25, 26]
    io.submit_load(load)
    assert io.flush()
    assert io.poll()[1] == {"b"}
    assert io.take_failed_blocks() == {22, 23, 24, 25, 26}
    assert counters.take()["load_failures"] == 1
    assert sched.matched_tokens(Req("c", p), 0) == (None, False)  # b's load in flight
    sched.on_output({"b"}, ())
    assert sched.matched_tokens(Req("c", p), 0) == (0, False)  # quarantined: a miss


class GatedPages(FakePages):
    """FakePages whose copy-outs wait for ``gate`` and are recorded in ``gathered``."""

    def __init__(self, blocks: int, seed: int) -> None:
        super().__init__(blocks, seed)
        self.gate, self.entered = threading.Event(), threading.Event()
        self.gathered: list[list[int]] = []

    def gather(self, block_ids: Any, after: object = None) -> list[np.ndarray]:
        self.entered.set()
        assert self.gate.wait(10)
        self.gathered.append(list(block_ids))
        return super().gather(block_ids, after)


def _step(sched: SchedulerSide, req: Req, n: int, blocks: list[int]) -> list[Any]:
    """One vLLM step computing ``n`` more tokens of ``req``: the saves it plans."""
    sched.plan_breakpoints({req.request_id: n}, lambda _rid: blocks)
    req.num_computed_tokens += n
    return sched.take_jobs()[1]


def test_breakpoints_publish_while_the_request_runs(one_rank: Any) -> None:
    store, sched, io, counters = one_rank
    p = prompt(300, 11)
    req = Req("a", p, kv_transfer_params={"sparkcache": {"breakpoints": [100, 200, 10]}})
    blocks = list(range(20, 40))
    assert sched.matched_tokens(req, 0) == (0, False)  # notes the breakpoints (10: no whole block)
    assert _step(sched, req, 64, blocks) == []  # 64 computed: no breakpoint reached
    (job,) = _step(sched, req, 64, blocks)  # 128 computed: past 100
    assert (len(job.token_ids), job.block_ids, job.report) == (96, blocks[:6], False)
    io.submit_save(job)
    assert io.flush()
    assert io.poll() == (set(), set())  # vLLM is never told of a breakpoint save
    (snap,) = store.snapshots()
    assert snap.n_tokens == 96  # published before the request finished
    # The prompt restores from it in another engine; bytes are the blocks' own.
    assert sched.matched_tokens(Req("b", p[:100] + prompt(50, 12)), 0) == (96, True)
    (job2,) = _step(sched, req, 128, blocks)  # 256 computed: past 200
    assert job2.parent == snap.id and job2.block_ids == blocks[6:12]  # the tail only
    io.submit_save(job2)
    assert io.flush()
    assert _step(sched, req, 44, blocks) == []  # no breakpoint left
    # Finished: the final save is another tail; the blocks are held until copied.
    req.output = prompt(16, 999)
    req.num_computed_tokens = len(req.all_token_ids) - 1
    held, _ = sched.finished(req, blocks)
    assert held
    _, (final,) = sched.take_jobs()
    assert final.report and final.parent == store.snapshots()[-1].id
    io.submit_save(final)
    assert io.flush()
    assert io.poll()[0] == {"a"}
    assert counters.take()["breakpoint_saves_planned"] == 2
    np.testing.assert_array_equal(
        store.read(store.lookup(identity(), p[:192]), 0)[1], io.pages.arr[1, 20:32])


def test_a_release_waits_for_the_breakpoint_copies(tmp_path: Path) -> None:
    """The request finishes while its breakpoint save is queued behind another
    copy and its final save is dropped: its blocks stay held until the
    breakpoint copy is done."""
    ident = identity()
    with SnapshotStore(tmp_path / "s") as store:
        pages = GatedPages(32, 4)
        io = WorkerIO(store, ident, 0, pages, Counters())
        sched = SchedulerSide(store, ident, Counters(), min_tokens=BS, load_async=True)
        other = SaveJob("x", np.asarray(prompt(32, 13), np.uint32), [0, 1], None, None, ())
        io.submit_save(other)
        assert pages.entered.wait(10)  # the saver is busy copying "x"
        req = Req("a", prompt(80, 14), kv_transfer_params={"sparkcache": {"breakpoints": [64]}})
        sched.matched_tokens(req, 0)
        (mid,) = _step(sched, req, 80, list(range(8, 14)))
        assert mid.block_ids == [8, 9, 10, 11] and not mid.report
        io.submit_save(mid)
        held, _ = sched.finished(req, list(range(8, 14)))
        assert held
        _, (final,) = sched.take_jobs()
        assert final.report and len(final.token_ids) == 80
        io.max_pending_bytes = 0  # the final save is dropped: it reports at once...
        io.submit_save(final)
        assert "a" not in io.poll()[0]  # ...but not while "a"'s breakpoint copy is queued
        pages.gate.set()
        assert io.flush()
        assert "a" in io.poll()[0]
        assert pages.gathered == [[0, 1], [8, 9, 10, 11]]
        # Finished with nothing more to save (the prefix is stored): a release
        # job without blocks still holds the blocks until the copies are done.
        again = Req("b", req.prompt_token_ids[:70],
                    kv_transfer_params={"sparkcache": {"breakpoints": [64]}})
        sched.matched_tokens(again, 0)  # a hit on the stored 64 tokens
        (mid,) = _step(sched, again, 70, list(range(16, 21))) or [None]
        assert mid is None  # the breakpoint prefix is already stored: nothing planned
        held, _ = sched.finished(again, list(range(16, 21)))
        assert not held and sched.take_jobs() == ([], [])
        io.close()


def test_preemption_cancels_queued_breakpoint_copies(tmp_path: Path) -> None:
    ident = identity()
    with SnapshotStore(tmp_path / "s") as store:
        counters = Counters()
        pages = GatedPages(32, 5)
        io = WorkerIO(store, ident, 0, pages, counters)
        tokens = np.asarray(prompt(64, 15), np.uint32)
        io.submit_save(SaveJob("x", tokens, [0, 1, 2, 3], None, None, ()))
        assert pages.entered.wait(10)
        io.submit_save(SaveJob("a", tokens, [4, 5, 6, 7], None, None, (), report=False))
        started = time.monotonic()
        io.cancel_copies(["a"])  # queued, not started: dropped without waiting
        assert time.monotonic() - started < 1
        assert counters.take()["saves_cancelled"] == 1
        pages.gate.set()
        assert io.flush()
        assert pages.gathered == [[0, 1, 2, 3]]  # the freed blocks were never read
        assert len(store.snapshots()) == 1
        # A copy already running is waited for: the preempted blocks are read first.
        pages.gate.clear()
        pages.entered.clear()
        io.submit_save(SaveJob("b", tokens, [8, 9, 10, 11], None, None, (), report=False))
        assert pages.entered.wait(10)
        threading.Timer(0.3, pages.gate.set).start()
        io.cancel_copies(["b"])
        assert pages.gathered[-1] == [8, 9, 10, 11]
        assert io.flush()
        io.close()


def test_a_planned_restore_leases_its_snapshot(one_rank: Any) -> None:
    """Between the lookup and the read nothing may evict the snapshot."""
    store, sched, io, _counters = one_rank
    p = prompt(100, 16)
    _save(sched, io, Req("a", p))
    (snap,) = store.snapshots()
    req = Req("b", [*p, 1])
    assert sched.matched_tokens(req, 0) == (100, True)
    assert store.evict(count=None) == [snap.id]  # not yet planned: evictable
    _save(sched, io, Req("a2", p))
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
    assert store.evict(count=None) == [snap.id]
    # A synchronous load (never reported) holds its lease until the request finishes.
    sync = SchedulerSide(store, identity(), Counters(), min_tokens=BS, load_async=False,
                         publish=False)
    _save(sched, io, Req("a3", p))
    req = Req("c", [*p, 2])
    assert sync.matched_tokens(req, 0) == (100, False)
    sync.after_alloc(req, list(range(7)), 100)
    assert store.evict(count=None) == []
    sync.finished(req, list(range(7)))
    assert len(store.evict(count=None)) == 1


def test_idle_steps_wait_for_a_landing_load(tmp_path: Path) -> None:
    """An engine step with nothing to compute sleeps until the load lands
    (instead of spinning), and never longer than asked."""
    with SnapshotStore(tmp_path / "s") as store:
        io = WorkerIO(store, identity(), 0, FakePages(8, 1), Counters())
        started = time.monotonic()
        io.wait_for_loads(5.0)  # nothing in flight: returns at once
        assert time.monotonic() - started < 1
        gate = threading.Event()
        io._load = lambda job, on_layer=None: gate.wait(10)  # type: ignore[method-assign,assignment,return-value]
        io.submit_load(LoadJob("r", 1, BS, np.zeros(BS, np.uint32), 0, [0]))
        started = time.monotonic()
        io.wait_for_loads(0.2)  # still loading: the full timeout
        assert 0.15 < time.monotonic() - started < 2
        threading.Timer(0.3, gate.set).start()
        io.wait_for_loads(10.0)  # woken by the landing load, not the timeout
        assert time.monotonic() - started < 5
        assert io.poll()[1] == {"r"}
        io.close()


# -- load_async: auto, and in-step loads read layer by layer --------------------------


def test_auto_restores_in_step_only_when_alone(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "s") as store:
        sched = SchedulerSide(store, identity(), Counters(), min_tokens=BS, load_async=None)
        io = WorkerIO(store, identity(), 0, FakePages(16, 1), Counters())
        p = prompt(100, 20)
        _save(sched, io, Req("a", p))
        alone = Req("b", [*p, 1])
        assert sched.matched_tokens(alone, 0) == (100, False)  # alone: in the step
        sched.after_alloc(alone, list(range(7)), 100)
        (load,), _ = sched.take_jobs()
        assert load.in_step
        # b is still running: c's restore lands while c waits.
        c = Req("c", [*p, 2])
        assert sched.matched_tokens(c, 0) == (100, True)
        sched.after_alloc(c, list(range(7, 14)), 100)
        (load,), _ = sched.take_jobs()
        assert not load.in_step
        sched.on_output({"c"}, ())
        for req in (alone, c):
            sched.finished(req, [])
        assert sched.matched_tokens(Req("d", [*p, 3]), 0) == (100, False)
        io.close()


def _published_pages(store: SnapshotStore, p: list[int]) -> tuple[Any, list[np.ndarray]]:
    pages = [np.random.default_rng(30 + i).integers(0, 256, 6 * PAGE_NBYTES, np.uint8)
             for i in range(LAYERS)]
    store.publish(identity(), 0, p[:96], pages)
    (snap,) = store.snapshots()
    return snap, pages


def test_in_step_load_lands_layer_by_layer(tmp_path: Path) -> None:
    """The forward's wait for layer 0 returns while layer 1 is still unread;
    layer 1's wait returns once it landed; scattered blocks get their pages."""
    with SnapshotStore(tmp_path / "s") as store:
        p = prompt(100, 21)
        snap, pages = _published_pages(store, p)
        kv = FakePages(16, 2)
        io = WorkerIO(store, identity(), 0, kv, Counters(), load_threads=1)
        gate, at_gate = threading.Event(), threading.Event()
        real = store.read_into

        def gated(*args: Any, on_layer: Any = None, **kwargs: Any) -> int:
            def hold(layer: int) -> None:
                on_layer(layer)
                if layer == 0:
                    at_gate.set()
                    assert gate.wait(10)
            return real(*args, on_layer=hold, **kwargs)

        store.read_into = gated  # type: ignore[method-assign]
        ids = [9, 3, 4, 12]  # three runs; blocks 2-5 of the snapshot (start_block 2)
        before = kv.arr[1, ids].copy()
        io.start_step_loads([LoadJob("r", snap.id, 96, np.asarray(p[:96], np.uint32), 2, ids,
                                     in_step=True)])
        io.wait_layer(0)
        assert at_gate.wait(10)
        expect = [pg.reshape(6, PAGE_NBYTES)[2:] for pg in pages]
        np.testing.assert_array_equal(kv.arr[0, ids], expect[0])
        np.testing.assert_array_equal(kv.arr[1, ids], before)  # not read yet
        done = threading.Event()
        waiter = threading.Thread(target=lambda: (io.wait_layer(1), done.set()))
        waiter.start()
        assert not done.wait(0.2)  # layer 1 is not there: its attention waits
        gate.set()
        assert done.wait(10)
        waiter.join()
        np.testing.assert_array_equal(kv.arr[1, ids], expect[1])
        io.finish_step_loads(all_layers_waited=True)
        assert io.take_failed_blocks() == set()
        assert io.poll() == (set(), set())  # in-step loads are never reported as received
        io.close()


def test_an_in_step_load_that_fails_or_is_not_awaited_is_recomputed(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "s") as store:
        p = prompt(100, 22)
        snap, pages = _published_pages(store, p)
        counters = Counters()
        kv = FakePages(16, 3)
        io = WorkerIO(store, identity(), 0, kv, counters)
        job = LoadJob("r", snap.id, 96, np.asarray(p[:96], np.uint32), 0, list(range(6)),
                      in_step=True)
        # Every layer awaited, all landed, but the forward skipped the hook for one:
        # those pages may have been read early, so vLLM must recompute them.
        io.start_step_loads([job])
        io.wait_layer(0)
        io.finish_step_loads(all_layers_waited=False)
        assert io.take_failed_blocks() == set(range(6))
        assert counters.take()["loads_unwaited"] == 1
        # Layer 1 of the segment corrupted: layer 0 lands (verified), layer 1 never;
        # every wait returns, the blocks are reported failed, the snapshot quarantined.
        (segment,) = (tmp_path / "s").glob("objects/*/*/*.safetensors")
        data = bytearray(segment.read_bytes())
        data[-96 * 4 - 10] ^= 0xFF  # in layer.1, just before the 96 token ids
        segment.write_bytes(bytes(data))
        kv.arr[:] = 0
        io.start_step_loads([job])
        io.wait_layer(0)
        np.testing.assert_array_equal(kv.arr[0, :6], pages[0].reshape(6, PAGE_NBYTES))
        io.wait_layer(1)
        io.finish_step_loads(all_layers_waited=True)
        assert not kv.arr[1, :6].any()  # no unverified byte reached the cache
        assert io.take_failed_blocks() == set(range(6))
        assert store.snapshot(snap.id).state == "quarantined"
        assert counters.take()["load_failures"] == 1
        # Failed and not awaited either: still one failure (and one unwaited).
        before = set((tmp_path / "s").glob("objects/*/*/*.safetensors"))
        fresh = store.publish(identity(), 0, p[:96], pages).snapshot_id
        (segment,) = set((tmp_path / "s").glob("objects/*/*/*.safetensors")) - before
        data = bytearray(segment.read_bytes())
        data[-96 * 4 - 10] ^= 0xFF
        segment.write_bytes(bytes(data))
        job = LoadJob("r", fresh, 96, job.token_ids, 0, job.block_ids, in_step=True)
        io.start_step_loads([job])
        io.finish_step_loads(all_layers_waited=False)
        assert io.take_failed_blocks() == set(range(6))
        got = counters.take()
        assert got["load_failures"] == 1 and got["loads_unwaited"] == 1
        io.close()
