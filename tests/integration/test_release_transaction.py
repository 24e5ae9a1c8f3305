"""Every way out of a fleet change ends released or undone, on the real stack.

One model, two staged versions, standalone swaps (the cheapest fleet change that writes
an intent; promote runs the same end_release, and the crash matrix drives it by CLI):

- MLflow down after the fleet switched: the record says ``incomplete`` with what is
  missing, and the next command (reconcile's recover hook, as the CLI wires it) finishes
  it: the aliases and the tag say the new version;
- a rerun of the swap to what already serves repairs aliases that lie (issue 18, defect 4);
- SIGTERM during the switch: the swap aborts, the record says ``cancelled`` (exit 143),
  and the fleet, the pin and the aliases still say the old version;
- a rollback while a live release of the model runs names it.
"""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest

from flows import standalone
from flows.check import run_check
from model_registry.client import RegistryClient
from modelship.clients import Clients, build_clients
from modelship.errors import ReleaseCancelled, ReleaseIncomplete, ReleaseLocked
from modelship.faults import RetryPolicy
from modelship.ledger import Ledger, ReleaseRecord, StageEntry, now_iso
from modelship.policy import Policy
from modelship.settings import Settings
from modelship.signals import stop_on_signals
from modelship.signing import key_bytes
from tasks import fleet
from tasks import reconcile as reconciling
from tasks.reconcile import read_pin
from tasks.swap import fleet_status
from tests import models

pytestmark = pytest.mark.integration

MODEL = "txn-release"
#: Retries of a registry that is down for good: still retried, with short waits.
DOWN_RETRY = RetryPolicy(attempts=2, first_backoff_s=0.05, max_backoff_s=0.05, budget_s=1.0)


@dataclass
class Staged:
    settings: Settings
    clients: Clients
    v1: int
    v2: int


@pytest.fixture(scope="module")
def staged(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Staged]:
    clients = build_clients(stack_settings)
    uri = str(stack_settings.mlflow_tracking_uri)
    versions = []
    for seed in (0, 1):
        version = models.register_sklearn(uri, MODEL, seed=seed, reuse=True)
        report = run_check(stack_settings, clients, Policy(), model=MODEL, version=version,
                           workdir=tmp_path_factory.mktemp(f"v{version}"), stage=True)
        assert report.verdict == "passed"
        versions.append(version)
    yield Staged(stack_settings, clients, *versions)
    clients.close()


def _swap(s: Staged, target: int, clients: Clients | None = None) -> dict[str, Any]:
    return standalone.swap(s.settings, clients or s.clients, Policy(), model=MODEL, target=target,
                      force=True, requester="txn-test")


def _read(s: Staged, release_id: str) -> ReleaseRecord:
    """One record by id (ids sort by the second only: "newest" is ambiguous here)."""
    assert s.clients.storage is not None
    return Ledger(s.clients.storage).read(MODEL, release_id)


def _truth(s: Staged) -> tuple[Any, Any, dict[str, int]]:
    """(the version every replica serves, the pin's version, the aliases)."""
    doc = fleet_status(s.clients.replicas, MODEL)
    serving = doc["replicas"][0]["ready_versions"] if doc["consistent"] else "mixed"
    assert s.clients.storage is not None and s.clients.registry is not None
    pin = read_pin(s.clients.storage, repository_prefix=s.settings.repository_prefix,
                   model=MODEL, signing_key=key_bytes(s.settings.manifest_signing_key))
    return serving, pin.version if pin else None, s.clients.registry.aliases(MODEL)


def test_mlflow_down_after_the_switch_ends_incomplete_and_the_next_command_finishes(
        staged: Staged) -> None:
    s = staged
    assert _swap(s, s.v1)["status"] == "released"
    assert _truth(s) == ([s.v1], s.v1, {"production": s.v1})

    # MLflow down (a closed port): each call still retries, with short waits (the default
    # policy's 1-2-4 s backoff would only add sleep to a refusal that is certain)
    down = replace(s.clients, registry=RegistryClient("http://127.0.0.1:9", timeout_s=2.0,
                                                      retry=DOWN_RETRY))
    with pytest.raises(ReleaseIncomplete) as incomplete:
        _swap(s, s.v2, clients=down)
    record = _read(s, incomplete.value.details["release_id"])
    assert record.status == "incomplete" and record.exit_code == 1
    assert record.intent["from_version"] == s.v1 and record.intent["to_version"] == s.v2
    assert record.intent["committed_at"]  # the fleet switched: finished, never undone
    assert record.incomplete["goal"] == "released"
    assert f"alias production -> v{s.v2}" in record.incomplete["missing"]
    assert record.id in incomplete.value.message
    assert _truth(s) == ([s.v2], s.v2, {"production": s.v1})  # MLflow still says v1

    # The next command of any kind finishes it first: reconcile, wired as the CLI wires it.
    assert s.clients.storage is not None
    done = reconciling.reconcile(
        s.clients.replicas, storage=s.clients.storage,
        repository_prefix=s.settings.repository_prefix,
        signing_key=key_bytes(s.settings.manifest_signing_key), model=MODEL,
        recover=lambda name: fleet.recover_model(s.settings, s.clients, Policy(),
                                                 model=name, by="txn-test-reconcile"))
    finished = done["models"][0]["recovered"]["finished"]
    assert [(f["id"], f["goal"], f["status"]) for f in finished] == [
        (record.id, "released", "released")]
    assert _read(s, record.id).status == "released" and _read(s, record.id).incomplete == {}
    assert _truth(s) == ([s.v2], s.v2, {"production": s.v2, "previous": s.v1})
    assert s.clients.registry is not None
    assert s.clients.registry.version_tags(MODEL, s.v2)["modelship.release_id"] == record.id


def test_a_rerun_to_what_serves_repairs_the_aliases(staged: Staged) -> None:
    s = staged
    assert s.clients.registry is not None
    if _truth(s)[0] != [s.v2]:
        _swap(s, s.v2)
    s.clients.registry.set_alias(MODEL, "production", s.v1)  # the lie of defect 4
    result = _swap(s, s.v2)
    assert result["kind"] == "noop" and f"alias production -> v{s.v2}" in result["repaired"]
    assert _read(s, result["release_id"]).status == "noop"
    assert _truth(s)[2]["production"] == s.v2
    assert _swap(s, s.v2)["repaired"] == []  # nothing left to repair


def test_sigterm_during_the_switch_aborts_and_records_cancelled(
        staged: Staged, monkeypatch: pytest.MonkeyPatch) -> None:
    s = staged
    if _truth(s)[0] != [s.v2]:
        _swap(s, s.v2)
    before = _truth(s)
    replica = s.clients.replicas[-1]
    load = replica.load_model

    def load_then_stop(model: str, *args: Any, **kwargs: Any) -> Any:
        result = load(model, *args, **kwargs)
        config = json.loads(kwargs.get("config_json") or "{}")
        versions = config.get("version_policy", {}).get("specific", {}).get("versions")
        if versions == [str(s.v1)] and "dynamic_batching" not in config:
            os.kill(os.getpid(), signal.SIGTERM)  # the switch to v1 reached this replica
        return result

    monkeypatch.setattr(replica, "load_model", load_then_stop)
    with pytest.raises(ReleaseCancelled) as cancelled, stop_on_signals():
        _swap(s, s.v1)
    monkeypatch.undo()
    assert cancelled.value.exit_code == 143
    record = _read(s, cancelled.value.details["record"]["id"])
    assert (record.status, record.exit_code) == ("cancelled", 143)
    assert "SIGTERM" in (record.reason or "")
    assert _truth(s) == before  # fleet (with its config: consistent), pin and aliases
    assert fleet_status(s.clients.replicas, MODEL)["consistent"]


def test_a_rollback_during_a_live_release_names_it(staged: Staged) -> None:
    s = staged
    assert s.clients.storage is not None
    ledger = Ledger(s.clients.storage)
    live = ReleaseRecord.start("promote", MODEL, from_version=s.v1, to_version=s.v2,
                               requester="U-other")
    live.stages = [StageEntry("swap", now_iso(), outcome="ok"), StageEntry("bake", now_iso())]
    ledger.write(live)  # this process is its holder: alive, as a bake in another terminal
    try:
        with pytest.raises(ReleaseLocked) as refused:
            standalone.rollback(s.settings, s.clients, Policy(), model=MODEL, to=None)
        assert live.id in refused.value.message and "bake" in refused.value.message
        assert f"kill -TERM {os.getpid()}" in (refused.value.hint or "")
    finally:
        live.finish("failed", 1, "test record")
        ledger.write(live)
