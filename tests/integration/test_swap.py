"""The fleet swap on the real stack (two Triton replicas on an S3 repository).

Acceptance comes from a request log, as DESIGN §4 asks: a light load of unversioned
requests runs against both replicas through each swap, and the log must show no failed
request and no answer from the old version by a replica after it answered as the new one.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flows.check import run_check
from modelship.clients import Clients, build_clients
from modelship.errors import PreflightError, StagingError, SwapAborted
from modelship.policy import Policy, SwapPolicy
from modelship.settings import Settings
from modelship.storage import S3Storage
from modelship.triton.client import TritonServer
from modelship.triton.infer import TritonInference
from modelship.triton.model_config import from_pbtxt, to_json, to_pbtxt, with_versions
from tasks.swap import SwapOptions, SwapReport, SwapTarget, fleet_status, swap_fleet
from tests import models
from tests.faulty_replica import BeforeLoad, faulty, first_load_of

pytestmark = pytest.mark.integration

MODEL = "swapper"
OUTPUTS = ["label", "probabilities"]
FEED = {"input": np.random.default_rng(5).standard_normal((2, models.N_FEATURES))
        .astype(np.float32)}
CLIENTS_PER_REPLICA = 2


@dataclass
class Fleet:
    settings: Settings
    clients: Clients
    storage: S3Storage
    replicas: list[TritonServer]
    versions: dict[str, int]  # "v1", "v2" -> MLflow/Triton version numbers


@pytest.fixture(scope="module")
def fleet(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two checked and staged versions of the model; nothing loaded yet."""
    clients = build_clients(stack_settings)
    assert clients.storage is not None and len(clients.replicas) == 2
    uri = str(stack_settings.mlflow_tracking_uri)
    versions = {}
    for label, seed in (("v1", 0), ("v2", 1)):
        version = models.register_sklearn(uri, MODEL, seed=seed, reuse=True)
        report = run_check(stack_settings, clients, Policy(), model=MODEL, version=version,
                           workdir=tmp_path_factory.mktemp(label), stage=True)
        assert report.verdict == "passed"
        versions[label] = version
    yield Fleet(stack_settings, clients, clients.storage, clients.replicas, versions)
    clients.close()


def swap(fleet: Fleet, target: int, *, pause_batching: bool = True,
         before_load: BeforeLoad | None = None, deadline_s: float = 60,
         pause_mode: str = "separate", converge: bool = False) -> SwapReport:
    lines: list[str] = []
    try:
        with faulty(fleet.replicas, before_load) as replicas:
            return swap_fleet(
                replicas,
                SwapTarget.from_settings(fleet.settings, fleet.storage, model=MODEL,
                                         version=target, probe_feed=FEED,
                                         probe_outputs=OUTPUTS),
                SwapOptions(SwapPolicy(pause_batching=pause_batching, deadline_s=deadline_s,
                                       probe_timeout_s=min(5.0, deadline_s / 2),
                                       pause_mode=pause_mode),  # type: ignore[arg-type]
                            http_timeout_s=fleet.settings.http_timeout_s, converge=converge),
                progress=lines.append)
    finally:
        print("\n".join(lines))


def settle(fleet: Fleet, version: int) -> SwapReport:
    """A test's starting point: every replica serves ``version`` (a no-op when it does
    already). Setup, not the subject: no batching pause, one reload per replica rather than
    three (the pause is tested where a swap is the subject)."""
    return swap(fleet, version, pause_batching=False)


def assert_skew_bounded(report: SwapReport, *, deadline_s: float) -> None:
    """The skew is the spread of the replicas' first answers as C, each answer fell inside
    the swap, and the spread is within one phase deadline (a later replica aborts)."""
    answered = list(report.timeline.values())
    assert answered and all(0 < t <= report.total_s for t in answered), report.timeline
    assert report.skew_ms == pytest.approx((max(answered) - min(answered)) * 1000)
    assert report.skew_ms <= deadline_s * 1000


def answers(server: TritonServer) -> str:
    inference = TritonInference(server.endpoint.http, timeout_s=10)
    try:
        return inference.infer(MODEL, FEED, outputs=OUTPUTS).model_version
    finally:
        inference.close()


def assert_serves(fleet: Fleet, version: int) -> None:
    """Every replica reports exactly ``version`` READY and answers as it."""
    for server in fleet.replicas:
        deadline = time.monotonic() + 10  # the old version unloads just after the switch
        while True:
            index = [m for m in server.repository_index()
                     if m.get("name") == MODEL and m.get("state") == "READY"]
            if [m["version"] for m in index] == [str(version)] or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert [m["version"] for m in index] == [str(version)], (server.name, index)
        assert answers(server) == str(version)
    status = fleet_status(fleet.replicas, MODEL)
    assert status["consistent"], status
    assert {tuple(r["ready_versions"]) for r in status["replicas"]} == {(version,)}


@dataclass
class LoadLog:
    """Unversioned requests, in a loop, from a few threads per replica, until stopped."""

    replicas: list[TritonServer]
    # (replica, thread, sent at, answered at (monotonic s), answering version or "error: ...")
    entries: list[tuple[str, int, float, float, str]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    threads: list[threading.Thread] = field(default_factory=list)

    def _client(self, server: TritonServer, worker: int) -> None:
        inference = TritonInference(server.endpoint.http, timeout_s=10)
        try:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    version = inference.infer(MODEL, FEED, outputs=OUTPUTS).model_version
                except Exception as exc:  # noqa: BLE001 - every failure is logged and counted
                    version = f"error: {exc}"
                self.entries.append((server.name, worker, sent, time.monotonic(), version))
        finally:
            inference.close()

    def __enter__(self) -> LoadLog:
        for server in self.replicas:
            for worker in range(CLIENTS_PER_REPLICA):
                thread = threading.Thread(target=self._client, args=(server, worker),
                                          daemon=True)
                thread.start()
                self.threads.append(thread)
        time.sleep(0.3)  # requests are flowing before the swap starts
        return self

    def __exit__(self, *exc: object) -> None:
        time.sleep(0.3)
        self.stop.set()
        for thread in self.threads:
            thread.join(timeout=15)

    def errors(self) -> list[tuple[str, int, float, float, str]]:
        return [e for e in self.entries if e[4].startswith("error")]

    def stale(self, old: int, new: int) -> list[str]:
        """Answers from ``old`` by a replica after that replica answered as ``new``."""
        found = []
        for server in self.replicas:
            mine = sorted((e for e in self.entries if e[0] == server.name), key=lambda e: e[2])
            first_new = min((e[3] for e in mine if e[4] == str(new)), default=None)
            if first_new is None:
                found.append(f"{server.name} never answered as v{new}")
                continue
            late = [e for e in mine if e[2] > first_new and e[4] == str(old)]
            found += [f"{server.name} answered v{old} to a request sent "
                      f"{e[2] - first_new:.3f} s after it answered v{new}" for e in late]
        return found

    def summary(self) -> dict[str, Any]:
        by: dict[str, int] = {}
        for entry in self.entries:
            key = entry[4] if not entry[4].startswith("error") else "error"
            by[key] = by.get(key, 0) + 1
        return {"requests": len(self.entries), "by_answer": by}


def test_first_deploy_serves_v1_on_every_replica(fleet: Fleet) -> None:
    v1 = fleet.versions["v1"]
    report = swap(fleet, v1)
    assert report.kind == "first_deploy" and not report.aborted
    assert [p.name for p in report.phases] == ["deploy"]
    assert set(report.timeline) == {s.name for s in fleet.replicas}
    assert_skew_bounded(report, deadline_s=60)
    assert_serves(fleet, v1)


def test_swap_v1_to_v2_under_load_fails_no_request_and_never_goes_back(
        fleet: Fleet) -> None:
    v1, v2 = fleet.versions["v1"], fleet.versions["v2"]
    settle(fleet, v1)  # a no-op after the first deploy; a first deploy when run alone
    with LoadLog(fleet.replicas) as load:
        report = swap(fleet, v2, pause_batching=True)
    print("load:", load.summary(), "report:", report.to_dict())
    assert report.kind == "swap" and not report.aborted
    assert (report.from_version, report.to_version) == (v1, v2)
    assert [p.name for p in report.phases] == ["pause_batching", "switch", "resume_batching"]
    assert all(r["ok"] for p in report.phases for r in p.replicas.values())
    assert load.errors() == []
    assert load.stale(v1, v2) == []
    assert load.summary()["by_answer"].get(str(v2), 0) > 0
    assert set(report.timeline) == {s.name for s in fleet.replicas}
    assert_skew_bounded(report, deadline_s=60)
    assert {s["version"] for s in report.final_states.values()} == {v2}
    assert_serves(fleet, v2)

    # a later plain load agrees with what serves: the model's config.pbtxt is C's
    key = f"{fleet.settings.repository_prefix}/{MODEL}/config.pbtxt"
    staged = from_pbtxt(fleet.storage.get_bytes(
        f"{fleet.settings.repository_prefix}/{MODEL}/{v2}/config.pbtxt").decode())
    assert fleet.storage.get_bytes(key).decode() == to_pbtxt(with_versions(staged, [v2]))

    as_dict = report.to_dict()
    assert {"model", "kind", "from_version", "to_version", "pause_batching", "phases",
            "timeline", "skew_ms", "total_s", "aborted", "final_states"} <= set(as_dict)


def test_running_it_again_is_a_noop(fleet: Fleet) -> None:
    v2 = fleet.versions["v2"]
    settle(fleet, v2)
    report = swap(fleet, v2)
    assert report.kind == "noop" and report.phases == [] and not report.aborted
    assert_serves(fleet, v2)


def test_a_mixed_fleet_is_refused_before_anything_changes(fleet: Fleet) -> None:
    v1, v2 = fleet.versions["v1"], fleet.versions["v2"]
    settle(fleet, v1)
    odd = fleet.replicas[1]
    config = from_pbtxt(fleet.storage.get_bytes(
        f"{fleet.settings.repository_prefix}/{MODEL}/{v2}/config.pbtxt").decode())
    odd.load_model(MODEL, config_json=to_json(with_versions(config, [v2])))
    try:
        with pytest.raises(PreflightError) as info:
            swap(fleet, v2)
        assert "disagree on the version" in info.value.message
        assert f"{odd.name} serves v{v2}" in info.value.message
        assert f"{fleet.replicas[0].name} serves v{v1}" in info.value.message
        assert odd.is_model_ready(MODEL, str(v2))  # refused: nothing was touched
        assert "--converge" in str(info.value.hint)
        # Issues 8 and 10: the same mixed fleet, converged on v1 (a rollback's target).
        with LoadLog(fleet.replicas) as load:
            report = swap(fleet, v1, converge=True)
        assert report.kind == "converge" and not report.aborted
        assert any("the fleet is mixed" in line for line in report.plan)
        assert [p.name for p in report.phases] == ["converge"]
        assert load.errors() == []
    finally:
        if odd.is_model_ready(MODEL, str(v2)):
            odd.load_model(MODEL, config_json=to_json(with_versions(config, [v1])))
    assert_serves(fleet, v1)


def test_a_candidate_whose_files_changed_is_refused(fleet: Fleet, tmp_path: Path) -> None:
    v1 = fleet.versions["v1"]
    settle(fleet, v1)
    # v1's bytes as a new version, staged on its own: its check is the cache's pass of
    # those bytes (the subject is the swap's preflight of v3's staged files)
    v3 = models.register_sklearn(str(fleet.settings.mlflow_tracking_uri), MODEL, seed=0,
                                 reuse=True)
    report = run_check(fleet.settings, fleet.clients, Policy(), model=MODEL, version=v3,
                       workdir=tmp_path, stage=True)
    assert report.verdict == "passed"
    folder = f"{fleet.settings.repository_prefix}/{MODEL}/{v3}"
    # Issue 10, fault 1: same size, the original sha256 in the metadata; only the bytes
    # differ. The preflight streams and hashes them: refused, exit 3, nothing touched.
    original = fleet.storage.get_bytes(f"{folder}/model.onnx")
    head = fleet.storage.head(f"{folder}/model.onnx")
    assert head is not None
    tampered = original[:-1] + bytes([original[-1] ^ 0x01])
    fleet.storage.put_bytes(f"{folder}/model.onnx", tampered, metadata=head["metadata"])
    with pytest.raises(StagingError) as info:
        swap(fleet, v3)
    assert info.value.exit_code == 3
    assert "model.onnx has sha256" in info.value.message and "(content)" in info.value.message
    assert_serves(fleet, v1)

    fleet.storage.delete_key(f"{folder}/model.onnx")
    with pytest.raises(StagingError) as info:
        swap(fleet, v3)
    assert "model.onnx is missing" in info.value.message
    assert info.value.exit_code == 3
    assert_serves(fleet, v1)
    # v3's folder is broken: remove it so later (re)loads do not download it
    fleet.storage.delete_prefix(f"{fleet.settings.repository_prefix}/{MODEL}/{v3}/")


def test_a_switch_failing_on_one_replica_aborts_every_replica_back_to_v1(
        fleet: Fleet) -> None:
    v1, v2 = fleet.versions["v1"], fleet.versions["v2"]
    settle(fleet, v1)
    victim = fleet.replicas[1].name

    def fault(replica: str) -> None:
        if replica == victim:
            raise RuntimeError("injected: replica lost its GPU")

    with LoadLog(fleet.replicas) as load, pytest.raises(SwapAborted) as info:
        swap(fleet, v2, before_load=first_load_of(v2, fault))
    print("load:", load.summary())
    error = info.value
    report = error.details["report"]
    assert report["aborted"] and "injected" in report["reason"]
    assert f"switch failed on {victim}" in error.message
    for server in fleet.replicas:
        assert f"{server.name}: restored, serves v{v1}" in error.message
    assert [p["name"] for p in report["phases"]] == ["pause_batching", "switch", "abort"]
    assert {s["version"] for s in report["final_states"].values()} == {v1}
    assert load.errors() == []
    assert_serves(fleet, v1)


def test_a_replica_past_the_deadline_aborts_and_its_late_thread_changes_nothing(
        fleet: Fleet) -> None:
    """The victim's switch load is held in flight past the deadline, then lands: the
    phase fails naming the deadline, and the abort leaves every replica on v1."""
    v1, v2 = fleet.versions["v1"], fleet.versions["v2"]
    settle(fleet, v1)
    victim = fleet.replicas[0].name
    deadline_s = 5.0

    def fault(replica: str) -> None:
        if replica == victim:
            time.sleep(deadline_s + 0.5)  # a load that hangs past the deadline

    with pytest.raises(SwapAborted) as info:
        swap(fleet, v2, before_load=first_load_of(v2, fault), deadline_s=deadline_s)
    report = info.value.details["report"]
    switch = next(p for p in report["phases"] if p["name"] == "switch")
    assert not switch["replicas"][victim]["ok"]
    assert "deadline" in switch["replicas"][victim]["reason"]
    assert {s["version"] for s in report["final_states"].values()} == {v1}
    time.sleep(1.5)  # the victim's late load has landed by now: the abort came after it
    assert_serves(fleet, v1)


def test_rollback_is_a_swap_back_without_the_pause(fleet: Fleet) -> None:
    v1, v2 = fleet.versions["v1"], fleet.versions["v2"]
    settle(fleet, v2)
    with LoadLog(fleet.replicas) as load:
        report = swap(fleet, v1, pause_batching=False)
    print("load:", load.summary(), "report:", report.to_dict())
    assert report.kind == "swap" and (report.from_version, report.to_version) == (v2, v1)
    assert [p.name for p in report.phases] == ["switch"]
    assert load.errors() == []
    assert load.stale(v2, v1) == []
    assert_serves(fleet, v1)


def test_pause_at_switch_under_load_fails_no_request_and_never_goes_back(fleet: Fleet) -> None:
    v1, v2 = fleet.versions["v1"], fleet.versions["v2"]
    settle(fleet, v1)
    with LoadLog(fleet.replicas) as load:
        report = swap(fleet, v2, pause_mode="at_switch")
    print("load:", load.summary(), "report:", report.to_dict())
    assert [p.name for p in report.phases] == ["switch", "resume_batching"]
    assert load.errors() == []
    assert load.stale(v1, v2) == []
    assert_serves(fleet, v2)


def test_an_unsigned_or_forged_manifest_is_refused_with_exit_3(fleet: Fleet) -> None:
    v1, v2 = fleet.versions["v1"], fleet.versions["v2"]
    settle(fleet, v1)
    mkey = f"{fleet.settings.repository_prefix}/{MODEL}/{v2}/release.json"
    genuine = fleet.storage.get_bytes(mkey)
    manifest = json.loads(genuine)
    try:
        unsigned = {k: v for k, v in manifest.items() if k != "signature"}
        fleet.storage.put_bytes(mkey, json.dumps(unsigned).encode())
        with pytest.raises(StagingError, match="it is not signed") as info:
            swap(fleet, v2)
        assert info.value.exit_code == 3
        forged = {**manifest, "created_at": "2020-01-01T00:00:00Z"}
        fleet.storage.put_bytes(mkey, json.dumps(forged).encode())
        with pytest.raises(StagingError, match="does not match its content"):
            swap(fleet, v2)
        assert_serves(fleet, v1)
    finally:
        fleet.storage.put_bytes(mkey, genuine)


def test_other_bytes_under_the_right_version_fail_the_golden_probe_and_abort(
        fleet: Fleet) -> None:
    """Bytes changed after the preflight (P's graph under C's number) never stay serving."""
    v1, v2 = fleet.versions["v1"], fleet.versions["v2"]
    settle(fleet, v1)
    prefix = fleet.settings.repository_prefix
    names = sorted(json.loads(fleet.storage.get_bytes(
        f"{prefix}/{MODEL}/{v2}/release.json"))["files"])
    originals = {n: (fleet.storage.get_bytes(f"{prefix}/{MODEL}/{v2}/{n}"),
                     (fleet.storage.head(f"{prefix}/{MODEL}/{v2}/{n}") or {})["metadata"])
                 for n in names}
    lock = threading.Lock()
    done: list[bool] = []

    def fault(replica: str) -> None:
        with lock:  # every replica waits until C's files hold P's bytes
            if not done:
                for name in names:
                    fleet.storage.put_bytes(
                        f"{prefix}/{MODEL}/{v2}/{name}",
                        fleet.storage.get_bytes(f"{prefix}/{MODEL}/{v1}/{name}"))
                done.append(True)

    try:
        with pytest.raises(SwapAborted) as info:
            swap(fleet, v2, before_load=first_load_of(v2, fault))
    finally:
        for name, (body, metadata) in originals.items():
            fleet.storage.put_bytes(f"{prefix}/{MODEL}/{v2}/{name}", body, metadata=metadata)
    report = info.value.details["report"]
    switch = next(p for p in report["phases"] if p["name"] == "switch")
    reasons = [r["reason"] or "" for r in switch["replicas"].values()]
    assert any("differ from those recorded at staging" in r for r in reasons), reasons
    assert {s["version"] for s in report["final_states"].values()} == {v1}
    assert_serves(fleet, v1)
