"""Helpers shared by the index tests."""

from __future__ import annotations

from pathlib import Path

import apsw

DATA = Path(__file__).parent / "data"


def raw(path: Path) -> apsw.Connection:
    """A plain apsw connection that bypasses Database (no pragmas, no migration)."""
    return apsw.Connection(str(path))


def schema_objects(conn: apsw.Connection) -> dict[tuple[str, str], str]:
    """(type, name) -> whitespace-normalised SQL of every schema object but alembic's."""
    rows = conn.execute(
        "SELECT type, name, coalesce(sql, '') FROM sqlite_master "
        "WHERE name NOT LIKE '%alembic_version%'"
    ).fetchall()
    return {(str(kind), str(name)): " ".join(str(sql).split()) for kind, name, sql in rows}


def check_later_columns(conn: apsw.Connection) -> None:
    """The views show what revisions 0006 to 0011 recorded (0012), read from the
    rows of ``make_golden.GOLDEN_ROWS["0011"]``, and nothing they keep back."""
    assert conn.execute("SELECT id, uploaded, tenant FROM v_snapshots ORDER BY id").fetchall() \
        == [(1, "2026-01-02 03:04:35", "team-a"), (2, None, None)]
    assert conn.execute(
        "SELECT request_id, written, remote, written_by_ttl, tenant, answer_id, restore_reason "
        "FROM v_request_log").fetchall() == [
        ("r1", 88, 256, '{"300":64,"3600":24}', "team-a", "msg_01", "partial")]
    assert conn.execute(
        "SELECT model, source, bucket, prompt_max, tokens_per_s, mb_per_s, latency_s, samples, "
        "updated, digest FROM v_costs ORDER BY source").fetchall() == [
        ("(host)", "local_warm", 0, None, None, 2000.0, 0.0012, 3, "2026-01-02 03:04:45", ""),
        ("meta-llama/Llama-3.1-8B", "prefill", 10, 1024, 10000.0, None, 0.0, 5,
         "2026-01-02 03:04:45", "0123456789abcdef0123456789abcdef"),
        ("meta-llama/Llama-3.1-8B", "step", 0, None, None, None, 0.0125, 9,
         "2026-01-02 03:04:45", "0123456789abcdef0123456789abcdef")]
    # Kept back: the request scope (it holds the client's cache salt) and the
    # prompt's fingerprint (digests a guess of a short part could be checked with).
    for view, hidden in (("v_snapshots", "scope_json"), ("v_request_log", "fingerprint")):
        names = [r[0] for r in conn.execute(f"SELECT name FROM pragma_table_info('{view}')")]
        assert hidden not in names, (view, names)
