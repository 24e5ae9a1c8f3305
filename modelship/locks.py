"""One release at a time per model, and one canary at a time on the canary Triton: leases
kept as small objects in the S3 bucket, written only with conditional puts.

Where a lock lives, and why
---------------------------
A lock is one JSON object, ``locks/release/<model>.json`` (``locks/canary/<slot>.json`` for
the canary slot), that holds its holder: release id, kind, host, pid and the pid's start
time, since, last heartbeat, and a fresh random token. It is only ever written with a
conditional ``PutObject``:

- a free lock (no object yet) is taken with ``If-None-Match: *``: of two writers, the
  second gets 412 Precondition Failed;
- every later write (a heartbeat, the release, taking over a dead holder's lock,
  ``modelship unlock``) is a compare-and-swap with ``If-Match: <the ETag read>``: it fails
  with 412 if anyone wrote the object since.

Released locks are not deleted: the object says ``released`` (with its last holder), so no
conditional delete is needed. Every body carries a new token, so two writes never share an
ETag (these servers' ETags are the body's MD5) and a stale compare-and-swap always fails.

The lock and its holder are one object, so they can never disagree, and the lock is as
durable as the bucket. Before this, the lock was a Prefect global concurrency limit whose
slot count lives in Prefect's database while its lease lives in the server's memory (the
default lease storage): a Prefect restart lost the lease and kept the slot, so the model
stayed locked for good, its holder unknown, and neither a takeover nor ``unlock`` could
free it (issue 18, defect 1). Reconciling that slot with a recorded holder would still
leave two stores that can disagree; a conditional put in one store cannot.

What was checked before choosing (the stack's S3 is SeaweedFS; production's is MinIO):

- **SeaweedFS 4.48** (``weed mini``, the stack's server), tried on a live server:
  ``If-None-Match: *`` and ``If-Match`` on ``PutObject`` (and ``If-Match`` on
  ``DeleteObject``) answer 412 as AWS does, ``If-Match`` on a missing key too; in 30 rounds
  of 16 concurrent writers, exactly one create and exactly one compare-and-swap won each
  round. ``tests/integration/test_locks.py`` keeps a smaller version of that race.
- **MinIO** honours ``If-Match`` and ``If-None-Match`` on ``PutObject``
  (``checkPreconditionsPUT`` in ``cmd/object-handlers-common.go``; ``*`` matches any ETag),
  evaluated while it holds the object's write lock.
- **AWS S3** has ``If-None-Match`` on ``PutObject`` since August 2024 and ``If-Match`` since
  November 2024.

Liveness and leases
-------------------
A heartbeat thread rewrites the object every :data:`HEARTBEAT_S`. Whether the holder still
lives is decided as before (:func:`holder_alive`): on its own host by its pid and the pid's
start time, elsewhere by a heartbeat younger than :data:`LEASE_S`. A dead holder's lock is
taken over at once by the next run (``took_over`` says whom); ``modelship unlock`` frees it
by hand and refuses while the holder lives. A document nobody can read (holder unknown)
counts as held until nothing has written it for a whole lease, by the S3 server's own clock.

A release whose lock cannot be written back as released (S3 down at the end) gives up after
:data:`RELEASE_BUDGET_S` and says so on stderr: the lock then names a process that is gone,
so the next run on this host takes it over at once, and elsewhere its lease runs out.

Without S3 (nothing configured) the release lock falls back to an advisory file lock under
``$MODELSHIP_HOME/locks`` (one machine only), with the same holder document beside it.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from datetime import UTC, datetime
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal
from urllib.parse import quote, unquote

from botocore.exceptions import ClientError

from modelship.errors import InfrastructureError, ReleaseLocked, UsageError
from modelship.procinfo import process_start_ticks

if TYPE_CHECKING:
    from modelship.storage import S3Storage

LEASE_S = 60.0
HEARTBEAT_S = 15.0
#: How long the end of a release may spend writing its lock back as released (seconds).
RELEASE_BUDGET_S = 10.0
#: How long a canary waits for the canary slot by default (seconds); a canary's own budget
#: is minutes, so this covers a few queued before it.
CANARY_SLOT_WAIT_S = 900.0
#: Seconds between two looks at a busy slot, and between two progress lines about it.
SLOT_POLL_S, SLOT_NOTICE_S = 1.0, 15.0
RELEASE_LOCKS, SLOT_LOCKS = "locks/release/", "locks/canary/"
CANARY_SLOT = "canary"

log = logging.getLogger(__name__)


def lock_key(model: str) -> str:
    """The S3 key of a model's release lock (the name quoted: MLflow names allow '/')."""
    return f"{RELEASE_LOCKS}{quote(model, safe='-_.')}.json"


def slot_key(slot: str) -> str:
    return f"{SLOT_LOCKS}{quote(slot, safe='-_.')}.json"


def _now() -> float:
    return time.time()


def _iso(epoch: float) -> str:
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds")


@dataclass(frozen=True)
class LockHolder:
    """Who holds a lock.

    Attributes:
        model: The model (for the canary slot: the model whose canary runs).
        since: When the lock was taken (epoch seconds).
        heartbeat: The holder's last heartbeat (epoch seconds).
        pid_start: The holder process's start time in clock ticks (Linux), to tell a
            recycled pid from the holder.
        lease_id: The token of the lock document this holder wrote (None for the file lock).
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
    for a whole lease is gone.
    """
    if holder.host == host:
        if start_ticks is None:
            return False
        return holder.pid_start is None or holder.pid_start == start_ticks
    return now - holder.heartbeat < lease_s


def _alive(holder: LockHolder) -> bool:
    host = socket.gethostname()
    ticks = process_start_ticks(holder.pid) if holder.host == host else None
    return holder_alive(holder, host=host, now=_now(), start_ticks=ticks)


def _locked(model: str, holder: LockHolder | None, *, unknown: str = "") -> ReleaseLocked:
    who = f"held by {holder.describe()}" if holder else f"held by an unknown holder{unknown}"
    return ReleaseLocked(
        f"another release of {model} is running: the lock is {who}",
        hint=f"wait for it to finish (`modelship locks {model}` shows the holder); if that "
        f"process is gone, `modelship unlock {model}"
        f"{' --release ' + holder.release_id if holder else ''}` frees it at once, else its "
        f"lease ends within {LEASE_S:.0f} s",
        model=model, holder=holder.to_dict() if holder else None,
    )


# --------------------------------------------------------------------------------------
# what one read saw, and what to do about it (pure)


@dataclass(frozen=True)
class Observed:
    """One read of a lock object.

    Attributes:
        etag: The object's ETag; None when there is no object (never taken).
        holder: Who holds it; None when it is released, absent or unreadable.
        released: The object says the lock was released.
        age_s: Seconds since the object was last written, by the S3 server's clock.
    """

    etag: str | None
    holder: LockHolder | None = None
    released: bool = False
    age_s: float | None = None

    @property
    def unreadable(self) -> bool:
        return self.etag is not None and not self.released and self.holder is None


@dataclass(frozen=True)
class Decision:
    """``create`` (If-None-Match), ``replace`` (If-Match the read ETag) or ``refuse``."""

    action: Literal["create", "replace", "refuse"]
    took_over: LockHolder | None = None
    reason: str = ""


def decide(seen: Observed, *, alive: Callable[[LockHolder], bool],
           lease_s: float | None = None) -> Decision:
    """Whether a run may take the lock it has just read (pure but for ``alive``);
    ``lease_s`` defaults to :data:`LEASE_S`."""
    lease_s = LEASE_S if lease_s is None else lease_s
    if seen.etag is None:
        return Decision("create", reason="never taken")
    if seen.released:
        return Decision("replace", reason="released")
    if seen.holder is None:
        if seen.age_s is not None and seen.age_s >= lease_s:
            return Decision("replace", reason=f"unreadable lock document, not written for "
                            f"{seen.age_s:.0f} s: no live holder renews it")
        return Decision("refuse", reason=f"unreadable lock document, written "
                        f"{seen.age_s if seen.age_s is not None else '?'} s ago")
    if alive(seen.holder):
        return Decision("refuse", reason=f"held by {seen.holder.describe()}")
    return Decision("replace", took_over=seen.holder, reason="its holder is gone")


# --------------------------------------------------------------------------------------
# the S3 side


class _S3Locks:
    """Lock objects in the bucket, read and written with conditional puts."""

    def __init__(self, storage: S3Storage) -> None:
        self.storage = storage

    def _failed(self, exc: Exception, action: str) -> InfrastructureError:
        error = InfrastructureError(
            f"the lock at s3://{self.storage.bucket}/{action} on {self.storage.endpoint} "
            f"failed: {type(exc).__name__}: {exc}",
            hint="check the S3 server (`modelship doctor`)", transient=True)
        self.storage.breaker.failed(exc, error)  # a hung S3 is not waited on per lock call
        return error

    def read(self, key: str) -> Observed:
        try:
            got = self.storage.client.get_object(Bucket=self.storage.bucket, Key=key)
            body = got["Body"].read()
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") in {"NoSuchKey", "404"}:
                return Observed(etag=None)
            raise self._failed(exc, key) from exc
        except Exception as exc:  # noqa: BLE001 - translated at the boundary
            raise self._failed(exc, key) from exc
        age = _age_s(got)
        try:
            doc = json.loads(body)
            if doc.get("released"):
                return Observed(etag=got["ETag"], released=True, age_s=age)
            return Observed(etag=got["ETag"], holder=LockHolder.from_dict(doc["holder"]),
                            age_s=age)
        except (ValueError, TypeError, KeyError, AttributeError):
            return Observed(etag=got["ETag"], age_s=age)

    def write(self, key: str, doc: dict[str, Any], *, etag: str | None) -> str | None:
        """Create (``etag`` None) or compare-and-swap; the new ETag, None when another
        write came first (412, or 409 for a concurrent conditional write)."""
        client, body = self.storage.client, json.dumps(doc).encode()
        try:
            if etag:
                put = client.put_object(Bucket=self.storage.bucket, Key=key, Body=body,
                                        ContentType="application/json", IfMatch=etag)
            else:
                put = client.put_object(Bucket=self.storage.bucket, Key=key, Body=body,
                                        ContentType="application/json", IfNoneMatch="*")
        except ClientError as exc:
            error = exc.response.get("Error", {})
            status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if error.get("Code") in {"PreconditionFailed", "ConditionalRequestConflict"} \
                    or status in {409, 412}:
                return None
            raise self._failed(exc, key) from exc
        except Exception as exc:  # noqa: BLE001
            raise self._failed(exc, key) from exc
        return str(put["ETag"])

    def keys(self, prefix: str) -> list[str]:
        try:
            return sorted(self.storage.list_keys(prefix))
        except Exception as exc:  # noqa: BLE001
            raise self._failed(exc, prefix) from exc


def _age_s(got: Any) -> float | None:
    """Seconds since the object was written, from two readings of the server's clock."""
    modified = got.get("LastModified")
    date = (got.get("ResponseMetadata", {}).get("HTTPHeaders", {}) or {}).get("date")
    if modified is None or not date:
        return None
    try:
        return max(0.0, (parsedate_to_datetime(date) - modified).total_seconds())
    except (TypeError, ValueError):
        return None


def _held_doc(holder: LockHolder) -> dict[str, Any]:
    return {"holder": asdict(holder), "released": False}


def _released_doc(holder: LockHolder | None, *, by: str) -> dict[str, Any]:
    return {"released": True, "released_at": _iso(_now()), "released_by": by,
            "last_holder": asdict(holder) if holder else None, "token": uuid.uuid4().hex}


# --------------------------------------------------------------------------------------
# the lock


class ReleaseLock:
    """A held lock (a model's release lock or the canary slot).

    ``lost`` turns true when a heartbeat found the lock taken by someone else, or could not
    renew it for a whole lease; :meth:`check` then raises, so a release never swaps without
    holding its lock. ``took_over`` is the dead holder whose lock this one took.
    """

    def __init__(self, holder: LockHolder, store: _S3Locks | None = None, key: str = "",
                 etag: str | None = None) -> None:
        self.holder = holder
        self.store = store
        self.key = key
        self.etag = etag
        self.lost: str | None = None
        self.took_over: LockHolder | None = None
        #: Why writing the lock back as released failed, if it did (also on stderr).
        self.release_error: str | None = None
        self._write = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> None:
        if self.lost:
            raise ReleaseLocked(
                f"the release lock of {self.holder.model} was lost: {self.lost}",
                hint="nothing more was changed; check `modelship locks` and `modelship "
                "status`, then run the release again", model=self.holder.model)

    def renew(self) -> None:
        """One heartbeat: rewrite the document if it is still ours."""
        assert self.store is not None
        beat = replace(self.holder, heartbeat=_now(), lease_id=uuid.uuid4().hex)
        with self._write:
            if self.etag is None or self.lost:
                return
            etag = self.store.write(self.key, _held_doc(beat), etag=self.etag)
            if etag is None:
                now = self.store.read(self.key)
                self.lost = ("it was taken by " + now.holder.describe() if now.holder
                             else "it was released or broken by someone else")
                self.etag = None
                return
            self.etag, self.holder = etag, beat

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                self.renew()
            except Exception as exc:  # noqa: BLE001 - recorded; check() raises on it
                if _now() - self.holder.heartbeat >= LEASE_S:
                    self.lost = f"no heartbeat reached S3 for {LEASE_S:.0f} s ({exc})"
            if self.lost:
                return

    def start(self) -> None:
        if self.store is not None:
            self._thread = threading.Thread(target=self._beat, daemon=True,
                                            name=f"lock-heartbeat-{self.key}")
            self._thread.start()

    def release(self, *, budget_s: float = RELEASE_BUDGET_S) -> None:
        """Stop the heartbeat and write the lock back as released, within ``budget_s``.

        Never raises: a failure is kept in ``release_error`` and said on stderr, with what
        frees the lock then (the next run takes over a gone holder's lock)."""
        self._stop.set()
        if self.store is None or self.etag is None:
            return
        store, key = self.store, self.key
        outcome: dict[str, str] = {}

        def write() -> None:
            try:
                with self._write:
                    if self.etag is None:
                        return
                    done = store.write(key, _released_doc(self.holder,
                                                          by=self.holder.release_id),
                                       etag=self.etag)
                    self.etag = None
                    if done is None:
                        outcome["error"] = "someone else wrote it first (it was taken over)"
            except Exception as exc:  # noqa: BLE001 - reported below
                outcome["error"] = f"{type(exc).__name__}: {exc}"

        worker = threading.Thread(target=write, daemon=True, name=f"lock-release-{key}")
        worker.start()
        worker.join(budget_s)
        if worker.is_alive():
            outcome.setdefault("error", f"S3 did not answer within {budget_s:.0f} s")
        if "error" in outcome:
            self.release_error = outcome["error"]
            log.warning("could not free the lock s3://%s/%s held by %s: %s; it names a "
                        "process that is gone, so the next run on %s takes it over at once "
                        "(elsewhere after its %.0f s lease), or run `modelship unlock %s`",
                        store.storage.bucket, key, self.holder.describe(),
                        self.release_error, self.holder.host, LEASE_S, self.holder.model)


def _me(model: str, release_id: str, kind: str) -> LockHolder:
    now = _now()
    return LockHolder(model=model, release_id=release_id, kind=kind,
                      host=socket.gethostname(), pid=os.getpid(),
                      pid_start=process_start_ticks(os.getpid()), since=now, heartbeat=now,
                      lease_id=uuid.uuid4().hex)


def _try_take(store: _S3Locks, key: str, me: LockHolder
              ) -> tuple[ReleaseLock | None, Observed, Decision]:
    """One attempt (a lost race is retried with a fresh read): the lock, or None and why."""
    for _ in range(3):
        seen = store.read(key)
        decision = decide(seen, alive=_alive)
        if decision.action == "refuse":
            return None, seen, decision
        etag = store.write(key, _held_doc(me), etag=seen.etag if decision.action == "replace"
                           else None)
        if etag is not None:
            lock = ReleaseLock(me, store, key, etag)
            lock.took_over = decision.took_over
            return lock, seen, decision
    seen = store.read(key)
    return None, seen, Decision("refuse", reason="others kept writing it")


@contextmanager
def _held(lock: ReleaseLock) -> Iterator[ReleaseLock]:
    lock.start()
    try:
        yield lock
    finally:
        lock.release()


@contextmanager
def release_lock(model: str, *, storage: S3Storage | None, home: Path,
                 release_id: str = "-", kind: str = "release") -> Iterator[ReleaseLock]:
    """Hold the model's release lock for the body; ReleaseLocked (exit 1, naming the
    holder and since when) if another run holds it.

    A holder whose process is gone (same host: its pid; elsewhere: no heartbeat for a
    lease) is taken over at once (``lock.took_over`` says whom). Without ``storage`` (no
    S3 configured) it is a file lock under ``home``.
    """
    me = _me(model, release_id, kind)
    if storage is None:
        with _file_lock(model, home, me) as filed:
            yield filed
        return
    lock, seen, decision = _try_take(_S3Locks(storage), lock_key(model), me)
    if lock is None:
        raise _locked(model, seen.holder, unknown=f" ({decision.reason})")
    with _held(lock):
        yield lock


@contextmanager
def canary_slot(storage: S3Storage | None, *, model: str, owner: str,
                wait_s: float = CANARY_SLOT_WAIT_S, slot: str = CANARY_SLOT,
                progress: Callable[[str], None] | None = None) -> Iterator[ReleaseLock | None]:
    """Hold the canary Triton's one slot for the body, waiting up to ``wait_s`` for it.

    Two models' canaries on the same canary server would each measure the other's load, so
    they run one at a time: a canary queues here, says who it waits for every
    :data:`SLOT_NOTICE_S`, and gives up after ``wait_s`` (``wait_s=0``: one try). Yields
    None without S3 (one process, nothing to share).

    Raises:
        ReleaseLocked: The slot stayed busy for ``wait_s`` (exit 1).
    """
    if storage is None:
        yield None
        return
    say = progress or (lambda _: None)
    store, key = _S3Locks(storage), slot_key(slot)
    me = _me(model, owner, "canary")
    started = time.monotonic()
    noticed = -SLOT_NOTICE_S
    while True:
        taken, seen, decision = _try_take(store, key, me)
        if taken is not None:
            lock = taken
            break
        waited = time.monotonic() - started
        if waited >= wait_s:
            who = seen.holder.describe() if seen.holder else decision.reason
            raise ReleaseLocked(
                f"the canary Triton stayed busy for {waited:.0f} s: its slot is held by {who}",
                hint="another model's canary runs there; try again when it is done "
                "(`modelship locks` shows it), or free a slot whose holder is gone with "
                f"`modelship unlock --canary {slot}`", model=model, slot=slot,
                holder=seen.holder.to_dict() if seen.holder else None)
        if waited - noticed >= SLOT_NOTICE_S:
            noticed = waited
            who = seen.holder.describe() if seen.holder else decision.reason
            say(f"waiting for the canary Triton: {who} holds it (waited {waited:.0f} s of "
                f"at most {wait_s:.0f} s)")
        time.sleep(min(SLOT_POLL_S, max(0.05, wait_s - waited)))
    if lock.took_over is not None:
        say(f"took over the canary slot of {lock.took_over.describe()}: that process is gone")
    say(f"took the canary slot for {owner} at {_iso(lock.holder.since)}")
    try:
        with _held(lock):
            yield lock
    finally:
        say(f"freed the canary slot of {owner}")


# --------------------------------------------------------------------------------------
# the file lock (no S3)


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
            yield ReleaseLock(holder)
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


def _row(name: str, seen: Observed, *, lock: str) -> dict[str, Any]:
    return {"model": name, "lock": lock, "held": not seen.released,
            "holder": seen.holder.to_dict() if seen.holder else None,
            "holder_alive": _alive(seen.holder) if seen.holder else None,
            "unreadable": seen.unreadable, "written_s_ago": seen.age_s}


def list_locks(*, storage: S3Storage | None, home: Path,
               model: str | None = None) -> list[dict[str, Any]]:
    """Every held lock (or ``model``'s release lock): the holder and whether it lives; the
    canary slot too (``lock: canary``) when no model is named."""
    rows: list[dict[str, Any]] = []
    if storage is None:
        folder = home / "locks"
        paths = [folder / f"{model}.holder.json"] if model else sorted(
            folder.glob("*.holder.json")) if folder.exists() else []
        for path in paths:
            holder = _read_file_holder(path)
            if holder is not None:
                rows.append({"model": holder.model, "lock": "release", "held": True,
                             "holder": holder.to_dict(), "holder_alive": _alive(holder)})
        return rows
    store = _S3Locks(storage)
    keys = [lock_key(model)] if model else store.keys(RELEASE_LOCKS) + store.keys(SLOT_LOCKS)
    for key in keys:
        seen = store.read(key)
        if seen.etag is None or seen.released:
            continue
        slot = key.startswith(SLOT_LOCKS)
        name = unquote(key.rsplit("/", 1)[1].removesuffix(".json"))
        row = _row(seen.holder.model if slot and seen.holder else name, seen,
                   lock="canary" if slot else "release")
        if slot:
            row["slot"] = name
        rows.append(row)
    return rows


def break_lock(model: str, release_id: str | None, *, storage: S3Storage | None,
               home: Path, canary_slot_name: str | None = None) -> dict[str, Any]:
    """Free a lock whose holder is gone, and say what was done; refuse while it lives.

    ``release_id`` names the holder (from ``modelship locks``); None frees whatever holds
    it once that is shown to be gone. A holder nobody can name (an unreadable lock
    document) counts as gone only when nothing has written the lock for a whole lease:
    a live holder rewrites it every :data:`HEARTBEAT_S`.

    Raises:
        UsageError: Nothing holds the lock, or another release than ``release_id`` does
            (exit 2).
        ReleaseLocked: The holder is alive, or the unknown holder wrote the lock within a
            lease (exit 1).
    """
    if storage is None:
        holder = _read_file_holder(home / "locks" / f"{model}.holder.json")
        if holder is None or (release_id is not None and holder.release_id != release_id):
            raise _not_held(model, release_id, holder)
        if _alive(holder):
            raise _refuse_live(model, holder)
        (home / "locks" / f"{model}.holder.json").unlink(missing_ok=True)
        return {"model": model, "broken": holder.to_dict(), "how": _how(holder)}
    store = _S3Locks(storage)
    key = slot_key(canary_slot_name) if canary_slot_name else lock_key(model)
    seen = store.read(key)
    if seen.etag is None or seen.released:
        raise _not_held(model, release_id, None)
    if seen.holder is not None and release_id is not None \
            and seen.holder.release_id != release_id:
        raise _not_held(model, release_id, seen.holder)
    decision = decide(seen, alive=_alive)
    if decision.action == "refuse":
        if seen.holder is not None:
            raise _refuse_live(model, seen.holder)
        raise ReleaseLocked(
            f"refusing to break the lock of {model}: its holder is unknown ({decision.reason})"
            f" and a live holder rewrites it every {HEARTBEAT_S:.0f} s",
            hint=f"run `modelship unlock {model}` again once nothing has written it for "
            f"{LEASE_S:.0f} s", model=model)
    by = f"unlock by pid {os.getpid()} on {socket.gethostname()}"
    if store.write(key, _released_doc(seen.holder, by=by), etag=seen.etag) is None:
        raise ReleaseLocked(f"the lock of {model} changed while it was being broken",
                            hint=f"see `modelship locks {model}` and try again", model=model)
    how = _how(seen.holder) if seen.holder else (
        f"its holder was unknown (the lock document could not be read) and nothing had "
        f"written it for {seen.age_s:.0f} s, longer than a {LEASE_S:.0f} s lease")
    return {"model": model, "broken": seen.holder.to_dict() if seen.holder else None,
            "how": how}


def _how(holder: LockHolder) -> str:
    if holder.host == socket.gethostname():
        return f"pid {holder.pid} is no longer running on {holder.host}"
    return (f"no heartbeat from {holder.host} since {_iso(holder.heartbeat)}, longer than a "
            f"{LEASE_S:.0f} s lease")


def _not_held(model: str, release_id: str | None, holder: LockHolder | None) -> UsageError:
    held = f"it is held by {holder.release_id}" if holder else "nothing holds it"
    what = f"by release {release_id}" if release_id else "at all"
    return UsageError(f"the lock of {model} is not held {what}: {held}",
                      hint=f"see `modelship locks {model}`", model=model)


def _refuse_live(model: str, holder: LockHolder) -> ReleaseLocked:
    return ReleaseLocked(
        f"refusing to break the lock of {model}: its holder is alive ({holder.describe()})",
        hint="wait for the release to finish, or stop that process first",
        model=model, holder=holder.to_dict())
