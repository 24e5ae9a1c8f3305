"""A migrated Prefect database that a new stack starts from, instead of migrating its own.

A Prefect server on an empty database first runs every migration of its schema: ~10 s of
CPU, half of its first start (``bench/stack_up``: 20 CPU-s on a new home, 10 on a kept
one). The schema only changes with Prefect's version, so the first stack that needs it
builds a migrated, empty database once (``prefect server database upgrade -y``, into a
file of its own, never a running server's) and keeps it in a cache directory, keyed by
Prefect's version; every new home then starts from a copy. A home that already has its
database keeps it. The cache is an optimisation only: when it cannot be built or read, the
server migrates its own database, as before.
"""

from __future__ import annotations

import fcntl
import importlib.metadata
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path

from modelship.progress import Progress, quiet

#: Where the migrated databases are kept (default: ``$XDG_CACHE_HOME/modelship``, else
#: ``~/.cache/modelship``).
CACHE_ENV = "MODELSHIP_CACHE_DIR"
#: The longest a template build may take; past it the server migrates its own database.
BUILD_TIMEOUT_S = 600.0


def cache_dir(env: Mapping[str, str]) -> Path:
    """The cache directory named by ``env`` (pure)."""
    if env.get(CACHE_ENV):
        return Path(env[CACHE_ENV])
    base = env.get("XDG_CACHE_HOME") or str(Path(env.get("HOME") or Path.home()) / ".cache")
    return Path(base) / "modelship"


def template_path(directory: Path, prefect_version: str) -> Path:
    """The migrated database for one Prefect version (pure)."""
    return directory / f"prefect-{prefect_version}.db"


def seed(db_path: Path, *, venv_bin: Path, env: Mapping[str, str],
         progress: Progress = quiet) -> str:
    """Give a new home its Prefect database from the template (built first if missing).

    Returns what happened: ``kept`` (the home has its database), ``copied``, ``built``
    (then copied), or ``unseeded`` (no template: the server migrates its own).
    """
    if db_path.exists():
        return "kept"
    try:
        template = template_path(cache_dir(env), importlib.metadata.version("prefect"))
        built = False
        if not template.is_file():
            built = _build_once(template, venv_bin=venv_bin, env=env, progress=progress)
        _copy_private(template, db_path)
    except (OSError, subprocess.SubprocessError, importlib.metadata.PackageNotFoundError) \
            as exc:
        progress(f"no migrated Prefect database to start from ({exc}); Prefect migrates "
                 "its own")
        return "unseeded"
    return "built" if built else "copied"


def _build_once(template: Path, *, venv_bin: Path, env: Mapping[str, str],
                progress: Progress) -> bool:
    """Build ``template`` unless another process did while this one waited for the lock
    (two stacks starting at once build it once). True when this process built it."""
    template.parent.mkdir(parents=True, exist_ok=True)
    with open(template.parent / ".prefect-db.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if template.is_file():
            return False
        progress(f"migrating a Prefect database once, to start new stacks from ({template})")
        with tempfile.TemporaryDirectory(prefix=".prefect-db-", dir=template.parent) as tmp:
            db = Path(tmp) / "prefect.db"
            subprocess.run(
                [str(venv_bin / "prefect"), "server", "database", "upgrade", "-y"],
                env=_build_env(env, prefect_home=Path(tmp) / "home", db_path=db),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                timeout=BUILD_TIMEOUT_S, check=True)
            if not db.is_file():
                raise OSError(f"`prefect server database upgrade` wrote no {db.name}")
            os.replace(db, template)
        return True


def _build_env(env: Mapping[str, str], *, prefect_home: Path, db_path: Path
               ) -> dict[str, str]:
    """The environment of the build: its own database and home, no API, no telemetry."""
    kept = {k: v for k, v in env.items() if not k.startswith("PREFECT_")}
    return {**kept, "PREFECT_HOME": str(prefect_home),
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": f"sqlite+aiosqlite:///{db_path}",
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "true"}


def _copy_private(source: Path, target: Path) -> None:
    """Copy ``source`` to ``target`` (0600) atomically: a half copy never looks like a
    database."""
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.partial")
    shutil.copyfile(source, partial)
    partial.chmod(0o600)
    os.replace(partial, target)
