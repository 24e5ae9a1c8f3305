"""Function-level imports only where import cost demands it, each with a one-line reason.

A group of consecutive import statements inside a function body needs a ``#`` comment on
the line before it or on one of its lines (``# lazy: boto3 costs ~0.4 s ...``). Anything
else belongs in the module's top-level imports (issue 19 item 8).
"""

from __future__ import annotations

import ast
import io
import tokenize
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("modelship", "tasks", "flows", "model_registry", "bench")


FUNCTIONS = (ast.FunctionDef, ast.AsyncFunctionDef)


def _import_groups(tree: ast.Module) -> Iterator[tuple[int, int]]:
    """(first line, last line) of each run of imports in a statement list inside a function
    (its body, or any block or class nested in it), in one pass over the tree."""
    stack: list[tuple[ast.AST, bool]] = [(tree, False)]
    while stack:
        node, inside = stack.pop()
        inside = inside or isinstance(node, FUNCTIONS)
        for _, value in ast.iter_fields(node):
            if isinstance(value, ast.AST):
                stack.append((value, inside))
                continue
            if not isinstance(value, list):
                continue
            stack.extend((child, inside) for child in value if isinstance(child, ast.AST))
            if not (inside and value and isinstance(value[0], ast.stmt)):
                continue
            i = 0
            while i < len(value):
                if not isinstance(value[i], ast.Import | ast.ImportFrom):
                    i += 1
                    continue
                j = i
                while j + 1 < len(value) and isinstance(value[j + 1], ast.Import | ast.ImportFrom):
                    j += 1
                yield value[i].lineno, value[j].end_lineno or value[j].lineno
                i = j + 1


def unexplained(source: str) -> list[int]:
    """The first line of each function-level import group without a reason comment (the
    source is tokenized only when it has such a group)."""
    groups = list(_import_groups(ast.parse(source)))
    if not groups:
        return []
    comments = {tok.start[0] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
                if tok.type == tokenize.COMMENT}
    return sorted(first for first, last in groups
                  if not comments & set(range(first - 1, last + 1)))


@pytest.mark.parametrize(("source", "expected"), [
    ("def f():\n    import json\n", [2]),
    ("def f():\n    # lazy: why\n    import json\n", []),
    ("def f():\n    import json  # lazy: why\n", []),
    ("def f():\n    from a import (\n        b,  # lazy: why\n    )\n", []),
    ("def f():\n    # lazy: why\n\n    import json\n", [4]),  # the reason is not adjacent
    ("def f():\n    # lazy: why\n    import a\n    import b\n    x = 1\n    import c\n", [6]),
    ("def f():\n    '''# in a string is no comment'''\n    import json\n", [3]),
    ("def f():\n    if x:\n        import a\n    else:\n        import b\n", [3, 5]),
    ("class C:\n    def m(self):\n        def g():\n            import a\n", [4]),
    ("async def f():\n    try:\n        import a\n    except ImportError:\n        pass\n", [3]),
    ("import json\nif TYPE_CHECKING:\n    import a\n", []),  # module level: not lazy
])
def test_the_scan(source: str, expected: list[int]) -> None:
    assert unexplained(source) == expected


def test_every_function_level_import_says_why() -> None:
    offenders = []
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            source = path.read_text()
            lines = source.splitlines()
            offenders += [f"{path.relative_to(ROOT)}:{n}: {lines[n - 1].strip()}"
                          for n in unexplained(source)]
    assert not offenders, (
        "function-level imports without a reason: move each to the module's top-level "
        "imports, or keep it and say why on the line before (e.g. `# lazy: boto3 costs "
        "~0.4 s; only S3 calls need it`):\n" + "\n".join(offenders))
