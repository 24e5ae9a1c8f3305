"""The session's embedded stack: real servers on free loopback ports, started once.

Loaded as a pytest plugin by tests/conftest.py so integration and e2e tests share it.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from modelship.settings import Settings
from modelship.stack import manager
from tests.conftest import base_settings, stack_settings_at


@pytest.fixture(scope="session")
def stack_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Bring the whole stack up once (2 replicas + canary) and always bring it down."""
    home = tmp_path_factory.mktemp("stack") / ".modelship"
    settings = base_settings(home)
    try:
        manager.up(settings, replicas=2)
        yield home
    finally:
        manager.down(settings)


@pytest.fixture(scope="session")
def stack_settings(stack_home: Path) -> Settings:
    """Settings as every command sees them: filled in from the stack's stack.json."""
    return stack_settings_at(stack_home)
