"""No function over 80 lines outside the tests (issue 19 item 8): a longer one does several
jobs, and its pieces want names and table tests of their own."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.unit.test_lazy_imports import FUNCTIONS, PACKAGES, ROOT

MAX_LINES = 80


def long_functions(source: str, limit: int = MAX_LINES) -> list[tuple[str, int]]:
    """(name, lines) of every function or method in ``source`` longer than ``limit`` lines,
    its decorators and docstring included (pure)."""
    return [(node.name, length) for node in ast.walk(ast.parse(source))
            if isinstance(node, FUNCTIONS)
            and (length := (node.end_lineno or node.lineno)
                 - min([node.lineno, *(d.lineno for d in node.decorator_list)]) + 1) > limit]


def _body(lines: int) -> str:
    return "".join(f"    x{i} = {i}\n" for i in range(lines))


@pytest.mark.parametrize(("source", "expected"), [
    ("def f():\n" + _body(79), []),  # 80 lines: the limit itself
    ("def f():\n" + _body(80), [("f", 81)]),
    ("@d\ndef f():\n" + _body(79), [("f", 81)]),  # its decorator counts
    ("class C:\n    def m(self):\n" + _body(80).replace("    ", "        "), [("m", 81)]),
    ("async def g():\n" + _body(85), [("g", 86)]),
])
def test_the_count(source: str, expected: list[tuple[str, int]]) -> None:
    assert long_functions(source) == expected


def test_no_function_outside_the_tests_is_over_80_lines() -> None:
    offenders = [f"{path.relative_to(ROOT)}: {name} ({lines} lines)"
                 for package in PACKAGES
                 for path in sorted(Path(ROOT / package).rglob("*.py"))
                 for name, lines in long_functions(path.read_text())]
    assert not offenders, (
        f"functions over {MAX_LINES} lines: split each into pieces that do one job each "
        "(a pure plan and its executor, a renderer per block):\n" + "\n".join(offenders))
