"""The engine around a connector: vLLM's ``MultiConnector``, and saves handed over at shutdown.

* Inside vLLM's ``MultiConnector`` each child gets a copy of the engine's
  ``kv_transfer_config``, while vLLM's scheduler reads the top-level one
  (``kv_load_failure_policy``), and the children's ``kv_transfer_params`` are
  merged into one dict (a key two children use is vLLM's "Key clash" error).
  :func:`parent_multi_connector` finds the ``MultiConnector`` being built
  around this connector, so that the connector can set the policy where vLLM
  reads it and choose a key no earlier sibling uses (:func:`params_key`).
  The children's stats are rebuilt in vLLM's main process by class name from
  vLLM's connector registry, which :func:`register_by_name` joins.
* Saves are planned on the scheduler side and reach the workers with the next
  step; an engine shut down before it (an in-process engine steps only when
  asked) would lose them.  Where a worker runs in its scheduler's process,
  :class:`Unsent` hands them over: the worker's shutdown runs them before it
  closes (docs/connector.md, "Shutdown").
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import threading
from collections.abc import Callable, Iterable
from typing import Any, ClassVar

from sparkcache.connector.jobs import SaveJob

__all__ = ["PARAMS_KEY", "Unsent", "params_key", "parent_multi_connector", "recompute_policy",
           "register_by_name"]

#: The ``kv_transfer_params`` key of the connector's facts (the first sparkcache
#: connector of an engine; a later one in the same MultiConnector adds its position).
PARAMS_KEY = "sparkcache"
_MULTI = "vllm.distributed.kv_transfer.kv_connector.v1.multi_connector"
_FACTORY = "vllm.distributed.kv_transfer.kv_connector.factory"


def register_by_name(name: str, module: str) -> None:
    """Add the connector class ``name`` of ``module`` to vLLM's registry (once
    per process): a ``MultiConnector`` rebuilds its children's stats by class
    name (``get_connector_class_by_name``), also in a process that only
    resolved the class by ``kv_connector_module_path``."""
    with contextlib.suppress(ValueError):  # registered already
        importlib.import_module(_FACTORY).KVConnectorFactory.register_connector(
            name, module, name)


def parent_multi_connector() -> Any | None:
    """The vLLM ``MultiConnector`` whose constructor is building the caller, or None.

    Found on the call stack (the frame of ``MultiConnector.__init__``): vLLM
    hands a child no reference to its parent.  While the child is built, the
    parent's ``_connectors`` holds the siblings before it and its
    ``_kv_transfer_config`` is the engine's own.
    """
    try:
        code = importlib.import_module(_MULTI).MultiConnector.__init__.__code__
    except (ImportError, AttributeError):
        return None
    frame = inspect.currentframe()
    try:
        while frame is not None:
            if frame.f_code is code:
                return frame.f_locals.get("self")
            frame = frame.f_back
        return None
    finally:
        del frame  # no reference cycle through the frames


def params_key(parent: Any | None, is_ours: Callable[[Any], bool]) -> str:
    """This connector's ``kv_transfer_params`` key: :data:`PARAMS_KEY`, or inside
    a ``MultiConnector`` whose earlier children include one of ours
    (``is_ours``), ``sparkcache.<position>`` (its place in the list of children)."""
    siblings = list(getattr(parent, "_connectors", None) or ())
    if not any(is_ours(c) for c in siblings):
        return PARAMS_KEY
    return f"{PARAMS_KEY}.{len(siblings)}"


def recompute_policy(configs: Iterable[Any]) -> list[str]:
    """Set ``kv_load_failure_policy = "recompute"`` on each ``kv_transfer_config``;
    the policies replaced (for the log)."""
    replaced = []
    for config in configs:
        if config is not None and config.kv_load_failure_policy != "recompute":
            replaced.append(str(config.kv_load_failure_policy))
            config.kv_load_failure_policy = "recompute"
    return replaced


class Unsent:
    """Per process: each engine's scheduler side, by key, with its planned saves
    not yet handed to the workers (``take``: hands them out once)."""

    _lock: ClassVar[threading.Lock] = threading.Lock()
    _takers: ClassVar[dict[tuple[str, str], Callable[[], list[SaveJob]]]] = {}

    @classmethod
    def register(cls, key: tuple[str, str], take: Callable[[], list[SaveJob]]) -> None:
        with cls._lock:
            cls._takers[key] = take

    @classmethod
    def unregister(cls, key: tuple[str, str]) -> None:
        with cls._lock:
            cls._takers.pop(key, None)

    @classmethod
    def take(cls, key: tuple[str, str]) -> list[SaveJob]:
        """The saves this process's scheduler side of ``key`` planned and no step
        carried to the workers (none when it runs in another process)."""
        with cls._lock:
            take = cls._takers.get(key)
        return [] if take is None else take()
