"""sparkcache.folder: the one resolver of the store's root, for the connector, retention and CLI."""

from __future__ import annotations

from pathlib import Path

import pytest

from sparkcache.connector.settings import ConnectorSettings
from sparkcache.folder import resolve_folder
from sparkcache.retention import RetentionSettings


def test_order_of_precedence(tmp_path: Path) -> None:
    env = {"SPARK_KV_CACHE_FOLDER": str(tmp_path / "kv"), "SPARK_STORAGE": str(tmp_path / "s")}
    assert resolve_folder(tmp_path / "given", env) == tmp_path / "given"
    assert resolve_folder(None, env) == tmp_path / "kv"
    storage_only = {"SPARK_STORAGE": str(tmp_path / "s")}
    assert resolve_folder(None, storage_only) == tmp_path / "s" / "kvcache"
    assert resolve_folder(None, {}) == Path.home() / ".local" / "share" / "spark" / "kvcache"
    empty = {"SPARK_KV_CACHE_FOLDER": "", "SPARK_STORAGE": ""}  # empty means unset
    assert resolve_folder("", empty) == resolve_folder(None, {})
    assert resolve_folder("~/x", {}) == Path.home() / "x"


def test_connector_retention_and_cli_agree(tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from sparkcache.cli import Context, build_parser

    monkeypatch.delenv("SPARK_KV_CACHE_FOLDER", raising=False)
    monkeypatch.setenv("SPARK_STORAGE", str(tmp_path))
    want = tmp_path / "kvcache"
    assert Path(ConnectorSettings.from_extra_config({}).folder) == want
    assert RetentionSettings.from_env().folder == want
    args = build_parser().parse_args(["ls"])
    assert Context(args, out=None, err=None).folder == want  # type: ignore[arg-type]
