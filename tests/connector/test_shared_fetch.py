"""The scheduler side with a shared tier (moto's S3 server): a second host's
request waits for the fetch ("ask again"), then restores the first host's
rows; a slow tier (a delaying proxy) or one that is down is a counted miss."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from sparkcache import SnapshotStore
from sparkcache.connector.fetcher import Fetcher
from sparkcache.connector.groups import KVGroups
from sparkcache.connector.jobs import Counters
from sparkcache.connector.scheduler import SchedulerSide
from sparkcache.connector.worker import WorkerIO
from sparkcache.identity import WINDOW_BLOCKS_KEY

from ..s3server import DelayProxy, S3Server, s3_calls, s3_server, stop_s3_servers
from .helpers import (
    BS,
    PAGE_NBYTES,
    FakePages,
    Req,
    ask,
    blocks_of,
    finished,
    identity,
    prompt,
    save,
)

P = prompt(100, 31)


@pytest.fixture(scope="module", autouse=True)
def _stop_s3() -> Iterator[None]:
    yield
    stop_s3_servers()


def _host(root: Path, url: str, endpoint: str, *, deadline: float = 30.0,
          ) -> tuple[SnapshotStore, SchedulerSide, WorkerIO, Counters, SnapshotStore]:
    ident = identity()
    store = SnapshotStore(root)
    shared = SnapshotStore(root, shared=url, shared_options={"endpoint_url": endpoint})
    counters = Counters()
    fetcher = Fetcher(shared, ident, counters, deadline=deadline, min_tokens=BS)
    sched = SchedulerSide(store, ident, counters, min_tokens=BS, load_async=True,
                          fetcher=fetcher)
    io = WorkerIO(store, ident, 0, FakePages(64, seed=int(root.stat().st_ino) % 100), counters)
    return store, sched, io, counters, shared


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Callable[..., Any]]:
    made: list[Any] = []

    def make(name: str, url: str, endpoint: str, **kw: Any) -> Any:
        host = _host(tmp_path / name, url, endpoint, **kw)
        made.append(host)
        return host

    yield make
    for store, sched, io, _counters, shared in made:
        io.close()
        assert sched.fetcher is not None
        sched.fetcher.close()
        store.close()
        shared.close()


def _uploaded(hosts: Callable[..., Any], server: S3Server) -> tuple[str, Any]:
    url = f"s3://{server.bucket()}/kv"
    a = hosts("a", url, server.endpoint)
    save(a[1], a[2], Req("a", P))  # 112 tokens: the prompt and 12 answer tokens
    assert a[4].upload().error is None
    return url, a


def test_a_second_host_restores_through_the_tier(hosts: Callable[..., Any]) -> None:
    server = s3_server()
    url, a = _uploaded(hosts, server)
    b_store, b_sched, b_io, counters, _ = hosts("b", url, server.endpoint)
    req = Req("b", P)
    assert b_sched.matched_tokens(req, 0) == (None, False)  # the fetch runs
    assert ask(b_sched, req) == (99, True)  # 96 whole + the block holding the end
    b_sched.after_alloc(req, list(range(7)), 99)
    (load,), _ = b_sched.take_jobs()
    b_io.submit_load(load)
    assert b_io.flush() and b_io.poll()[1] == {"b"} and not b_io.take_failed_blocks()
    np.testing.assert_array_equal(b_io.pages.arr[:, :7], a[2].pages.arr[:, :7])  # a's rows
    data = counters.take()
    assert (data["remote_lookups"], data["remote_hits"], data["remote_hit_tokens"],
            data["hits"]) == (1, 1, 99, 1)
    assert b_store.stats()["fetches"] == 1
    b_sched.on_output({"b"}, ())
    facts: list[dict[str, Any]] = []
    b_sched.on_facts = facts.append
    b_sched.finished(finished(req), blocks_of(req))
    assert (facts[-1]["restored_tokens"], facts[-1]["remote_tokens"]) == (99, 99)  # the log
    # local now: the next request is answered at once, without the tier
    assert b_sched.matched_tokens(Req("c", P), 0) == (99, True)
    assert "remote_lookups" not in counters.take()


def test_a_slow_tier_is_a_miss_at_the_deadline(hosts: Callable[..., Any]) -> None:
    server = s3_server()
    url, _a = _uploaded(hosts, server)
    proxy = DelayProxy(server.port, 0.0)
    try:
        b = hosts("b", url, proxy.endpoint, deadline=0.5)  # opened while the tier is fast
        _store, sched, _io, counters, _shared = b
        proxy.delay = 5.0
        req = Req("b", P)
        started = time.monotonic()
        assert sched.matched_tokens(req, 0) == (None, False)
        # another request with nothing to ask the tier (under a block) is answered at once
        assert sched.matched_tokens(Req("short", P[:10]), 0) == (0, False)
        answer = ask(sched, req)
        waited = time.monotonic() - started
        assert answer == (0, False) and 0.5 <= waited < 3.0, (answer, waited)
        # the tier is paused now: the next request does not wait out the deadline
        assert sched.matched_tokens(Req("next", P), 0) == (0, False)
        data = counters.take()
        assert (data["remote_timeouts"], data["remote_skipped"]) == (1, 1)
        assert "remote_hits" not in data
        # fast again: after the pause (1 s) the tier is asked, and restores
        proxy.delay = 0.0
        time.sleep(1.1)
        again = Req("again", P)
        assert sched.matched_tokens(again, 0) == (None, False)
        answer = ask(sched, again)
        assert answer == (99, True), (answer, counters.take())  # what the tier did
    finally:
        proxy.stop()


def test_a_tier_that_is_down_is_a_counted_miss(hosts: Callable[..., Any]) -> None:
    s3_server()  # the session's environment (credentials) stays
    server = S3Server(set_env=False)
    try:
        url, _a = _uploaded(hosts, server)
        _store, sched, _io, counters, _shared = hosts("b", url, server.endpoint)
    finally:
        server.stop()
    req = Req("b", P)
    assert sched.matched_tokens(req, 0) == (None, False)
    assert ask(sched, req) == (0, False)
    assert sched.matched_tokens(Req("next", P), 0) == (0, False)  # paused: not asked
    data = counters.take()
    assert (data["remote_errors"], data["remote_skipped"]) == (1, 1)
    assert "remote_hits" not in data


def test_a_sliding_window_model_fetches_the_snapshot_ending_at_a_breakpoint(
    tmp_path: Path,
) -> None:
    """A windowed model (its layer 0 keeps 2 blocks): host a's snapshot of 112
    tokens is in the tier; host b's request goes on past it with a breakpoint
    at its end.  The fetch asks for the manifests at the prompt's last whole
    block and at the breakpoint, and b offers the whole snapshot (its end).  A
    later request asks only for breakpoints past what is local."""
    server = s3_server()
    url = f"s3://{server.bucket()}/kv"
    opts = {"endpoint_url": server.endpoint}
    ident = dataclasses.replace(identity(), extra=((WINDOW_BLOCKS_KEY, "2,0"),))
    toks = np.asarray(prompt(112, 41), np.uint32)
    rows = np.random.default_rng(5).integers(0, 256, (7, PAGE_NBYTES), np.uint8)
    with SnapshotStore(tmp_path / "a", shared=url, shared_options=opts) as a:
        assert a.publish(ident, 0, toks, [rows[-2:], rows]).state == "ready"
        assert a.upload().error is None
    store = SnapshotStore(tmp_path / "b")
    shared = SnapshotStore(tmp_path / "b", shared=url, shared_options=opts)
    counters = Counters()
    fetcher = Fetcher(shared, ident, counters, deadline=30.0, min_tokens=BS)
    sched = SchedulerSide(store, ident, counters, min_tokens=BS, fetcher=fetcher,
                          groups=KVGroups((2, 0)))
    try:
        longer = [*toks.tolist(), *prompt(60, 42)]  # 172 tokens: 160 in whole blocks
        req = Req("b", longer, kv_transfer_params={"sparkcache": {"breakpoints": [112]}})
        assert sched.matched_tokens(req, 0) == (None, False)  # the fetch runs
        assert ask(sched, req) == (112, True)  # the whole snapshot, at its end
        data = counters.take()
        assert data["remote_lookups"] == 1 and "remote_misses" not in data
        assert store.stats()["fetches"] == 1
        # 112 is local now: a longer prompt's breakpoint at 112 is not asked for
        assert shared.shared is not None
        again = Req("c", [*longer, *prompt(80, 43)],
                    kv_transfer_params={"sparkcache": {"breakpoints": [112, 200]}})
        with s3_calls(shared.shared.backend.fs) as calls:
            assert sched.matched_tokens(again, 0) == (None, False)
            assert ask(sched, again) == (112, True)
        assert calls == {"HeadObject": 2}  # 240 and 200: no snapshot ends there
        assert counters.take()["remote_misses"] == 1
    finally:
        fetcher.close()
        store.close()
        shared.close()
