"""What an index file is, opening it without upgrading, and taking it back (downgrade)."""

from __future__ import annotations

import io
import shutil
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

import pytest
from alembic.config import Config

from sparkcache.errors import InvalidArgument, SchemaMismatch
from sparkcache.index import Database, current_revision, head_revision, migrate, upgrade
from sparkcache.index.migrate import check_revision, downgrade, known_revisions

from .helpers import DATA, raw, schema_objects


def _dump(path: Path) -> list[object]:
    """The schema, the revision and every row of the tables every revision has."""
    conn = raw(path)
    try:
        tables = ("settings", "models", "snapshots", "segments", "boundaries", "alembic_version")
        return [schema_objects(conn),
                *(conn.execute(f"SELECT * FROM {table}").fetchall() for table in tables)]
    finally:
        conn.close()


def _golden(tmp_path: Path) -> Path:
    path = tmp_path / "index.sqlite"
    shutil.copyfile(DATA / "golden_0001.sqlite", path)
    return path


# -- opening without upgrading: Database(upgrade=False) ------------------------------------------


def test_an_old_index_opened_without_upgrading_is_left_as_it_was(tmp_path: Path) -> None:
    path = _golden(tmp_path)
    before = path.read_bytes()  # a rollback-journal file: WAL would rewrite its header
    with pytest.raises(SchemaMismatch, match="sparkcache db upgrade") as info:
        Database(path, upgrade=False)
    assert "'0001'" in str(info.value) and "Nothing was changed" in str(info.value)
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["index.sqlite"]
    with Database(path) as db:  # upgrading is the default
        assert db.migrated[-1] == head_revision()
    with Database(path, upgrade=False) as db, db.read() as conn:
        assert current_revision(conn) == head_revision()


def test_an_empty_file_is_not_created_without_upgrading(db_path: Path) -> None:
    db_path.write_bytes(b"")
    with pytest.raises(SchemaMismatch, match="holds no tables"):
        Database(db_path, upgrade=False)
    assert db_path.read_bytes() == b""


def test_a_text_file_is_not_an_index(db_path: Path) -> None:
    db_path.write_text("hello\n")
    for upgrading in (True, False):
        with pytest.raises(SchemaMismatch, match="not a SQLite database"):
            Database(db_path, upgrade=upgrading)
    assert db_path.read_text() == "hello\n"


# -- what a file is: check_revision ----------------------------------------------------------------


def test_check_revision_says_what_a_file_is(tmp_path: Path) -> None:
    text = tmp_path / "text"
    text.write_text("not a database\n")
    with pytest.raises(SchemaMismatch, match="not a SQLite database"):
        check_revision(raw(text))
    empty = raw(tmp_path / "empty")
    assert check_revision(empty) is None
    with pytest.raises(SchemaMismatch, match="holds no tables"):
        check_revision(empty, empty_ok=False)
    other = raw(tmp_path / "other")
    other.execute("CREATE TABLE people (name TEXT)")
    with pytest.raises(SchemaMismatch, match="not a sparkcache index"):
        check_revision(other)
    old = _golden(tmp_path)
    assert check_revision(raw(old)) == "0001"
    with pytest.raises(SchemaMismatch, match="sparkcache db upgrade"):
        check_revision(raw(old), behind_ok=False)
    conn = raw(tmp_path / "head")
    upgrade(conn)
    assert check_revision(conn, empty_ok=False, behind_ok=False) == head_revision()
    conn.execute("UPDATE alembic_version SET version_num = 'ffff'")
    with pytest.raises(SchemaMismatch, match="newer sparkcache"):
        check_revision(conn)
# -- going back: downgrade ----------------------------------------------------------------------


def _fresh_objects(path: Path, revision: str) -> dict[tuple[str, str], str]:
    conn = raw(path)
    upgrade(conn, revision)
    return schema_objects(conn)


def test_downgrade_to_every_older_revision(tmp_path: Path) -> None:
    known = known_revisions()
    for target in known:
        conn = raw(tmp_path / f"from-head-to-{target}")
        upgrade(conn)
        undone = downgrade(conn, target)
        assert undone == list(reversed(known[known.index(target) + 1:]))
        assert current_revision(conn) == target and not conn.in_transaction
        assert schema_objects(conn) == _fresh_objects(tmp_path / f"fresh-{target}", target)
        assert upgrade(conn) == list(known[known.index(target) + 1:])  # and up again


def test_downgrade_keeps_the_rows_of_what_stays(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    shutil.copyfile(DATA / "golden_0001.sqlite", path)
    with Database(path):
        pass
    conn = raw(path)
    before = conn.execute("SELECT * FROM snapshots ORDER BY id").fetchall()
    downgrade(conn, "0001")
    assert conn.execute("SELECT * FROM snapshots ORDER BY id").fetchall() == [
        row[:15] for row in before]  # the columns of 0001
    assert conn.execute("SELECT count(*) FROM segments").fetchall() == [(2,)]


def test_downgrade_refuses_what_it_cannot_do(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    shutil.copyfile(DATA / "golden_0001.sqlite", path)
    before = _dump(path)
    conn = raw(path)
    for bad in ("base", "0000", "9999"):
        with pytest.raises(InvalidArgument, match="0001"):
            downgrade(conn, bad)
    with pytest.raises(InvalidArgument, match="db upgrade"):
        downgrade(conn, head_revision())
    conn.execute("UPDATE alembic_version SET version_num = 'ffff'")
    with pytest.raises(SchemaMismatch, match="newer sparkcache"):
        downgrade(conn, "0001")
    conn.execute("UPDATE alembic_version SET version_num = '0001'")
    assert _dump(path) == before and not conn.in_transaction
    with pytest.raises(SchemaMismatch, match="holds no tables"):
        downgrade(raw(tmp_path / "empty.sqlite"), "0001")


EXTRA_REVISION = '''
from alembic import op

revision = "9001"
down_revision = "{head}"
branch_labels = None
depends_on = None


def upgrade():
    op.execute("CREATE TABLE extra (x INTEGER)")


def downgrade():
    {body}
'''


@pytest.fixture
def extra_revision(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                   ) -> Iterator[Callable[[str], None]]:
    """A copy of the revisions plus 9001, whose downgrade() is the body given."""
    location = tmp_path / "migrations"
    shutil.copytree(str(resources.files(migrate.MIGRATIONS_PACKAGE)), location)

    def make(body: str) -> None:
        (location / "versions" / "9001_extra.py").write_text(
            EXTRA_REVISION.format(head=head_revision(), body=body))
        known_revisions.cache_clear()

    def config(output_buffer: io.StringIO | None = None) -> Config:
        cfg = Config(output_buffer=output_buffer)
        cfg.set_main_option("script_location", str(location))
        return cfg

    head = head_revision()
    monkeypatch.setattr(migrate, "alembic_config", config)
    yield make
    known_revisions.cache_clear()
    monkeypatch.undo()
    assert head_revision() == head


@pytest.mark.parametrize(("body", "error", "match"), [
    ('raise NotImplementedError("extra stays")', InvalidArgument, "extra stays"),
    ("pass", SchemaMismatch, "incomplete"),
])
def test_a_revision_that_cannot_go_back_changes_nothing(
        body: str, error: type[Exception], match: str, db_path: Path,
        extra_revision: Callable[[str], None]) -> None:
    head = head_revision()
    extra_revision(body)
    conn = raw(db_path)
    upgrade(conn)
    assert current_revision(conn) == "9001"
    before = _dump(db_path)
    with pytest.raises(error, match=match):
        downgrade(conn, head)
    assert _dump(db_path) == before and not conn.in_transaction
