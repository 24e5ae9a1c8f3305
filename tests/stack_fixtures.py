"""The session's embedded stack: real servers on free loopback ports, started once.

Loaded as a pytest plugin by tests/conftest.py so integration and e2e tests share it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelship.clients import Clients, build_clients
from modelship.settings import Settings
from modelship.stack import manager
from tests.conftest import base_settings, stack_settings_at

#: The home of a stack that is already up (2 replicas + canary) for this session to use
#: instead of starting its own; whoever started it stops it. ``make test`` brings the canary
#: file's stack up this way while lint runs (see Makefile). With ``_<worker>`` appended
#: (``MODELSHIP_TEST_STACK_HOME_gw0``): for that pytest-xdist worker only; ``make test``
#: hands the canary file's stack on to the first worker once that file is done, so one
#: stack start (~24 s of CPU) fewer.
EXTERNAL_STACK = "MODELSHIP_TEST_STACK_HOME"


def external_stack() -> str | None:
    """The home of the running stack this process is given, if any (:data:`EXTERNAL_STACK`)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    return (os.environ.get(EXTERNAL_STACK)
            or (os.environ.get(f"{EXTERNAL_STACK}_{worker}") if worker else None))


@pytest.fixture(scope="session")
def stack_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Bring the whole stack up once (2 replicas + canary) and always bring it down; or use
    the running one that :data:`EXTERNAL_STACK` names."""
    external = external_stack()
    if external:
        yield Path(external)
        return
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


@pytest.fixture(scope="module")
def clients(stack_settings: Settings) -> Iterator[Clients]:
    """One client per external system of the session stack, built once per test module."""
    built = build_clients(stack_settings)
    yield built
    built.close()
