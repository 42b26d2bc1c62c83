"""What the scheduler side reports of each request: the request log row and usage.

The facts go out twice: when the prompt has been scheduled (``sparkcache
serve`` reads them for a streamed answer's usage) and at the finish, where
they are also the ``kv_transfer_params`` vLLM returns with the output.  A
breakpoint's ``ttl`` becomes a keep lease that retention respects and an
explicit clear does not.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from sparkcache import SnapshotStore, admin
from sparkcache.connector import requests as requests_module
from sparkcache.connector.jobs import Counters, SaveJob
from sparkcache.connector.logwriter import LogWriter
from sparkcache.connector.scheduler import SchedulerSide, params_of
from sparkcache.connector.worker import WorkerIO
from sparkcache.core import KEEP_LEASE

from .helpers import BS, FakePages, Req, finished, identity, prompt, save, step


def test_params_accept_positions_and_ttls_and_ignore_garbage() -> None:
    req = Req("a", [1], kv_transfer_params={"sparkcache": {
        "id": "sc-1", "breakpoints": [40, {"at": 70, "ttl": 3600}, {"at": 70, "ttl": 300}]}})
    params = params_of(req)
    assert (params.log_id, params.breakpoints, dict(params.keep)) == \
        ("sc-1", (40, 70, 70), {70: 3600.0})
    for bad in ([{"at": 70, "ttl": 99999}], [{"at": -1}], [True], "x", [{"ttl": 5}]):
        assert params_of(Req("b", [1], kv_transfer_params={
            "sparkcache": {"breakpoints": bad}})).breakpoints == (), bad
    assert params_of(Req("c", [1], kv_transfer_params={"sparkcache": {"id": 7}})).log_id is None
    assert params_of(Req("d", [1])).log_id is None
    assert params_of(Req("e", [1])).cache is True
    assert params_of(Req("f", [1], kv_transfer_params={"sparkcache": {"cache": False}})).cache \
        is False
    assert params_of(Req("g", [1], kv_transfer_params={"sparkcache": {"cache": "no"}})).cache
    day = params_of(Req("h", [1], kv_transfer_params={"sparkcache": {"breakpoints": [
        {"at": 70, "ttl": 86400}]}}))
    assert dict(day.keep) == {70: 86400.0}  # OpenAI's 24h retention


def test_a_prefix_breakpoint_is_where_its_tokens_stop_agreeing_with_the_prompt() -> None:
    tokens = prompt(100, 3)
    render = [*tokens[:70], 9, 9]  # the template closes the cut prompt its own way
    params = params_of(Req("a", tokens, kv_transfer_params={"sparkcache": {"breakpoints": [
        {"prefix": render, "ttl": 300}, {"prefix": tokens[:40]}, {"prefix": [*tokens, 1]},
        {"prefix": []}]}}))
    assert params.breakpoints == (70, 40, 100, 0) and dict(params.keep) == {70: 300.0}
    for bad in ({"prefix": "x"}, {"prefix": [1, -2]}, {"prefix": [1.5]}, {"prefix": [True]},
                {"prefix": [2**32]}, {"prefix": tokens, "at": 5}, {"prefix": [1], "ttl": 0}):
        assert params_of(Req("b", tokens, kv_transfer_params={
            "sparkcache": {"breakpoints": [bad]}})).breakpoints == (), bad


def test_a_prefix_breakpoint_is_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(requests_module, "MAX_PREFIX_TOKENS", 5)
    tokens = prompt(10, 4)
    for n, want in ((5, (5,)), (6, ())):
        assert params_of(Req("a", tokens, kv_transfer_params={"sparkcache": {
            "breakpoints": [{"prefix": tokens[:n]}]}})).breakpoints == want


def run(sched: SchedulerSide, req: Req, blocks: list[int], local: int = 0) -> list[SaveJob]:
    """Admit ``req`` (vLLM's own hit: ``local`` tokens) and prefill it in one step;
    the saves that step plans."""
    offered, load_async = sched.matched_tokens(req, local)
    sched.after_alloc(req, blocks, offered or 0)
    if offered and load_async:  # the load lands; vLLM then calls again, with 0
        sched.on_output([req.request_id], ())
        sched.after_alloc(req, blocks, 0)
    req.num_computed_tokens = local + (offered or 0)
    return step(sched, req, len(req.prompt_token_ids) - req.num_computed_tokens, blocks)


def test_facts_at_prefill_and_finish(one_rank: Any) -> None:
    store, _sched, io, _counters = one_rank
    facts: list[dict[str, Any]] = []
    sched = SchedulerSide(store, identity(), Counters(), min_tokens=BS, load_async=True,
                          on_facts=facts.append)
    p = prompt(200, 21)
    req = Req("a", p, kv_transfer_params={"sparkcache": {"id": "sc-a", "breakpoints": [150]}})
    req.arrival_time = time.time() - 0.5  # type: ignore[attr-defined]
    saves = run(sched, req, list(range(10)))
    (prefill,) = facts
    assert prefill["request_id"] == "sc-a" and prefill["prompt_tokens"] == 200
    assert (prefill["live_tokens"], prefill["restored_tokens"], prefill["written_tokens"]) == \
        (0, 0, 150)  # up to the breakpoint (its block is stored whole), all new
    assert prefill["breakpoints"] == [150] and prefill["queue_s"] >= 0.5
    assert "ttft_s" not in prefill  # no token yet
    for job in saves:
        io.submit_save(job)
    assert io.flush()
    _held, params = sched.finished(req, list(range(10)))
    final = facts[-1]
    assert params == {"sparkcache": {k: v for k, v in final.items() if k != "created_at"}}
    assert final["written_tokens"] == 150 and final["output_tokens"] == 0
    # A second request under the same 150-token prefix: vLLM's own cache has the
    # first 128 tokens, a restore the next 22 (the 6 of them in the stored block
    # holding the breakpoint); the breakpoint is stored already.
    other = Req("b", p[:150] + prompt(40, 22),
                kv_transfer_params={"sparkcache": {"breakpoints": [150]}})
    facts.clear()
    run(sched, other, list(range(10, 22)), local=128)
    (prefill,) = facts
    assert prefill["request_id"] == "b"  # no id given: vLLM's own
    assert (prefill["live_tokens"], prefill["restored_tokens"], prefill["written_tokens"]) == \
        (128, 22, 0)


def test_written_counts_only_what_was_not_read_or_stored(one_rank: Any) -> None:
    store, _sched, io, _counters = one_rank
    facts: list[dict[str, Any]] = []
    sched = SchedulerSide(store, identity(), Counters(), min_tokens=BS, load_async=True,
                          on_facts=facts.append)
    p = prompt(300, 23)
    save(sched, io, Req("x", p[:96]))  # 96 (+16 answer -> 96 stored tokens) published
    facts.clear()
    req = Req("a", p, kv_transfer_params={"sparkcache": {"breakpoints": [200, 260]}})
    run(sched, req, list(range(20)))
    (prefill,) = facts
    assert prefill["restored_tokens"] == 96  # the stored prefix is read...
    assert prefill["written_tokens"] == 260 - 96  # ...and only the rest is new


def test_a_ttl_keeps_the_snapshot_from_retention_not_from_clear(tmp_path: Path) -> None:
    ident = identity()
    with SnapshotStore(tmp_path / "s") as store:
        io = WorkerIO(store, ident, 0, FakePages(32, 1), Counters())
        sched = SchedulerSide(store, ident, Counters(), min_tokens=BS, load_async=True)
        p = prompt(100, 24)
        req = Req("a", p, kv_transfer_params={"sparkcache": {"breakpoints": [
            {"at": 96, "ttl": 3600}]}})
        sched.matched_tokens(req, 0)
        (job,) = step(sched, req, 100, list(range(8)))
        assert job.keep == 3600
        io.submit_save(job)
        assert io.flush()
        (snap,) = store.snapshots()
        (lease,) = _leases(store, snap.id)
        assert lease.kind == KEEP_LEASE and 3599 < lease.expires_at - lease.created_at <= 3600
        assert store.evict(count=10) == []  # retention passes it by
        report = admin.clear_model(store, snap.model_id)
        assert report.deleted == [snap.id]  # an explicit clear does not
        io.close()


def _leases(store: SnapshotStore, snapshot_id: int) -> list[Any]:
    with store._core.read() as conn:
        return store._core.leases(conn, snapshot_id)


def test_a_request_that_asks_not_to_be_cached_neither_restores_nor_saves(
        one_rank: Any) -> None:
    store, sched, io, _counters = one_rank
    p = prompt(200, 25)
    save(sched, io, Req("x", p[:128]))  # a stored prefix the request could restore
    before = {s.id for s in store.snapshots()}
    assert before
    off = {"sparkcache": {"cache": False, "breakpoints": [150]}}
    req = Req("a", p, kv_transfer_params=off)
    assert sched.matched_tokens(req, 0) == (0, False)  # no restore offered
    assert step(sched, req, 200, list(range(10))) == []  # no breakpoint save
    held, params = sched.finished(req, list(range(10)))
    assert not held and sched.take_jobs() == ([], [])  # no save at the finish
    assert params is not None and params["sparkcache"]["written_tokens"] == 0
    assert {s.id for s in store.snapshots()} == before
    # The same request without the flag restores the stored prefix.
    again = Req("b", p, kv_transfer_params={"sparkcache": {"breakpoints": [150]}})
    assert sched.matched_tokens(again, 0)[0] == 128


def test_the_log_writer_commits_rows_off_the_caller(tmp_path: Path) -> None:
    counters = Counters()
    writer = LogWriter(str(tmp_path / "s"), identity(), counters, keep=3)
    try:
        for i in range(5):
            writer.put({"request_id": f"r{i}", "created_at": 1000.0 + i, "prompt_tokens": i})
        writer.put({"request_id": "r4", "restored_tokens": 32})
    finally:
        writer.close()
    with SnapshotStore(tmp_path / "s") as store:
        rows = store.requests()
    assert [r.request_id for r in rows] == ["r4", "r3", "r2"]  # the newest 3 kept
    assert rows[0].restored_tokens == 32 and rows[0].prompt_tokens == 4
    assert rows[0].model_id == writer.model_id and "log_failures" not in counters.take()


def test_facts_go_under_the_connectors_own_key(one_rank: Any) -> None:
    """A second sparkcache connector inside vLLM's MultiConnector reports under
    its own key (vLLM refuses two children's dicts that share one); both read
    the request's parameters from ``"sparkcache"``."""
    store, _sched, _io, _counters = one_rank
    sched = SchedulerSide(store, identity(), Counters(), min_tokens=BS,
                          params_key="sparkcache.1")
    req = Req("a", prompt(100, 23), kv_transfer_params={"sparkcache": {"id": "sc-a"}})
    assert sched.matched_tokens(req, 0) == (0, False)
    _held, params = sched.finished(req, list(range(7)))
    assert params is not None and list(params) == ["sparkcache.1"]
    assert params["sparkcache.1"]["request_id"] == "sc-a"


def test_written_tokens_split_by_each_breakpoints_ttl(one_rank: Any) -> None:
    """Each written token is its breakpoint's: the tokens up to a breakpoint,
    above the one before it, count for its ttl ("0": none)."""
    store, _sched, io, _counters = one_rank
    facts: list[dict[str, Any]] = []
    sched = SchedulerSide(store, identity(), Counters(), min_tokens=BS, load_async=True,
                          on_facts=facts.append)
    p = prompt(300, 24)
    marks = [{"at": 100, "ttl": 3600}, 200, {"at": 260, "ttl": 300}]
    req = Req("a", p, kv_transfer_params={"sparkcache": {"id": "sc-a", "breakpoints": marks}})
    saves = run(sched, req, list(range(20)))
    (prefill,) = facts
    assert prefill["written_tokens"] == 260
    assert prefill["written_by_ttl"] == {"3600": 100, "0": 200 - 100, "300": 260 - 200}
    for job in saves:
        io.submit_save(job)
    assert io.flush()
    _held, params = sched.finished(req, list(range(20)))
    assert params is not None
    assert params["sparkcache"]["written_by_ttl"] == {"3600": 100, "0": 100, "300": 60}
    # The same prefix under a longer prompt: the first two breakpoints are read,
    # the third (1h now) writes only what lies above what was stored.
    facts.clear()
    other = Req("b", p[:260] + prompt(40, 25), kv_transfer_params={"sparkcache": {
        "breakpoints": [{"at": 100, "ttl": 3600}, {"at": 290, "ttl": 3600}]}})
    run(sched, other, list(range(20, 40)))
    (prefill,) = facts
    read = prefill["live_tokens"] + prefill["restored_tokens"]
    assert read == 260 and prefill["written_tokens"] == 288 - read
    assert prefill["written_by_ttl"] == {"3600": 288 - read}
    # Nothing written: an empty split.
    # The breakpoint inside a stored block, read to it exactly: not saved again.
    facts.clear()
    assert run(sched, Req("c", p[:100] + prompt(20, 26), kv_transfer_params={"sparkcache": {
        "breakpoints": [{"at": 100, "ttl": 3600}]}}), list(range(40, 48))) == []
    assert (facts[0]["written_tokens"], facts[0]["written_by_ttl"]) == (0, {})


def test_a_breakpoint_in_the_prompts_last_block_rounds_down(one_rank: Any) -> None:
    """A breakpoint in the prompt's last, partial block is saved as the whole
    blocks below it (that block is not full while the prompt is computed), and
    its writes are counted so in the prefill's row and the final one alike,
    even when the answer fills the block; a later prompt still restores to the
    mark, from the finished request's snapshot."""
    store, _sched, io, _counters = one_rank
    facts: list[dict[str, Any]] = []
    sched = SchedulerSide(store, identity(), Counters(), min_tokens=BS, load_async=True,
                          on_facts=facts.append)
    p = prompt(100, 27)
    req = Req("a", p, kv_transfer_params={"sparkcache": {"breakpoints": [98]}})
    (job,) = run(sched, req, list(range(8)))
    assert len(job.token_ids) == 96 and facts[0]["written_tokens"] == 96
    io.submit_save(job)
    held, params = sched.finished(finished(req), list(range(8)))
    assert held and params is not None and params["sparkcache"]["written_tokens"] == 96
    _, (final,) = sched.take_jobs()
    io.submit_save(final)
    assert io.flush()
    sched.on_output((), io.poll()[0])
    assert sched.matched_tokens(Req("b", p[:98] + prompt(30, 28)), 0) == (98, True)
