"""Plain vLLM finds the connector by name, through sparkcache's vLLM plugin entry point.

One ``python -m vllm.entrypoints.openai.api_server`` whose ``--kv-transfer-config``
names only ``"kv_connector": "SparkCacheConnector"`` (no module path): vLLM's
API server, engine core and worker each run the plugin, the engine starts with
the connector, a prompt's answer is published, and the same prompt, after
vLLM's own prefix cache was reset, is restored from the store and answered
the same.  The entry point comes from the installed metadata when it is this
tree's (CI), else from this tree's ``pyproject.toml`` (:mod:`tests.entry_points`);
without it the server does not start (``Unsupported connector type``).
"""

from __future__ import annotations

import json
import re
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from serve_helpers import MODEL_NAME, Server, log_rows, wait_for
from tiny_model import BLOCK_SIZE, COMPUTED, LONG_PROMPT, MAX_MODEL_LEN, NEEDS_VLLM

from sparkcache.store import SnapshotStore
from tests.entry_points import pythonpath

pytestmark = NEEDS_VLLM

def transfer_config(folder: Path) -> dict[str, Any]:
    """What a user writes: the connector by name, nothing else but its store."""
    return {"kv_connector": "SparkCacheConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": {"folder": str(folder)}}


class VllmServer(Server):
    """vLLM's own OpenAI server (not ``sparkcache serve``) with the short form."""

    def __init__(self, model_dir: Path, folder: Path, log: Path, plugins: Path) -> None:
        super().__init__(model_dir, folder, log, env={"VLLM_SERVER_DEV_MODE": "1"})
        self.cmd = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", MODEL_NAME,
            "--host", "127.0.0.1", "--port", str(self.port), "--dtype", "float32",
            "--block-size", str(BLOCK_SIZE), "--max-model-len", str(MAX_MODEL_LEN),
            "--max-num-seqs", "8", "--seed", "0", "--enforce-eager",
            "--enable-prompt-tokens-details",
            "--kv-transfer-config", json.dumps(transfer_config(folder)),
        ]
        self.env["PYTHONPATH"] = pythonpath(plugins, "vllm.general_plugins",
                                            self.env.get("PYTHONPATH", ""))


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("by-name")
    with VllmServer(tiny_model_dir, tmp / "store", tmp / "server.log", tmp / "plugins") as s:
        yield s


def complete(server: Server) -> Any:
    status, answer = server.post("/v1/completions", {
        "model": MODEL_NAME, "prompt": LONG_PROMPT, "max_tokens": 4, "temperature": 0})
    assert status == 200, answer
    return answer


def test_vllm_started_with_the_name_only_restores_from_the_store(server: Server) -> None:
    assert "kv_connector_module_path" not in " ".join(server.cmd)
    first = complete(server)
    stored = whole_blocks = len(LONG_PROMPT) // BLOCK_SIZE * BLOCK_SIZE

    def published() -> bool:
        with SnapshotStore(server.folder) as store:
            return any(s.n_tokens >= stored for s in store.snapshots())

    wait_for(published, timeout=60)

    def reset() -> bool:  # retried while the finished request's blocks are held for its save
        request = urllib.request.Request(server.url + "/reset_prefix_cache", data=b"",
                                         method="POST")
        with urllib.request.urlopen(request, timeout=30) as answer:
            return bool(json.loads(answer.read())["success"])

    wait_for(reset)
    second = complete(server)
    assert second["choices"][0]["text"] == first["choices"][0]["text"]
    cached = second["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached >= whole_blocks - BLOCK_SIZE and cached <= len(LONG_PROMPT) - COMPUTED, second
    rows = log_rows(server.folder, lambda rows: any((r.restored_tokens or 0) > 0 for r in rows))
    assert max(r.restored_tokens or 0 for r in rows) == cached

    def restored_on_metrics() -> float:
        with urllib.request.urlopen(server.url + "/metrics", timeout=30) as answer:
            text = answer.read().decode()
        found = re.findall(r"^vllm:sparkcache_hit_tokens_total\{[^}]*\} (\S+)$", text,
                           re.MULTILINE)
        return sum(float(v) for v in found)

    assert wait_for(restored_on_metrics) == cached
