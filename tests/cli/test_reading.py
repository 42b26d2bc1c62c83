"""The commands that read a store: models, ls, show, stats, shell (sparkcache.cli.commands)."""

from __future__ import annotations

import inspect
import json
from pathlib import Path

from sparkcache import admin
from sparkcache.cli import commands
from sparkcache.index import schema
from sparkcache.measures import CostRow

from .helpers import Run


def test_models_ls_show_stats_json(run: Run) -> None:
    models = run.json("models")
    assert [(m["name"], m["snapshots"]) for m in models] == [("tiny-llama", 2), ("other", 1)]
    snaps = run.json("ls", "tiny-llama")
    assert [(s["id"], s["tokens"], s["parent"], s["hits"]) for s in snaps] == [
        (1, 32, None, 1), (2, 64, 1, 1)]
    assert len(run.json("ls")) == 3
    shown = run.json("show", "2")
    assert [c["id"] for c in shown["chain"]] == [1, 2]
    assert shown["segments"][0]["token_start"] == 32
    stats = run.json("stats", "tiny-llama")
    assert (stats["hits"], stats["restored_tokens"]) == (1, 64)


def test_tables_for_people(run: Run) -> None:
    lines = run("ls").splitlines()
    assert lines[0].split()[:4] == ["ID", "MODEL", "TOKENS", "MB"]
    assert len(lines) == 4 and len({len(line) for line in lines[1:]}) <= 2
    assert "tiny-llama" in run("models")
    assert "chain:" in run("show", "2") and "hit rate:" in run("stats")


def test_shell_runs_sql_read_only(run: Run) -> None:
    rows = run.json("shell", "SELECT id, state FROM v_snapshots ORDER BY id")
    assert [r["id"] for r in rows] == [1, 2, 3]
    assert "id|name" in run("shell", "SELECT id, name FROM v_models")
    run("shell", "DELETE FROM snapshots", code=2)
    assert "readonly" in run.err
    run("shell", "SELECT nope", code=2)


def test_interactive_shell_names_every_view() -> None:
    # apsw prints the banner only on a terminal, so its text is read from the source.
    banner = inspect.getsource(commands.cmd_shell)
    assert all(view in banner for view in schema.VIEWS), sorted(schema.VIEWS)


def test_admin_results_match_cli_json(run: Run, folder: Path) -> None:
    with admin.open_store(folder) as store:
        expected = admin.to_dict(admin.list_snapshots(store))
    assert run.json("ls") == expected


def test_shell_json_prints_one_document(run: Run) -> None:
    rows = run.json("shell", "SELECT id FROM v_snapshots ORDER BY id",
                    "SELECT name FROM v_models ORDER BY id; SELECT 1 AS one WHERE 0")
    assert rows == [{"id": 1}, {"id": 2}, {"id": 3}, {"name": "tiny-llama"}, {"name": "other"}]
    assert run.json("shell", "SELECT 1 WHERE 0") == []
    assert run.json("shell", "SELECT x'0102' AS b, 1.5 AS f") == [{"b": "AQI=", "f": 1.5}]
    run("shell", ".tables", "--json", code=2)
    assert "dot-command" in json.loads(run.err)["message"]


def test_stats_shows_the_measured_costs(run: Run, folder: Path) -> None:
    with admin.open_store(folder) as store:
        digest = admin.resolve_model(store, "tiny-llama").digest
        store.record_costs([
            CostRow(digest, "prefill", 12, 1 / 8000, 0.0, 3, 1767323045.0),
            CostRow("", "local_cold", 0, 1e-8, 0.0, 2, 1767323045.0),
            CostRow("", "tier s3://b/kv http://127.0.0.1:9", 0, 1e-6, 0.25, 1, 1767323045.0),
        ])
    costs = run.json("stats", "tiny-llama")["costs"]
    assert [(c["source"], c["samples"]) for c in costs] == [
        ("local_cold", 2), ("tier s3://b/kv http://127.0.0.1:9", 1), ("prefill", 3)]
    assert len(run.json("stats", "other")["costs"]) == 2  # the host's, not tiny-llama's
    text = run("stats", "tiny-llama")
    assert "8,000 tokens/s" in text and "100.0 MB/s" in text and "1.0 MB/s" in text
    assert "<=4096" in text
    # The index's view shows the same rates (revision 0012).
    assert run.json("shell", "SELECT model, source, prompt_max, tokens_per_s, mb_per_s "
                    "FROM v_costs ORDER BY digest, source") == [
        {"model": "(host)", "source": "local_cold", "prompt_max": None, "tokens_per_s": None,
         "mb_per_s": 100.0},
        {"model": "(host)", "source": "tier s3://b/kv http://127.0.0.1:9", "prompt_max": None,
         "tokens_per_s": None, "mb_per_s": 1.0},
        {"model": "tiny-llama", "source": "prefill", "prompt_max": 4096, "tokens_per_s": 8000.0,
         "mb_per_s": None}]
