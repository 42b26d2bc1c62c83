"""The cost model: measured rates averaged (recent ones weigh more), kept in the
index across a restart, and the scheduler's choice made from them - restore,
restore only the local part, or recompute - with its reason in the request log
and the ``cost_*`` counters.  Rates are injected through the model's inputs
(``CostModel.set``, ``observe``), never through a product setting."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from sparkcache import SnapshotStore
from sparkcache.connector import costs as costs_module
from sparkcache.connector.costs import (
    LOAD_KEY,
    PREFILL,
    STEP,
    CostModel,
    CostPlanner,
    bucket_of,
    tier_source,
)
from sparkcache.connector.fetcher import Fetcher
from sparkcache.connector.jobs import Counters
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.stats import SparkCacheStats
from sparkcache.connector.worker import WorkerIO

from ..s3server import DelayProxy, s3_server, stop_s3_servers
from .helpers import BS, FakePages, Req, ask, blocks_of, finished, identity, prompt, save

P = prompt(100, 31)
Q = prompt(100, 77)
LOCAL_WARM, LOCAL_COLD = "local_warm", "local_cold"


@pytest.fixture(scope="module", autouse=True)
def _stop_s3() -> Iterator[None]:
    yield
    stop_s3_servers()


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    """A scheduler side with the cost model on (and a worker), optionally with a tier."""
    made: list[Any] = []

    def make(name: str = "a", url: str | None = None, endpoint: str | None = None,
             deadline: float = 30.0) -> tuple[SchedulerSide, WorkerIO, Counters]:
        root = tmp_path / name
        store = SnapshotStore(root)
        counters = Counters()
        sched = SchedulerSide(store, identity(), counters, min_tokens=BS, costs=True)
        io = WorkerIO(store, identity(), 0, FakePages(64, seed=3), counters)
        made.append((sched, io, store))
        if url is not None:
            shared = SnapshotStore(root, shared=url, shared_options={"endpoint_url": endpoint})
            fetcher = Fetcher(shared, identity(), counters, deadline=deadline, min_tokens=BS)
            sched.use_tier(fetcher, url, endpoint)
            made.append((None, None, shared))
        return sched, io, counters

    yield make
    for sched, io, store in made:
        if io is not None:
            io.close()
        if sched is not None:
            if sched.fetcher is not None:
                sched.fetcher.close()
            sched.close()
        store.close()


def _facts(sched: SchedulerSide, req: Req) -> dict[str, Any]:
    rows: list[dict[str, Any]] = []
    sched.on_facts = rows.append
    sched.finished(finished(req), blocks_of(req))
    sched.take_jobs()
    sched.on_facts = None
    return rows[-1]


def test_recent_measurements_weigh_more() -> None:
    model = CostModel("m")
    assert model.rate(LOCAL_WARM) is None and model.restore_seconds(LOCAL_WARM, 1) is None
    model.observe(LOCAL_WARM, 1000, 1.0)
    model.observe(LOCAL_WARM, 1000, 0.1)
    rate = model.rate(LOCAL_WARM)
    assert rate is not None and rate.samples == 2
    assert 1e-4 < rate.unit_s < 1e-3  # between the two, nearer the old one after one
    for _ in range(30):
        model.observe(LOCAL_WARM, 1000, 0.1)
    assert model.restore_seconds(LOCAL_WARM, 1000) == pytest.approx(0.1, rel=1e-3)


def test_a_local_restore_s_fixed_time_is_fitted_apart_from_its_rate() -> None:
    """Restores of 1 MB in 2 ms and 10 MB in 11 ms: 1 ms a restore, 1 ns a byte
    (a rate averaged per byte would make the 10 MB one 20 ms)."""
    model = CostModel("m")
    model.observe(LOCAL_WARM, 1e6, 0.002, fit=True)
    assert model.restore_seconds(LOCAL_WARM, 1e6) == pytest.approx(0.002)
    model.observe(LOCAL_WARM, 1e7, 0.011, fit=True)
    rate = model.rate(LOCAL_WARM)
    assert rate is not None
    assert (rate.latency_s, rate.unit_s) == (pytest.approx(0.001), pytest.approx(1e-9))
    for _ in range(20):  # the disk got slower: recent samples win
        model.observe(LOCAL_WARM, 1e6, 0.011, fit=True)
        model.observe(LOCAL_WARM, 1e7, 0.101, fit=True)
    assert model.restore_seconds(LOCAL_WARM, 1e7) == pytest.approx(0.101, rel=0.01)


def test_prefill_is_measured_from_steps_less_their_overhead() -> None:
    model = CostModel("m")
    assert model.prefill_seconds(100, 512) is None  # nothing measured: unknown
    model.observe_step(0, 0, 0.01)  # a decode step: the overhead
    model.observe_step(512, 512, 0.11)  # 512 tokens in 0.1 s past the overhead
    model.observe_step(8, 520, 5.0)  # too few tokens to measure
    step = model.rate(STEP)
    assert step is not None and step.latency_s == pytest.approx(0.01)
    assert model.prefill_seconds(256, 512) == pytest.approx(0.05)
    # another length: the nearest measured bucket until its own is measured
    assert model.prefill_seconds(256, 3000) == pytest.approx(0.05)
    model.observe_step(3000, 3000, 1.51)
    assert model.prefill_seconds(300, 3000) == pytest.approx(0.15)
    assert bucket_of(3000) == 12 and bucket_of(512) == 9 and bucket_of(1) == 0


@given(latency=st.floats(0.0, 1.9), tokens=st.integers(200, 100_000))
@example(latency=0.0025442721360680338, tokens=2976)  # 1.9999999999999998 s, unrounded
def test_a_tier_that_missed_the_deadline_is_not_asked_for_as_much_again(
        latency: float, tokens: int) -> None:
    """A request waited out the 2 s deadline for ``tokens`` of the tier: the
    next prompt of as many is not fetched (recomputing them takes longer than
    the deadline, so the deadline decides), whatever rounding makes of the bound."""
    model = CostModel("m")
    tier = tier_source("s3://b/kv", None)
    model.set(PREFILL, 0.02, bucket=bucket_of(tokens))
    model.observe_latency(tier, latency)
    planner = CostPlanner(model, None, bytes_per_token=49152, tier=tier, deadline=2.0)
    planner.fetch_expired(0, tokens)
    assert not planner.tier_pays(0, tokens, tokens)


def test_a_cold_local_store_on_a_slow_disk_is_recomputed(
    host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A 100 KB/s disk: restoring 96 tokens (6 KB) takes 0.06 s, recomputing
    them 0.0096 s - recomputed, ``too_slow``.  The same snapshot read recently
    (warm, never measured: tried) is restored, and so is a cold one once the
    disk is fast; a slow one is restored again once in a while, to measure it."""
    monkeypatch.setattr(costs_module, "REPROBE_SECONDS", (0.3, 0.6))
    sched, io, counters = host()
    save(sched, io, Req("a", P))
    counters.take()
    model = sched.costs
    model.set(PREFILL, 1e-4, bucket=bucket_of(len(P)))
    model.set(LOCAL_COLD, 1e-5)
    now = time.time()
    model.clock = lambda: now + 3600  # an hour on: the snapshot's file is cold
    req = Req("b", P)
    assert sched.matched_tokens(req, 0) == (0, False)
    assert _facts(sched, req)["restore_reason"] == "too_slow"
    data = counters.take()
    assert data["cost_too_slow"] == 1 and "hits" not in data and "misses" not in data
    model.clock = time.time  # warm: that source was never measured, so it is tried
    warm = Req("c", P)
    assert sched.matched_tokens(warm, 0) == (99, True)
    assert _facts(sched, warm)["restore_reason"] == "restored"
    model.set(LOCAL_COLD, 1e-9)  # a fast disk: cold restores pay
    model.clock = lambda: now + 3600
    assert sched.matched_tokens(Req("d", P), 0) == (99, True)
    assert counters.take()["cost_restored"] == 2
    model.set(LOCAL_COLD, 1e-5)  # slow again: recomputed, then probed after 0.3 s
    assert sched.matched_tokens(Req("e", P), 0) == (0, False)
    time.sleep(0.35)
    assert sched.matched_tokens(Req("f", P), 0) == (99, True)  # a probe: restored
    assert sched.matched_tokens(Req("g", P), 0) == (0, False)  # not again until 0.6 s on


def _restore(sched: SchedulerSide, io: WorkerIO, counters: Counters, req: Req) -> float:
    """Restore ``req`` as vLLM would; the worker's time for it, reported back."""
    assert sched.matched_tokens(req, 0) == (99, True)
    sched.after_alloc(req, list(range(7)), 99)
    (load,), _ = sched.take_jobs()
    io.submit_load(load)
    assert io.flush()
    data = counters.take()
    assert "\x01" not in "".join(SparkCacheStats(data=data).reduce())  # never logged
    sched.on_output(io.poll()[1], (), SparkCacheStats(data=data))
    sched.finished(finished(req), blocks_of(req))
    sched.take_jobs()
    return float(data[LOAD_KEY + req.request_id])


def test_a_restore_is_measured_from_the_workers_stats(host: Callable[..., Any]) -> None:
    """The engine's first restore from a source pays its set-up: not measured;
    the next one is."""
    sched, io, counters = host()
    save(sched, io, Req("a", P))
    assert _restore(sched, io, counters, Req("b", P)) > 0
    assert sched.costs.rate(LOCAL_WARM) is None
    seconds = _restore(sched, io, counters, Req("c", P))
    rate = sched.costs.rate(LOCAL_WARM)
    assert rate is not None and rate.samples == 1
    assert rate.unit_s == pytest.approx(seconds / (99 * 64), rel=1e-6)


def test_what_was_learned_survives_a_restart(host: Callable[..., Any], tmp_path: Path) -> None:
    sched, _io, _counters = host("a")
    sched.costs.observe(LOCAL_COLD, 1 << 20, 0.5)
    sched.costs.observe_step(1024, 1024, 0.2)
    sched.close()  # the engine stops: what it learned is written
    with SnapshotStore(tmp_path / "a") as store:
        rows = {(r.model, r.source, r.bucket): r for r in store.costs()}
    assert rows[("", LOCAL_COLD, 0)].unit_s == pytest.approx(0.5 / (1 << 20))
    assert rows[(identity().digest(), PREFILL, bucket_of(1024))].samples == 1
    assert rows[("", "verify", 0)].unit_s > 0  # measured when it started
    again = SchedulerSide(SnapshotStore(tmp_path / "a"), identity(), Counters(), costs=True)
    try:
        assert again.costs.restore_seconds(LOCAL_COLD, 1 << 20) == pytest.approx(0.5)
        assert again.costs.prefill_seconds(1024, 1024) == pytest.approx(0.2)
    finally:
        again.close()
        again.store.close()


def test_a_slow_tier_restores_only_the_local_part(host: Callable[..., Any]) -> None:
    """The tier holds the whole prompt, the local store its first 48 tokens; the
    tier is known to be slower than recomputing: the local part is restored at
    once (``partial``) and the tier is not asked."""
    server = s3_server()
    url = f"s3://{server.bucket()}/kv"
    a_sched, a_io, _ = host("a", url, server.endpoint)
    save(a_sched, a_io, Req("a", P))
    assert a_sched.fetcher is not None and a_sched.fetcher.store.upload().error is None
    sched, io, counters = host("b", url, server.endpoint)
    save(sched, io, Req("short", P[:48]))  # 48 tokens of P here (the answer differs)
    counters.take()
    sched.costs.set(PREFILL, 1e-4, bucket=bucket_of(len(P)))
    sched.costs.set(tier_source(url, server.endpoint), 1e-3)  # 1 KB/s
    req = Req("b", P)
    tokens, _async = sched.matched_tokens(req, 0)
    assert tokens == 48
    assert _facts(sched, req)["restore_reason"] == "partial"
    data = counters.take()
    assert data["cost_partial"] == 1 and "remote_lookups" not in data


def test_a_tier_seen_slow_is_skipped_then_used_again_once_it_recovered(
    host: Callable[..., Any], monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first request waits out the deadline (the tier was never measured);
    the next ones are answered at once, even after the fetcher's own pause.  A
    background probe finds the tier fast again, and it is asked once more."""
    monkeypatch.setattr(costs_module, "REPROBE_SECONDS", (0.5, 1.0))
    server = s3_server()
    url = f"s3://{server.bucket()}/kv"
    a_sched, a_io, _ = host("a", url, server.endpoint)
    prompts = [prompt(100, seed) for seed in (31, 32, 33, 34)]
    for i, p in enumerate(prompts):
        save(a_sched, a_io, Req(f"a{i}", p))
    assert a_sched.fetcher is not None and a_sched.fetcher.store.upload().error is None
    proxy = DelayProxy(server.port, 0.0)
    try:
        sched, _io, counters = host("b", url, proxy.endpoint, deadline=0.5)
        fetcher = sched.fetcher
        assert fetcher is not None
        sched.costs.set(PREFILL, 4e-3, bucket=bucket_of(len(P)))  # 0.38 s to recompute
        proxy.delay = 0.6
        started = time.monotonic()
        assert ask(sched, Req("b", prompts[0])) == (0, False)  # tried: the deadline
        assert 0.5 <= time.monotonic() - started < 3.0
        assert counters.take()["remote_timeouts"] == 1
        time.sleep(1.1)  # past the fetcher's own pause
        started = time.monotonic()
        assert sched.matched_tokens(Req("c", prompts[1]), 0) == (0, False)  # too slow
        assert time.monotonic() - started < 0.3
        data = counters.take()
        assert data["cost_too_slow"] == 1 and "remote_lookups" not in data
        time.sleep(0.6)  # a probe is due
        assert sched.matched_tokens(Req("c2", prompts[1]), 0) == (0, False)  # too slow
        assert counters.take()["remote_lookups"] == 1  # the probe, in the background
        _idle(fetcher)
        proxy.delay = 0.0
        time.sleep(1.1)  # the next probe is due
        assert sched.matched_tokens(Req("d", prompts[2]), 0) == (0, False)  # probes
        _idle(fetcher)
        assert counters.take()["remote_lookups"] == 1
        assert ask(sched, Req("e", prompts[3])) == (99, True)  # fast again: restored
    finally:
        proxy.stop()


def _idle(fetcher: Fetcher, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while fetcher.busy:
        assert time.monotonic() < deadline, "a fetch never ended"
        time.sleep(0.05)
