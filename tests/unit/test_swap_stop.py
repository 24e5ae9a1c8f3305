"""A swap told to stop (SIGINT, SIGTERM, any exception) aborts: every replica back on P's
production config, dynamic batching included. Defect 3 of issue 18 as a class, against
fake replicas that record every load (the executor's own code, no servers)."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from modelship.policy import SwapPolicy, TritonPolicy
from modelship.signals import StopRequested, stop_on_signals
from modelship.triton.model_config import (
    ModelSpec,
    TensorSpec,
    render_model_config,
    serving_digest,
)
from modelship.triton.swap_plan import Aborted, ReplicaView, next_action, plan_swap
from tasks import swap as swapping

MODEL = "fraud"
SPEC = ModelSpec(MODEL, inputs=(TensorSpec("input", "float32", (6,)),),
                 outputs=(TensorSpec("label", "int64", ()),))
P_CONFIG = render_model_config(SPEC, TritonPolicy(), versions=[1])
C_CONFIG = render_model_config(SPEC, TritonPolicy(), versions=[2])
SERVERS: dict[str, FakeReplica] = {}


@dataclass
class FakeReplica:
    """A replica that serves what it was last told to load; ``on_load`` sees each load."""

    name: str
    serving: int | None = 1
    loads: list[tuple[int, bool]] = field(default_factory=list)  # (version, batching on)
    on_load: Any = None

    def __post_init__(self) -> None:
        self.endpoint = SimpleNamespace(http=f"fake://{self.name}")
        SERVERS[self.endpoint.http] = self

    def load_model(self, model: str, config_json: str | None = None) -> None:
        config = json.loads(config_json or "{}")
        version = int(config["version_policy"]["specific"]["versions"][0])
        self.loads.append((version, "dynamic_batching" in config))
        if self.on_load is not None:
            self.on_load(self, version)
        self.serving = version

    def is_model_ready(self, model: str, version: str = "") -> bool:
        return self.serving is not None and (not version or int(version) == self.serving)

    def unload_model(self, model: str) -> None:
        self.serving = None

    def warm(self) -> None:
        """No client to build."""


class FakeInference:
    """Answers as the version its replica serves."""

    def __init__(self, url: str, timeout_s: float) -> None:
        self.replica = SERVERS[url]

    def infer(self, model: str, feed: Any, outputs: Any = None) -> Any:
        return SimpleNamespace(model_version=str(self.replica.serving), outputs={})

    def close(self) -> None:
        pass


def _swap(replicas: list[FakeReplica], monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setattr(swapping, "TritonInference", FakeInference)
    digest = serving_digest(P_CONFIG)
    plan = plan_swap(MODEL, [ReplicaView(r.name, True, (1,), digest) for r in replicas],
                     target=2, candidate_config=C_CONFIG, production_config=P_CONFIG,
                     pause_batching=True, candidate_verified=True)
    report = swapping.SwapReport(MODEL, plan.kind, 1, 2, True)
    probe = swapping._Probe({}, [], 1.0, golden=None, target=2)
    lines: list[str] = []
    run = swapping._execute(plan, {r.name: r for r in replicas}, report,  # type: ignore[misc]
                            model=MODEL, swap_start=time.monotonic(),
                            policy=SwapPolicy(deadline_s=10.0, probe_timeout_s=1.0),
                            probe=probe, progress=lines.append)
    return run, report, lines


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_during_the_switch_aborts_on_every_replica(
        signum: int, monkeypatch: pytest.MonkeyPatch) -> None:
    def stop_at_switch(replica: FakeReplica, version: int) -> None:
        if version == 2 and replica.name == "r1":  # r0 may have switched already
            os.kill(os.getpid(), signum)
            time.sleep(0.2)

    replicas = [FakeReplica("r0"), FakeReplica("r1", on_load=stop_at_switch),
                FakeReplica("r2")]
    with pytest.raises(StopRequested) as stopped, stop_on_signals():
        _swap(replicas, monkeypatch)
        threading.Event().wait(2)
    assert stopped.value.signum == signum
    for replica in replicas:
        # the last load is P's production config, with dynamic batching back on
        assert replica.loads[-1] == (1, True), (replica.name, replica.loads)
        assert replica.serving == 1
        assert (2, False) in replica.loads or replica.name == "r2"  # the switch reached some


def test_a_signal_while_the_switch_is_handed_out_waits_for_every_started_replica(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SIGINT lands inside the submit of r2's switch, after its work is queued; r2's thread
    starts late. The stop must reach r2 (it sends nothing) before the abort loads P there,
    so no late switch load of C lands after the abort's load of P."""
    run_phase_on = swapping._run_phase_on

    def late_r2(server: Any, phase: Any, **kwargs: Any) -> Any:
        if server.name == "r2" and phase.name == "switch":
            time.sleep(0.3)
        return run_phase_on(server, phase, **kwargs)

    class SignalInsideSubmit(ThreadPoolExecutor):
        def submit(self, fn: Any, /, *args: Any, **kwargs: Any) -> Any:
            future = super().submit(fn, *args, **kwargs)
            if args[0].name == "r2" and args[1].name == "switch":
                os.kill(os.getpid(), signal.SIGINT)
            return future

    monkeypatch.setattr(swapping, "_run_phase_on", late_r2)
    monkeypatch.setattr(swapping, "ThreadPoolExecutor", SignalInsideSubmit)
    replicas = [FakeReplica("r0"), FakeReplica("r1"), FakeReplica("r2")]
    with pytest.raises(StopRequested), stop_on_signals():
        _swap(replicas, monkeypatch)
    time.sleep(0.5)  # r2's thread, had it been left running, would load C by now
    for replica in replicas:
        assert replica.loads[-1] == (1, True), (replica.name, replica.loads)
        assert replica.serving == 1
    assert (2, False) not in replicas[2].loads


def test_a_base_exception_in_a_replica_thread_fails_that_replica_and_aborts(
        monkeypatch: pytest.MonkeyPatch) -> None:
    def die(replica: FakeReplica, version: int) -> None:
        if version == 2:
            raise SystemExit("the load hook died")

    replicas = [FakeReplica("r0"), FakeReplica("r1", on_load=die)]
    run, report, _ = _swap(replicas, monkeypatch)
    action = next_action(run)
    assert isinstance(action, Aborted) and "SystemExit" in action.reason
    assert [r.serving for r in replicas] == [1, 1]
    assert all(r.loads[-1] == (1, True) for r in replicas)


def test_an_uninterrupted_swap_still_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    replicas = [FakeReplica("r0"), FakeReplica("r1")]
    run, report, _ = _swap(replicas, monkeypatch)
    assert run.status == "done" and [r.serving for r in replicas] == [2, 2]
    assert all(r.loads == [(1, False), (2, False), (2, True)] for r in replicas)
    assert not report.aborted
