"""The one type for the progress lines a long operation reports, and its silent default.

Every stage that takes ``progress=`` takes a :data:`Progress`: the CLI passes a printer to
stderr, a flow passes Prefect's run logger, a test passes ``list.append``. :func:`quiet` is
the default where nobody listens. Ground floor: imports nothing from the project.
"""

from __future__ import annotations

from collections.abc import Callable

Progress = Callable[[str], None]
"""Called with one human-readable line (no trailing newline) per step of an operation."""


def quiet(_: str) -> None:
    """The default progress sink: say nothing."""
