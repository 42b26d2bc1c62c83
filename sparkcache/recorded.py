"""What a store records when it is created - its storage and its shared tier -
checked against what it is opened with, and opened.

Both are kept in the index's settings table without credentials
(:func:`~sparkcache.backends.canonical_url`, :func:`~sparkcache.shared.tier.shared_url`):
another one raises StorageMismatch naming both, unless ``relocate`` records it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from sparkcache.backends import Backend, canonical_url, open_backend
from sparkcache.core import Core
from sparkcache.errors import StorageMismatch
from sparkcache.index import queries as q
from sparkcache.index.db import Database
from sparkcache.shared.tier import SharedTier, shared_url

__all__ = ["SHARED_SETTING", "STORAGE_SETTING", "open_shared", "recorded_shared",
           "recorded_storage"]

#: The settings key recording the store's storage ("" for the root folder itself).
STORAGE_SETTING = "storage"
#: The settings key recording the store's shared tier (:func:`shared_url`).
SHARED_SETTING = "shared"


def recorded_storage(
    db: Database, root: Path, storage: str | os.PathLike[str] | Backend | None, *,
    relocate: bool, record: bool, clock: Callable[[], float],
) -> Backend:
    """The backend the store keeps its payloads in: the one it recorded when it
    was created, checked against ``storage`` when one is given (see
    :class:`~sparkcache.store.SnapshotStore`)."""
    if storage is None:
        given = None
    else:
        url = storage.url if isinstance(storage, Backend) else storage
        given = canonical_url(url)
        if given == canonical_url(root):
            given = ""
    with db.read() as conn:
        row = conn.execute(q.GET_SETTING, (STORAGE_SETTING,)).fetchone()
    recorded = None if row is None else str(row[0])
    if recorded is not None and given is not None and given != recorded:
        if not relocate:
            raise StorageMismatch(
                f"this store ({root}) keeps its payloads in {recorded or 'its own folder'}, "
                f"not in {given or 'its own folder'}: open it without a storage (or with the "
                "one it was created with); after moving the payloads, open it with the new "
                "storage and relocate=True (`--relocate`) to record it"
            )
        recorded = None
    if recorded is None and record:
        with db.write() as conn:
            conn.execute(q.PUT_SETTING, (STORAGE_SETTING, given or "", clock()))
    if isinstance(storage, Backend):
        return storage
    if storage is not None and given:
        return open_backend(storage)  # as given: its credentials are not recorded
    chosen = given if given is not None else (recorded or "")
    return open_backend(chosen or str(root))


def recorded_shared(db: Database) -> str | None:
    """The shared tier this store recorded (None: none yet)."""
    with db.read() as conn:
        row = conn.execute(q.GET_SETTING, (SHARED_SETTING,)).fetchone()
    return None if row is None else str(row[0])


def open_shared(core: Core, shared: str | os.PathLike[str],
                 options: Mapping[str, Any] | None, *, alias_stride: int, relocate: bool,
                 record: bool) -> SharedTier:
    """The shared tier, checked against the one the store recorded, then opened
    and checked (reachable, bucket or folder there); recorded when it is new to
    the store.  Recording another tier (``relocate``) forgets every upload."""
    given = shared_url(shared)
    recorded = recorded_shared(core.db)
    if recorded is not None and recorded != given and not relocate:
        raise StorageMismatch(
            f"this store ({core.root}) uploads to the shared tier {recorded}, not {given}: "
            f"open it with that shared tier (or with none); to use {given} from now on, "
            "open it with relocate=True (`--relocate`), and every snapshot is uploaded there")
    tier = SharedTier(shared, options, alias_stride=alias_stride)
    if recorded != given and record:
        try:
            with core.write() as conn:
                conn.execute(q.PUT_SETTING, (SHARED_SETTING, given, core.clock()))
                if recorded is not None:
                    conn.execute(q.FORGET_UPLOADS)
        except BaseException:
            tier.close()
            raise
    return tier
