"""What the connector takes from the engine around it (no vLLM engine needed).

The MultiConnector parts (:func:`parent_multi_connector` finding the parent
on the call stack) run in real engines: tests/vllm/test_multi_connector.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from sparkcache.connector.engine import PARAMS_KEY, Unsent, params_key, recompute_policy
from sparkcache.connector.jobs import SaveJob


@dataclass
class Config:
    kv_load_failure_policy: str


class Ours:
    pass


def test_the_first_of_ours_keeps_the_key_a_later_one_adds_its_position() -> None:
    def ours(c: object) -> bool:
        return isinstance(c, Ours)

    class Parent:
        _connectors: list[object]

    parent = Parent()
    assert params_key(None, ours) == PARAMS_KEY == "sparkcache"
    for before, key in (([], "sparkcache"), ([object()], "sparkcache"),
                        ([Ours()], "sparkcache.1"), ([object(), Ours(), object()], "sparkcache.3")):
        parent._connectors = before
        assert params_key(parent, ours) == key


def test_the_policy_is_recompute_wherever_vllm_reads_it() -> None:
    child, parent = Config("fail"), Config("fail")
    assert recompute_policy([child, None, parent]) == ["fail", "fail"]
    assert child.kv_load_failure_policy == parent.kv_load_failure_policy == "recompute"
    assert recompute_policy([child, parent]) == []


def test_unsent_saves_are_handed_out_once_and_only_under_their_key() -> None:
    job = SaveJob(req_id="r", token_ids=np.empty(0, np.uint32), blocks=(), parent=None,
                  scope=None, breakpoints=())
    planned = [job]

    def take() -> list[SaveJob]:
        out = list(planned)
        planned.clear()
        return out

    key = ("engine", "sparkcache")
    Unsent.register(key, take)
    try:
        assert Unsent.take(("engine", "sparkcache.1")) == []
        assert Unsent.take(key) == [job]
        assert Unsent.take(key) == []
    finally:
        Unsent.unregister(key)
    planned.append(job)
    assert Unsent.take(key) == []  # unregistered: the scheduler side is gone
