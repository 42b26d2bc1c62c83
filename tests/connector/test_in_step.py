"""In-step restores (``load_async`` false, or ``auto`` while a request is alone):
the forward of the prefill step waits for each layer of the restore, read
layer by layer under it; a failure or a skipped wait means vLLM recomputes."""

from __future__ import annotations

import dataclasses
import threading
from pathlib import Path
from typing import Any

import numpy as np

from sparkcache import SnapshotStore
from sparkcache.connector.jobs import Counters, LoadJob
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.worker import WorkerIO

from .helpers import BS, PAGE_NBYTES, FakePages, Req, identity, prompt, published_pages, save


def test_auto_restores_in_step_only_when_alone(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "s") as store:
        sched = SchedulerSide(store, identity(), Counters(), min_tokens=BS, load_async=None)
        io = WorkerIO(store, identity(), 0, FakePages(16, 1), Counters())
        p = prompt(100, 20)
        save(sched, io, Req("a", p))
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


def test_in_step_load_lands_layer_by_layer(tmp_path: Path) -> None:
    """The forward's wait for layer 0 returns while layer 1 is still unread;
    layer 1's wait returns once it landed; scattered blocks get their pages."""
    with SnapshotStore(tmp_path / "s") as store:
        p = prompt(100, 21)
        snap, pages = published_pages(store, p)
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
        io.start_step_loads([LoadJob("r", snap.id, 96, np.asarray(p[:96], np.uint32), 2,
                                     (tuple(ids),), in_step=True)])
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
        snap, pages = published_pages(store, p)
        counters = Counters()
        kv = FakePages(16, 3)
        io = WorkerIO(store, identity(), 0, kv, counters)
        job = LoadJob("r", snap.id, 96, np.asarray(p[:96], np.uint32), 0, (tuple(range(6)),),
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
        job = LoadJob("r", fresh, 96, job.token_ids, 0, job.blocks, in_step=True)
        io.start_step_loads([job])
        io.finish_step_loads(all_layers_waited=False)
        assert io.take_failed_blocks() == set(range(6))
        got = counters.take()
        assert got["load_failures"] == 1 and got["loads_unwaited"] == 1
        io.close()


def test_a_last_block_the_forward_writes_into_lands_before_it_starts(tmp_path: Path) -> None:
    """vLLM writes a layer's new tokens into the cache before that layer waits
    for its restore: where the prompt leaves the snapshot inside the last
    restored block, that block (every layer) is read first and the step's
    forward does not start before it landed; the other blocks then land
    layer by layer under the forward."""
    with SnapshotStore(tmp_path / "s") as store:
        p = prompt(100, 23)
        snap, pages = published_pages(store, p)
        kv = FakePages(16, 2)
        io = WorkerIO(store, identity(), 0, kv, Counters(), load_threads=1)
        gate = threading.Event()
        calls: list[tuple[Any, Any]] = []
        real = store.read_into

        def gated(*args: Any, **kwargs: Any) -> int:
            calls.append((kwargs["start_tokens"], kwargs["n_tokens"]))
            assert gate.wait(10)
            return real(*args, **kwargs)

        store.read_into = gated  # type: ignore[method-assign]
        ids = (9, 3, 4, 12, 1, 7)
        job = LoadJob("r", snap.id, 96, np.asarray(p[:96], np.uint32), 0, (ids,),
                      in_step=True, computes_from=90)  # 10 tokens of block 5 restored
        started = threading.Event()
        starter = threading.Thread(target=lambda: (io.start_step_loads([job]), started.set()))
        starter.start()
        assert not started.wait(0.3)  # the shared block has not landed: no forward yet
        assert calls == [([80, 80], 96)]  # block 5 of both layers, read first
        gate.set()
        assert started.wait(10)
        starter.join()
        expect = [pg.reshape(6, PAGE_NBYTES) for pg in pages]
        for layer in (0, 1):
            np.testing.assert_array_equal(kv.arr[layer, ids[-1]], expect[layer][5])
        io.wait_layer(None)
        assert calls[1] == ([0, 0], 80)  # then the five blocks before it
        for layer in (0, 1):
            np.testing.assert_array_equal(kv.arr[layer, list(ids)], expect[layer])
        io.finish_step_loads(all_layers_waited=True)
        assert io.take_failed_blocks() == set()
        stats = store.stats()  # one restore, read in two parts: one hit, all its blocks
        assert (stats["hits"], stats["restored_tokens"]) == (1, 96), stats
        # The same load where the shared block fails its check: the forward
        # starts at once, every block is reported failed and recomputed.
        (segment,) = (tmp_path / "s").glob("objects/*/*/*.safetensors")
        data = bytearray(segment.read_bytes())
        data[-96 * 4 - 10] ^= 0xFF  # layer 1's last block, just before the token ids
        segment.write_bytes(bytes(data))
        calls.clear()
        io.start_step_loads([job])
        io.finish_step_loads(all_layers_waited=True)
        assert calls == [([80, 80], 96)]  # nothing read past the failure
        assert io.take_failed_blocks() == set(ids)
        io.close()


def test_split_of_a_load_sharing_its_last_block() -> None:
    tokens = np.arange(96, dtype=np.uint32)
    job = LoadJob("r", 1, 96, tokens, 2, ((1, 2, 3, 4),), in_step=True, computes_from=90)
    last, rest = job.split(BS)  # type: ignore[misc]
    assert (last.blocks, last.start_block, last.n_tokens) == (((4,),), 5, 96)
    assert rest is not None and (rest.blocks, rest.start_block, rest.n_tokens) == \
        (((1, 2, 3),), 2, 80)
    np.testing.assert_array_equal(rest.token_ids, tokens[:80])
    # Nothing the forward writes into: no split.
    for other in (dataclasses.replace(job, computes_from=96),
                  dataclasses.replace(job, computes_from=None),
                  dataclasses.replace(job, in_step=False)):
        assert other.split(BS) is None
    # Only the shared block: that block alone.  A window group holding only the
    # shared block: the whole load first.
    one = dataclasses.replace(job, blocks=((4,),), start_block=5)
    assert one.split(BS) == (one, None)
    window = dataclasses.replace(job, blocks=((1, 2, 3, 4), (8,)))
    assert window.split(BS) == (window, None)
    two = dataclasses.replace(job, blocks=((1, 2, 3, 4), (7, 8)))
    last, rest = two.split(BS)  # type: ignore[misc]
    assert last.blocks == ((4,), (8,)) and rest is not None and rest.blocks == ((1, 2, 3), (7,))
