"""Two hosts, one shared tier (moto's S3 server): an engine on host 1 answers
LONG_PROMPT and OTHER_PROMPT and uploads both as it exits; an engine on host 2,
with an empty store and the same tier, restores LONG_PROMPT from the tier and
answers exactly as plain vLLM does.  OTHER_PROMPT's segment is corrupted in the
tier before host 2 starts: the negative control, a verified miss recomputed to
the same answer.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import CHUNK
from tiny_model import (
    LONG_PROMPT,
    NEEDS_VLLM,
    OTHER_PROMPT,
    assert_from_tier,
    run_scenario,
    same_answer,
)

from sparkcache import SnapshotStore
from sparkcache.shared import SharedTier, parse_manifest
from sparkcache.shared.layout import manifest_key
from tests.s3server import s3_server, stop_s3_servers

pytestmark = NEEDS_VLLM


@pytest.fixture(scope="module")
def two_hosts(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory,
              ) -> Iterator[dict[str, Any]]:
    server = s3_server()  # its environment (credentials) reaches the engines
    url = f"s3://{server.bucket()}/kv"
    extra = {"shared": url, "shared_options": {"endpoint_url": server.endpoint},
             "upload_wait_seconds": 60, "shared_deadline_seconds": 60}
    tmp = tmp_path_factory.mktemp("shared-hosts")
    one = run_scenario(tiny_model_dir, tmp, [
        {"op": "gen", "name": "long", "prompts": [LONG_PROMPT]},
        {"op": "gen", "name": "other", "prompts": [OTHER_PROMPT], "ready": 2},
    ], folder=tmp / "host1", engine=CHUNK, extra=extra)
    # Corrupt OTHER_PROMPT's snapshot in the tier: one byte of its rows.
    with SnapshotStore(tmp / "host1") as store:
        snaps = sorted((s for s in store.snapshots() if s.state == "ready"), key=lambda s: s.id)
        assert len(snaps) == 2 and all(s.uploaded_at for s in snaps), one["_log"]
        other = snaps[1]  # OTHER_PROMPT's, answered second
        with store._core.read() as conn:
            model = store._core.model(conn, other.model_id)
    assert model is not None
    tier = SharedTier(url, {"endpoint_url": server.endpoint}, alias_stride=256)
    try:
        raw = tier.get(manifest_key(model.digest, other.snap_key))
        assert raw is not None
        (segment,) = parse_manifest(raw, model.digest, other.snap_key).segments
        with tier.backend.open(segment.key) as blob:
            data = bytearray(blob.buffer)
        data[len(data) // 2] ^= 0xFF
        tier.put(segment.key, [bytes(data)])
    finally:
        tier.close()
    two = run_scenario(tiny_model_dir, tmp, [
        {"op": "gen", "name": "long", "prompts": [LONG_PROMPT], "logprobs": True},
        {"op": "gen", "name": "other", "prompts": [OTHER_PROMPT]},
    ], folder=tmp / "host2", engine=CHUNK, extra=extra)
    yield {"one": one, "two": two}
    stop_s3_servers()


def test_host2_restores_host1s_prompt_from_the_tier(
    two_hosts: dict[str, Any], baseline: dict[str, Any]
) -> None:
    two = two_hosts["two"]
    assert_from_tier(two["long"], LONG_PROMPT, baseline["long"][0], two["_log"])
    assert two["long"]["stats"]["fetches"] >= 1


def test_a_corrupted_object_in_the_tier_is_recomputed(
    two_hosts: dict[str, Any], baseline: dict[str, Any]
) -> None:
    """The negative control: the same path, one flipped byte in the tier, no restore."""
    two = two_hosts["two"]
    (out,) = two["other"]["outs"]
    assert out["cached"] == 0, two["_log"]
    assert same_answer(out, baseline["other"][0]) == "", two["_log"]
    assert two["other"]["stats"]["fetch_refused"] >= 1
    assert two["other"]["metrics"].get("vllm:sparkcache_remote_refused") == 1
