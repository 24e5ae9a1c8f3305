"""Faults that kill a replica, on a fleet of our own tritonservers (never the session's).

The servers serve the session stack's S3 repository, as stack replicas do, but they are
started and stopped (by PID) by this module, so killing one harms no other test.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from flows.check import run_check
from modelship.clients import build_clients
from modelship.errors import SwapAborted
from modelship.policy import Policy, SwapPolicy
from modelship.settings import Settings, TritonEndpoint
from modelship.stack.local_triton import LocalTriton, local_tritonserver
from modelship.storage import S3Storage
from modelship.triton.client import TritonServer
from modelship.triton.infer import TritonInference
from tasks.swap import SwapOptions, SwapReport, SwapTarget, fleet_status, swap_fleet
from tests import models
from tests.conftest import RUNTIME_VENV
from tests.faulty_replica import BeforeLoad, faulty, first_load_of

pytestmark = pytest.mark.integration

MODEL = "killed"
OUTPUTS = ["label", "probabilities"]
FEED = {"input": np.random.default_rng(7).standard_normal((1, models.N_FEATURES))
        .astype(np.float32)}
DEADLINE_S = 60.0
ABORT_BOUND_S = 15.0  # the abort must take seconds, far below the 60 s deadline


@dataclass
class OwnFleet:
    settings: Settings
    storage: S3Storage
    servers: list[LocalTriton]
    replicas: list[TritonServer]
    versions: tuple[int, int]


@pytest.fixture(scope="module")
def own_fleet(stack_settings: Settings,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[OwnFleet]:
    clients = build_clients(stack_settings)
    assert clients.storage is not None
    uri = str(stack_settings.mlflow_tracking_uri)
    versions = []
    for seed in (0, 1):  # the seeds the other swap tests register: their checks are reused
        version = models.register_sklearn(uri, MODEL, seed=seed, reuse=True)
        report = run_check(stack_settings, clients, Policy(), model=MODEL, version=version,
                           workdir=tmp_path_factory.mktemp(f"check{version}"), stage=True)
        assert report.verdict == "passed"
        versions.append(version)
    repository = f"{stack_settings.s3_endpoint}/{stack_settings.bucket}/" \
        f"{stack_settings.repository_prefix}".replace("http://", "s3://")
    assert stack_settings.aws_secret_access_key is not None
    credentials = (str(stack_settings.aws_access_key_id),
                   stack_settings.aws_secret_access_key.get_secret_value())
    with ExitStack() as stack:
        servers = [stack.enter_context(local_tritonserver(
            RUNTIME_VENV, repository, tmp_path_factory.mktemp(f"triton{i}"),
            s3_credentials=credentials)) for i in range(2)]
        replicas = [TritonServer(TritonEndpoint(http=s.http_url, grpc=s.grpc_url,
                                                metrics=s.metrics_url, name=f"own-{i}"),
                                 timeout_s=5, control_timeout_s=60)
                    for i, s in enumerate(servers)]
        fleet = OwnFleet(stack_settings, clients.storage, servers, replicas,
                         (versions[0], versions[1]))
        swap(fleet, versions[0])  # first deploy
        yield fleet
        for replica in replicas:
            replica.close()
    clients.close()


def swap(fleet: OwnFleet, target: int, before_load: BeforeLoad | None = None) -> SwapReport:
    with faulty(fleet.replicas, before_load) as replicas:
        return swap_fleet(
            replicas,
            SwapTarget.from_settings(fleet.settings, fleet.storage, model=MODEL,
                                     version=target, probe_feed=FEED, probe_outputs=OUTPUTS),
            SwapOptions(SwapPolicy(deadline_s=DEADLINE_S, probe_timeout_s=5.0)),
            progress=print)


class Load:
    """Unversioned requests to one replica in a loop; logs (sent, answered, version)."""

    def __init__(self, server: TritonServer) -> None:
        self.server = server
        self.log: list[tuple[float, float, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        inference = TritonInference(self.server.endpoint.http, timeout_s=10)
        try:
            while not self.stop.is_set():
                sent = time.monotonic()
                try:
                    version = inference.infer(MODEL, FEED, outputs=OUTPUTS).model_version
                except Exception as exc:  # noqa: BLE001 - every failure is logged
                    version = f"error: {exc}"
                self.log.append((sent, time.monotonic(), version))
        finally:
            inference.close()

    def served(self, version: int) -> tuple[float, float] | None:
        """First and last answer time as ``version``, or None if it never answered so."""
        times = [answered for _, answered, v in self.log if v == str(version)]
        return (min(times), max(times)) if times else None


def test_a_replica_killed_as_the_switch_starts_aborts_within_seconds(
        own_fleet: OwnFleet) -> None:
    """Issue 10, fault 3: a SIGKILLed replica used to hold the abort for the deadline."""
    v1, v2 = own_fleet.versions
    victim = own_fleet.servers[0]
    victim_name, survivor_replica = own_fleet.replicas[0].name, own_fleet.replicas[1]
    killed: list[float] = []

    def fault(replica: str) -> None:
        if replica == victim_name and not killed:
            os.kill(victim.process.pid, signal.SIGKILL)
            killed.append(time.monotonic())

    load = Load(survivor_replica)
    load.thread.start()
    time.sleep(0.3)
    try:
        with pytest.raises(SwapAborted) as info:
            swap(own_fleet, v2, before_load=first_load_of(v2, fault))
        aborted_at = time.monotonic()
        time.sleep(0.5)
    finally:
        load.stop.set()
        load.thread.join(timeout=15)
    report = info.value.details["report"]
    assert killed, "the victim was never killed"
    took = aborted_at - killed[0]
    served_c = load.served(v2)
    served_s = served_c[1] - served_c[0] if served_c else 0.0
    print(f"abort {took:.2f} s after the kill; the survivor served v{v2} for {served_s:.2f} s;"
          f" report total {report['total_s']} s")
    assert took < ABORT_BOUND_S, report
    assert served_s < ABORT_BOUND_S
    assert report["total_s"] < ABORT_BOUND_S
    states = report["final_states"]
    assert states[survivor_replica.name]["version"] == v1
    assert not states[victim_name]["ok"]  # its state is unknown, and said so
    # the survivor is back on P, serving, and never failed a request
    assert [e for e in load.log if e[2].startswith("error")] == []
    status = fleet_status([survivor_replica], MODEL)
    assert status["replicas"][0]["ready_versions"] == [v1]
    last = [v for _, _, v in load.log][-1]
    assert last == str(v1)


def test_the_workdirs_hold_no_secret_on_the_command_line(own_fleet: OwnFleet) -> None:
    """The S3 keys reach our tritonservers through the environment, not argv."""
    assert own_fleet.settings.aws_secret_access_key is not None
    secret = own_fleet.settings.aws_secret_access_key.get_secret_value()
    server = own_fleet.servers[1]
    cmdline = Path(f"/proc/{server.process.pid}/cmdline").read_bytes()
    assert secret.encode() not in cmdline
    assert secret not in server.log.read_text(errors="replace")
