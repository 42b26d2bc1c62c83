"""Breakpoints: prefixes a request names are published at once, while it runs.

Such a save is never reported to vLLM; the request's blocks are held at its
finish until every one of its copies is done, and a preemption drops (or
waits for) the copies before vLLM reuses the blocks.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache import SnapshotStore, admin
from sparkcache.connector import restores
from sparkcache.connector.jobs import Counters, SaveJob
from sparkcache.connector.scheduler import SchedulerSide, breakpoints_of
from sparkcache.connector.worker import WorkerIO

from .helpers import BS, GatedPages, Req, blocks_of, finished, identity, prompt, save, step


def test_breakpoints_from_kv_transfer_params(one_rank: Any) -> None:
    _store, sched, io, _counters = one_rank
    p = prompt(120, 8)
    req = Req("a", p, kv_transfer_params={"sparkcache": {"breakpoints": [40, 70]}})
    assert breakpoints_of(req) == (40, 70)
    assert breakpoints_of(Req("z", p, kv_transfer_params={"sparkcache": {"breakpoints": "x"}}))\
        == ()
    job = save(sched, io, req)
    assert job.breakpoints == (119, 40, 70)
    # A prompt sharing 70 tokens restores them all: the 64-token breakpoint
    # alias (the stride alias would give 0: the store's stride is 256 tokens)
    # and the 6 tokens of the stored block after it that it shares.
    assert sched.matched_tokens(Req("b", p[:70] + prompt(30, 9)), 0) == (70, True)


def test_breakpoints_publish_while_the_request_runs(one_rank: Any) -> None:
    store, sched, io, counters = one_rank
    p = prompt(300, 11)
    req = Req("a", p, kv_transfer_params={"sparkcache": {"breakpoints": [100, 200, 10]}})
    blocks = list(range(20, 40))
    assert sched.matched_tokens(req, 0) == (0, False)  # notes the breakpoints (10: no whole block)
    assert step(sched, req, 64, blocks) == []  # 64 computed: no breakpoint reached
    (job,) = step(sched, req, 64, blocks)  # 128 computed: past 100's block
    assert (len(job.token_ids), job.blocks, job.report) == (112, (tuple(blocks[:7]),), False)
    assert job.explicit  # it stores an asked breakpoint: published without waiting
    io.submit_save(job)
    assert io.flush()
    assert io.poll() == (set(), set())  # vLLM is never told of a breakpoint save
    (snap,) = store.snapshots()
    assert snap.n_tokens == 112  # published before the request finished
    # The prompt restores from it in another engine, exactly to the breakpoint
    # (into the block holding it); bytes are the blocks' own.
    assert sched.matched_tokens(Req("b", p[:100] + prompt(50, 12)), 0) == (100, True)
    (job2,) = step(sched, req, 128, blocks)  # 256 computed: past 200's block
    assert job2.parent == snap.id and job2.blocks == (tuple(blocks[7:13]),)  # the tail only
    assert job2.explicit
    io.submit_save(job2)
    assert io.flush()
    assert step(sched, req, 44, blocks) == []  # no breakpoint left
    # Finished: the final save is another tail; the blocks are held until copied.
    req.output = prompt(16, 999)
    req.num_computed_tokens = len(req.all_token_ids) - 1
    held, _ = sched.finished(req, blocks)
    assert held
    _, (final,) = sched.take_jobs()
    assert final.report and final.parent == store.snapshots()[-1].id
    assert not final.explicit  # its breakpoints are stored already: it may wait
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
        other = SaveJob("x", np.asarray(prompt(32, 13), np.uint32), ((0, 1),), None, None, ())
        io.submit_save(other)
        assert pages.entered.wait(10)  # the saver is busy copying "x"
        req = Req("a", prompt(80, 14), kv_transfer_params={"sparkcache": {"breakpoints": [64]}})
        sched.matched_tokens(req, 0)
        (mid,) = step(sched, req, 80, list(range(8, 14)))
        assert mid.blocks == ((8, 9, 10, 11),) and not mid.report
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
        (mid,) = step(sched, again, 70, list(range(16, 21))) or [None]
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
        io.submit_save(SaveJob("x", tokens, ((0, 1, 2, 3),), None, None, ()))
        assert pages.entered.wait(10)
        io.submit_save(SaveJob("a", tokens, ((4, 5, 6, 7),), None, None, (), report=False))
        started = time.monotonic()
        io.cancel_copies(["a"])  # queued, not started: dropped without waiting
        assert time.monotonic() - started < 10  # waiting would have taken 60 s
        assert counters.take()["saves_cancelled"] == 1
        pages.gate.set()
        assert io.flush()
        assert pages.gathered == [[0, 1, 2, 3]]  # the freed blocks were never read
        assert len(store.snapshots()) == 1
        # A copy already running is waited for: the preempted blocks are read first.
        pages.gate.clear()
        pages.entered.clear()
        io.submit_save(SaveJob("b", tokens, ((8, 9, 10, 11),), None, None, (), report=False))
        assert pages.entered.wait(10)  # "b" is being copied, the gate shut
        io.cancel_copies(["b"], timeout=0.1)  # waits, in vain: not cancelled
        assert "saves_cancelled" not in counters.take()
        assert pages.gathered == [[0, 1, 2, 3]]
        pages.gate.set()
        io.cancel_copies(["b"])  # returns once the copy is done
        assert pages.gathered[-1] == [8, 9, 10, 11]
        assert io.flush()
        io.close()


def test_a_save_builds_on_the_breakpoint_snapshot_not_a_longer_one(one_rank: Any) -> None:
    """Two conversations under one breakpoint prefix: each saves only its own
    tail on the breakpoint's snapshot, though the first conversation's
    snapshot also has an alias row where the breakpoint is (and is newer)."""
    store, sched, io, _counters = one_rank
    system = prompt(64, 31)
    first = Req("a", system + prompt(40, 32),
                kv_transfer_params={"sparkcache": {"breakpoints": [64]}})
    sched.matched_tokens(first, 0)
    (mid,) = step(sched, first, 104, list(range(8)))
    io.submit_save(mid)
    assert io.flush()
    (base,) = store.snapshots()
    assert save(sched, io, first).parent == base.id
    second = Req("b", system + prompt(40, 33),
                 kv_transfer_params={"sparkcache": {"breakpoints": [64]}})
    job = save(sched, io, second)
    assert job.parent == base.id and len(job.blocks[0]) == (len(job.token_ids) - 64) // BS
    assert mid.explicit and not job.explicit  # the breakpoint was stored by the first


def test_a_finish_save_that_stores_an_asked_breakpoint_is_explicit(one_rank: Any) -> None:
    """A breakpoint in the prompt's last block is stored by the save at the
    finish (the answer fills that block): an explicit write, the first time
    only; a later request's finish save with the same breakpoint is not."""
    _store, sched, io, _counters = one_rank
    system = prompt(4 * BS + 5, 41)  # the breakpoint inside the fifth block
    mark = {"sparkcache": {"breakpoints": [len(system)]}}
    first = Req("a", system + prompt(3, 42), kv_transfer_params=mark)
    sched.matched_tokens(first, 0)
    assert save(sched, io, first).explicit
    second = Req("b", system + prompt(3, 43), kv_transfer_params=mark)
    sched.matched_tokens(second, 0)
    assert not save(sched, io, second).explicit  # stored by the first already


def test_the_next_request_waits_for_a_cache_write_in_flight(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A finish save storing an asked breakpoint (an explicit write) planned,
    not yet published: a request sharing the prompt to that breakpoint is told
    to ask again until it is, then reads to the breakpoint; a request sharing
    less does not wait; a write never published holds nobody past
    WRITE_WAIT_SECONDS."""
    _store, sched, io, _counters = one_rank
    system = prompt(4 * BS + 5, 51)  # the breakpoint inside the fifth block
    mark = {"sparkcache": {"breakpoints": [len(system)]}}
    first = Req("a", system + prompt(3, 52), kv_transfer_params=mark)
    sched.matched_tokens(first, 0)
    held, _ = sched.finished(finished(first), blocks_of(first))
    assert held
    second = Req("b", system + prompt(3, 53), kv_transfer_params=mark)
    # vLLM holds the four whole blocks live; the write brings the fifth's 5 tokens.
    assert sched.matched_tokens(second, 4 * BS) == (None, False)
    assert sched.matched_tokens(Req("c", prompt(200, 54)), 0) == (0, False)  # shares nothing
    _, (job,) = sched.take_jobs()
    assert job.explicit
    io.submit_save(job)
    assert io.flush()
    assert sched.matched_tokens(second, 4 * BS) == (5, False)  # read in the step
    # A write that never lands: after the wait, the request goes on without it.
    other = prompt(4 * BS + 7, 55)
    third = Req("d", other + prompt(3, 56), kv_transfer_params={
        "sparkcache": {"breakpoints": [len(other)]}})
    sched.matched_tokens(third, 0)
    sched.finished(finished(third), blocks_of(third))
    fourth = Req("e", other + prompt(3, 57))
    assert sched.matched_tokens(fourth, 4 * BS) == (None, False)
    monkeypatch.setattr(restores, "WRITE_WAIT_SECONDS", 0.0)
    assert sched.matched_tokens(fourth, 4 * BS) == (0, False)


def test_the_next_turn_waits_for_its_previous_turns_save_when_vllm_evicted_it(
    one_rank: Any, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A finished request's save (no breakpoint asked) planned, not published:
    the conversation's next turn, sharing more of it than is stored or live
    (vLLM evicted its blocks), asks again and names that request to hurry;
    once the worker reports the publish it restores the previous turn; a
    request holding the shared part live, or sharing less than a lookup can
    reach, does not wait; nor does one after the publish ended with nothing
    to offer (cleared, or quarantined before the workers' report came), or
    one in another scope."""
    store, sched, io, _counters = one_rank
    turn = prompt(6 * BS + 3, 61)  # a turn's prompt and answer
    first = Req("a", turn)
    sched.matched_tokens(first, 0)
    held, _ = sched.finished(finished(first), blocks_of(first))
    assert held
    nxt = Req("b", turn + prompt(20, 62))
    assert sched.matched_tokens(nxt, 0) == (None, False)  # evicted: waits for the save
    assert sched.take_hurry() == ["a"] and sched.take_hurry() == []
    assert sched.matched_tokens(Req("c", turn + prompt(20, 63)), 6 * BS) == (0, False)  # live
    assert sched.matched_tokens(Req("d", turn[:BS + 5] + prompt(40, 64)), 0) == (0, False)
    _, (job,) = sched.take_jobs()
    assert not job.explicit
    io.submit_save(job)
    assert io.flush()
    sent, _ = io.poll()
    sched.on_output((), sent, None, io.take_ended())
    assert sched.matched_tokens(nxt, 0) == (len(turn), True)  # the previous turn, restored
    # Published, reported, and cleared at once: nobody waits for it.
    other = prompt(5 * BS, 65)
    save(sched, io, Req("e", other))
    cleared = admin.clear_model(store, store.snapshots()[-1].model_id)
    assert cleared.deleted
    assert sched.matched_tokens(Req("f", other + prompt(9, 66)), 0) == (0, False)
    # Published and quarantined before the workers' report came: the index
    # shows the publish ended, so nobody waits for it.
    bad = prompt(5 * BS, 69)
    quarantined = Req("i", bad)
    sched.matched_tokens(quarantined, 0)
    assert sched.finished(finished(quarantined), blocks_of(quarantined))[0]
    _, (job,) = sched.take_jobs()
    io.submit_save(job)
    assert io.flush()
    assert sched.matched_tokens(Req("j", bad + prompt(9, 70)), 0) == (len(bad), True)
    store.quarantine(store.snapshots()[-1].id, "test")
    assert sched.matched_tokens(Req("k", bad + prompt(9, 71)), 0) == (0, False)
    assert sched.take_hurry() == []
    sched.on_output((), io.poll()[0], None, io.take_ended())
    # A save in another scope (a tenant's) holds none of this request's prefixes.
    mine = prompt(5 * BS, 72)
    tenant = Req("l", mine, kv_transfer_params={"sparkcache": {"tenant": "t1"}})
    sched.matched_tokens(tenant, 0)
    assert sched.finished(finished(tenant), blocks_of(tenant))[0]
    assert sched.matched_tokens(Req("m", mine + prompt(9, 73)), 0) == (0, False)
    assert sched.matched_tokens(
        Req("n", mine + prompt(9, 73), kv_transfer_params={"sparkcache": {"tenant": "t1"}}),
        0) == (None, False)
    _, (job,) = sched.take_jobs()
    io.submit_save(job)
    assert io.flush()
    sched.on_output((), io.poll()[0], None, io.take_ended())
    # A save whose publish is never reported holds nobody past WRITE_WAIT_SECONDS.
    lost = prompt(5 * BS, 67)
    gone = Req("g", lost)
    sched.matched_tokens(gone, 0)
    assert sched.finished(finished(gone), blocks_of(gone))[0]
    assert sched.matched_tokens(Req("h", lost + prompt(9, 68)), 0) == (None, False)
    monkeypatch.setattr(restores, "WRITE_WAIT_SECONDS", 0.0)
    assert sched.matched_tokens(Req("h", lost + prompt(9, 68)), 0) == (0, False)
