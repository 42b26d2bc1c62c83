"""The ``vllm.general_plugins`` entry point: vLLM finds it and knows the connector by name.

Each case runs in a fresh interpreter (vLLM loads its plugins once per process,
and its connector registry is per process).  The engine started with the
short name is tests/vllm/test_connector_by_name.py.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.entry_points import ROOT, declared, pythonpath

GROUP = "vllm.general_plugins"
NEEDS_VLLM = pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                reason="needs vLLM (bash scripts/install-vllm.sh)")

#: vLLM blocked: any import of it fails as it does where it is not installed.
WITHOUT_VLLM = """
import sys
class Blocked:
    def find_spec(self, name, path=None, target=None):
        if name == "vllm" or name.startswith("vllm."):
            raise ModuleNotFoundError(f"No module named {name!r}")
sys.meta_path.insert(0, Blocked())
from sparkcache.connector.plugin import register
register()
register()
assert not any(m == "vllm" or m.startswith("vllm.") for m in sys.modules)
"""

#: What vLLM does at start-up, then what it does with a config naming only the connector.
BY_NAME = """
from importlib.metadata import entry_points
found = {e.name: e.value for e in entry_points(group="vllm.general_plugins")}
assert found.get("sparkcache") == "sparkcache.connector.plugin:register", found
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
config = KVTransferConfig(kv_connector="SparkCacheConnector", kv_role="kv_both")
cls = KVConnectorFactory.get_connector_class(config)
import sparkcache.connector.connector as ours
assert cls is ours.SparkCacheConnector, cls
from sparkcache.connector.plugin import register
register()  # vLLM knows the name already: nothing happens, nothing raised
assert KVConnectorFactory.get_connector_class(config) is cls
print("registered")
"""


def run(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=300)


def test_pyproject_declares_the_plugin() -> None:
    assert declared(GROUP) == {"sparkcache": "sparkcache.connector.plugin:register"}


def test_without_vllm_registering_does_nothing_and_raises_nothing() -> None:
    done = run(WITHOUT_VLLM, {**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr


@pytest.mark.vllm
@NEEDS_VLLM
def test_vllm_finds_the_plugin_and_the_connector_by_name(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": pythonpath(tmp_path, GROUP)}
    done = run(BY_NAME, env)
    assert done.returncode == 0 and "registered" in done.stdout, done.stderr[-3000:]
