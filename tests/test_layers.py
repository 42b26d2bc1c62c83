"""The package's imports point one way, in the layer order docs/architecture.md writes.

Every ``import`` of every module is read from its source (function-level and
``TYPE_CHECKING`` ones included) and held to the ``layers`` block of
docs/architecture.md: a module imports only modules on lines above its own.
No module may use another sparkcache module's private (``_name``) members, and
only the layers that need them import vLLM or torch.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "sparkcache"
DOC = ROOT / "docs" / "architecture.md"
#: Third-party packages only some layers may import.
HEAVY = {"torch": ("cuda", "connector", "demo"), "vllm": ("connector", "demo", "serve")}
#: Private members of third-party objects that their libraries document for use.
#: Other projects' private members used for want of a public one: fsspec's
#: AbstractFileSystem._strip_protocol; vLLM's CPU attention kernel chooser
#: (the page format of a CPU engine's KV cache, which vLLM names nowhere else).
THIRD_PARTY_PRIVATE = {"_strip_protocol", "_get_attn_isa"}


def layer_order(text: str) -> dict[str, int]:
    """Module name (without ``sparkcache.``) -> its line in the ``layers`` block."""
    block = re.search(r"```layers\n(.*?)```", text, re.DOTALL)
    assert block is not None, "docs/architecture.md has no ```layers block"
    order: dict[str, int] = {}
    for number, line in enumerate(block.group(1).splitlines()):
        for name in line.split():
            assert name not in order, f"{name} is listed twice in the layers block"
            order[name] = number
    return order


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts) or "sparkcache"


def package_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


@dataclass(frozen=True)
class Use:
    line: int
    target: str  # a sparkcache module ("" for third-party), without "sparkcache."
    member: str  # the name imported from it or used on it, "" for a plain import
    top: str  # the top-level package imported


def _short(name: str) -> str:
    return "sparkcache" if name == "sparkcache" else name.removeprefix("sparkcache.")


def uses(name: str, path: Path, modules: set[str]) -> list[Use]:
    """Every import of ``path`` (and every attribute taken from an imported
    sparkcache module), resolved to modules of the package."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[Use] = []
    aliases: dict[str, str] = {}  # local name -> sparkcache module it names
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                top = alias.name.split(".")[0]
                target = _short(alias.name) if top == "sparkcache" else ""
                found.append(Use(node.lineno, target, "", top))
                if target and alias.asname:
                    aliases[alias.asname] = target
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = (["sparkcache", *package])[: len(package) + 2 - node.level]
                source = ".".join([*base, *([node.module] if node.module else [])])
            else:
                source = node.module or ""
            top = source.split(".")[0]
            for alias in node.names:
                if top != "sparkcache":
                    found.append(Use(node.lineno, "", alias.name, top))
                    continue
                sub = _short(f"{source}.{alias.name}")
                if sub in modules:  # `from sparkcache import segment`: the module itself
                    found.append(Use(node.lineno, sub, "", top))
                    aliases[alias.asname or alias.name] = sub
                else:
                    found.append(Use(node.lineno, _short(source), alias.name, top))
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                and node.value.id in aliases):
            found.append(Use(node.lineno, aliases[node.value.id], node.attr, "sparkcache"))
    return found


def _private(member: str) -> bool:
    return member.startswith("_") and not (member.startswith("__") and member.endswith("__"))


def test_imports_follow_the_documented_layers() -> None:
    order = layer_order(DOC.read_text())
    modules = package_modules()
    assert sorted(set(modules) - set(order)) == [], (
        "modules missing from the layers block of docs/architecture.md")
    assert sorted(set(order) - set(modules)) == [], (
        "docs/architecture.md lists modules that do not exist")
    upward: list[str] = []
    private: list[str] = []
    heavy: list[str] = []
    for name, path in modules.items():
        for use in uses(name, path, set(modules)):
            where = f"sparkcache/{path.relative_to(PACKAGE)}:{use.line}"
            if use.top in HEAVY and not name.startswith(HEAVY[use.top]):
                heavy.append(f"{where} imports {use.top}")
            if not use.target or use.target == name:
                continue
            if _private(use.member):
                private.append(f"{where} uses {use.target}.{use.member}")
            if order[use.target] >= order[name]:
                upward.append(f"{where} ({name}, layer {order[name]}) imports "
                              f"{use.target} (layer {order[use.target]})")
    assert upward == [], "\n".join(upward)
    assert private == [], "\n".join(private)
    assert heavy == [], "\n".join(heavy)


def test_the_cli_is_a_thin_layer_over_admin() -> None:
    """The ``cli`` package's modules import only admin, errors, each other and
    the server's launcher (``sparkcache serve`` execs vLLM; it imports nothing heavy)."""
    modules = package_modules()
    cli = {name for name in modules if name == "cli" or name.startswith("cli.")}
    assert {"cli", "cli.output", "cli.commands", "cli.maintenance"} <= cli, cli
    for name in sorted(cli):
        used = {u.target for u in uses(name, modules[name], set(modules)) if u.target}
        assert used - {name} <= {"admin", "errors", "serve.launch"} | cli, (name, used)


#: Parts of the package that never import each other, either way: the vLLM
#: connector runs inside vLLM's processes; the admin API, the CLI and
#: export/import run beside it, on the same store.
INDEPENDENT = (("connector", ("admin", "cli", "transfer")),)


def _within(module: str, part: str) -> bool:
    return module == part or module.startswith(part + ".")


def test_independent_parts_never_import_each_other() -> None:
    modules = package_modules()
    crossing = []
    for left, rights in INDEPENDENT:
        for name, path in modules.items():
            for use in uses(name, path, set(modules)):
                for right in rights:
                    a, b = (left, right) if _within(name, left) else (right, left)
                    if _within(name, a) and use.target and _within(use.target, b):
                        crossing.append(f"{name}:{use.line} imports {use.target}")
    assert crossing == [], "\n".join(crossing)


def foreign_private_members_of(path: Path) -> list[str]:
    """``obj._name`` where ``obj`` is not ``self`` or ``cls``: another object's
    private member (a helper calling back into a facade's internals)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and _private(node.attr)
                and node.attr not in THIRD_PARTY_PRIVATE
                and not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"))):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_no_module_reaches_into_another_objects_private_members() -> None:
    found = [hit for path in package_modules().values()
             for hit in foreign_private_members_of(path)]
    assert found == [], "\n".join(found)


#: The modules that hold a store's core: the facade (store.py and its two halves)
#: opens it, core.py defines it.
CORE_HOLDERS = ("store.py", "upkeep.py", "storelog.py", "core.py")
#: ``<name>.core`` read elsewhere: an object's own core (``self.core``: the sweeper and
#: the uploader keep the Core they are given) and fsspec's module ``fsspec.core``.
CORE_READERS = ("self", "fsspec")


def core_reads_of(path: Path) -> list[str]:
    """``x.core`` (or ``x._core``) where ``x`` is not one of :data:`CORE_READERS`:
    a module reaching through the facade for the core it wraps."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Attribute) and node.attr in ("core", "_core")
                and not (isinstance(node.value, ast.Name) and node.value.id in CORE_READERS)):
            found.append(f"{path.name}:{node.lineno} {ast.unparse(node)}")
    return found


def test_only_the_store_holds_its_core() -> None:
    """Nothing above the store takes ``SnapshotStore``'s core: it calls the facade
    (or ``store.catalog``), and the helpers below it are handed the Core."""
    found = [hit for path in package_modules().values()
             if path.relative_to(PACKAGE).as_posix() not in CORE_HOLDERS
             for hit in core_reads_of(path)]
    assert found == [], "\n".join(found)


# -- the checker itself catches what it must ---------------------------------------------


@pytest.fixture
def fake(tmp_path: Path) -> Path:
    (tmp_path / "mod.py").write_text(
        "from sparkcache import store\n"
        "from sparkcache.core import _hidden\n"
        "def late():\n"
        "    from sparkcache.admin import open_store\n"
        "    return store._helper, open_store\n"
    )
    return tmp_path / "mod.py"


def test_the_checker_sees_function_level_and_private_uses(fake: Path) -> None:
    found = uses("reader", fake, {"store", "core", "admin", "reader"})
    assert {(u.target, u.member) for u in found} == {
        ("store", ""), ("core", "_hidden"), ("admin", "open_store"), ("store", "_helper")}
    fake.write_text("def f(store):\n    with store._read():\n        return self._ok\n")
    assert [hit.split()[-1] for hit in foreign_private_members_of(fake)] == ["store._read"]
    fake.write_text("import fsspec.core\ndef f(store, x):\n"
                    "    return store.core.db, self.core, fsspec.core, x.y.core\n")
    assert sorted(hit.split()[-1] for hit in core_reads_of(fake)) == ["store.core", "x.y.core"]


def test_the_layers_block_is_parsed_in_order() -> None:
    order = layer_order("x\n```layers\na  b\nc\n```\n")
    assert order == {"a": 0, "b": 0, "c": 1}
    with pytest.raises(AssertionError):
        layer_order("no block")
