"""``modelship status``: read every source at once, within a deadline, and compare them.

The decision is pure (:func:`tasks.truth.truth`); this module only reads, in parallel:

- each replica: the ready versions and the live config (:func:`tasks.swap.observe_fleet`);
- S3: the production pin (:func:`tasks.reconcile.read_pin`, rendered in the fleet's form
  as reconcile renders it) and the ledger;
- MLflow: the aliases;
- the lock store (S3, or the file lock): the release lock's holder;
- the traffic router, when one is configured: the live weights
  (:func:`tasks.traffic_state.live_traffic`), shown as ``traffic`` (None without a router).

Every read runs in its own daemon thread and the whole read ends by a deadline of
:data:`DEADLINE_FACTOR` x ``settings.http_timeout_s``: a source that did not answer by
then is reported unreachable, and a hung server never holds the command (daemon threads do
not keep the process alive). Any one source down leaves the others compared, with a note.
The clock starts once every client is built (:meth:`Clients.warm`): the deadline times the
servers, never the imports (MLflow's alone took longer than the deadline under load).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from model_registry.client import PRODUCTION_ALIAS
from modelship.clients import Clients
from modelship.errors import InfrastructureError, ModelNotFound, ModelshipError, Unreachable
from modelship.faults import translate
from modelship.ledger import Ledger, ReleaseRecord, holder_process_alive, sort_newest_first
from modelship.locks import list_locks
from modelship.settings import Settings
from modelship.signing import key_bytes
from modelship.traffic.port import TrafficRouter
from modelship.triton.client import TritonServer
from modelship.triton.model_config import config_digest, serving_digest
from modelship.triton.target import render_for_servers
from tasks.reconcile import read_pin
from tasks.swap import Observed, observe_fleet
from tasks.traffic_state import live_traffic
from tasks.truth import (
    FLEET_KINDS,
    LockSeen,
    Observation,
    PinSeen,
    ReplicaSeen,
    Source,
    Truth,
    record_seen,
    truth,
)

#: The read of every source ends by this many HTTP timeouts (a call may take a ping and a
#: request, each bounded by ``http_timeout_s``).
DEADLINE_FACTOR = 2.0

SOURCE_NAMES: dict[Source, str] = {"mlflow": "MLflow", "s3": "S3", "prefect": "Prefect"}


# --------------------------------------------------------------------------------------
# reading within a deadline


def read_within(calls: dict[str, Callable[[], Any]], *, deadline_s: float) -> dict[str, Any]:
    """Run every call at once; each result is its value or the exception it raised.

    A call that has not returned ``deadline_s`` s after the start gives an
    :class:`Unreachable` naming the deadline; its daemon thread is left behind.
    """
    results: dict[str, Any] = {}

    def run(name: str, call: Callable[[], Any]) -> None:
        try:
            results[name] = call()
        except Exception as exc:  # noqa: BLE001 - every failure is reported per source
            results[name] = exc

    threads = {name: threading.Thread(target=run, args=(name, call), daemon=True,
                                      name=f"status-{name}")
               for name, call in calls.items()}
    for thread in threads.values():
        thread.start()
    end = time.monotonic() + deadline_s
    for name, thread in threads.items():
        thread.join(max(0.0, end - time.monotonic()))
        if name not in results:
            results[name] = Unreachable(f"no answer within {deadline_s:g} s",
                                        hint="check that it is running (`modelship doctor`)")
    return {name: results[name] for name in calls}


def _message(exc: BaseException, what: str) -> str:
    return translate(exc, what=what).message


# --------------------------------------------------------------------------------------
# the reads


def _observe_one(server: TritonServer, model: str) -> Observed:
    return observe_fleet([server], model)[0]


def _replica(observed: Observed | BaseException, name: str, url: str
             ) -> tuple[ReplicaSeen, dict[str, Any]]:
    row: dict[str, Any] = {"name": name, "url": url, "ready_versions": [],
                           "config_digest": None, "serving_digest": None,
                           "dynamic_batching": None}
    if isinstance(observed, BaseException):
        problem = _message(observed, f"Triton {name}")
        row["error"] = problem
        return ReplicaSeen(name, False, problem=problem), row
    view, live = observed.view, observed.live_config
    if not view.live:
        row["error"] = view.problem
        return ReplicaSeen(name, False, problem=view.problem), row
    batching = live.HasField("dynamic_batching") if live is not None else None
    row.update(ready_versions=list(view.ready_versions), serving_digest=view.serving_digest,
               config_digest=config_digest(live) if live is not None else None,
               dynamic_batching=batching)
    return ReplicaSeen(name, True, view.ready_versions, view.serving_digest, batching), row


def _read_pin(settings: Settings, clients: Clients, model: str) -> PinSeen | None:
    assert clients.storage is not None
    pin = read_pin(clients.storage, repository_prefix=settings.repository_prefix, model=model,
                   signing_key=key_bytes(settings.manifest_signing_key))
    if pin is None:
        return None
    # In the fleet's form, as reconcile loads it (a no-op for the pins the swap writes).
    try:
        config, _ = render_for_servers(pin.config, clients.replicas,
                                       timeout_s=settings.http_timeout_s)
    except ModelshipError:  # the fleet's form cannot be told (servers of two kinds)
        config = pin.config
    return PinSeen(pin.version, serving_digest(config), config.HasField("dynamic_batching"))


def _read_locks(settings: Settings, clients: Clients, model: str) -> list[dict[str, Any]]:
    # The release lock is an object in the bucket (modelship/locks.py): S3 answers for it.
    return list_locks(storage=clients.storage, home=settings.home, model=model)


def _lock_seen(rows: list[dict[str, Any]]) -> LockSeen | None:
    row = next((r for r in rows if r.get("held")), None)
    if row is None:
        return None
    holder = row.get("holder") or {}
    described = (f"{holder.get('kind')} {holder.get('release_id')} (pid {holder.get('pid')} on "
                 f"{holder.get('host')})") if holder else None
    return LockSeen(True, holder.get("release_id"), holder.get("kind"),
                    row.get("holder_alive"), described)


def _pid_running(record: ReleaseRecord, here: str) -> bool | None:
    if record.status != "running":
        return None
    return holder_process_alive(record.holder, here)


def _summary(record: ReleaseRecord, verdict: Truth) -> dict[str, Any]:
    """The newest record, in brief (``history`` has the whole record)."""
    doc: dict[str, Any] = {
        "id": record.id, "kind": record.kind, "status": record.status,
        "from_version": record.from_version, "to_version": record.to_version,
        "stage": record.stages[-1].name if record.stages else None,
        "started_at": record.started_at, "finished_at": record.finished_at,
        "exit_code": record.exit_code, "reason": record.reason,
        "holder": {k: record.holder.get(k) for k in ("host", "pid") if k in record.holder}}
    if record.id in verdict.processes:
        doc["process"] = verdict.processes[record.id]
    if record.incomplete:
        doc["incomplete"] = record.incomplete
    return doc


# --------------------------------------------------------------------------------------
# the command


def status_report(settings: Settings, clients: Clients, *, model: str,
                  router: TrafficRouter | None = None) -> dict[str, Any]:
    """``modelship status MODEL``: the replicas against the pin, the alias and the ledger.

    Returns:
        The DESIGN §6 keys (``model``, ``production_version``, ``aliases``, ``replicas``)
        and: ``consistent`` (no disagreement), ``disagreements`` [{kind, detail,
        repair}], ``next`` (the repair to run first), ``unreachable`` (sources that did
        not answer), ``unread`` (those and the ones not configured), ``notes``,
        ``record`` (the newest fleet record in brief; also ``last_release``), ``pin``,
        ``expected`` (what should serve, and which source says so), ``in_progress``,
        ``lock``, ``fleet_consistent``, ``served`` and ``summary``; ``traffic``: the
        live weights read back from ``router`` (``{"router", "live", "production_only",
        "at"}``, or ``error`` when it did not answer), None when no router is configured.
    """
    here = socket.gethostname()
    calls = _reads(settings, clients, model)
    if router is not None:
        calls["traffic"] = partial(live_traffic, router)
    clients.warm()
    got = read_within(calls, deadline_s=DEADLINE_FACTOR * settings.http_timeout_s)
    gaps = _Gaps()
    pairs = [_replica(got[f"replica:{i}"], s.name, s.endpoint.http)
             for i, s in enumerate(clients.replicas)]
    seen, rows = [p[0] for p in pairs], [p[1] for p in pairs]
    pin, pin_problem, records = _bucket(clients, got, gaps)
    aliases = _aliases(clients, got, gaps, model)
    lock = _lock(got, gaps)
    observation = Observation(
        model=model, here=here, replicas=tuple(seen), pin=pin, pin_problem=pin_problem,
        alias=aliases.get(PRODUCTION_ALIAS),
        records=tuple(record_seen(r, pid_running=_pid_running(r, here)) for r in records),
        lock=lock, unread=frozenset(gaps.unread))
    verdict = truth(observation)
    doc = _document(model, seen, rows, aliases=aliases, pin=pin, lock=lock,
                    records=records, verdict=verdict, gaps=gaps)
    doc["traffic"] = _traffic(router, got.get("traffic"))
    return doc


def _traffic(router: TrafficRouter | None, answer: Any) -> dict[str, Any] | None:
    """The router's live weights; a read that missed the deadline says so."""
    if router is None:
        return None
    if isinstance(answer, BaseException):
        return {"router": router.name, "live": None, "error": _message(answer, "router")}
    traffic: dict[str, Any] = answer
    return traffic


def _reads(settings: Settings, clients: Clients, model: str) -> dict[str, Callable[[], Any]]:
    """One call per source status reads: every replica, and each configured dependency."""
    calls: dict[str, Callable[[], Any]] = {
        f"replica:{i}": partial(_observe_one, server, model)
        for i, server in enumerate(clients.replicas)}
    if clients.storage is not None:
        storage = clients.storage
        calls["pin"] = lambda: _read_pin(settings, clients, model)
        calls["ledger"] = lambda: Ledger(storage).records(model)
    if clients.registry is not None:
        registry = clients.registry
        calls["mlflow"] = lambda: registry.aliases(model)
    if clients.prefect is not None:
        calls["prefect"] = clients.prefect.ping  # noted only: status compares nothing of it
    calls["locks"] = lambda: _read_locks(settings, clients, model)
    return calls


@dataclass
class _Gaps:
    """What status could not read, for the report: the sources it could not compare
    (``unread``), those that did not answer (``unreachable``) and notes in words."""

    unread: set[Source] = field(default_factory=set)
    unreachable: list[dict[str, str]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def failed(self, source: Source, exc: BaseException) -> None:
        """``source`` did not answer: not compared, and said why."""
        self.unread.add(source)
        message = _message(exc, SOURCE_NAMES[source])
        self.unreachable.append({"source": source, "error": message})
        self.notes.append(f"{SOURCE_NAMES[source]} did not answer: {message}")


def _bucket(clients: Clients, got: dict[str, Any], gaps: _Gaps
            ) -> tuple[PinSeen | None, str | None, list[ReleaseRecord]]:
    """The pin (or why it cannot be used) and the fleet records, newest first: S3's
    answers; any of its three reads failing leaves S3 unread."""
    if clients.storage is None:
        gaps.unread.add("s3")
        gaps.notes.append("S3 is not configured (set MODELSHIP_S3_ENDPOINT)")
        return None, None, []
    for key in ("ledger", "pin", "locks"):  # all three are objects in the bucket
        answer = got[key]
        # A pin that does not verify is a finding (pin_problem), not an outage.
        verdict_on_pin = key == "pin" and isinstance(answer, ModelshipError) \
            and not isinstance(answer, InfrastructureError)
        if "s3" not in gaps.unread and isinstance(answer, BaseException) and not verdict_on_pin:
            gaps.failed("s3", answer)
    if "s3" in gaps.unread:
        return None, None, []
    records = [r for r in sort_newest_first(got["ledger"])
               if r.kind in FLEET_KINDS and not r.dry_run]
    if isinstance(got["pin"], ModelshipError):
        return None, got["pin"].message, records  # it does not verify or parse
    return got["pin"], None, records


def _aliases(clients: Clients, got: dict[str, Any], gaps: _Gaps, model: str
             ) -> dict[str, int]:
    """The model's aliases in MLflow; none when it is not configured, not registered or
    did not answer (each said in a note)."""
    if clients.registry is None:
        gaps.unread.add("mlflow")
        gaps.notes.append("MLflow is not configured (set MLFLOW_TRACKING_URI)")
    elif isinstance(got["mlflow"], ModelNotFound):
        gaps.notes.append(f"{model} is not registered in MLflow, so it has no aliases")
    elif isinstance(got["mlflow"], BaseException):
        gaps.failed("mlflow", got["mlflow"])
    else:
        aliases: dict[str, int] = got["mlflow"]
        return aliases
    return {}


def _lock(got: dict[str, Any], gaps: _Gaps) -> LockSeen | None:
    """The release lock's holder; and Prefect's answer, which status only notes."""
    lock: LockSeen | None = None
    if isinstance(got["locks"], BaseException):
        if "s3" not in gaps.unread:  # the file lock (no S3 configured) could not be read
            gaps.notes.append(f"the release lock was not read: "
                              f"{_message(got['locks'], 'lock')}")
    else:
        lock = _lock_seen(got["locks"])
    if isinstance(got.get("prefect"), BaseException):
        gaps.failed("prefect", got["prefect"])
        gaps.notes.append("status needs nothing from Prefect; releases run as Prefect flows, "
                          "so they need it back")
    return lock


def _document(model: str, seen: list[ReplicaSeen], rows: list[dict[str, Any]], *,
              aliases: dict[str, int], pin: PinSeen | None, lock: LockSeen | None,
              records: list[ReleaseRecord], verdict: Truth, gaps: _Gaps) -> dict[str, Any]:
    """The ``status --json`` document (the keys :func:`status_report` lists)."""
    fleet_consistent = bool(seen) and all(r.reachable and len(r.ready_versions) == 1
                                          for r in seen) \
        and len({(tuple(r["ready_versions"]), r["config_digest"]) for r in rows}) == 1
    production = seen[0].ready_versions[0] if fleet_consistent else None
    served = any(r.ready_versions for r in seen if r.reachable)
    record = _summary(records[0], verdict) if records else None
    for row in rows:
        row["matches_pin"] = None if pin is None or not row["ready_versions"] else (
            row["ready_versions"] == [pin.version]
            and row["serving_digest"] == pin.serving_digest)
    return {
        "model": model,
        "production_version": production,
        "aliases": aliases,
        "replicas": rows,
        "consistent": verdict.consistent,
        "disagreements": [d.to_dict() for d in verdict.disagreements],
        "next": verdict.next,
        "unreachable": gaps.unreachable,
        "unread": sorted(gaps.unread),
        "notes": [*gaps.notes, *verdict.notes],
        "record": record,
        "last_release": record,
        "pin": None if pin is None else {"version": pin.version,
                                         "serving_digest": pin.serving_digest,
                                         "dynamic_batching": pin.dynamic_batching},
        "expected": verdict.expected.to_dict() if verdict.expected else None,
        "in_progress": verdict.in_progress,
        "lock": None if lock is None else {"held": lock.held, "release_id": lock.release_id,
                                           "holder": lock.holder,
                                           "holder_alive": lock.holder_alive},
        "fleet_consistent": fleet_consistent,
        "served": served,
        "summary": _line(model, production, served, verdict),
    }


def _line(model: str, production: int | None, served: bool, verdict: Truth) -> str:
    """One human line: what serves, and whether everything agrees."""
    serving = f"v{production} on every replica" if production is not None else \
        "a mixed fleet" if served else "nothing"
    if verdict.consistent:
        state = "consistent" if served or verdict.expected else "never released"
    else:
        count = len(verdict.disagreements)
        state = f"INCONSISTENT ({count} disagreement{'s' if count > 1 else ''})"
    return f"{model}: {serving}; {state}"
