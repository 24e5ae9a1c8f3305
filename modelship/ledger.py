"""The release ledger: one JSON record per release, rollback or swap, in S3.

``releases/<model>/<release id>.json`` answers "what serves, who asked, who approved, on
what evidence". A record is written as the release goes (every stage rewrites it), so a
crash leaves a record that says where it stopped. Not to be confused with the staging
manifest (``release.json`` inside a version folder), which describes bytes, not decisions.

The decisions the ledger feeds are pure functions of the records, table-tested without S3:

- :func:`passing_canary` — the evidence ``swap`` needs: a passing canary for exactly this
  candidate digest, run against the version that serves now;
- :func:`served_before` — a rollback target must have served before;
- :func:`rollback_target` — the default rollback target: what served before the current
  production version, as the ledger (not a possibly stale alias) says.

Release ids sort by time (``20261201T004455123456Z-1a2b3c``), so "newest first" is a sort.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal

from modelship.errors import ModelshipError, StorageError
from modelship.jsonable import jsonable
from modelship.procinfo import process_start_ticks
from modelship.storage import S3Storage

LEDGER_PREFIX = "releases"

Kind = Literal["promote", "rollback", "swap", "canary", "unlock"]
Trigger = Literal["cli", "deployment", "schedule", "webhook"]
#: ``running`` until the release ends; ``interrupted`` when a later run found it running
#: without a holder (the process died) and finished or undid what it left; ``cancelled``
#: when a signal or a cancel stopped it and it undid its own swap; ``incomplete`` when its
#: way out could not be finished (a dependency was down): ``incomplete`` in the record says
#: the goal and what is missing, and the next command of any kind finishes it.
Status = Literal["running", "released", "rejected", "failed", "rolled_back", "interrupted",
                 "cancelled", "incomplete", "noop", "planned", "passed"]
#: Statuses after which the record's ``to_version`` served on every replica.
SERVED_STATUSES = frozenset({"released", "rolled_back_to"})


def now_iso() -> str:
    """UTC now, ISO 8601 to the millisecond (stage timings), for records and messages."""
    return datetime.now(UTC).isoformat(timespec="milliseconds")


def new_release_id() -> str:
    """A time-sortable unique id, e.g. ``20261201T004455123456Z-1a2b3c``.

    To the microsecond: "newest first" is a sort of ids, so two records of one model started
    within the same second (a repair, then the next release) must not be ordered by their
    random suffix. The characters are those of the seconds-only ids from before (digits,
    ``T``, ``Z``, ``-``, lowercase hex), so every name built from an id stays valid (a
    Prefect pause key takes lowercase letters, digits and dashes); ids of that older form sort
    after this form's ids of the same second, and correctly against every other second.
    """
    global _last_id_time
    with _id_lock:  # strictly increasing in this process, even within one microsecond
        stamp = max(datetime.now(UTC), _last_id_time + timedelta(microseconds=1))
        _last_id_time = stamp
    return f"{stamp.strftime('%Y%m%dT%H%M%S%fZ')}-{secrets.token_hex(3)}"


_id_lock = threading.Lock()
_last_id_time = datetime.min.replace(tzinfo=UTC)


def holder_process_alive(holder: dict[str, Any], here: str) -> bool | None:
    """Whether the process that holds a record still runs: True or False on its own host,
    None on another host (unknown from here) or when the record names no pid.

    Pids are recycled: a process with the holder's pid that started at another time than
    the holder's recorded ``pid_start`` is another process, and the holder is gone. (Records
    from before ``pid_start`` was kept are judged by their pid alone.)
    """
    pid = holder.get("pid")
    if holder.get("host") != here or not isinstance(pid, int):
        return None
    ticks = process_start_ticks(pid)
    recorded = holder.get("pid_start")
    return ticks is not None and (not isinstance(recorded, int) or recorded == ticks)


@dataclass
class StageEntry:
    """One stage of a release: when it ran and how it ended.

    Attributes:
        outcome: ``running``, ``ok``, ``failed``, ``skipped`` or ``interrupted``.
        reason: Why it failed or was skipped, in words; the details say more.
    """

    name: str
    started_at: str
    ended_at: str | None = None
    outcome: str = "running"
    reason: str | None = None
    details: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "started_at": self.started_at, "ended_at": self.ended_at,
                "outcome": self.outcome, "reason": self.reason,
                "details": jsonable(self.details)}


@dataclass
class ReleaseRecord:
    """One release (or rollback, or swap) as the ledger keeps it.

    Attributes:
        id: The release id (time-sortable).
        kind: ``promote``, ``rollback``, ``swap`` or ``canary``.
        from_version: What served on every replica when it started (None: nothing).
        to_version: The version it set out to serve.
        candidate: The candidate digest: model, version, ``onnx_sha256``,
            ``manifest_sha256`` and the canary report id; the evidence is bound to it.
        trigger: ``cli``, ``deployment``, ``schedule`` or ``webhook``.
        requester: Who asked (a Slack user id or a login name).
        status: Where it stands (see :data:`Status`).
        exit_code: The process exit code it ended with (DESIGN §6), None while running.
        stages: Every stage, in order.
        gates: The canary verdict, the rules and the S3 keys of the report files.
        swap: The swap report (phases, per-replica timeline, skew).
        approvals: Who approved or rejected, when, and through which channel.
        forced: ``--force`` skipped the evidence check; the record says so.
        notes: Things that went wrong without changing the outcome (Slack down, ...).
        slack: Where the release thread is (channel, ts).
        holder: The process that ran it (host, pid, flow run id).
        intent: What the release is about to change, written **before** the first change
            of the fleet (:func:`release_intent`): ``from_version``, ``to_version``, the
            pin and the aliases from and to, the tag; ``committed_at`` once it passed its
            point of no return (the bake passed; a plain swap or rollback switched).
            Empty for a record that never reached its swap.
        incomplete: Set while the record's status is ``incomplete``: ``goal``
            (``released`` or ``undone``), ``missing`` (the steps left, in words),
            ``error`` (why they could not be done), and the ``status``, ``exit_code`` and
            ``reason`` the record gets once they are done.
        traffic: The release's hold on the traffic router (issue 20), written **before**
            each change of the router (:func:`tasks.traffic_state.traffic_intent`):
            ``router``, ``split`` (the last split it set or is about to set), ``at``, and
            ``events`` (each step of a progressive canary,
            :class:`tasks.traffic_plan.StepEvent`). Empty for a release that never
            touched the router; a killed run's split is restored by the next command.
    """

    id: str
    kind: Kind
    model: str
    from_version: int | None = None
    to_version: int | None = None
    candidate: dict[str, Any] = field(default_factory=dict)
    trigger: str = "cli"
    requester: str | None = None
    status: str = "running"
    exit_code: int | None = None
    reason: str | None = None
    started_at: str = field(default_factory=now_iso)
    finished_at: str | None = None
    stages: list[StageEntry] = field(default_factory=list)
    gates: dict[str, Any] = field(default_factory=dict)
    swap: dict[str, Any] = field(default_factory=dict)
    bake: dict[str, Any] = field(default_factory=dict)
    approvals: list[dict[str, Any]] = field(default_factory=list)
    forced: bool = False
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)
    slack: dict[str, Any] = field(default_factory=dict)
    holder: dict[str, Any] = field(default_factory=dict)
    intent: dict[str, Any] = field(default_factory=dict)
    incomplete: dict[str, Any] = field(default_factory=dict)
    traffic: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def start(cls, kind: Kind, model: str, *, trigger: str = "cli",
              requester: str | None = None, **fields: Any) -> ReleaseRecord:
        """A new running record, held by this process."""
        return cls(id=new_release_id(), kind=kind, model=model, trigger=trigger,
                   requester=requester,
                   holder={"host": socket.gethostname(), "pid": os.getpid(),
                           "pid_start": process_start_ticks(os.getpid())}, **fields)

    def stage(self, name: str) -> StageEntry | None:
        """The last entry of stage ``name``, or None."""
        return next((s for s in reversed(self.stages) if s.name == name), None)

    def finish(self, status: str, exit_code: int, reason: str | None = None) -> None:
        """End the record; a stage still running ends with it."""
        self.status, self.exit_code, self.reason = status, exit_code, reason
        self.finished_at = now_iso()
        for entry in self.stages:
            if entry.outcome == "running":
                entry.outcome, entry.ended_at = "failed", self.finished_at
                entry.reason = entry.reason or reason

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "kind": self.kind, "model": self.model,
            "from_version": self.from_version, "to_version": self.to_version,
            "candidate": jsonable(self.candidate), "trigger": self.trigger,
            "requester": self.requester, "status": self.status, "exit_code": self.exit_code,
            "reason": self.reason, "started_at": self.started_at,
            "finished_at": self.finished_at, "stages": [s.to_dict() for s in self.stages],
            "gates": jsonable(self.gates), "swap": jsonable(self.swap),
            "bake": jsonable(self.bake), "approvals": jsonable(self.approvals),
            "forced": self.forced, "dry_run": self.dry_run, "notes": list(self.notes),
            "slack": jsonable(self.slack), "holder": jsonable(self.holder),
            "intent": jsonable(self.intent), "incomplete": jsonable(self.incomplete),
            "traffic": jsonable(self.traffic),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ReleaseRecord:
        stages = [StageEntry(**{k: v for k, v in s.items()
                                if k in StageEntry.__dataclass_fields__})
                  for s in data.get("stages", [])]
        known = {k: v for k, v in data.items()
                 if k in cls.__dataclass_fields__ and k != "stages"}
        return cls(**known, stages=stages)


# --------------------------------------------------------------------------------------
# pure decisions over the records


RELEASE_ID_TAG = "modelship.release_id"


def release_intent(*, from_version: int | None, to_version: int,
                   aliases: dict[str, int] | None, release_id: str) -> dict[str, Any]:
    """What a fleet change is about to do, for the record before the first change.

    Args:
        from_version: What every replica serves now (None: nothing, a first release).
        to_version: What they are to serve.
        aliases: The model's aliases now (``production``, ``previous``); None when they
            could not be read: an undo then leaves ``previous`` as it is (``"keep"``).
        release_id: The record's id, the value of the ``modelship.release_id`` tag.

    Returns:
        ``{"from_version", "to_version", "pin": {"from", "to"}, "aliases": {"production":
        {"from", "to"}, "previous": {"from", "to"}}, "tag": {"version", "release_id"},
        "written_at", "committed_at": None}``: released means every "to" holds, undone
        means the fleet, the pin and ``production`` say ``from_version`` and ``previous``
        is what it was.
    """
    known: dict[str, Any] = aliases if aliases is not None else \
        {"production": from_version, "previous": "keep"}
    previous_to = from_version if from_version is not None and from_version != to_version \
        else known.get("previous", "keep")
    return {"from_version": from_version, "to_version": to_version,
            "pin": {"from": from_version, "to": to_version},
            "aliases": {"production": {"from": known.get("production"), "to": to_version},
                        "previous": {"from": known.get("previous"), "to": previous_to}},
            "tag": {"version": to_version, "release_id": release_id},
            "written_at": now_iso(), "committed_at": None}


def candidate_digest(model: str, version: int, manifest: dict[str, Any],
                     manifest_sha256: str) -> dict[str, Any]:
    """The digest a canary, an approval and a swap are bound to."""
    onnx = (manifest.get("files") or {}).get("model.onnx") or {}
    return {"model": model, "version": version, "onnx_sha256": onnx.get("sha256"),
            "manifest_sha256": manifest_sha256}


def same_candidate(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Two digests name the same bytes (model, version and manifest digest all equal)."""
    keys = ("model", "version", "manifest_sha256")
    return all(a.get(k) is not None and a.get(k) == b.get(k) for k in keys)


def passing_canary(records: Iterable[ReleaseRecord], *, digest: dict[str, Any],
                   baseline: int | None) -> ReleaseRecord | None:
    """The newest record whose canary passed for exactly this candidate against ``baseline``
    (the version serving now), or None."""
    for record in sort_newest_first(records):
        gates = record.gates or {}
        if gates.get("verdict") == "passed" and gates.get("baseline") == baseline \
                and same_candidate(record.candidate, digest):
            return record
    return None


def served_versions(records: Iterable[ReleaseRecord]) -> set[int]:
    """Every version that served on the whole fleet after a completed release or rollback
    (a release rolled back by its bake still served; its predecessor too)."""
    served: set[int] = set()
    for record in records:
        if record.kind in ("promote", "swap", "rollback") and record.status in (
                "released", "rolled_back", "cancelled", "noop"):
            if record.to_version is not None and record.status not in ("rolled_back",
                                                                        "cancelled"):
                served.add(record.to_version)
            if record.from_version is not None:
                served.add(record.from_version)
    return served


def served_before(records: Iterable[ReleaseRecord], version: int) -> bool:
    """``version`` served on the whole fleet at some point, as the ledger says."""
    return version in served_versions(records)


def rollback_target(records: Sequence[ReleaseRecord], current: int | None) -> int | None:
    """What served before ``current``: the ``from_version`` of the newest completed record
    that put ``current`` in production. None when the ledger does not know."""
    for record in sort_newest_first(records):
        if record.kind in ("promote", "swap", "rollback") and record.status == "released" \
                and record.to_version == current and record.from_version is not None \
                and record.from_version != current:
            return record.from_version
    return None


def last_release(records: Iterable[ReleaseRecord]) -> ReleaseRecord | None:
    """The newest record that set out to change the fleet."""
    return next((r for r in sort_newest_first(records)
                 if r.kind in ("promote", "swap", "rollback") and not r.dry_run), None)


def sort_newest_first(records: Iterable[ReleaseRecord]) -> list[ReleaseRecord]:
    return sorted(records, key=lambda r: r.id, reverse=True)


# --------------------------------------------------------------------------------------
# the store


class Ledger:
    """Release records in S3 under ``releases/<model>/``. The constructor does no I/O.

    Args:
        storage: The S3 client of the bucket (outside the Triton repository prefix, so
            Triton never sees the records as models).
        prefix: Key prefix of the ledger.
    """

    def __init__(self, storage: S3Storage, prefix: str = LEDGER_PREFIX) -> None:
        self.storage = storage
        self.prefix = prefix.strip("/")

    def key(self, model: str, release_id: str, suffix: str = ".json") -> str:
        return f"{self.prefix}/{model}/{release_id}{suffix}"

    def write(self, record: ReleaseRecord) -> str:
        """Write (or rewrite) one record; returns its key."""
        key = self.key(record.model, record.id)
        body = json.dumps(record.to_dict(), indent=2, sort_keys=False).encode()
        self.storage.put_bytes(key, body)
        return key

    def attach(self, record: ReleaseRecord, name: str, path: Path) -> str:
        """Upload a file next to the record (``<id>/<name>``); returns its key."""
        key = f"{self.prefix}/{record.model}/{record.id}/{name}"
        self.storage.upload_file(path, key)
        return key

    def read(self, model: str, release_id: str) -> ReleaseRecord:
        key = self.key(model, release_id)
        try:
            data = json.loads(self.storage.get_bytes(key))
        except ModelshipError:
            raise
        except ValueError as exc:
            raise StorageError(f"release record {key} is not valid JSON: {exc}",
                               hint="inspect or delete the object", key=key) from exc
        return ReleaseRecord.from_dict(data)

    def records(self, model: str) -> list[ReleaseRecord]:
        """Every record of ``model``, newest first (unreadable ones are skipped)."""
        found: list[ReleaseRecord] = []
        for key in self.storage.list_keys(f"{self.prefix}/{model}/"):
            rest = key[len(self.prefix) + len(model) + 2:]
            if "/" in rest or not rest.endswith(".json"):
                continue
            try:
                found.append(ReleaseRecord.from_dict(json.loads(self.storage.get_bytes(key))))
            except (ValueError, TypeError):
                continue
        return sort_newest_first(found)
