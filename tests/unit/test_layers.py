"""The layer contracts in pyproject.toml cover every module (`make lint` runs lint-imports).

import-linter only checks the modules a contract names, so a new module under modelship/
that no layer lists would escape the check. These tests fail until it is placed.
"""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIG = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]


def _contract(contract_id: str) -> dict:
    return next(c for c in CONFIG["contracts"] if c["id"] == contract_id)


def _layer_modules(*, optional: bool = True) -> set[str]:
    """The modules the layers contract names; ``(name)`` marks one that may be absent."""
    names = set()
    for layer in _contract("layers")["layers"]:
        for part in layer.replace("|", ":").split(":"):
            part = part.strip()
            if optional or not part.startswith("("):
                names.add(part.strip("()"))
    return names


def _modelship_modules() -> set[str]:
    """Every module and package directly under modelship/."""
    found = set()
    for path in (ROOT / "modelship").iterdir():
        if path.suffix == ".py" and path.stem != "__init__":
            found.add(f"modelship.{path.stem}")
        elif path.is_dir() and (path / "__init__.py").exists():
            found.add(f"modelship.{path.name}")
    return found


def test_every_package_and_modelship_module_sits_in_a_layer() -> None:
    expected = _modelship_modules() | {"flows", "tasks", "model_registry"}
    missing = sorted(expected - _layer_modules())
    assert not missing, (f"{missing} are in no layer of [tool.importlinter] in pyproject.toml: "
                         "add each to the layer it belongs to (ports or kernel, usually)")


def test_the_layers_name_no_module_that_is_gone() -> None:
    expected = _modelship_modules() | {"flows", "tasks", "model_registry"}
    stale = sorted(_layer_modules(optional=False) - expected)
    assert not stale, f"{stale} are named by a layer but do not exist"
