"""vLLM's ``vllm.general_plugins`` entry point: the connector known to vLLM by name.

vLLM runs every general plugin at start-up in each of its processes (the API
server, the engine core, every worker).  :func:`register` adds
``SparkCacheConnector`` to vLLM's connector registry, so a
``kv_transfer_config`` needs no ``kv_connector_module_path``::

    --kv-transfer-config '{"kv_connector": "SparkCacheConnector", "kv_role": "kv_both"}'

It imports nothing of the connector: the registry loads ``sparkcache.connector``
only when an engine asks for the class (docs/connector.md, "Quick start").
"""

from __future__ import annotations

import contextlib

from sparkcache.connector.engine import register_by_name

__all__ = ["CONNECTOR_NAME", "register"]

#: The name the connector is registered under (``kv_connector``).
CONNECTOR_NAME = "SparkCacheConnector"


def register() -> None:
    """Register :data:`CONNECTOR_NAME` with vLLM's ``KVConnectorFactory``.

    Harmless to call more than once, or where vLLM already knows the name, and
    does nothing where vLLM is not installed.
    """
    with contextlib.suppress(ImportError):  # no vLLM: nothing to register with
        register_by_name(CONNECTOR_NAME, "sparkcache.connector")
