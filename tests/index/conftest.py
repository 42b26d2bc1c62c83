"""Fixtures for the index tests: real SQLite files under tmp_path, no mocks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkcache.index import Database


@pytest.fixture
def db_path(tmp_path: Path) -> Path:
    return tmp_path / "index.sqlite"


@pytest.fixture
def db(db_path: Path) -> Iterator[Database]:
    database = Database(db_path)
    yield database
    database.close()
