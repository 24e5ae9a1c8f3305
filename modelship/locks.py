"""One release at a time per model: a lock held across every trigger, with a lease.

With a Prefect server configured, the lock is a Prefect global concurrency limit named
``modelship-release-<model>`` (limit 1), taken with ``strict=True`` (without it a missing
limit is silently skipped) and a lease, so a crashed run frees the model when its lease
expires. Without Prefect it falls back to an advisory file lock under ``$MODELSHIP_HOME``,
which only protects one machine.
"""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from modelship.errors import InfrastructureError, ReleaseLocked

LEASE_S = 300.0


def lock_name(model: str) -> str:
    return f"modelship-release-{model}"


@contextmanager
def release_lock(model: str, *, prefect_api_url: str | None, home: Path,
                 wait_s: float = 2.0, lease_s: float = LEASE_S) -> Iterator[None]:
    """Hold the model's release lock for the body; ReleaseLocked if another run holds it."""
    if prefect_api_url:
        with _prefect_lock(model, prefect_api_url, wait_s=wait_s, lease_s=lease_s):
            yield
    else:
        with _file_lock(model, home):
            yield


def _locked(model: str) -> ReleaseLocked:
    return ReleaseLocked(
        f"another release or swap of {model} is running",
        hint="wait for it to finish (see `modelship status` and the Prefect UI); a crashed "
        f"run frees the lock when its lease ends (at most {LEASE_S:.0f} s)",
        model=model,
    )


@contextmanager
def _prefect_lock(model: str, api_url: str, *, wait_s: float, lease_s: float) -> Iterator[None]:
    from prefect.client.orchestration import get_client
    from prefect.concurrency.sync import concurrency
    from prefect.settings import PREFECT_API_URL, temporary_settings

    name = lock_name(model)
    with temporary_settings({PREFECT_API_URL: api_url}):
        try:
            with get_client(sync_client=True) as client:
                client.upsert_global_concurrency_limit_by_name(name, 1)
        except Exception as exc:
            raise InfrastructureError(
                f"cannot create the release lock {name} on Prefect at {api_url}: {exc}",
                hint="check the Prefect server (`modelship doctor`)",
            ) from exc
        acquired = False
        try:
            with concurrency(name, occupy=1, timeout_seconds=wait_s, strict=True,
                             lease_duration=lease_s):
                acquired = True
                yield
        except TimeoutError as exc:
            if acquired:
                raise
            raise _locked(model) from exc


@contextmanager
def _file_lock(model: str, home: Path) -> Iterator[None]:
    folder = home / "locks"
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / f"{model}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise _locked(model) from exc
        yield
    finally:
        os.close(fd)
