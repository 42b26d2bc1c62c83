"""What a store holds, for people: models, snapshots and one snapshot in detail.

Every function takes the narrow :class:`~sparkcache.core.Core` and returns
plain dataclasses (bytes and unix seconds, never formatted text) that
:func:`sparkcache.admin.to_dict` turns into JSON.  Models are named by their
name, their id or a prefix (4+ hex characters) of their digest, or else by a
unique part of their name (:func:`resolve_model`); a name shared by several
identities is ambiguous and the error lists the candidates.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from sparkcache.core import Core, LeaseInfo, Match, SegmentInfo, SnapshotInfo, ids, select_all
from sparkcache.errors import InvalidArgument, NotFound
from sparkcache.identity import ModelIdentity
from sparkcache.index import queries as q
from sparkcache.reader import stored_tokens

__all__ = [
    "MB",
    "Catalog",
    "LinkRow",
    "ModelRow",
    "SnapshotDetail",
    "SnapshotRow",
    "list_models",
    "list_snapshots",
    "mb",
    "model_identity",
    "no_snapshot",
    "resolve_model",
    "show",
    "snapshot_row",
]

MB = 1_000_000
MIN_DIGEST_PREFIX = 4


def mb(nbytes: int) -> float:
    """Bytes as megabytes with one decimal, for people."""
    return round(nbytes / MB, 1)


@dataclass(frozen=True)
class ModelRow:
    id: int
    name: str
    digest: str
    folder: str
    snapshots: int  # rows in any state (from model_usage)
    nbytes: int
    mb: float
    created_at: float
    deleted_at: float | None  # set once deleted; rows stay while leased snapshots remain


@dataclass(frozen=True)
class SnapshotRow:
    id: int
    model_id: int
    model: str
    tokens: int
    start_token: int
    nbytes: int
    mb: float
    created_at: float
    last_used: float
    hits: int  # restores (use_count)
    parent: int | None
    depth: int
    world_size: int
    pinned: bool
    state: str
    reason: str | None
    uploaded_at: float | None  # when it reached the shared tier; None: not uploaded
    #: How its KV is split over ranks: ``tp=2`` (and ``pp=``, ``dcp=`` when not 1).
    sharding: str = ""
    #: The tenant whose request published it (docs/serve.md, "Tenants"); None: none.
    tenant: str | None = None


@dataclass(frozen=True)
class LinkRow:
    """One link of a snapshot's chain as ``show`` lists it."""

    id: int
    start_token: int
    n_tokens: int
    state: str


@dataclass(frozen=True)
class SnapshotDetail:
    snapshot: SnapshotRow
    model_digest: str
    segments: list[SegmentInfo]
    chain: list[LinkRow]  # root first, ending with this snapshot
    children: list[int]
    leases: list[LeaseInfo]


def list_models(core: Core) -> list[ModelRow]:
    """Every model row, deleted ones included, with counts from ``model_usage``."""
    with core.read() as conn:
        models = select_all(conn, q.ADMIN_MODELS, into=_model_row)
    return models


def _model_row(id_: int, name: str, digest: str, folder: str, _identity_json: str,
               created_at: float, deleted_at: float | None, snapshots: int,
               nbytes: int) -> ModelRow:
    """A row of ``queries.ADMIN_MODELS``."""
    return ModelRow(id_, name, digest, folder, snapshots, nbytes, mb(nbytes), created_at,
                    deleted_at)


def resolve_model(core: Core, model: str | int) -> ModelRow:
    """The one model named by ``model``: an id, a name, or a digest prefix (4+ hex);
    failing those, a unique part of a name (case-insensitive).

    Raises NotFound (listing the known models) or InvalidArgument when several
    models match (listing them, so the caller can pass an id).
    """
    rows = list_models(core)
    if isinstance(model, int) and not isinstance(model, bool):
        found = [r for r in rows if r.id == model]
    else:
        text = str(model).strip()
        low = text.lower()
        found = [
            r for r in rows
            if r.name == text
            or (text.isdecimal() and r.id == int(text))
            or (len(low) >= MIN_DIGEST_PREFIX and r.digest.startswith(low))
        ]
        if not found and text:  # a part of a name, when nothing matched exactly
            found = [r for r in rows if low in r.name.lower()]
    if not found:
        known = ", ".join(f"{r.id}:{r.name}" for r in rows) or "none"
        raise NotFound(
            f"no model {model!r} in {core.root} (known: {known}); name a model by its id, "
            f"its name or {MIN_DIGEST_PREFIX}+ characters of its digest (see "
            "`sparkcache models`)"
        )
    if len(found) > 1:
        listed = "; ".join(
            f"id {r.id} {r.name} {r.digest[:12]}{' (deleted)' if r.deleted_at else ''}"
            for r in found
        )
        raise InvalidArgument(
            f"model {model!r} is ambiguous, it matches {len(found)} models: {listed}; "
            "pass the id or a longer digest prefix"
        )
    return found[0]


def model_identity(core: Core, model_id: int) -> ModelIdentity:
    """The identity a model row was created with."""
    with core.read() as conn:
        model = core.model(conn, model_id)
    if model is None:
        raise NotFound(f"no model {model_id}")
    return model.identity()


#: Each model row's identity, for the sharding its snapshots are listed with.
MODEL_IDENTITIES = "SELECT id, identity_json FROM models"


def sharding_of(identity_json: str) -> str:
    """``tp=2`` (``pp=``/``dcp=`` added when not 1) of a model row's identity;
    ``?`` when it does not parse."""
    try:
        ident = ModelIdentity.from_dict(json.loads(identity_json))
    except (InvalidArgument, ValueError, TypeError):
        return "?"
    sizes = [("tp", ident.tp_size), ("pp", ident.pp_size), ("dcp", ident.dcp_size)]
    return " ".join(f"{k}={v}" for k, v in sizes if v != 1 or k == "tp")


def _shardings(core: Core) -> dict[int, str]:
    with core.read() as conn:
        rows = select_all(conn, MODEL_IDENTITIES, into=lambda i, j: (int(i), str(j)))
    return {model_id: sharding_of(text) for model_id, text in rows}


def snapshot_row(info: SnapshotInfo, names: dict[int, str],
                 shardings: dict[int, str] | None = None) -> SnapshotRow:
    """A snapshot row for people, with its model's name from ``names`` (and
    its sharding from ``shardings``)."""
    return SnapshotRow(
        info.id, info.model_id, names.get(info.model_id, "?"), info.n_tokens, info.start_token,
        info.nbytes, mb(info.nbytes), info.created_at, info.last_used, info.use_count,
        info.parent_id, info.depth, info.world_size, info.pinned, info.state, info.reason,
        info.uploaded_at, (shardings or {}).get(info.model_id, ""), info.tenant,
    )


def list_snapshots(core: Core, model: str | int | None = None) -> list[SnapshotRow]:
    """Every snapshot (of one model, when given), oldest id first."""
    names = {m.id: m.name for m in list_models(core)}
    with core.read() as conn:
        if model is None:
            infos = select_all(conn, q.ADMIN_SNAPSHOTS, into=SnapshotInfo)
        else:
            infos = select_all(conn, q.ADMIN_MODEL_SNAPSHOTS, (resolve_model(core, model).id,),
                          into=SnapshotInfo)
    shardings = _shardings(core)
    return [snapshot_row(info, names, shardings) for info in infos]


def no_snapshot(core: Core, snapshot_id: int) -> NotFound:
    """The error for a snapshot id that names nothing."""
    return NotFound(f"no snapshot {snapshot_id} in {core.root}; `sparkcache ls` lists them")


def show(core: Core, snapshot_id: int) -> SnapshotDetail:
    """One snapshot with its segments, its chain (root first), children and leases."""
    models = {m.id: m for m in list_models(core)}
    with core.read() as conn:
        info = core.snapshot(conn, snapshot_id)
        if info is None:
            raise no_snapshot(core, snapshot_id)
        segments = core.segments(conn, snapshot_id)
        chain = [LinkRow(link.id, link.start, link.end, link.state)
                 for link in core.chain(conn, snapshot_id)]
        children = ids(conn, q.ADMIN_CHILDREN, (snapshot_id,))
        leases = core.leases(conn, snapshot_id)
    model = models.get(info.model_id)
    return SnapshotDetail(
        snapshot_row(info, {k: m.name for k, m in models.items()}, _shardings(core)),
        model.digest if model else "", segments, chain, children, leases,
    )


class Catalog:
    """What a store holds, for people: this module's functions bound to one core.

    :attr:`SnapshotStore.catalog <sparkcache.store.SnapshotStore.catalog>` is the
    store's; it only reads.  Each method is the function of the same name (or the
    one its docstring names) applied to the store's core.
    """

    def __init__(self, core: Core) -> None:
        self._core = core

    def models(self) -> list[ModelRow]:
        """Every model row, deleted ones included (:func:`list_models`)."""
        return list_models(self._core)

    def resolve_model(self, model: str | int) -> ModelRow:
        """The one model named by ``model`` (:func:`resolve_model`)."""
        return resolve_model(self._core, model)

    def model_identity(self, model_id: int) -> ModelIdentity:
        """The identity a model row was created with (:func:`model_identity`)."""
        return model_identity(self._core, model_id)

    def snapshots(self, model: str | int | None = None) -> list[SnapshotRow]:
        """Every snapshot (of one model, when given), oldest id first
        (:func:`list_snapshots`)."""
        return list_snapshots(self._core, model)

    def show(self, snapshot_id: int) -> SnapshotDetail:
        """One snapshot in detail (:func:`show`)."""
        return show(self._core, snapshot_id)

    def no_snapshot(self, snapshot_id: int) -> NotFound:
        """The error for a snapshot id that names nothing (:func:`no_snapshot`)."""
        return no_snapshot(self._core, snapshot_id)

    def segments(self, snapshot_id: int) -> list[SegmentInfo]:
        """The segment rows of one snapshot, by rank (none for an unknown id)."""
        with self._core.read() as conn:
            return self._core.segments(conn, snapshot_id)

    def breakpoints(self, snapshot_id: int) -> list[int]:
        """The token counts of one snapshot's breakpoint rows, in order."""
        with self._core.read() as conn:
            return ids(conn, q.BREAKPOINTS_OF, (snapshot_id,))

    def tokens(self, snapshot_id: int) -> np.ndarray:
        """A snapshot's token ids, read verified from rank 0's segments (no payload
        is read); NotFound when it is not restorable, CorruptSnapshot when damaged."""
        with self._core.read() as conn:
            info = self._core.snapshot(conn, snapshot_id)
        if info is None:
            raise no_snapshot(self._core, snapshot_id)
        match = Match(snapshot_id, 0, model_identity(self._core, info.model_id),
                      np.empty(0, np.uint32))
        return stored_tokens(self._core, match, 0, info.n_tokens)

    def publish_ended(self, identity: ModelIdentity, snap_key: str) -> bool:
        """Whether a publish of snapshot ``snap_key`` (the hex of the last prefix
        hash of its tokens in its scope) has ended: a row of it, none pending
        (ready, or quarantined since).  False: not published yet, or deleted."""
        with self._core.read() as conn:
            model_id = self._core.model_id(conn, identity)
            states = [] if model_id is None else [
                str(row[0]) for row in conn.execute(q.SNAPSHOT_STATES_BY_KEY, (model_id, snap_key))]
        return bool(states) and "pending" not in states

    def counters(self, model_id: int | None = None) -> dict[str, int]:
        """Every counter, summed over models unless ``model_id`` is given, unsaved
        counts included."""
        return self._core.counter_totals(model_id)

    def saved_counters(self) -> dict[int, dict[str, int]]:
        """The counters as the index holds them, by model id (0: the whole store),
        read without a write: what other processes saved, not this one's unsaved
        counts (for a reader that counts nothing, e.g. a metrics scrape)."""
        out: dict[int, dict[str, int]] = {}
        with self._core.read() as conn:
            for model_id, name, value in conn.execute(q.COUNTERS):
                out.setdefault(int(model_id), {})[str(name)] = int(value)
        return out
