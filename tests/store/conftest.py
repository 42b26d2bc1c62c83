from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from sparkcache import SnapshotStore


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SnapshotStore]:
    s = SnapshotStore(tmp_path / "store", alias_stride=16)
    yield s
    s.close()
