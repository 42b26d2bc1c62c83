"""docs/index.md stays true: its shell queries run, and it names every schema object."""

from __future__ import annotations

import shutil
from pathlib import Path

from sparkcache.index import Database, schema
from sparkcache.index.migrate import known_revisions

from .helpers import DATA

DOC = Path(__file__).resolve().parents[2] / "docs" / "index.md"


def shell_queries() -> list[str]:
    text = DOC.read_text()
    blocks = [part.split("```", 1)[0] for part in text.split("```sql\n")[1:]]
    lines = [ln for block in blocks for ln in block.splitlines() if not ln.startswith("--")]
    return [q.strip() for q in "\n".join(lines).split(";") if q.strip()]


def test_shell_examples_run(tmp_path: Path) -> None:
    path = tmp_path / "index.sqlite"
    shutil.copyfile(DATA / "golden_0001.sqlite", path)
    queries = shell_queries()
    assert any("v_snapshots ORDER BY last_used DESC" in q for q in queries)
    with Database(path) as db, db.read() as conn:
        for query in queries:
            conn.execute(query).fetchall()


def test_every_table_column_index_and_view_is_documented() -> None:
    text = DOC.read_text()
    for table in schema.METADATA.sorted_tables:
        assert f"### `{table.name}`" in text
        for column in table.columns:
            assert f"`{column.name}`" in text, f"{table.name}.{column.name}"
        for index in table.indexes:
            assert f"`{index.name}" in text
    for view in schema.VIEWS:
        assert f"`{view}`" in text


def test_every_revision_is_listed() -> None:
    text = DOC.read_text()
    for revision in known_revisions():
        assert f"| `{revision}` |" in text, f"docs/index.md does not list revision {revision}"
