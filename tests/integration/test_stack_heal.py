"""A stack of our own that heals itself (issue 10, fault 4 and the hygiene items).

It is not the session stack: this module starts a one-replica stack in its own home, kills
parts of it, and stops it at the end, so no other test is harmed. The stack comes up
through the console script (`modelship stack up --replicas 1 --json`), so the same stack
also proves `stack up | status | down` end to end: the first test reads `up`'s answer, the
last one runs `stack down` and finds nothing left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flows.check import run_check
from modelship.clients import Clients, build_clients
from modelship.errors import UsageError
from modelship.policy import Policy, SwapPolicy
from modelship.settings import Settings
from modelship.signing import key_bytes
from modelship.stack import manager
from modelship.stack.process import (
    ProcessRecord,
    group_members,
    is_alive,
    listening_pids,
    port_open,
    shm_regions,
    stop_process,
)
from modelship.stack.state import process_records, read_state
from modelship.triton.infer import TritonInference
from tasks.reconcile import reconcile, reconcile_stack
from tasks.swap import SwapOptions, SwapTarget, fleet_status, pin_signature, swap_fleet
from tests import models
from tests.conftest import base_settings, run_cli, stack_settings_at, start_cli
from tests.e2e.test_stack_cli import processes_mentioning
from tests.faults import kill_component
from tests.inprocess import run_inprocess

pytestmark = pytest.mark.integration

MODEL = "healer"
FEED = {"input": np.random.default_rng(3).standard_normal((1, models.N_FEATURES))
        .astype(np.float32)}


@dataclass
class OwnStack:
    settings: Settings
    clients: Clients
    version: int
    #: `modelship stack up --replicas 1 --json` as it answered, and stack.json right after
    up: subprocess.CompletedProcess[str]
    state: dict[str, Any]
    #: every server process this stack has had, restarts included (`down` leaves none)
    ever: list[ProcessRecord] = field(default_factory=list)


def record(settings: Settings, name: str) -> ProcessRecord:
    state = read_state(settings.stack_file)
    assert state is not None
    return next(r for r in process_records(state) if r.name == name)


def hook(state: dict[str, object]) -> dict[str, object]:
    return reconcile_stack(state, progress=print)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnStack]:
    home = tmp_path_factory.mktemp("heal") / ".modelship"
    base = base_settings(home)
    try:
        up = run_cli("stack", "up", "--replicas", "1", "--json", home=home)
        assert up.returncode == 0, up.stderr[-3000:]
        state = json.loads((home / "stack.json").read_text())
        settings = stack_settings_at(home)
        clients = build_clients(settings)
        assert clients.storage is not None
        version = models.register_sklearn(str(settings.mlflow_tracking_uri), MODEL, seed=5)
        report = run_check(settings, clients, Policy(), model=MODEL, version=version,
                           workdir=tmp_path_factory.mktemp("check"), stage=True)
        assert report.verdict == "passed"
        swap_fleet(clients.replicas,
                   SwapTarget.from_settings(settings, clients.storage, model=MODEL,
                                            version=version, probe_feed=FEED,
                                            probe_outputs=["label"]),
                   SwapOptions(SwapPolicy()))
        yield OwnStack(settings, clients, version, up, state,
                       ever=[ProcessRecord.from_dict(p) for p in state["processes"]])
        clients.close()
    finally:
        manager.down(base)


def answers(stack: OwnStack) -> str:
    inference = TritonInference(stack.clients.replicas[0].endpoint.http, timeout_s=10)
    try:
        return inference.infer(MODEL, FEED, outputs=["label"]).model_version
    finally:
        inference.close()


@pytest.mark.e2e
def test_stack_up_answers_with_its_endpoints_and_up_again_is_idempotent(
        own_stack: OwnStack) -> None:
    home = own_stack.settings.home
    doc = json.loads(own_stack.up.stdout)
    assert set(doc) >= {"mlflow_uri", "s3_endpoint", "bucket", "prefect_api_url",
                        "slack_api_url", "approvals_url", "triton"}
    assert doc["approvals_url"].startswith("http://127.0.0.1:")
    assert len(doc["triton"]["replicas"]) == 1
    assert set(doc["triton"]["canary"]) == {"http", "grpc", "metrics"}
    assert (home / "stack.json").stat().st_mode & 0o777 == 0o600
    records = [ProcessRecord.from_dict(p) for p in own_stack.state["processes"]]
    assert {r.name for r in records} == {"seaweedfs", "mlflow", "prefect", "slack", "approvals",
                                         "webhooks", "triton-0", "canary", "gateway"}

    status = run_cli("stack", "status", "--json", home=home)
    assert status.returncode == 0
    assert json.loads(status.stdout)["triton"] == doc["triton"]

    before = json.loads((home / "stack.json").read_text())["processes"]
    assert all(is_alive(ProcessRecord.from_dict(p)) for p in before)
    # `up` again and `up` with another count: the console script's own function, in this
    # process (the same arguments, exit code and output; its interpreter start is the
    # fixture's `up`, above, and the racing `up`s below)
    again = run_inprocess("stack", "up", "--replicas", "1", home=home)
    assert again.returncode == 0
    assert "already running" in again.stdout
    assert json.loads((home / "stack.json").read_text())["processes"] == before

    wrong_count = run_inprocess("stack", "up", "--replicas", "3", home=home)
    assert wrong_count.returncode == 1
    assert "stack down" in wrong_count.stderr


def test_a_killed_replica_is_restarted_alone_and_serves_production_before_up_returns(
        own_stack: OwnStack) -> None:
    settings = own_stack.settings
    victim = record(settings, "triton-0")
    others = {r.name: r.pid for r in process_records(read_state(settings.stack_file) or {})
              if r.name != "triton-0"}
    regions = shm_regions([victim.pid, *group_members(victim.pid)])
    assert regions, "a serving Triton maps its backend's shm regions"
    os.kill(victim.pid, signal.SIGKILL)
    end = time.monotonic() + 30  # dead before `up` looks (a fixed 0.5 s was a guess)
    while is_alive(victim) and time.monotonic() < end:
        time.sleep(0.05)

    state, report = manager.up(settings, replicas=1, on_ready=hook)
    assert report.restarted == ["triton-0"]
    assert report.reconciled is not None and report.reconciled["ok"], report.reconciled
    (healed,) = report.reconciled["models"]
    assert healed["model"] == MODEL and healed["changed"] == ["triton-0"]
    # it serves production the moment `up` returns: no manual swap
    assert answers(own_stack) == str(own_stack.version)
    # nothing else was restarted
    assert {r.name: r.pid for r in process_records(state) if r.name != "triton-0"} == others
    # the killed server's orphaned shm regions are gone
    assert not [p for p in regions if Path(p).exists()]

    # again: all up, nothing restarted, nothing changed
    _, again = manager.up(settings, replicas=1, on_ready=hook)
    assert again.already_running and again.restarted == []
    assert again.reconciled is not None and again.reconciled["changed"] == 0


def test_reconcile_fixes_a_replica_left_on_another_config(own_stack: OwnStack) -> None:
    settings, clients = own_stack.settings, own_stack.clients
    assert clients.storage is not None
    replica = clients.replicas[0]
    replica.unload_model(MODEL)
    deadline = time.monotonic() + 20
    while replica.is_model_ready(MODEL) and time.monotonic() < deadline:
        time.sleep(0.1)
    kwargs = {"storage": clients.storage, "repository_prefix": settings.repository_prefix,
              "signing_key": key_bytes(settings.manifest_signing_key), "model": MODEL}
    planned = reconcile(clients.replicas, dry_run=True, **kwargs)  # type: ignore[arg-type]
    assert planned["changed"] == 0 and "would load triton-0" in planned["models"][0]["status"]
    done = reconcile(clients.replicas, **kwargs)  # type: ignore[arg-type]
    assert done["ok"] and done["changed"] == 1
    assert answers(own_stack) == str(own_stack.version)
    assert reconcile(clients.replicas, **kwargs)["changed"] == 0  # type: ignore[arg-type]


def test_an_unsigned_pin_is_never_loaded(own_stack: OwnStack) -> None:
    settings, clients = own_stack.settings, own_stack.clients
    assert clients.storage is not None
    key = f"{settings.repository_prefix}/{MODEL}/config.pbtxt"
    body = clients.storage.get_bytes(key)
    head = clients.storage.head(key)
    assert head is not None
    try:
        kwargs = {"storage": clients.storage, "repository_prefix": settings.repository_prefix,
                  "signing_key": key_bytes(settings.manifest_signing_key), "model": MODEL}
        clients.replicas[0].unload_model(MODEL)
        clients.storage.put_bytes(key, body)  # same bytes, signature metadata dropped
        result = reconcile(clients.replicas, **kwargs)  # type: ignore[arg-type]
        assert result["changed"] == 0 and "nothing loaded" in result["models"][0]["status"]
        # a pin re-signed with another key (or edited) is refused outright
        clients.storage.put_bytes(key, body, metadata={
            "modelship-pin-signature": pin_signature(body, b"k" * 32)})
        result = reconcile(clients.replicas, **kwargs)  # type: ignore[arg-type]
        assert not result["ok"] and "not signed with our key" in result["models"][0]["error"]
        assert result["models"][0]["exit_code"] == 3
        assert not clients.replicas[0].is_model_ready(MODEL)
    finally:
        clients.storage.put_bytes(key, body, metadata=head["metadata"])
        reconcile(clients.replicas, storage=clients.storage,
                  repository_prefix=settings.repository_prefix,
                  signing_key=key_bytes(settings.manifest_signing_key), model=MODEL)
    assert answers(own_stack) == str(own_stack.version)


def test_status_answers_from_the_replicas_while_s3_is_down(own_stack: OwnStack) -> None:
    settings, clients = own_stack.settings, own_stack.clients
    assert clients.storage is not None
    stop_process(record(settings, "seaweedfs"))
    try:
        status = fleet_status(clients.replicas, MODEL, storage=clients.storage)
        assert status["replicas"][0]["ready_versions"] == [own_stack.version]
        assert status["consistent"] and status["served"]
        assert status["repository"]["reachable"] is False
        assert any("S3" in n and "still serve" in n for n in status["notes"])
        unknown = fleet_status(clients.replicas, "no-such-model")
        assert not unknown["served"] and "no replica serves no-such-model" in unknown["summary"]
    finally:
        _, report = manager.up(settings, replicas=1, on_ready=hook)
    assert report.restarted == ["seaweedfs"]
    clients.storage.ping()


def test_secrets_stay_out_of_argv_and_logs(own_stack: OwnStack) -> None:
    settings = own_stack.settings
    assert settings.slack_token is not None
    token = settings.slack_token.get_secret_value()
    slack = record(settings, "slack")
    assert token.encode() not in Path(f"/proc/{slack.pid}/cmdline").read_bytes()
    for log in (settings.home / "logs").iterdir():
        assert token not in log.read_text(errors="replace"), log
    state = json.loads(settings.stack_file.read_text())
    assert state["commands"]["slack"]["argv"] and token not in json.dumps(state["commands"])


def test_replicas_zero_is_a_usage_error(own_stack: OwnStack) -> None:
    with pytest.raises(UsageError) as info:
        manager.up(own_stack.settings, replicas=0)
    assert info.value.exit_code == 2


def prefect_servers(home: Path) -> list[int]:
    """The live Prefect servers of the stack in ``home`` (their environment names its
    Prefect home), however they were started."""
    marker = f"PREFECT_HOME={home.resolve() / 'data' / 'prefect'}".encode()
    return [pid for pid in started_in(home) if marker in _environ(pid)]


def started_in(home: Path) -> list[int]:
    """Live processes whose environment points at ``home``: the stack's servers, and any
    process one of its commands (or a Prefect client in them) left behind."""
    markers = (f"MODELSHIP_HOME={home}".encode(), f"MODELSHIP_HOME={home.resolve()}".encode(),
               f"PREFECT_HOME={home.resolve() / 'data' / 'prefect'}".encode())
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            environ = _environ(int(entry.name))
            if any(m + b"\0" in environ + b"\0" for m in markers) \
                    and is_alive(ProcessRecord(entry.name, int(entry.name), None, (), "")):
                found.append(int(entry.name))
    return found


def _environ(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return b""


def test_prefect_killed_as_the_fault_matrix_does_then_two_ups_at_once_leave_one_prefect(
        own_stack: OwnStack) -> None:
    """The fault matrix's path (tests.faults.kill_component: SIGKILL of Prefect's process
    group, then `modelship stack up`), with two `up` racing on the home: one restarts
    Prefect, the other waits for it and finds the stack running."""
    settings, home = own_stack.settings, own_stack.settings.home
    old = record(settings, "prefect")
    kill_component(home, "prefect")
    ups = [start_cli("stack", "up", "--replicas", "1", "--json", home=home) for _ in range(2)]
    answers_ = [up.communicate(timeout=300) for up in ups]
    assert [up.returncode for up in ups] == [0, 0], [err[-2000:] for _, err in answers_]
    restarted = sorted(json.loads(out)["startup"]["restarted"] for out, _ in answers_)
    assert restarted == [[], ["prefect"]]
    new = record(settings, "prefect")
    own_stack.ever.append(new)
    assert new.pid != old.pid and is_alive(new) and not is_alive(old)
    assert new.pgid == new.pid  # a session of its own: `down` stops its whole group
    (port,) = new.ports
    assert listening_pids([port]) == {port: [new.pid]}
    assert prefect_servers(home) == [new.pid]


@pytest.mark.e2e
def test_stack_down_stops_everything_and_leaves_nothing_behind(own_stack: OwnStack) -> None:
    """Last in this module: the stack is gone afterwards (the fixture's down is a no-op).

    Prefect's record is first made to name the server the fault matrix killed (as if a
    restart had lost track of the live one): `down` still stops the live one, found on the
    recorded port running Prefect's own command line."""
    home = own_stack.settings.home
    state = json.loads((home / "stack.json").read_text())
    records = [ProcessRecord.from_dict(p) for p in state["processes"]]
    ports = [p for r in records for p in r.ports]
    assert {r.name for r in records} == {r["name"] for r in own_stack.state["processes"]}
    live_prefect = record(own_stack.settings, "prefect")
    lost = next(r for r in own_stack.ever if r.name == "prefect" and not is_alive(r))
    state["processes"] = [{**p, "pid": lost.pid, "start_ticks": lost.start_ticks}
                          if p["name"] == "prefect" else p for p in state["processes"]]
    (home / "stack.json").write_text(json.dumps(state))
    assert started_in(home)  # the servers are found this way
    down = run_cli("stack", "down", "--json", home=home)
    assert down.returncode == 0, down.stderr
    doc = json.loads(down.stdout)
    assert sorted(doc["stopped"]) == sorted(r.name for r in records if r.name != "prefect")
    assert doc["already_stopped"] == ["prefect"]
    assert doc["strays_stopped"] == [{"name": "prefect", "pid": live_prefect.pid,
                                      "port": live_prefect.ports[0]}]
    # nothing of the stack is left: by PID (every server it ever had), by port, by
    # command line and by environment
    assert not [r for r in [*records, *own_stack.ever, live_prefect] if is_alive(r)]
    assert not [p for p in ports if port_open(p)]
    assert not processes_mentioning(str(home))
    assert not started_in(home)
    assert not (home / "stack.json").exists()
