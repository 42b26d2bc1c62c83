"""Stateful test: every backend behaves like a plain dict of bytes under random operations."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from sparkcache.backends import Backend
from sparkcache.errors import NotFound

from .conftest import BACKEND_KINDS, dispose_backend, make_backend

KEYS = st.sampled_from(["a", "a/b", "a/c/d", "b/x", "b/y.tmp.1.0123abcd", "c/d/e/f"])
DATA = st.lists(st.binary(max_size=300), max_size=4)


class BackendModel(RuleBasedStateMachine):
    """Compare a backend with a dict; the backend kind is set by the subclass."""

    kind = "local"

    def __init__(self) -> None:
        super().__init__()
        self.folder = tempfile.TemporaryDirectory(prefix="sparkcache-model-")
        self.backend: Backend = make_backend(self.kind, Path(self.folder.name) / "store")
        self.model: dict[str, bytes] = {}
        self.folders: set[str] = set()  # every folder a put created; deletes leave them

    def teardown(self) -> None:
        dispose_backend(self.backend)
        self.folder.cleanup()

    def _conflicts(self, key: str) -> bool:
        # A name cannot be both an object and a folder, and delete leaves folders in
        # place; store keys never mix the two (folders have no '.safetensors'), so the
        # model does not ask for it either.
        return key in self.folders or any(key.startswith(k + "/") for k in self.model)

    @rule(key=KEYS, chunks=DATA)
    def put(self, key: str, chunks: list[bytes]) -> None:
        if self._conflicts(key):
            return
        assert self.backend.put(key, chunks) == sum(map(len, chunks))
        self.model[key] = b"".join(chunks)
        parts = key.split("/")
        self.folders.update("/".join(parts[:i]) for i in range(1, len(parts)))

    @rule(key=KEYS)
    def delete(self, key: str) -> None:
        assert self.backend.delete(key) == (key in self.model)
        self.model.pop(key, None)

    @rule(key=KEYS)
    def read(self, key: str) -> None:
        if key in self.model:
            with self.backend.open(key) as blob:
                assert bytes(blob.buffer) == self.model[key]
            assert self.backend.size(key) == len(self.model[key])
        else:
            with pytest.raises(NotFound):
                self.backend.open(key)

    @rule(prefix=st.sampled_from(["", "a", "b", "c/d"]))
    def listing(self, prefix: str) -> None:
        want = sorted(k for k in self.model if not prefix or k.startswith(prefix + "/"))
        assert sorted(self.backend.list(prefix)) == want

    @invariant()
    def existence(self) -> None:
        for key in self.model:
            assert self.backend.exists(key)


for _kind in BACKEND_KINDS:
    _machine = type(f"Model_{_kind.replace('-', '_')}", (BackendModel,), {"kind": _kind})
    _case = _machine.TestCase  # type: ignore[attr-defined]
    _case.settings = settings(max_examples=20, stateful_step_count=15, deadline=None)
    globals()[f"TestModel_{_kind.replace('-', '_')}"] = _case
del _kind, _machine, _case  # or pytest would collect the last TestCase twice
