"""Fixtures of the shared-tier tests: a real S3 server (moto's), stores as hosts.

Each test gets a new bucket on the session's server (``tests/s3server.py``),
reached through ``endpoint_url`` with the credentials in the environment, as a
fleet would: options never carry credentials.  Two store folders are two hosts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from sparkcache import SnapshotStore

from ..s3server import S3Server, s3_server, stop_s3_servers


@pytest.fixture(scope="session", autouse=True)
def _stop_s3_server() -> Iterator[None]:
    yield
    stop_s3_servers()


@dataclass
class Tier:
    """A shared tier's URL and the options that reach it."""

    url: str
    options: dict[str, Any]
    server: S3Server | None = None


@pytest.fixture
def s3() -> S3Server:
    """The session's S3 server (started first: its environment carries the credentials)."""
    return s3_server()


@pytest.fixture
def s3_tier(s3: S3Server) -> Tier:
    """A new bucket on the session's server, prefix ``kv``."""
    return Tier(f"s3://{s3.bucket()}/kv", {"endpoint_url": s3.endpoint}, s3)


@pytest.fixture
def file_tier(tmp_path: Path) -> Tier:
    folder = tmp_path / "tier"
    folder.mkdir()
    return Tier(f"file://{folder}", {})


@pytest.fixture(params=["s3", "file"])
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> Tier:
    """Each kind of tier in turn: S3 (moto) and a local folder (file://)."""
    if request.param == "s3":
        server = s3_server()
        return Tier(f"s3://{server.bucket()}/kv", {"endpoint_url": server.endpoint}, server)
    folder = tmp_path / "tier"
    folder.mkdir()
    return Tier(f"file://{folder}", {})


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Callable[..., SnapshotStore]]:
    """``host(name, tier, **kwargs)``: a store in its own folder (a host) that uses
    ``tier``; every store made is closed at the end."""
    made: list[SnapshotStore] = []

    def make(name: str, tier: Tier | None = None, **kwargs: Any) -> SnapshotStore:
        kwargs.setdefault("alias_stride", 16)
        if tier is not None:
            kwargs.setdefault("shared", tier.url)
            kwargs.setdefault("shared_options", tier.options)
        store = SnapshotStore(tmp_path / name, **kwargs)
        made.append(store)
        return store

    yield make
    for store in made:
        store.close()
