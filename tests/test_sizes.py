"""Every module and function stays small enough to read in one sitting.

A module of sparkcache/ or migrations/ has at most 600 lines and a function at
most 60 (its decorators and docstring included), unless docs/architecture.md
lists it, with a reason, in its "Size exceptions" table.  A listed exception
that no longer exceeds the limit fails too, so the table cannot rot.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "architecture.md"
SOURCES = ("sparkcache", "migrations")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 60


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int]]:
    """(qualified name, lines from its first decorator to its end) of every function."""
    found: list[tuple[str, int]] = []
    for node in ast.iter_child_nodes(tree):
        name = f"{prefix}{getattr(node, 'name', '')}"
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
            assert node.end_lineno is not None
            found.append((name, node.end_lineno - first + 1))
            found += _functions(node, f"{name}.")
        elif isinstance(node, ast.ClassDef):
            found += _functions(node, f"{name}.")
        else:
            found += _functions(node, prefix)
    return found


def sizes(root: Path, sources: tuple[str, ...] = SOURCES) -> dict[str, int]:
    """``path`` -> lines of each module, ``path:function`` -> lines of each function
    over the limits (paths relative to ``root``)."""
    over: dict[str, int] = {}
    for source in sources:
        for path in sorted((root / source).rglob("*.py")):
            text = path.read_text()
            where = path.relative_to(root).as_posix()
            lines = len(text.splitlines())
            if lines > MAX_MODULE_LINES:
                over[where] = lines
            for name, size in _functions(ast.parse(text, where)):
                if size > MAX_FUNCTION_LINES:
                    over[f"{where}:{name}"] = size
    return over


def exceptions(text: str) -> dict[str, str]:
    """The "Size exceptions" table of docs/architecture.md: where -> reason."""
    section = re.search(r"^## Size exceptions\n(.*?)(?=^## |\Z)", text, re.DOTALL | re.MULTILINE)
    assert section is not None, "docs/architecture.md has no '## Size exceptions' section"
    table: dict[str, str] = {}
    for line in section.group(1).splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 2 or not cells[0].startswith("`"):
            continue  # prose, the header row and its rule
        where, reason = cells[0].strip("`"), cells[1]
        assert reason, f"the size exception {where} gives no reason"
        assert where not in table, f"the size exception {where} is listed twice"
        table[where] = reason
    return table


def problems(over: dict[str, int], allowed: dict[str, str]) -> list[str]:
    """What breaks the rule: sizes over the limits not listed, listed ones within them."""
    def limit(where: str) -> int:
        return MAX_FUNCTION_LINES if ":" in where else MAX_MODULE_LINES

    found = [f"{where} has {lines} lines (limit {limit(where)}): split it along a real seam, "
             "or list it with its reason under 'Size exceptions' in docs/architecture.md"
             for where, lines in sorted(over.items()) if where not in allowed]
    found += [f"{where} is listed under 'Size exceptions' in docs/architecture.md but is "
              "within the limits (or gone): remove it from the table"
              for where in sorted(allowed) if where not in over]
    return found


def test_modules_and_functions_are_within_the_limits() -> None:
    found = problems(sizes(ROOT), exceptions(DOC.read_text()))
    assert found == [], "\n".join(found)


# -- the checker itself catches what it must ---------------------------------------------


def _function(name: str, body_lines: int, decorators: int = 0) -> str:
    return ("".join("@staticmethod\n" for _ in range(decorators)) + f"def {name}():\n"
            + '    """Doc."""\n' + "    x = 1\n" * (body_lines - 2))


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    pkg = tmp_path / "sparkcache"
    pkg.mkdir()
    (pkg / "ok.py").write_text(_function("fits", 60))
    (pkg / "long.py").write_text(
        "class Store:\n" + "".join("    " + line + "\n" for line in
                                   _function("method", 59, decorators=2).splitlines())
        + _function("outer", 61) + "x = 1\n" * 600)
    return tmp_path


def test_the_checker_counts_decorators_docstrings_and_module_lines(tree: Path) -> None:
    assert sizes(tree) == {"sparkcache/long.py": 723, "sparkcache/long.py:Store.method": 61,
                           "sparkcache/long.py:outer": 61}


def test_the_checker_names_offenders_and_stale_exceptions(tree: Path) -> None:
    over = sizes(tree)
    allowed = {"sparkcache/long.py": "reason", "sparkcache/ok.py:fits": "reason"}
    found = problems(over, allowed)
    assert len(found) == 3, found
    assert found[0].startswith("sparkcache/long.py:Store.method has 61 lines (limit 60)")
    assert found[1].startswith("sparkcache/long.py:outer has 61 lines")
    assert found[2].startswith("sparkcache/ok.py:fits is listed")


def test_the_table_is_parsed_and_needs_reasons() -> None:
    doc = ("## Size exceptions\n\n| where | reason |\n|---|---|\n"
           "| `a.py:f` | frozen |\n| `b.py` | big |\n\n## Next\n| `c.py` | not here |\n")
    assert exceptions(doc) == {"a.py:f": "frozen", "b.py": "big"}
    with pytest.raises(AssertionError, match="no reason"):
        exceptions("## Size exceptions\n| `a.py` |  |\n")
    with pytest.raises(AssertionError, match="no '## Size exceptions'"):
        exceptions("## Other\n")
