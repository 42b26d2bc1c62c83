"""The connector's settings, read from vLLM's ``kv_connector_extra_config``.

Pure Python (no vLLM, no torch) so it is tested without either installed::

    --kv-transfer-config '{"kv_connector": "SparkCacheConnector",
                           "kv_role": "kv_both",
                           "kv_load_failure_policy": "recompute",
                           "kv_connector_extra_config": {"folder": "/var/cache/kv"}}'

Every key is documented in docs/connector.md; unknown keys are an error (a
typo must not silently turn a feature off).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from sparkcache.cuda.staging import DEFAULT_STAGING_BYTES
from sparkcache.errors import InvalidArgument
from sparkcache.folder import resolve_folder
from sparkcache.shared import check_options, resolve_shared

__all__ = [
    "DEFAULT_MAX_PENDING_MB",
    "DEFAULT_MAX_QUEUED",
    "DEFAULT_SHARED_DEADLINE_SECONDS",
    "DEFAULT_STAGING_MB",
    "DEFAULT_UPLOAD_WAIT_SECONDS",
    "MODES",
    "ConnectorSettings",
]

#: Host bytes of copied-out pages waiting for their disk write, per worker; past
#: it new saves are dropped (counted), never queued behind the forward pass.
DEFAULT_MAX_PENDING_MB = 1024
#: Loads (and saves) that may wait for a worker's I/O thread; past it a load is
#: reported failed (vLLM recomputes) and a save is dropped, both counted.
DEFAULT_MAX_QUEUED = 64
#: Threads that verify and copy one restore (each takes the next layer not yet taken).
DEFAULT_LOAD_THREADS = 2
#: Host memory of a worker's restore staging slots (reused; pinned on a GPU).
DEFAULT_STAGING_MB = DEFAULT_STAGING_BYTES >> 20
#: How long the scheduler's shutdown waits for queued uploads to the shared tier.
DEFAULT_UPLOAD_WAIT_SECONDS = 30.0
#: How long a request waits for the shared tier before it is recomputed instead.
DEFAULT_SHARED_DEADLINE_SECONDS = 2.0
#: How much of the store an engine's start reads into the page cache, at most.
DEFAULT_WARM_MB = 1024
#: mode -> (restore, publish).
MODES: dict[str, tuple[bool, bool]] = {
    "read-write": (True, True),
    "restore-only": (True, False),
    "store-only": (False, True),
    "off": (False, False),
}


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("1", "true", "yes", "on", "0", "false",
                                                    "no", "off"):
        return value.lower() in ("1", "true", "yes", "on")
    raise InvalidArgument(f"kv_connector_extra_config[{key!r}] must be true or false, "
                          f"got {value!r}")


def _load_async(value: Any) -> bool | None:
    if isinstance(value, str) and value.lower() == "auto":
        return None
    try:
        return _as_bool("load_async", value)
    except InvalidArgument:
        raise InvalidArgument("kv_connector_extra_config['load_async'] must be true, false "
                              f"or 'auto', got {value!r}") from None


def _as_int(key: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise InvalidArgument(f"kv_connector_extra_config[{key!r}] must be an integer, "
                              f"got {value!r}")
    try:
        number = int(value)
    except ValueError:
        raise InvalidArgument(f"kv_connector_extra_config[{key!r}] must be an integer, "
                              f"got {value!r}") from None
    if number < minimum:
        raise InvalidArgument(f"kv_connector_extra_config[{key!r}] must be >= {minimum}, "
                              f"got {number}")
    return number


def _as_seconds(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidArgument(f"kv_connector_extra_config[{key!r}] must be seconds >= 0, "
                              f"got {value!r}")
    try:
        number = float(value)
    except ValueError:
        raise InvalidArgument(f"kv_connector_extra_config[{key!r}] must be seconds >= 0, "
                              f"got {value!r}") from None
    if not number >= 0:
        raise InvalidArgument(f"kv_connector_extra_config[{key!r}] must be seconds >= 0, "
                              f"got {value!r}")
    return number


def _compute_tokens(value: Any) -> int | None:
    if isinstance(value, str) and value.strip().lower() == "auto":
        return None
    try:
        return _as_int("compute_tokens", value, 1)
    except InvalidArgument:
        raise InvalidArgument("kv_connector_extra_config['compute_tokens'] must be 'auto' or "
                              f"an integer >= 1, got {value!r}") from None


@dataclass(frozen=True)
class ConnectorSettings:
    """What the connector does; every field is a ``kv_connector_extra_config`` key.

    ``folder``: the store root (default SPARK_KV_CACHE_FOLDER, else
    $SPARK_STORAGE/kvcache, SPARK_STORAGE defaulting to ~/.local/share/spark:
    :func:`sparkcache.folder.resolve_folder`).  ``mode``: ``read-write`` (default),
    ``restore-only``, ``store-only`` or ``off``.  ``min_tokens``: shorter
    contexts are not saved (default SPARK_KV_CACHE_MIN_TOKENS, 64).
    ``load_async``: ``true`` (default) restores on a worker thread between
    scheduler steps (the request waits in WAITING_FOR_REMOTE_KVS); ``false``
    restores within the step that prefills the request, read layer by layer
    while its forward runs (each attention layer waits for its own layer);
    ``auto`` does the latter when no other request is in the engine and the
    former otherwise, so a restore never delays other requests' steps.  On the
    2-core CPU machine the default is as fast as ``auto`` or faster: reading
    under the forward competes with it for the memory bus
    (docs/benchmarks.md).
    ``revision``: names the weights when vLLM's model revision cannot (a local
    folder whose files may change); it is part of the identity.
    ``max_pending_mb``: host memory a worker may hold for saves not yet on disk.
    ``max_queued_loads`` / ``max_queued_saves``: bounds of the worker queues.
    ``load_threads``: threads that verify and copy one restore (default 2).
    ``staging_mb``: host memory of the staging slots that restores into a GPU
    cache go through (allocated once, pinned, reused; default 64).
    ``sweep``: run the retention sweeper thread in the scheduler process.
    ``tail_block``: ``true`` (default) also restores the stored block where
    the prompt leaves the snapshot, for the tokens they share (the prompt's
    last block, a breakpoint's), so vLLM computes only from there;
    ``false`` stops at the last whole block, as vLLM's own prefix cache does
    (up to a block is recomputed).
    ``compute_tokens``: how many of the prompt's last tokens vLLM computes
    after a restore (default auto: 2 on vLLM's CPU backend with split-KV
    decoding on, where one token computed alone takes another kernel path than
    the prefill that stored the snapshot and may answer differently; else 1).
    ``log_rows``: the request log keeps this many newest rows in the index
    (default SPARK_KV_CACHE_LOG_ROWS, else 10000); 0 writes no log.
    ``shared``: the shared tier's URL (default SPARK_KV_CACHE_SHARED; none when
    unset), checked when the scheduler starts; the scheduler process uploads
    every ready snapshot there (docs/shared.md).  ``shared_options``: its
    filesystem's options (endpoint_url, profile, client_kwargs; never
    credentials).  ``upload_wait_seconds``: how long the scheduler's shutdown
    waits for queued uploads (default 30).  ``shared_sweep``: the scheduler
    process also sweeps the tier (its per-model budget and age,
    ``SPARK_KV_CACHE_SHARED_*``) every ``SPARK_KV_CACHE_SHARED_SWEEP_SECONDS``,
    one host of the fleet at a time (default false; needs ``shared``).
    ``shared_fetch``: ``true`` (default)
    asks the tier for a prompt's prefix when the local index holds less of it
    than the tier may, and restores what it fetched (modes that restore);
    ``shared_deadline_seconds``: how long such a request waits for the tier
    before it goes on with what is local (default 2; a slow or unreachable
    tier is then a miss, recomputed).
    ``warm_mb``: at the engine's start, read the files of this model's most
    recently used snapshots into the page cache, up to this many MB and at
    most a quarter of the memory available (default 1024; 0: off), so that
    the first restores after a restart read memory, not the disk
    (docs/connector.md, "Engine start").
    ``cost_model``: ``true`` (default) restores a match only when its measured
    restore time (per source: local disk, the shared tier) is below the
    engine's measured time to recompute it, and asks the tier only when
    fetching is expected to pay; the rates are kept in the index
    (docs/connector.md, "Restore or recompute").  ``false``
    restores every match and asks the tier whenever it may hold more.
    """

    folder: str
    mode: str = "read-write"
    min_tokens: int | None = None
    load_async: bool | None = True  # None: auto
    revision: str | None = None
    max_pending_mb: int = DEFAULT_MAX_PENDING_MB
    max_queued_loads: int = DEFAULT_MAX_QUEUED
    load_threads: int = DEFAULT_LOAD_THREADS
    staging_mb: int = DEFAULT_STAGING_MB
    max_queued_saves: int = DEFAULT_MAX_QUEUED
    sweep: bool = True
    tail_block: bool = True
    compute_tokens: int | None = None  # None: auto
    log_rows: int | None = None  # None: SPARK_KV_CACHE_LOG_ROWS, else the default
    shared: str | None = None
    shared_options: dict[str, Any] = field(default_factory=dict)
    upload_wait_seconds: float = DEFAULT_UPLOAD_WAIT_SECONDS
    shared_sweep: bool = False
    shared_fetch: bool = True
    shared_deadline_seconds: float = DEFAULT_SHARED_DEADLINE_SECONDS
    cost_model: bool = True
    warm_mb: int = DEFAULT_WARM_MB

    @property
    def restore(self) -> bool:
        return MODES[self.mode][0]

    @property
    def publish(self) -> bool:
        return MODES[self.mode][1]

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> ConnectorSettings:
        extra = dict(extra or {})
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(extra) - known)
        if unknown:
            raise InvalidArgument(
                f"unknown sparkcache settings {unknown} in kv_connector_extra_config; "
                f"known: {sorted(known)}"
            )
        folder, mode, revision = _folder_mode_revision(extra)
        min_tokens = extra.get("min_tokens")
        log_rows = extra.get("log_rows")
        shared, shared_options, shared_sweep = _shared_settings(extra)
        return cls(
            folder=str(resolve_folder(folder)),
            mode=mode,
            min_tokens=None if min_tokens is None else _as_int("min_tokens", min_tokens, 1),
            load_async=_load_async(extra.get("load_async", True)),
            revision=revision,
            max_pending_mb=_as_int(
                "max_pending_mb", extra.get("max_pending_mb", DEFAULT_MAX_PENDING_MB), 0
            ),
            max_queued_loads=_as_int(
                "max_queued_loads", extra.get("max_queued_loads", DEFAULT_MAX_QUEUED), 1
            ),
            load_threads=_as_int(
                "load_threads", extra.get("load_threads", DEFAULT_LOAD_THREADS), 1
            ),
            staging_mb=_as_int("staging_mb", extra.get("staging_mb", DEFAULT_STAGING_MB), 1),
            max_queued_saves=_as_int(
                "max_queued_saves", extra.get("max_queued_saves", DEFAULT_MAX_QUEUED), 1
            ),
            sweep=_as_bool("sweep", extra.get("sweep", True)),
            tail_block=_as_bool("tail_block", extra.get("tail_block", True)),
            compute_tokens=_compute_tokens(extra.get("compute_tokens", "auto")),
            log_rows=None if log_rows is None else _as_int("log_rows", log_rows, 0),
            shared=shared,
            shared_sweep=shared_sweep,
            shared_options=shared_options,
            upload_wait_seconds=_as_seconds(
                "upload_wait_seconds",
                extra.get("upload_wait_seconds", DEFAULT_UPLOAD_WAIT_SECONDS)),
            shared_fetch=_as_bool("shared_fetch", extra.get("shared_fetch", True)),
            shared_deadline_seconds=_as_seconds(
                "shared_deadline_seconds",
                extra.get("shared_deadline_seconds", DEFAULT_SHARED_DEADLINE_SECONDS)),
            cost_model=_as_bool("cost_model", extra.get("cost_model", True)),
            warm_mb=_as_int("warm_mb", extra.get("warm_mb", DEFAULT_WARM_MB), 0),
        )


def _folder_mode_revision(extra: Mapping[str, Any]) -> tuple[str | None, str, str | None]:
    """The ``folder``, ``mode`` and ``revision`` of the extra config, checked."""
    folder = extra.get("folder")
    if folder is not None and not isinstance(folder, str):
        raise InvalidArgument(
            "kv_connector_extra_config['folder'] must be a path string, got "
            f"{folder!r}; or leave it out for SPARK_KV_CACHE_FOLDER"
        )
    mode = str(extra.get("mode", "read-write")).lower().replace("_", "-")
    if mode not in MODES:
        raise InvalidArgument(f"kv_connector_extra_config['mode'] must be one of "
                              f"{sorted(MODES)}, got {extra.get('mode')!r}")
    revision = extra.get("revision")
    if revision is not None and not isinstance(revision, str):
        raise InvalidArgument("kv_connector_extra_config['revision'] must be a string")
    return folder, mode, revision


def _shared_settings(extra: Mapping[str, Any]) -> tuple[str | None, dict[str, Any], bool]:
    """The shared tier's URL (or SPARK_KV_CACHE_SHARED), its options and ``shared_sweep``."""
    shared = extra.get("shared")
    if shared is not None and not isinstance(shared, str):
        raise InvalidArgument("kv_connector_extra_config['shared'] must be a URL string "
                              f"(s3://bucket/prefix, file:///path), got {shared!r}")
    try:
        shared_options = check_options(extra.get("shared_options"))
    except InvalidArgument as exc:
        raise InvalidArgument(f"kv_connector_extra_config['shared_options']: {exc}") from None
    shared = resolve_shared(shared)
    shared_sweep = _as_bool("shared_sweep", extra.get("shared_sweep", False))
    if shared_sweep and shared is None:
        raise InvalidArgument("kv_connector_extra_config['shared_sweep'] sweeps the shared "
                              "tier: give 'shared' (or SPARK_KV_CACHE_SHARED) too")
    return shared, shared_options, shared_sweep
