"""sparkcache.requestlog: rows filled in by request id, the newest kept, read back
in order, summed, and visible to a plain sqlite3 reader of index.sqlite."""

from __future__ import annotations

import dataclasses
import json
import sqlite3
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from sparkcache import SnapshotStore, admin, requestlog
from sparkcache.errors import InvalidArgument, NotFound
from sparkcache.index import schema
from sparkcache.requestlog import LOG_FIELDS, RequestRow, log_rows_setting

from .filled import Filled
from .store.helpers import Clock, identity, pages_for, tokens

T0 = 1767323045.0  # 2026-01-02 03:04:05 UTC


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def store(tmp_path: Path, clock: Clock) -> Iterator[SnapshotStore]:
    with SnapshotStore(tmp_path / "store", clock=clock) as s:
        yield s


def ids(rows: list[RequestRow]) -> list[str]:
    return [r.request_id for r in rows]


def test_fields_are_the_table_columns_and_the_row_type() -> None:
    columns = [c.name for c in schema.REQUEST_LOG.columns]
    assert columns == ["seq", *LOG_FIELDS]
    assert [f.name for f in dataclasses.fields(RequestRow)] == columns


def test_a_later_record_fills_in_the_row(store: SnapshotStore) -> None:
    store.log_requests([{"request_id": "a", "created_at": T0, "model": "llama", "api": "chat",
                         "prompt_tokens": 100, "live_tokens": 32, "restored_tokens": 48,
                         "breakpoints": [64, 96], "queue_s": 0.01}], keep=10)
    store.log_requests([{"request_id": "a", "created_at": None, "live_tokens": None,
                         "output_tokens": 7, "ttft_s": 0.25, "total_s": 1.5, "status": 200}],
                       keep=10)
    row = store.request("a")
    assert row == RequestRow(
        seq=1, request_id="a", created_at=T0, model_id=None, model="llama", api="chat",
        cache_key=None, prompt_tokens=100, live_tokens=32, restored_tokens=48,
        written_tokens=None, output_tokens=7, breakpoints=(64, 96), queue_s=0.01,
        restore_s=None, ttft_s=0.25, total_s=1.5, status=200)
    assert row.cached_tokens == 80
    # A value given again replaces the stored one; the row keeps its place.
    store.log_requests([{"request_id": "a", "prompt_tokens": 120, "breakpoints": "[8]"}],
                       keep=10)
    row = store.request("a")
    assert row is not None and (row.seq, row.prompt_tokens, row.breakpoints) == (1, 120, (8,))
    assert store.request("nope") is None


def test_written_by_ttl_is_stored_as_json_and_read_as_a_mapping(store: SnapshotStore) -> None:
    store.log_requests([{"request_id": "a", "written_tokens": 160,
                         "written_by_ttl": {"3600": 96, "300": 64}},
                        {"request_id": "b", "written_by_ttl": '{"0": 5}'}], keep=10)
    a, b = store.request("a"), store.request("b")
    assert a is not None and a.written_by_ttl == {"300": 64, "3600": 96}
    assert b is not None and b.written_by_ttl == {"0": 5}
    assert admin.to_dict(a)["written_by_ttl"] == {"300": 64, "3600": 96}
    store.log_requests([{"request_id": "c"}], keep=10)
    c = store.request("c")
    assert c is not None and c.written_by_ttl is None  # never recorded
    # A row written by hand that is no such mapping reads as None.
    conn = sqlite3.connect(store.root / "index.sqlite")
    with conn:
        conn.execute("UPDATE request_log SET written_by_ttl = '[1]' WHERE request_id = 'c'")
    conn.close()
    c = store.request("c")
    assert c is not None and c.written_by_ttl is None


def test_created_at_defaults_to_the_first_record(store: SnapshotStore, clock: Clock) -> None:
    store.log_requests([{"request_id": "a"}], keep=10)
    clock.now += 60
    store.log_requests([{"request_id": "a", "prompt_tokens": 5},
                        {"request_id": "b", "prompt_tokens": 6}], keep=10)
    a, b = store.request("a"), store.request("b")
    assert a is not None and b is not None
    assert (a.created_at, b.created_at) == (clock.now - 60, clock.now)
    assert (a.cached_tokens, a.breakpoints) == (0, ())  # nothing recorded: zero, none


def test_trimming_keeps_the_newest_rows_even_when_rows_were_filled_in(
        store: SnapshotStore) -> None:
    # Every request recorded twice, as the connector does (scheduled, finished):
    # an upsert that took a new seq each time would leave only half of `keep`.
    for n in range(6):
        rid = f"r{n}"
        store.log_requests([{"request_id": rid, "prompt_tokens": n}], keep=3)
        store.log_requests([{"request_id": rid, "output_tokens": 1}], keep=3)
    rows = store.requests()
    assert ids(rows) == ["r5", "r4", "r3"]
    assert [r.seq for r in rows] == [6, 5, 4]
    store.log_requests([], keep=1)  # a smaller keep trims at once
    assert ids(store.requests()) == ["r5"]
    # A trimmed request recorded again is a new row, at the end.
    store.log_requests([{"request_id": "r0"}, {"request_id": "r6"}], keep=2)
    assert ids(store.requests()) == ["r6", "r0"]


def test_newest_first_or_after_a_seq_oldest_first(store: SnapshotStore) -> None:
    store.log_requests([{"request_id": f"r{n}", "model_id": n % 2, "created_at": T0 + n}
                        for n in range(1, 7)], keep=100)
    assert ids(store.requests()) == ["r6", "r5", "r4", "r3", "r2", "r1"]
    assert ids(store.requests(limit=2)) == ["r6", "r5"]
    assert ids(store.requests(model_id=1)) == ["r5", "r3", "r1"]
    assert ids(store.requests(after_seq=2)) == ["r3", "r4", "r5", "r6"]
    assert ids(store.requests(after_seq=2, limit=2)) == ["r3", "r4"]
    assert ids(store.requests(after_seq=2, model_id=0)) == ["r4", "r6"]
    assert store.requests(after_seq=6) == []
    assert ids(store.requests(after_seq=0)) == ["r1", "r2", "r3", "r4", "r5", "r6"]


@pytest.mark.parametrize(("row", "match"), [
    ({"request_id": "x", "prompt": 5}, "unknown request log field.*'prompt'"),
    ({"request_id": "x", "seq": 5}, "unknown request log field.*'seq'"),
    ({"prompt_tokens": 5}, "needs its request_id"),
    ({"request_id": ""}, "request_id=''"),
    ({"request_id": "x", "api": "embeddings"}, "api='embeddings'.*messages, chat"),
    ({"request_id": "x", "prompt_tokens": -1}, "prompt_tokens=-1"),
    ({"request_id": "x", "live_tokens": True}, "live_tokens=True"),
    ({"request_id": "x", "status": 200.5}, "status=200.5"),
    ({"request_id": "x", "ttft_s": float("nan")}, "ttft_s=nan"),
    ({"request_id": "x", "created_at": "now"}, "created_at='now'"),
    ({"request_id": "x", "breakpoints": "not json"}, "breakpoints='not json'"),
    ({"request_id": "x", "breakpoints": [16, -1]}, "breakpoints"),
    ({"request_id": "x", "breakpoints": 16}, "breakpoints=16"),
    ({"request_id": "x", "written_by_ttl": {"5m": 3}}, "written_by_ttl=.*keep seconds"),
    ({"request_id": "x", "written_by_ttl": {"300": -3}}, "written_by_ttl="),
    ({"request_id": "x", "written_by_ttl": [300]}, "written_by_ttl="),
    ("x", "a mapping"),
])
def test_bad_rows_are_refused_and_nothing_is_written(store: SnapshotStore, row: Any,
                                                     match: str) -> None:
    with pytest.raises(InvalidArgument, match=match):
        store.log_requests([{"request_id": "good"}, row], keep=10)
    assert store.requests() == []


def test_keep_limit_and_after_seq_are_checked(store: SnapshotStore) -> None:
    for keep in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgument, match="keep"):
            store.log_requests([{"request_id": "a"}], keep=keep)
    with pytest.raises(InvalidArgument, match="limit"):
        store.requests(limit=0)
    with pytest.raises(InvalidArgument, match="after_seq"):
        store.requests(after_seq=-1)
    assert store.requests() == []


def test_summary_and_by_cache_key(store: SnapshotStore) -> None:
    empty = store.request_summary()
    assert (empty.requests, empty.prompt_tokens, empty.hit_rate) == (0, 0, 0.0)
    assert store.requests_by_key() == []
    store.log_requests([
        {"request_id": "a", "model_id": 1, "cache_key": "k1", "prompt_tokens": 100,
         "live_tokens": 20, "restored_tokens": 60, "written_tokens": 0},
        {"request_id": "b", "model_id": 1, "cache_key": "k1", "prompt_tokens": 100,
         "live_tokens": 100, "written_tokens": 32},
        {"request_id": "c", "model_id": 1, "cache_key": "k2", "prompt_tokens": 50},
        {"request_id": "d", "model_id": 2, "cache_key": "k2", "prompt_tokens": 40,
         "restored_tokens": 40},
        {"request_id": "e", "model_id": 2, "cache_key": "k2", "prompt_tokens": 10},
        {"request_id": "f", "model_id": 2, "prompt_tokens": 1000, "live_tokens": 10},
    ], keep=100)
    total = store.request_summary()
    assert (total.requests, total.prompt_tokens, total.live_tokens, total.restored_tokens,
            total.written_tokens) == (6, 1300, 130, 100, 32)
    assert total.cached_tokens == 230 and total.hit_rate == pytest.approx(230 / 1300)
    one = store.request_summary(model_id=1)
    assert (one.requests, one.prompt_tokens, one.cached_tokens) == (3, 250, 180)
    assert one.hit_rate == pytest.approx(0.72)
    keys = store.requests_by_key()
    assert [(k.cache_key, k.requests, k.prompt_tokens, k.cached_tokens) for k in keys] == [
        ("k2", 3, 100, 40), ("k1", 2, 200, 180)]
    assert keys[1].hit_rate == pytest.approx(0.9)
    assert [(k.cache_key, k.requests) for k in store.requests_by_key(model_id=1)] == [
        ("k1", 2), ("k2", 1)]
    assert store.requests_by_key(model_id=3) == []


def test_the_log_outlives_a_deleted_model(store: SnapshotStore) -> None:
    ident, toks = identity(), tokens(16)
    store.publish(ident, 0, toks, pages_for(ident, toks))
    (snap,) = store.snapshots()
    store.log_requests([{"request_id": "a", "model_id": snap.model_id}], keep=10)
    store.delete(snap.id)
    with store._core.write() as conn:
        conn.execute("DELETE FROM models WHERE id = ?", (snap.model_id,))
    assert ids(store.requests(model_id=snap.model_id)) == ["a"]


def test_the_log_is_plain_sqlite(store: SnapshotStore) -> None:
    """What the issue asks: the log can be read with the sqlite3 shell (here
    Python's sqlite3 module, read-only) while the store is open."""
    store.log_requests([{"request_id": "a", "created_at": T0, "api": "messages",
                         "prompt_tokens": 64, "live_tokens": 16, "restored_tokens": 32,
                         "breakpoints": [32, 64], "ttft_s": 0.1234}], keep=10)
    conn = sqlite3.connect(f"file:{store.root / 'index.sqlite'}?mode=ro", uri=True)
    try:
        assert conn.execute(
            "SELECT request_id, api, prompt_tokens, breakpoints FROM request_log").fetchall() == [
            ("a", "messages", 64, "[32,64]")]
        assert conn.execute(
            "SELECT created, api, prompt, cached, live, restored, ttft_s FROM v_request_log"
        ).fetchall() == [("2026-01-02 03:04:05", "messages", 64, 48, 16, 32, 0.123)]
    finally:
        conn.close()


# -- the admin API -----------------------------------------------------------------


def test_admin_names_the_model(filled: Filled) -> None:
    store = filled.store
    mine, other = (admin.resolve_model(store, name).id for name in ("tiny-llama", "other"))
    store.log_requests([
        {"request_id": "a", "model_id": mine, "cache_key": "k", "prompt_tokens": 10,
         "live_tokens": 5},
        {"request_id": "b", "model_id": other, "prompt_tokens": 30, "restored_tokens": 30},
        {"request_id": "c", "model_id": mine, "cache_key": "k", "prompt_tokens": 10,
         "restored_tokens": 10, "written_tokens": 4},
    ], keep=10)
    assert ids(admin.request_log(store)) == ["c", "b", "a"]
    assert ids(admin.request_log(store, model="tiny-llama")) == ["c", "a"]
    assert ids(admin.request_log(store, model=other)) == ["b"]
    assert ids(admin.request_log(store, model="tiny-llama", after=1)) == ["c"]
    assert ids(admin.request_log(store, limit=1)) == ["c"]
    with pytest.raises(NotFound, match="sparkcache models"):
        admin.request_log(store, model="llama-9")
    summed = admin.request_summary(store, model="tiny")
    assert (summed.model, summed.requests, summed.prompt_tokens, summed.cached_tokens,
            summed.written_tokens, summed.hit_rate) == ("tiny-llama", 2, 20, 15, 4, 0.75)
    assert [(k.cache_key, k.requests, k.cached_tokens) for k in summed.by_cache_key] == [
        ("k", 2, 15)]
    everything = admin.to_dict(admin.request_summary(store))
    assert (everything["model"], everything["requests"], everything["hit_rate"]) == (
        None, 3, 0.9)
    rows = json.loads(json.dumps(admin.to_dict(admin.request_log(store))))
    assert [(r["request_id"], r["cached_tokens"], r["breakpoints"]) for r in rows] == [
        ("c", 10, []), ("b", 30, []), ("a", 5, [])]


# -- against a plain model ---------------------------------------------------------


ROW = st.fixed_dictionaries(
    {"request_id": st.sampled_from(["a", "b", "c", "d", "e"])},
    optional={"prompt_tokens": st.none() | st.integers(0, 99),
              "live_tokens": st.none() | st.integers(0, 99),
              "cache_key": st.none() | st.sampled_from(["k1", "k2"]),
              "breakpoints": st.lists(st.integers(0, 999), max_size=3)},
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(batches=st.lists(st.tuples(st.lists(ROW, max_size=4), st.integers(1, 4)),
                        max_size=6))
def test_the_log_is_a_trimmed_ordered_merge_of_its_records(
        batches: list[tuple[list[dict[str, Any]], int]]) -> None:
    model: dict[str, dict[str, Any]] = {}  # request id -> merged fields, in first-record order
    with tempfile.TemporaryDirectory() as folder, SnapshotStore(folder) as store:
        for rows, keep in batches:
            for row in rows:
                merged = model.setdefault(row["request_id"], {})
                merged.update({k: v for k, v in row.items() if v is not None})
            while len(model) > keep:
                del model[next(iter(model))]
            store.log_requests(rows, keep=keep)
            got = list(reversed(store.requests(limit=100)))
            assert ids(got) == list(model)
            for found in got:
                want = model[found.request_id]
                assert found.prompt_tokens == want.get("prompt_tokens")
                assert found.live_tokens == want.get("live_tokens")
                assert found.cache_key == want.get("cache_key")
                assert found.breakpoints == tuple(want.get("breakpoints", ()))


# -- the setting -------------------------------------------------------------------


def test_log_rows_setting() -> None:
    assert log_rows_setting({}) == requestlog.DEFAULT_LOG_ROWS == 10_000
    assert log_rows_setting({"SPARK_KV_CACHE_LOG_ROWS": " 500 "}) == 500
    assert log_rows_setting({"SPARK_KV_CACHE_LOG_ROWS": ""}) == 10_000
    assert log_rows_setting({"SPARK_KV_CACHE_LOG_ROWS": "0"}) == 0  # no log
    for bad in ("many", "-1", "1.5"):
        with pytest.raises(InvalidArgument, match=f"SPARK_KV_CACHE_LOG_ROWS='{bad}'"):
            log_rows_setting({"SPARK_KV_CACHE_LOG_ROWS": bad})


def test_log_rows_setting_reads_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPARK_KV_CACHE_LOG_ROWS", "42")
    assert log_rows_setting() == 42
    monkeypatch.delenv("SPARK_KV_CACHE_LOG_ROWS")
    assert log_rows_setting() == 10_000


# -- a client's text ----------------------------------------------------------------


def test_a_huge_model_name_or_key_is_stored_cut(store: SnapshotStore) -> None:
    store.log_requests([{"request_id": "big", "model": "m" * 1_000_000,
                         "cache_key": "k" * 5000}], keep=10)
    (row,) = store.requests()
    assert row.model is not None and row.cache_key is not None
    assert len(row.model) == len(row.cache_key) == requestlog.MAX_TEXT
    assert row.model.endswith("...") and row.model.startswith("m" * 1000)


def test_an_empty_model_or_key_keeps_its_row(store: SnapshotStore) -> None:
    store.log_requests([{"request_id": "e", "model": "", "cache_key": "", "status": 200}],
                       keep=10)
    (row,) = store.requests()
    assert (row.model, row.cache_key, row.status) == ("", "", 200)


def test_an_error_never_repeats_a_whole_input(store: SnapshotStore) -> None:
    with pytest.raises(InvalidArgument) as caught:
        store.log_requests([{"request_id": "x", "api": "z" * 100_000}], keep=10)
    assert len(str(caught.value)) < 300
    with pytest.raises(InvalidArgument, match="at most 256"):
        store.log_requests([{"request_id": "r" * 257}], keep=10)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(model=st.text(max_size=40), key=st.text(max_size=40))
def test_any_text_is_stored_and_printable_keeps_it_on_one_line(
        store: SnapshotStore, model: str, key: str) -> None:
    """Lone surrogates, escape sequences, newlines: the row is written, and
    what the CLI prints of it is one line without control characters."""
    store.log_requests([{"request_id": "any", "model": model, "cache_key": key}], keep=10)
    row = store.request("any")
    assert row is not None and row.model is not None and row.cache_key is not None
    if model.encode("utf-8", "surrogatepass").decode("utf-8", "replace") == model:
        assert row.model == model  # valid text is stored as it was sent
    for text in (row.model, row.cache_key):
        shown = requestlog.printable(text) or ""
        assert shown.isprintable(), shown
    assert requestlog.printable(None) is None


def test_a_row_is_found_by_its_answers_id_and_its_fingerprint_is_never_cut(
        store: SnapshotStore) -> None:
    print_ = json.dumps({"v": 1, "parts": ["0" * 32] * 1000})  # longer than MAX_TEXT
    store.log_requests([{"request_id": "a", "answer_id": "msg_1", "fingerprint": print_},
                        {"request_id": "b", "answer_id": "msg_2"}], keep=10)
    found = store.request_by_answer("msg_1")
    assert found is not None and found.request_id == "a" and found.fingerprint == print_
    assert store.request_by_answer("msg_3") is None
    # The newest row of a reused id wins; a trimmed one is gone.
    store.log_requests([{"request_id": "c", "answer_id": "msg_1"}], keep=2)
    again = store.request_by_answer("msg_1")
    assert again is not None and again.request_id == "c"
    store.log_requests([{"request_id": "d"}, {"request_id": "e"}], keep=2)
    assert store.request_by_answer("msg_1") is None
    for bad in ({"answer_id": "m" * (requestlog.MAX_ID + 1)}, {"answer_id": ""},
                {"fingerprint": "x" * (requestlog.MAX_FINGERPRINT + 1)}, {"fingerprint": 5}):
        with pytest.raises(InvalidArgument):
            store.log_requests([{"request_id": "f", **bad}], keep=10)
    assert store.request("f") is None
