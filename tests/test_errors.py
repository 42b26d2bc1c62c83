"""Every failure is a SparkCacheError that says what to do.

Each case here escaped as a raw exception before (apsw's, ValueError,
OverflowError, botocore's): a caller that treats sparkcache errors as a miss
would have crashed instead.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from sparkcache import InvalidArgument, ModelIdentity, SnapshotStore, SparkCacheError
from sparkcache.backends import FsspecBackend
from sparkcache.errors import BackendError, CorruptIndex

from .backends.conftest import free_port
from .store.helpers import identity, pages_for, tokens


def test_a_constraint_failure_is_corrupt_index(tmp_path: Path) -> None:
    with SnapshotStore(tmp_path / "s") as store:
        ident, toks = identity(), tokens(8)
        store.publish(ident, 0, toks, pages_for(ident, toks))
        with pytest.raises(CorruptIndex, match="check --fix"), store._core.write() as conn:
            conn.execute("INSERT INTO models (id, digest, name, folder, identity_json, "
                         "created_at) SELECT id, digest, name, folder, identity_json, "
                         "created_at FROM models")  # the same primary keys again
        assert len(store.snapshots()) == 1  # rolled back, the store goes on


@pytest.mark.parametrize("marks", [["12"], [None], ["abc"], [1.5]])
def test_breakpoints_that_are_not_token_counts(tmp_path: Path, marks: list[object]) -> None:
    with SnapshotStore(tmp_path / "s") as store:
        ident, toks = identity(), tokens(8)
        with pytest.raises(InvalidArgument, match="breakpoints"):
            store.publish(ident, 0, toks, pages_for(ident, toks),
                          breakpoints=marks)  # type: ignore[arg-type]
        assert store.snapshots() == []


@pytest.mark.parametrize("bad", [
    {"model": "m"},
    {**identity().to_dict(), "page_shape": "ab"},
    {**identity().to_dict(), "extra": [[1, 2, 3]]},
    {**identity().to_dict(), "num_layers": "two"},
    [("model", "m")],
    5,
])
def test_a_bad_identity_dict(bad: object) -> None:
    with pytest.raises(InvalidArgument):
        ModelIdentity.from_dict(bad)  # type: ignore[arg-type]


def test_an_id_out_of_sqlites_range(tmp_path: Path) -> None:
    huge = 10**30
    with SnapshotStore(tmp_path / "s") as store:
        for call in (lambda: store.pin(huge), lambda: store.snapshot(huge),
                     lambda: store.acquire_lease(huge), lambda: store.delete(huge)):
            with pytest.raises(InvalidArgument, match="64-bit"):
                call()


def test_an_unreachable_object_store_is_a_backend_error_within_seconds() -> None:
    port = free_port()  # nothing listens there
    backend = FsspecBackend("s3://bucket/store", endpoint_url=f"http://127.0.0.1:{port}",
                            key="k", secret="s", skip_instance_cache=True)
    for call in (lambda: backend.put("objects/x", [b"data"]), lambda: backend.open("objects/x"),
                 lambda: backend.exists("objects/x"), lambda: list(backend.list("objects"))):
        started = time.monotonic()
        with pytest.raises(SparkCacheError) as info:
            call()
        assert isinstance(info.value, BackendError) and "endpoint" in str(info.value)
        assert time.monotonic() - started < 30  # bounded retries, not minutes
