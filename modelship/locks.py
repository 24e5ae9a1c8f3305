"""One release at a time per model: a lock held across every trigger, with a short lease.

With a Prefect server configured, the lock is a Prefect global concurrency limit named
``modelship-release-<model>`` (limit 1). A slot is taken with a **lease** of
:data:`LEASE_S` (Prefect's minimum, 60 s) that a heartbeat thread renews every
:data:`HEARTBEAT_S` while the release runs, so a SIGKILLed process frees the model within
about a minute (Prefect's repossessor revokes expired leases) instead of wedging it.

Who holds the lock is kept next to it, in a Prefect variable ``modelship-lock-<model>``:
release id, kind, host, pid (and its start time), since, last heartbeat and the lease id.
``modelship locks`` reads it; ``modelship unlock MODEL --release ID`` revokes the lease of a
holder that is gone (same host: its pid is dead; another host: no heartbeat for a whole
lease) and refuses while the holder lives.

Without Prefect it falls back to an advisory file lock under ``$MODELSHIP_HOME/locks``
(one machine only), with the same holder document in a file beside it.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from modelship.errors import InfrastructureError, ReleaseLocked, UsageError
from modelship.procinfo import process_start_ticks

LEASE_S = 60.0
HEARTBEAT_S = 15.0
LIMIT_PREFIX = "modelship-release-"
HOLDER_PREFIX = "modelship-lock-"


def lock_name(model: str) -> str:
    return f"{LIMIT_PREFIX}{model}"


def _holder_variable(model: str) -> str:
    """Prefect variable names allow letters, digits, dashes and underscores only."""
    safe = re.sub(r"[^A-Za-z0-9_-]", "_", model).lower()
    return f"{HOLDER_PREFIX}{safe}"


def _now() -> float:
    return time.time()


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class LockHolder:
    """Who holds a model's release lock.

    Attributes:
        since: When the lock was taken (epoch seconds).
        heartbeat: The holder's last heartbeat (epoch seconds).
        pid_start: The holder process's start time in clock ticks (Linux), to tell a
            recycled pid from the holder.
        lease_id: The Prefect lease, None for the file lock.
    """

    model: str
    release_id: str
    kind: str
    host: str
    pid: int
    pid_start: int | None
    since: float
    heartbeat: float
    lease_id: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "since_iso": _iso(self.since),
                "heartbeat_iso": _iso(self.heartbeat)}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> LockHolder:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})

    def describe(self) -> str:
        return (f"{self.kind} {self.release_id} (pid {self.pid} on {self.host}, since "
                f"{_iso(self.since)}, last heartbeat {_iso(self.heartbeat)})")


def holder_alive(holder: LockHolder, *, host: str, now: float, lease_s: float = LEASE_S,
                 start_ticks: int | None = None) -> bool:
    """Whether the holder may still run (pure, given what the caller observed).

    On the holder's own host the pid decides: ``start_ticks`` is what /proc says of that
    pid now (None: no such process). Elsewhere only the heartbeat can tell: a holder silent
    for a whole lease is gone (its lease has expired too).
    """
    if holder.host == host:
        if start_ticks is None:
            return False
        return holder.pid_start is None or holder.pid_start == start_ticks
    return now - holder.heartbeat < lease_s


def _locked(model: str, holder: LockHolder | None) -> ReleaseLocked:
    who = f"held by {holder.describe()}" if holder else "held by another run"
    return ReleaseLocked(
        f"another release of {model} is running: the lock is {who}",
        hint=f"wait for it to finish (`modelship locks {model}` shows the holder); if that "
        f"process is gone, `modelship unlock {model} --release "
        f"{holder.release_id if holder else 'ID'}` frees it at once, else its lease ends "
        f"within {LEASE_S:.0f} s",
        model=model, holder=holder.to_dict() if holder else None,
    )


# --------------------------------------------------------------------------------------
# the store of holders and slots


class _PrefectLocks:
    """The Prefect side: the limit, the lease and the holder variable."""

    def __init__(self, api_url: str) -> None:
        self.api_url = api_url

    @contextmanager
    def _client(self) -> Iterator[Any]:
        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        try:
            with temporary_settings({PREFECT_API_URL: self.api_url}), \
                    get_client(sync_client=True) as client:
                yield client
        except (ReleaseLocked, UsageError):
            raise
        except Exception as exc:
            raise InfrastructureError(
                f"the release lock on Prefect at {self.api_url} failed: "
                f"{type(exc).__name__}: {exc}",
                hint="check the Prefect server (`modelship doctor`)", transient=True,
            ) from exc

    def acquire(self, model: str) -> str | None:
        """Take the slot with a lease; the lease id, or None when it is taken."""
        import httpx

        with self._client() as client:
            client.upsert_global_concurrency_limit_by_name(lock_name(model), 1)
            try:
                response = client.increment_concurrency_slots_with_lease(
                    names=[lock_name(model)], slots=1, mode="concurrency",
                    lease_duration=LEASE_S)
            except httpx.HTTPStatusError as exc:
                if exc.response.status_code == 423:
                    return None
                raise
            return str(response.json()["lease_id"])

    def renew(self, lease_id: str) -> None:
        from uuid import UUID

        with self._client() as client:
            client.renew_concurrency_lease(UUID(lease_id), lease_duration=LEASE_S)

    def release(self, lease_id: str) -> None:
        from uuid import UUID

        with self._client() as client:
            client.release_concurrency_slots_with_lease(UUID(lease_id))

    def active(self, model: str) -> int:
        with self._client() as client:
            try:
                limit = client.read_global_concurrency_limit_by_name(lock_name(model))
            except Exception:  # noqa: BLE001 - no limit yet means nothing holds it
                return 0
            return len(limit.active_slots) if isinstance(limit.active_slots, list) \
                else int(limit.active_slots or 0)

    def models(self) -> list[str]:
        with self._client() as client:
            limits = client.read_global_concurrency_limits(limit=200)
        return sorted(lim.name[len(LIMIT_PREFIX):] for lim in limits
                      if lim.name.startswith(LIMIT_PREFIX))

    def read_holder(self, model: str) -> LockHolder | None:
        with self._client() as client:
            variable = client.read_variable_by_name(_holder_variable(model))
        if variable is None or not isinstance(variable.value, dict):
            return None
        return LockHolder.from_dict(variable.value)

    def write_holder(self, holder: LockHolder) -> None:
        from prefect.client.schemas.actions import VariableCreate, VariableUpdate

        name = _holder_variable(holder.model)
        with self._client() as client:
            if client.read_variable_by_name(name) is None:
                client.create_variable(VariableCreate(name=name, value=asdict(holder)))
            else:
                client.update_variable(VariableUpdate(name=name, value=asdict(holder)))

    def clear_holder(self, model: str, release_id: str) -> None:
        current = self.read_holder(model)
        if current is not None and current.release_id == release_id:
            with self._client() as client:
                client.delete_variable_by_name(_holder_variable(model))


# --------------------------------------------------------------------------------------
# the lock


class ReleaseLock:
    """The model's release lock, held by one release from its canary to its end.

    Use :func:`release_lock`. ``lost`` turns true when a heartbeat could not renew the
    lease (the server was unreachable for a whole lease, or someone broke the lock);
    :meth:`check` then raises, so a release never swaps without holding its lock.
    """

    def __init__(self, holder: LockHolder, store: _PrefectLocks | None) -> None:
        self.holder = holder
        self.store = store
        self.lost: str | None = None
        #: The dead holder (same host, process gone) whose lock this one took over.
        self.took_over: LockHolder | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        if self.lost:
            raise ReleaseLocked(
                f"the release lock of {self.holder.model} was lost: {self.lost}",
                hint="nothing more was changed; check `modelship locks` and `modelship "
                "status`, then run the release again", model=self.holder.model)

    def _beat(self) -> None:
        assert self.store is not None and self.holder.lease_id is not None
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.store.renew(self.holder.lease_id)
                self.holder = replace(self.holder, heartbeat=_now())
                self.store.write_holder(self.holder)
            except Exception as exc:  # noqa: BLE001 - recorded; check() raises on it
                if _now() - self.holder.heartbeat >= LEASE_S:
                    self.lost = f"no heartbeat reached Prefect for {LEASE_S:.0f} s ({exc})"

    def start(self) -> None:
        if self.store is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True,
                                            name=f"lock-heartbeat-{self.holder.model}")
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)


@contextmanager
def release_lock(model: str, *, prefect_api_url: str | None, home: Path,
                 release_id: str = "-", kind: str = "release") -> Iterator[ReleaseLock]:
    """Hold the model's release lock for the body; ReleaseLocked (exit 1, naming the
    holder and since when) if another run holds it.

    A holder that ran on this host and whose process is gone (a SIGKILLed CLI) is taken
    over at once rather than after its lease (``lock.took_over`` says whom); a holder on
    another host is only ever freed by its lease or by ``modelship unlock``.
    """
    now = _now()
    holder = LockHolder(model=model, release_id=release_id, kind=kind,
                        host=socket.gethostname(), pid=os.getpid(),
                        pid_start=process_start_ticks(os.getpid()), since=now, heartbeat=now)
    if not prefect_api_url:
        with _file_lock(model, home, holder) as lock:
            yield lock
        return
    store = _PrefectLocks(prefect_api_url)
    lease_id = store.acquire(model)
    took_over = None
    if lease_id is None:
        stale = store.read_holder(model)
        if stale is None or stale.host != holder.host or _alive(stale):
            raise _locked(model, stale)
        # The holder ran on this host and its process is gone (pid and start time say so):
        # its lease would only keep a dead run's slot for up to LEASE_S more. Free it now.
        _free(store, stale)
        lease_id = store.acquire(model)
        if lease_id is None:  # another run took the freed slot first
            raise _locked(model, store.read_holder(model))
        took_over = stale
    lock = ReleaseLock(replace(holder, lease_id=lease_id), store)
    lock.took_over = took_over
    try:
        store.write_holder(lock.holder)
        lock.start()
        yield lock
    finally:
        lock.stop()
        try:
            store.release(lease_id)
        except InfrastructureError:
            pass  # the lease expires on its own within LEASE_S
        try:
            store.clear_holder(model, release_id)
        except InfrastructureError:
            pass


@contextmanager
def _file_lock(model: str, home: Path, holder: LockHolder) -> Iterator[ReleaseLock]:
    folder = home / "locks"
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    fd = os.open(folder / f"{model}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    info = folder / f"{model}.holder.json"
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as exc:
            raise _locked(model, _read_file_holder(info)) from exc
        info.write_text(json.dumps(asdict(holder)))
        try:
            yield ReleaseLock(holder, None)
        finally:
            info.unlink(missing_ok=True)
    finally:
        os.close(fd)


def _read_file_holder(path: Path) -> LockHolder | None:
    try:
        return LockHolder.from_dict(json.loads(path.read_text()))
    except (OSError, ValueError, TypeError):
        return None


# --------------------------------------------------------------------------------------
# inspecting and breaking


def _alive(holder: LockHolder) -> bool:
    host = socket.gethostname()
    ticks = process_start_ticks(holder.pid) if holder.host == host else None
    return holder_alive(holder, host=host, now=_now(), start_ticks=ticks)


def list_locks(*, prefect_api_url: str | None, home: Path,
               model: str | None = None) -> list[dict[str, Any]]:
    """Every held release lock (or ``model``'s): the holder and whether it still lives."""
    rows: list[dict[str, Any]] = []
    if not prefect_api_url:
        folder = home / "locks"
        paths = [folder / f"{model}.holder.json"] if model else sorted(
            folder.glob("*.holder.json")) if folder.exists() else []
        for path in paths:
            holder = _read_file_holder(path)
            if holder is not None:
                rows.append({"model": holder.model, "held": True, "holder": holder.to_dict(),
                             "holder_alive": _alive(holder)})
        return rows
    store = _PrefectLocks(prefect_api_url)
    for name in [model] if model else store.models():
        active = store.active(name)
        holder = store.read_holder(name)
        if not active and holder is None:
            continue
        rows.append({"model": name, "held": bool(active),
                     "holder": holder.to_dict() if holder else None,
                     "holder_alive": _alive(holder) if holder else None})
    return rows


def break_lock(model: str, release_id: str, *, prefect_api_url: str | None,
               home: Path) -> LockHolder:
    """Free the lock of a holder that is gone; refuse while it lives.

    Raises:
        UsageError: No lock of ``model`` is held by ``release_id`` (exit 2).
        ReleaseLocked: The holder is alive (exit 1): stopping a running release through
            its lock would let a second release run next to it.
    """
    if not prefect_api_url:
        holder = _read_file_holder(home / "locks" / f"{model}.holder.json")
    else:
        holder = _PrefectLocks(prefect_api_url).read_holder(model)
    if holder is None or holder.release_id != release_id:
        held = f"it is held by {holder.release_id}" if holder else "nothing holds it"
        raise UsageError(f"the lock of {model} is not held by release {release_id}: {held}",
                         hint=f"see `modelship locks {model}`", model=model)
    if _alive(holder):
        raise ReleaseLocked(
            f"refusing to break the lock of {model}: its holder is alive "
            f"({holder.describe()})",
            hint="wait for the release to finish, or stop that process first",
            model=model, holder=holder.to_dict())
    if prefect_api_url:
        _free(_PrefectLocks(prefect_api_url), holder)
    else:
        (home / "locks" / f"{model}.holder.json").unlink(missing_ok=True)
    return holder


def _free(store: _PrefectLocks, holder: LockHolder) -> None:
    """Release a gone holder's lease and forget it as the holder."""
    if holder.lease_id:
        try:
            store.release(holder.lease_id)
        except InfrastructureError:
            pass  # the lease had already expired: the slot is free
    store.clear_holder(holder.model, holder.release_id)

