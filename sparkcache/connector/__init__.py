"""The vLLM KV connector (scheduler and worker sides).

vLLM loads it by name (the ``vllm.general_plugins`` entry point,
:mod:`sparkcache.connector.plugin`, registers it), or from
``"kv_connector_module_path": "sparkcache.connector"``::

    --kv-transfer-config '{"kv_connector": "SparkCacheConnector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"folder": "/var/cache/kv"}}'

Importing this package does not import vLLM: :class:`SparkCacheConnector`
(which subclasses vLLM's ``KVConnectorBase_V1``) is resolved on first access,
so the settings, the layout helpers and both sides' logic (``scheduler``,
``worker``, the ``jobs`` they share) work, and are tested, without vLLM.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from sparkcache.connector.settings import ConnectorSettings

if TYPE_CHECKING:
    from sparkcache.connector.connector import (
        SparkCacheConnector,
        SparkCacheMetadata,
        SparkCacheStats,
    )

__all__ = ["ConnectorSettings", "SparkCacheConnector", "SparkCacheMetadata", "SparkCacheStats"]

_LAZY = {"SparkCacheConnector", "SparkCacheMetadata", "SparkCacheStats"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        from sparkcache.connector import connector

        return getattr(connector, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | _LAZY)
