"""SparkCacheConnector: vLLM's ``KVConnectorBase_V1`` over a :class:`SnapshotStore`.

Loaded by vLLM from ``kv_connector_module_path="sparkcache.connector"``; see
docs/connector-notes.md for the vLLM API this follows and what is missing.

Scheduler side (one per engine, in the engine-core process):

* ``get_num_new_matched_tokens`` looks the prompt up in the index and offers
  the tokens of the longest restorable snapshot beyond vLLM's own prefix hit
  (never the last prompt token: vLLM must compute at least one).
* ``update_state_after_alloc`` turns that offer into a *load job* naming the
  blocks vLLM allocated for it; ``request_finished`` turns a finished request
  into a *save job* and keeps its blocks (returns True) until the workers have
  copied them out.  ``build_connector_meta`` ships both to the workers.

Worker side (one per rank):

* loads: verified read into a staging buffer, then scattered into the KV
  tensors - synchronously in ``start_load_kv`` (default: the request's first
  forward needs them) or on a thread with ``load_async`` (the request waits in
  WAITING_FOR_REMOTE_KVS).  A failed load reports its blocks through
  ``get_block_ids_with_load_errors``; vLLM recomputes them
  (``kv_load_failure_policy=recompute``, which this connector sets).
* saves: ``wait_for_save`` gathers the blocks into host memory and reports the
  request finished (vLLM frees the blocks); a background thread publishes from
  host memory.  The pending bytes are bounded; over the bound saves are dropped.

vLLM and torch are imported through ``importlib`` (types are ``Any``): mypy then
never follows into them, and this package imports without them.
"""

from __future__ import annotations

import importlib
import logging
import queue
import threading
import time
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from sparkcache.connector.layout import check_tensors, model_identity, rank_of
from sparkcache.connector.pages import LayerPages
from sparkcache.connector.settings import ConnectorSettings
from sparkcache.errors import NotFound, SparkCacheError
from sparkcache.identity import ModelIdentity, RequestScope
from sparkcache.store import Match, SnapshotStore

__all__ = ["SparkCacheConnector", "SparkCacheMetadata", "SparkCacheStats"]

_base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
_metrics = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
_hit_source = importlib.import_module("vllm.v1.metrics.cache_hit_source")
KVConnectorBase_V1: Any = _base.KVConnectorBase_V1
KVConnectorMetadata: Any = _base.KVConnectorMetadata
KVConnectorRole: Any = _base.KVConnectorRole
KVConnectorStats: Any = _metrics.KVConnectorStats
CacheHitSource: Any = _hit_source.CacheHitSource

# A child of vLLM's logger: our lines get vLLM's handler and format.
logger = logging.getLogger("vllm.sparkcache")


# -- metadata (scheduler -> workers, pickled every step) ---------------------------------


@dataclass(frozen=True)
class LoadJob:
    """Restore blocks ``[start_block, start_block + len(block_ids))`` of a snapshot."""

    req_id: str
    snapshot_id: int
    n_tokens: int  # the match: tokens [0, n_tokens) are read and verified
    token_ids: np.ndarray  # uint32, the prompt's first n_tokens
    start_block: int  # blocks below it are vLLM's own prefix hit
    block_ids: list[int]


@dataclass(frozen=True)
class SaveJob:
    """Publish tokens ``[0, len(token_ids))``; the blocks hold ``[parent_tokens, end)``."""

    req_id: str
    token_ids: np.ndarray  # uint32, whole blocks
    block_ids: list[int]
    parent: int | None
    scope: RequestScope | None
    prompt_tokens: int  # an alias boundary: the same prompt sent again restores it all


@dataclass
class SparkCacheMetadata(KVConnectorMetadata):  # type: ignore[misc]
    loads: list[LoadJob] = field(default_factory=list)
    saves: list[SaveJob] = field(default_factory=list)


# -- stats (workers and scheduler -> the logger process) ---------------------------------


@dataclass
class SparkCacheStats(KVConnectorStats):  # type: ignore[misc]
    """Counters summed over an interval: ``data`` maps name -> number."""

    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> SparkCacheStats:
        for key, value in (other.data or {}).items():
            self.data[key] = self.data.get(key, 0) + value
        return self

    def reduce(self) -> dict[str, int | float]:
        return {key: value for key, value in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class _Counters:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: dict[str, float] = {}

    def add(self, name: str, value: float = 1) -> None:
        with self._lock:
            self._data[name] = self._data.get(name, 0) + value

    def take(self) -> SparkCacheStats | None:
        with self._lock:
            data: dict[str, float] = self._data
            self._data = {}
        return SparkCacheStats(data=data) if data else None


def _scope_of(request: Any) -> RequestScope | None:
    lora = getattr(request, "lora_request", None)
    mm = [str(f.identifier) for f in (getattr(request, "mm_features", None) or [])]
    scope = RequestScope(
        cache_salt=getattr(request, "cache_salt", None),
        lora=None if lora is None else f"{lora.lora_name}:{lora.lora_int_id}",
        mm_hashes=tuple(mm),
    )
    return None if scope.is_default else scope


class SparkCacheConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """Persistent, verified prefix snapshots for vLLM (see the module docstring)."""

    _cache_hit_source = CacheHitSource.DISK

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.settings = ConnectorSettings.from_extra_config(
            self._kv_transfer_config.kv_connector_extra_config
        )
        self.identity: ModelIdentity = model_identity(
            vllm_config, kv_cache_config, revision=self.settings.revision
        )
        self.block_size = self.identity.block_size
        self.store = SnapshotStore(self.settings.folder)
        self.counters = _Counters()
        if role == KVConnectorRole.SCHEDULER:
            self._init_scheduler()
        else:
            self._init_worker()
        logger.info("sparkcache %s connector on %s (model %s, identity %s)",
                    "scheduler" if role == KVConnectorRole.SCHEDULER else "worker",
                    self.settings.folder, self.identity.model, self.identity.digest())

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a dropped save is a future miss, never an error.
        return False

    # ==============================================================================
    # Scheduler side
    # ==============================================================================

    def _init_scheduler(self) -> None:
        self._offers: dict[str, tuple[Match, int]] = {}
        self._async_loading: set[str] = set()  # until a worker reports finished_recving
        self._loads: list[LoadJob] = []
        self._saves: list[SaveJob] = []
        config = self._kv_transfer_config
        if config.kv_load_failure_policy != "recompute":
            # Invariant: a failed restore is a miss.  The scheduler reads the policy
            # right after constructing this connector, so setting it here takes effect.
            logger.warning("sparkcache sets kv_load_failure_policy=recompute (was %r): a "
                           "snapshot that fails verification is recomputed, not an error",
                           config.kv_load_failure_policy)
            config.kv_load_failure_policy = "recompute"

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` a stored snapshot can restore.

        Side-effect free for vLLM (it may call again): the offer is remembered
        per request and replaced by the next call.
        """
        self._offers.pop(request.request_id, None)
        if not self.settings.restore or request.prompt_token_ids is None:
            return 0, False
        tokens = request.all_token_ids
        # vLLM must compute at least one token itself to sample the next one.
        limit = (len(tokens) - 1) // self.block_size * self.block_size
        if limit <= num_computed_tokens:
            return 0, False
        started = time.perf_counter()
        try:
            match = self.store.lookup(
                self.identity, np.asarray(tokens[:limit], dtype=np.uint32),
                scope=_scope_of(request),
            )
        except SparkCacheError as exc:
            logger.warning("sparkcache lookup failed (a miss): %s", exc)
            self.counters.add("lookup_errors")
            return 0, False
        finally:
            self.counters.add("lookup_seconds", time.perf_counter() - started)
        self.counters.add("lookups")
        if match is None or match.n_tokens <= num_computed_tokens:
            return 0, False
        self._offers[request.request_id] = (match, num_computed_tokens)
        return match.n_tokens - num_computed_tokens, self.settings.load_async

    def update_state_after_alloc(
        self, request: Any, blocks: Any, num_external_tokens: int
    ) -> None:
        offer = self._offers.pop(request.request_id, None)
        if num_external_tokens == 0 or offer is None:
            return
        match, local = offer
        if local + num_external_tokens != match.n_tokens or local % self.block_size:
            # vLLM trimmed the offer in a way this skeleton does not plan for.
            logger.warning("sparkcache: unexpected external token count %d (offered %d from "
                           "%d); not loading", num_external_tokens, match.n_tokens - local, local)
            return
        (block_ids, *_rest) = blocks.get_block_ids()
        start, end = local // self.block_size, match.n_tokens // self.block_size
        self._loads.append(LoadJob(
            req_id=request.request_id, snapshot_id=match.snapshot_id, n_tokens=match.n_tokens,
            token_ids=match.token_ids, start_block=start, block_ids=list(block_ids[start:end]),
        ))
        if self.settings.load_async:
            self._async_loading.add(request.request_id)
        self.counters.add("hits")
        self.counters.add("hit_tokens", num_external_tokens)

    def get_external_cache_hit_sources(
        self, request: Any, num_external_tokens: int
    ) -> dict[Any, int]:
        return {CacheHitSource.DISK: num_external_tokens} if num_external_tokens else {}

    def build_connector_meta(self, scheduler_output: Any) -> SparkCacheMetadata:
        meta = SparkCacheMetadata(loads=self._loads, saves=self._saves)
        self._loads, self._saves = [], []
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        self._async_loading.difference_update(connector_output.finished_recving or ())

    def request_finished(
        self, request: Any, block_ids: list[int]
    ) -> tuple[bool, dict[str, Any] | None]:
        """Plan a save of the request's computed whole blocks; hold them until copied."""
        self._offers.pop(request.request_id, None)
        if request.request_id in self._async_loading:
            # Aborted while its restore is in flight: the blocks are still being
            # written (vLLM holds them until the load reports); nothing to save.
            self._async_loading.discard(request.request_id)
            return False, None
        if not self.settings.publish or request.prompt_token_ids is None:
            return False, None
        tokens = request.all_token_ids
        n = min(request.num_computed_tokens, len(tokens), len(block_ids) * self.block_size)
        n = n // self.block_size * self.block_size
        if n < max(self.settings.min_tokens, self.block_size):
            return False, None
        token_ids = np.asarray(tokens[:n], dtype=np.uint32)
        scope = _scope_of(request)
        parent_id, parent_tokens = None, 0
        try:
            known = self.store.lookup(self.identity, token_ids, scope=scope)
            if known is not None:
                if known.n_tokens == n:
                    self.counters.add("saves_known")
                    return False, None  # already stored (perhaps restored from it)
                if self.store.snapshot(known.snapshot_id).n_tokens == known.n_tokens:
                    # A whole stored snapshot is our prefix: write only the tail.
                    parent_id, parent_tokens = known.snapshot_id, known.n_tokens
        except SparkCacheError as exc:
            logger.warning("sparkcache lookup before save failed; saving in full: %s", exc)
        first = parent_tokens // self.block_size
        self._saves.append(SaveJob(
            req_id=request.request_id, token_ids=token_ids,
            block_ids=list(block_ids[first:n // self.block_size]),
            parent=parent_id, scope=scope, prompt_tokens=int(request.num_prompt_tokens),
        ))
        return True, None

    # ==============================================================================
    # Worker side
    # ==============================================================================

    def _init_worker(self) -> None:
        self.pages: LayerPages | None = None
        self.rank = 0
        self._failed_blocks: set[int] = set()
        self._sent: set[str] = set()
        self._loading: dict[str, tuple[Future[None], LoadJob]] = {}
        self._recved: set[str] = set()
        self._loader: ThreadPoolExecutor | None = None
        self._pending_bytes = 0
        self._pending_lock = threading.Lock()
        self._publish_queue: queue.Queue[tuple[SaveJob, list[np.ndarray]] | None] = queue.Queue()
        self._publisher = threading.Thread(
            target=self._publish_loop, name="sparkcache-publish", daemon=True
        )
        self._publisher.start()

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        parallel = importlib.import_module("vllm.distributed.parallel_state")
        try:
            pages = LayerPages(kv_caches)
            check_tensors(self.identity, pages.tensors)
            self.rank = rank_of(
                self.identity, parallel.get_tensor_model_parallel_rank(),
                parallel.get_pipeline_model_parallel_rank(),
            )
        except SparkCacheError as exc:
            # Loads will fail (and be recomputed), saves are skipped: misses only.
            logger.error("sparkcache is off on this worker: %s", exc)
            return
        self.pages = pages
        logger.info("sparkcache worker rank %d: %d layers of %d blocks, %d-byte pages %s",
                    self.rank, len(pages), pages.num_blocks, pages.page_nbytes,
                    self.identity.page_shape)

    # -- loads -----------------------------------------------------------------------

    def _load(self, job: LoadJob) -> None:
        """Verified read of the match, then scatter of the blocks vLLM wants."""
        if self.pages is None:
            raise SparkCacheError("this worker's KV cache is not registered with sparkcache")
        started = time.perf_counter()
        n_blocks = job.n_tokens // self.block_size
        staging = np.empty((len(self.pages), n_blocks, self.pages.page_nbytes), np.uint8)
        match = Match(job.snapshot_id, job.n_tokens, self.identity, job.token_ids)
        self.store.read_into(match, self.rank, list(staging), n_tokens=job.n_tokens)
        self.pages.scatter(job.block_ids, list(staging[:, job.start_block:]))
        self.counters.add("loads")
        self.counters.add("loaded_tokens", len(job.block_ids) * self.block_size)
        self.counters.add("load_seconds", time.perf_counter() - started)

    def _load_failed(self, job: LoadJob, exc: BaseException) -> None:
        logger.warning("sparkcache restore of snapshot %d for %s failed (recomputed): %s",
                       job.snapshot_id, job.req_id, exc)
        self.counters.add("load_failures")
        self._failed_blocks.update(job.block_ids)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        for job in meta.loads:
            if self.settings.load_async:
                if self._loader is None:
                    self._loader = ThreadPoolExecutor(1, thread_name_prefix="sparkcache-load")
                self._loading[job.req_id] = (self._loader.submit(self._load, job), job)
                continue
            try:
                self._load(job)
            except (SparkCacheError, ValueError, OSError) as exc:
                self._load_failed(job, exc)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # whole requests are loaded before (sync) or between (async) steps

    def save_kv_layer(
        self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves copy whole blocks when the request finishes (wait_for_save)

    # -- saves -----------------------------------------------------------------------

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        for job in meta.saves:
            self._sent.add(job.req_id)  # always reported, or vLLM never frees the blocks
            if self.pages is None:
                continue
            nbytes = len(job.block_ids) * self.pages.page_nbytes * len(self.pages)
            with self._pending_lock:
                if self._pending_bytes + nbytes > self.settings.max_pending_mb << 20:
                    self.counters.add("saves_dropped")
                    continue
                self._pending_bytes += nbytes
            started = time.perf_counter()
            pages = self.pages.gather(job.block_ids)
            self.counters.add("save_copy_seconds", time.perf_counter() - started)
            self._publish_queue.put((job, pages))

    def _publish_loop(self) -> None:
        while True:
            item = self._publish_queue.get()
            if item is None:
                return
            job, pages = item
            started = time.perf_counter()
            try:
                # The snapshot holds the output too; a breakpoint at the prompt's end
                # lets a resend of the same prompt (which must leave its last token
                # to vLLM) match more than the last stride alias below it.
                self.store.publish(self.identity, self.rank, job.token_ids, pages,
                                   parent=job.parent, scope=job.scope,
                                   breakpoints=[job.prompt_tokens - 1])
                self.counters.add("saves")
                self.counters.add("saved_tokens", len(job.block_ids) * self.block_size)
            except NotFound:
                # The parent was evicted meanwhile: these pages alone cannot stand.
                self.counters.add("saves_lost_parent")
            except (SparkCacheError, OSError) as exc:
                logger.warning("sparkcache publish for %s failed: %s", job.req_id, exc)
                self.counters.add("save_failures")
            finally:
                self.counters.add("publish_seconds", time.perf_counter() - started)
                nbytes = sum(p.nbytes for p in pages)
                with self._pending_lock:
                    self._pending_bytes -= nbytes
                self._publish_queue.task_done()

    # -- completion reporting ------------------------------------------------------------

    def get_finished(
        self, finished_req_ids: set[str]
    ) -> tuple[set[str] | None, set[str] | None]:
        sent, self._sent = self._sent, set()
        done = [rid for rid, (fut, _job) in self._loading.items() if fut.done()]
        recved: set[str] = set()
        for rid in done:
            fut, job = self._loading.pop(rid)
            exc = fut.exception()
            if exc is not None:
                self._load_failed(job, exc)
            recved.add(rid)  # failed loads are finished too; their blocks are reported
        return (sent or None), (recved or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        failed, self._failed_blocks = self._failed_blocks, set()
        return failed

    def get_kv_connector_stats(self) -> SparkCacheStats | None:
        return self.counters.take()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SparkCacheStats:
        return SparkCacheStats(data=dict(data or {}))

    def flush(self, timeout: float = 60.0) -> bool:
        """Wait until every queued save is on disk (worker side); False on timeout."""
        if self.role == KVConnectorRole.SCHEDULER:
            return True
        deadline = time.monotonic() + timeout
        while self._publish_queue.unfinished_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def shutdown(self) -> None:
        if self.role != KVConnectorRole.SCHEDULER:
            if not self.flush():
                logger.warning("sparkcache: shutting down with saves still queued (dropped)")
            self._publish_queue.put(None)
            self._publisher.join(timeout=5)
            if self._loader is not None:
                self._loader.shutdown(wait=True)
        self.store.close()

    def take_events(self) -> Iterable[Any]:
        return ()
