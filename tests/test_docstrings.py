"""The facade's public methods say their contract: every argument under ``Args:``.

Google style (``Args:``, ``Returns:``, ``Raises:``), as the rest of the docs link
docs/*.md for the mechanism instead of retelling it.
"""

from __future__ import annotations

import inspect
import re

from sparkcache.store import SnapshotStore


def undocumented(cls: type) -> list[str]:
    """``Class.method(arg)`` for every argument of a public method that its
    docstring's ``Args:`` section does not name (or ``Class.method`` without one)."""
    found = []
    for name, member in inspect.getmembers(cls):
        if name.startswith("_") or isinstance(inspect.getattr_static(cls, name), property):
            continue
        if not callable(member) or getattr(member, "__module__", "").split(".")[0] != "sparkcache":
            continue
        doc = inspect.getdoc(member) or ""
        if not doc:
            found.append(f"{cls.__name__}.{name} has no docstring")
            continue
        args = re.search(r"^Args:\n((?:    .*\n?|\n)*)", doc, re.MULTILINE)
        named = set(re.findall(r"^    (\w+):", args.group(1), re.MULTILINE)) if args else set()
        params = [p for p in inspect.signature(member).parameters if p != "self"]
        found += [f"{cls.__name__}.{name}({p})" for p in params if p not in named]
    return found


def test_every_public_method_of_the_store_documents_its_arguments() -> None:
    assert undocumented(SnapshotStore) == []


def test_the_class_documents_its_constructor() -> None:
    doc = inspect.getdoc(SnapshotStore) or ""
    params = [p for p in inspect.signature(SnapshotStore.__init__).parameters if p != "self"]
    assert [p for p in params if not re.search(rf"^    {p}:", doc, re.MULTILINE)] == []


def test_the_checker_sees_a_missing_argument() -> None:
    class Fake:
        def ok(self, a: int) -> None:
            """Do.

            Args:
                a: the thing.
            """

        def bad(self, a: int, b: int) -> None:
            """Do.

            Args:
                a: the thing.
            """

    Fake.__module__ = "sparkcache.fake"
    Fake.ok.__module__ = Fake.bad.__module__ = "sparkcache.fake"
    assert undocumented(Fake) == ["Fake.bad(b)"]
