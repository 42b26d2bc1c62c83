"""Saves without vLLM: a finished request's blocks are copied out by the
worker's saver thread, reported sent, and published from host memory."""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from sparkcache import SnapshotStore
from sparkcache.connector.jobs import Counters, SaveJob, save_tag
from sparkcache.connector.publisher import Prefills
from sparkcache.connector.worker import WorkerIO
from sparkcache.cpus import LOWEST_PRIORITY

from .helpers import BS, LAYERS, PAGE_NBYTES, FakePages, Req, identity, prompt, save


def test_a_grown_context_publishes_only_its_tail(one_rank: Any) -> None:
    store, sched, io, _counters = one_rank
    p = prompt(95, 6)
    first = save(sched, io, Req("a", p))
    assert len(first.token_ids) == 96  # 95 + 15 computed tokens, whole blocks
    (snap,) = store.snapshots()
    turn2 = Req("b", list(first.token_ids) + prompt(40, 7))
    second = save(sched, io, turn2)
    assert second.parent == snap.id
    assert second.blocks[0][0] == snap.n_tokens // BS  # only the tail's blocks
    tail = store.snapshot(max(s.id for s in store.snapshots()))
    assert tail.parent_id == snap.id and tail.start_token == snap.n_tokens


def test_a_save_over_the_memory_bound_is_dropped_and_reported_sent(tmp_path: Path) -> None:
    """Serving never waits for the disk: the blocks are freed at once, a future miss."""
    with SnapshotStore(tmp_path / "s") as store:
        counters = Counters()
        io = WorkerIO(store, identity(), 0, FakePages(8, 1), counters, max_pending_bytes=0)
        io.submit_save(SaveJob("s", np.zeros(BS, np.uint32), ((0,),), None, None, ()))
        assert io.poll()[0] == {"s"}
        assert counters.take()["saves_dropped"] == 1
        assert io.flush() and store.snapshots() == []
        io.close()


class _FailingStore:
    """A store whose publishes fail: the first with an OSError, the next with
    a crash of its own (a bug)."""

    def __init__(self) -> None:
        self.calls = 0

    def publish(self, *_args: Any, **_kwargs: Any) -> Any:
        self.calls += 1
        raise OSError(28, "No space left on device") if self.calls == 1 else RuntimeError("bug")


def test_a_failed_publish_frees_its_memory_and_the_flush(tmp_path: Path) -> None:
    """The publish thread's failures are counted, never raised: the save's host
    bytes are freed and ``flush`` returns, so later saves still fit."""
    with SnapshotStore(tmp_path / "s") as real:
        counters = Counters()
        pages = FakePages(8, 1)
        # One save's bytes at most: a failed publish that kept its bytes would
        # have the next save dropped.
        io = WorkerIO(real, identity(), 0, pages, counters,
                      max_pending_bytes=LAYERS * PAGE_NBYTES)
        failing = _FailingStore()
        io._publisher.store = failing
        for i in range(3):
            io.submit_save(SaveJob(f"r{i}", np.arange(BS, dtype=np.uint32), ((0,),), None,
                                   None, ()))
            assert io.flush(10)
        io._publisher.store = real
        io.submit_save(SaveJob("ok", np.arange(BS, dtype=np.uint32), ((0,),), None, None, ()))
        assert io.flush(10)
        got = counters.take()
        assert got.get("save_failures") == 3 and failing.calls == 3, got
        assert got.get("saves") == 1 and "saves_dropped" not in got, got
        assert io._pending_bytes == 0 and len(real.snapshots()) == 1
        io.close()


def test_a_publish_writes_below_the_engine_and_commits_at_its_priority(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The segment file is written at the lowest priority; the index's write
    transactions (its write lock) run at the engine's, never starved."""
    if not os.path.isdir("/proc/self/task"):
        pytest.skip("per-thread priorities are Linux's")

    def nice() -> int:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    seen: dict[str, set[int]] = {"file": set(), "index": set()}
    with SnapshotStore(tmp_path / "s") as store:
        core = store._core
        put, write = core.backend.put, core.write

        def spy_put(*args: Any, **kwargs: Any) -> Any:
            seen["file"].add(nice())
            return put(*args, **kwargs)

        @contextlib.contextmanager
        def spy_write(*args: Any, **kwargs: Any) -> Iterator[Any]:
            seen["index"].add(nice())
            with write(*args, **kwargs) as conn:
                yield conn

        monkeypatch.setattr(core.backend, "put", spy_put)
        monkeypatch.setattr(core, "write", spy_write)
        io = WorkerIO(store, identity(), 0, FakePages(8, 1), Counters())
        io.submit_save(SaveJob("a", np.arange(BS, dtype=np.uint32), ((0,),), None, None, ()))
        assert io.flush(10)
        assert seen == {"file": {LOWEST_PRIORITY}, "index": {nice()}}, seen
        # An explicit save (an asked breakpoint) is written at the engine's priority.
        seen["file"].clear()
        io.submit_save(SaveJob("b", np.arange(BS, 2 * BS, dtype=np.uint32), ((1,),), None,
                               None, (BS,), explicit=True))
        assert io.flush(10)
        io.close()
        assert len(store.snapshots()) == 2
    assert seen == {"file": {nice()}, "index": {nice()}}, seen


def _waited(prefills: Prefills, since: float) -> tuple[threading.Thread, list[float]]:
    out: list[float] = []
    thread = threading.Thread(target=lambda: out.append(prefills.wait_quiet(since)))
    thread.start()
    return thread, out


def _copied_out(io: WorkerIO, timeout: float = 10.0) -> set[str]:
    """The ids ``io.poll`` reports copied out, once it reports any."""
    deadline = time.monotonic() + timeout
    while not (sent := io.poll()[0]) and time.monotonic() < deadline:
        time.sleep(0.01)
    return sent


def test_a_publish_waits_the_settle_time_then_for_the_prefill_to_end() -> None:
    prefills = Prefills(settle_s=0.05, max_wait_s=5.0)
    started = time.monotonic()
    assert prefills.wait_quiet(started) >= 0.049  # no step: the settle time only
    prefills.started(True)
    thread, out = _waited(prefills, time.monotonic())
    time.sleep(0.3)
    assert thread.is_alive()  # a prefill step runs
    prefills.ended()
    thread.join(2)
    assert not thread.is_alive() and 0.29 <= out[0] < 2
    prefills.started(False)  # a decode step: no wait beyond the settle time
    assert prefills.wait_quiet(time.monotonic() - 1) < 0.05


def test_a_publish_waits_no_longer_than_the_bound_after_its_save_was_queued() -> None:
    prefills = Prefills(settle_s=0.01, max_wait_s=0.3)
    prefills.started(True)  # never ends
    queued = time.monotonic()
    assert 0.29 <= prefills.wait_quiet(queued) < 1.0
    assert prefills.wait_quiet(queued) < 0.01  # queued long enough ago: at once
    thread, out = _waited(prefills, time.monotonic())
    prefills.close()  # the worker closes: what is queued is published at once
    thread.join(1)
    assert not thread.is_alive() and out[0] < 0.2


def test_a_save_queued_under_a_prefill_is_published_after_it(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "s") as store:
        counters = Counters()
        io = WorkerIO(store, identity(), 0, FakePages(8, 1), counters)
        io.prefills.max_wait_s = 30.0  # a slow machine does not reach the bound first
        io.prefills.started(True)
        io.submit_save(SaveJob("a", np.arange(BS, dtype=np.uint32), ((0,),), None, None, ()))
        assert _copied_out(io) == {"a"}  # vLLM has its blocks back
        # The publish is queued just after the copy-out is reported: it waits from
        # then on (a second here, of which at least half is counted below).
        time.sleep(1.0)
        assert store.snapshots() == []  # not written while the prefill runs
        io.prefills.ended()
        assert io.flush(10) and len(store.snapshots()) == 1
        assert counters.take()["save_yield_seconds"] >= 0.5
        io.close()


def test_the_connector_marks_each_step_that_computes_prompt_tokens() -> None:
    pytest.importorskip("vllm")
    from sparkcache.connector.connector import SparkCacheConnector
    from sparkcache.connector.stats import SparkCacheMetadata, computes_prompt

    assert computes_prompt(SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 200}))
    assert not computes_prompt(SimpleNamespace(num_scheduled_tokens={"a": 1, "b": 1}))
    assert not computes_prompt(SimpleNamespace(num_scheduled_tokens={}))
    prefills = Prefills(settle_s=0.0, max_wait_s=5.0)
    connector = object.__new__(SparkCacheConnector)  # only its per-step hooks run
    connector.io = SimpleNamespace(prefills=prefills, poll=lambda: (set(), set()))
    connector._step_loading = False
    connector.bind_connector_metadata(SparkCacheMetadata(prefill=True))
    thread, out = _waited(prefills, time.monotonic())
    time.sleep(0.2)
    assert thread.is_alive()  # the step's forward runs
    assert connector.get_finished(set()) == (None, None)  # the step ended
    thread.join(2)
    assert not thread.is_alive() and 0.19 <= out[0] < 2
    connector.bind_connector_metadata(SparkCacheMetadata(prefill=False))
    assert prefills.wait_quiet(time.monotonic()) < 0.05


def test_an_explicit_save_is_published_under_a_prefill(tmp_path: Path) -> None:
    """A save that stores an asked breakpoint (an API's cache write) does not
    wait, nor does a save queued before it (publishes run in order)."""
    with SnapshotStore(tmp_path / "s") as store:
        io = WorkerIO(store, identity(), 0, FakePages(8, 1), Counters())
        io.prefills.max_wait_s = 30.0  # a save that waited would wait past the flushes
        io.prefills.started(True)  # never ends
        io.submit_save(SaveJob("a", np.arange(BS, dtype=np.uint32), ((0,),), None, None,
                               (BS,), explicit=True))
        assert io.flush(10) and len(store.snapshots()) == 1
        io.submit_save(SaveJob("b", np.arange(BS, 2 * BS, dtype=np.uint32), ((1,),), None,
                               None, ()))
        time.sleep(0.1)
        assert len(store.snapshots()) == 1  # the implicit one waits
        io.submit_save(SaveJob("c", np.arange(2 * BS, 3 * BS, dtype=np.uint32), ((2,),), None,
                               None, (BS,), explicit=True))
        assert io.flush(10) and len(store.snapshots()) == 3
        io.close()


def test_a_save_another_request_waits_for_is_published_under_a_prefill(tmp_path: Path) -> None:
    """The scheduler names the requests whose saves a request waits for
    (``SparkCacheMetadata.hurry``): such a save is published at once, with
    the ones queued before it; the worker reports its publish ended
    (``take_ended``, the scheduler's ``SparkCacheWorkerMeta``);
    a want whose save never comes lapses (``WANT_S``)."""
    pytest.importorskip("vllm")
    from sparkcache.connector.connector import SparkCacheConnector
    from sparkcache.connector.stats import SparkCacheMetadata, SparkCacheWorkerMeta

    with SnapshotStore(tmp_path / "s") as store:
        counters = Counters()
        io = WorkerIO(store, identity(), 0, FakePages(8, 1), counters)
        io.prefills.max_wait_s = 30.0  # a save that waited would wait past the flush
        connector = object.__new__(SparkCacheConnector)  # only its per-step hooks run
        connector.io = io
        connector.bind_connector_metadata(SparkCacheMetadata(prefill=True))  # never ends
        a = SaveJob("a", np.arange(BS, dtype=np.uint32), ((0,),), None, None, ())
        b = SaveJob("b", np.arange(BS, 2 * BS, dtype=np.uint32), ((1,),), None, None, ())
        io.submit_save(a)
        io.submit_save(b)
        time.sleep(0.2)
        assert store.snapshots() == []  # both wait for the prefill to end
        connector.bind_connector_metadata(SparkCacheMetadata(prefill=True, hurry=["b"]))
        assert io.flush(10) and len(store.snapshots()) == 2  # b, and a before it
        assert connector.build_connector_worker_meta().ended == {save_tag(a): 1, save_tag(b): 1}
        assert connector.build_connector_worker_meta() is None  # each reported once
        # vLLM sums the ranks' reports (its KVOutputAggregator calls aggregate).
        both = SparkCacheWorkerMeta({"x": 1}).aggregate(SparkCacheWorkerMeta({"x": 1, "y": 1}))
        assert both.ended == {"x": 2, "y": 1}
        assert not io.prefills.wanted("b")  # published: nobody waits for it
        io.close()
    prefills = Prefills(settle_s=0.01, max_wait_s=5.0, want_s=0.2)
    prefills.started(True)
    prefills.want(["never-saved"])
    assert prefills.hurried() and prefills.wait_quiet(time.monotonic()) < 0.05
    time.sleep(0.25)
    assert not prefills.hurried()  # lapsed


def test_an_idle_step_sleeps_until_a_wanted_publish_ends(tmp_path: Path) -> None:
    """On a step that computes nothing (``wait_for_loads``) while a request
    waits for a save, the engine sleeps until that save's publish ended, not
    for the whole timeout; with no save wanted it does not sleep at all."""
    with SnapshotStore(tmp_path / "s") as store:
        io = WorkerIO(store, identity(), 0, FakePages(8, 1), Counters())
        started = time.monotonic()
        io.wait_for_loads(2.0)
        assert time.monotonic() - started < 0.1  # nothing in flight, nothing wanted
        io.prefills.started(False, ["a"])  # the scheduler: a request waits for a's save
        job = SaveJob("a", np.arange(BS, dtype=np.uint32), ((0,),), None, None, ())
        threading.Timer(0.2, io.submit_save, (job,)).start()
        started = time.monotonic()
        io.wait_for_loads(5.0)
        assert 0.2 <= time.monotonic() - started < 2.0
        assert io.take_ended() == {save_tag(job): 1} and io.take_ended() == {}
        io.close()
