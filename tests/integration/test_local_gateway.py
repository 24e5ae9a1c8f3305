"""The local gateway (nginx) in the session stack, in front of the real Tritons.

One tiny ONNX model, ``gw``, is put in the stack's S3 repository and loaded as version 1 on
the replicas (production) and version 2 on the canary Triton, so every answer names the
backend that gave it. The module unloads and deletes it at the end.

- weights route, the mirror copies, and ``live()`` reads both back from nginx;
- moving the weights and the mirror several times under HTTP and gRPC load (the project's
  load generator, through the gateway) fails no request;
- a killed gateway comes back on ``stack up`` with the split it had (last: it restarts it).
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from bench.traffic import MODEL, PAYLOAD, serve_two_versions
from modelship.loadgen import LoadReport, LoadSpec, run_load, run_load_sync
from modelship.settings import Settings
from modelship.stack import manager
from modelship.stack.state import read_state
from modelship.traffic.local_gateway import LocalGateway
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit

pytestmark = pytest.mark.integration

@pytest.fixture(scope="module")
def gateway(stack_settings: Settings) -> Iterator[LocalGateway]:
    """The session stack's gateway, with ``gw`` v1 on the replicas and v2 on the canary."""
    state = read_state(stack_settings.stack_file)
    assert state is not None
    undo = serve_two_versions(stack_settings, state)
    router = LocalGateway.from_state(state)
    try:
        yield router
    finally:
        # a fresh router: a test may have restarted the gateway (another PID)
        healed = LocalGateway.from_state(read_state(stack_settings.stack_file) or {})
        healed.set_weights(0)
        healed.mirror(0)
        undo()


def answers(target: str, protocol: str, seconds: float = 2.0) -> Counter[str]:
    """The answering versions of the requests sent through the gateway for ``seconds``."""
    report = run_load_sync([target], MODEL, PAYLOAD, LoadSpec(
        protocol=protocol, concurrency=4, duration_s=seconds, warmup_s=0.0,
        timeout_s=10.0))
    assert all(r.ok for r in report.records), [r.error for r in report.records if not r.ok][:3]
    assert len(report.records) >= 20
    return Counter(r.model_version for r in report.records)


def within(k: int, n: int, share: float) -> bool:
    """``k`` of ``n`` is within 4.5 standard deviations of a binomial ``share`` (a false
    alarm about once in 150,000 runs)."""
    return abs(k - share * n) <= 4.5 * (n * share * (1 - share)) ** 0.5 + 1


def canary_mirrored(state: dict[str, Any]) -> int:
    """Requests for ``gw`` v2 the canary Triton has answered (its own metrics)."""
    text = urllib.request.urlopen(state["triton"]["canary"]["metrics"], timeout=10).read()
    found = re.search(rf'nv_inference_request_success{{model="{MODEL}",version="2"}} (\d+)',
                      text.decode())
    return int(found.group(1)) if found else 0


def test_stack_status_shows_the_gateway(stack_settings: Settings) -> None:
    doc = manager.status(stack_settings)
    assert doc["gateway_url"].startswith("http://127.0.0.1:")
    assert doc["gateway"]["grpc"].startswith("127.0.0.1:")
    assert any(c["name"] == "gateway" and c["alive"] for c in doc["components"])
    with urllib.request.urlopen(f"{doc['gateway_url']}/v2/health/ready", timeout=10) as ok:
        assert ok.status == 200


def test_weights_route_the_mirror_copies_and_live_reads_them_back(
        gateway: LocalGateway, stack_settings: Settings) -> None:
    state = read_state(stack_settings.stack_file)
    assert state is not None
    http, grpc = state["gateway"]["http"], state["gateway"]["grpc"]
    assert gateway.live() == PRODUCTION_ONLY
    assert set(answers(http, "http")) == {"1"}

    gateway.set_weights(100)
    assert gateway.live() == TrafficSplit(canary_pct=100)
    assert set(answers(grpc, "grpc")) == {"2"}

    gateway.set_weights(30)
    split = answers(grpc, "grpc", 3.0)
    assert within(split["2"], split.total(), 0.30), split

    gateway.set_weights(0)
    gateway.mirror(50)
    assert gateway.live() == TrafficSplit(canary_pct=0, mirror_pct=50)
    before = canary_mirrored(state)
    served = answers(http, "http", 3.0)
    assert set(served) == {"1"}  # a copy's answer never reaches a client
    time.sleep(0.5)
    copied = canary_mirrored(state) - before
    assert within(copied, served.total(), 0.50), (copied, served)

    gateway.mirror(0)
    assert gateway.live() == PRODUCTION_ONLY


def test_moving_weights_and_mirror_under_load_fails_no_request(
        gateway: LocalGateway, stack_settings: Settings) -> None:
    state = read_state(stack_settings.stack_file)
    assert state is not None
    steps = [TrafficSplit(5, 0), TrafficSplit(5, 50), TrafficSplit(50, 50),
             TrafficSplit(100, 0), TrafficSplit(25, 100), TrafficSplit(0, 0)]
    reports: dict[str, LoadReport] = {}

    def load() -> None:
        async def both() -> None:
            http, grpc = await asyncio.gather(*[
                run_load([target], MODEL, PAYLOAD,
                         LoadSpec(protocol=protocol, concurrency=4, duration_s=9.0,
                                  warmup_s=0.0, timeout_s=10.0))
                for protocol, target in (("http", state["gateway"]["http"]),
                                         ("grpc", state["gateway"]["grpc"]))])
            reports["http"], reports["grpc"] = http, grpc

        asyncio.run(both())

    thread = threading.Thread(target=load)
    thread.start()
    time.sleep(1.0)
    for step in steps:
        gateway.set_weights(step.canary_pct)
        gateway.mirror(step.mirror_pct)
        assert gateway.live() == step
        time.sleep(0.8)
    thread.join(timeout=60)
    assert not thread.is_alive()
    for protocol, report in reports.items():
        failed = [r.error for r in report.records if not r.ok]
        assert len(report.records) > 100, protocol
        assert failed == [], f"{protocol}: {len(failed)} failed, e.g. {failed[:3]}"
        # both backends answered during the run: the weights really moved
        assert {r.model_version for r in report.records} == {"1", "2"}, protocol


def test_a_killed_gateway_comes_back_on_stack_up_with_its_split(
        gateway: LocalGateway, stack_settings: Settings) -> None:
    gateway.set_weights(20)
    state = read_state(stack_settings.stack_file)
    assert state is not None
    # the master alone: its workers are left holding the ports, as after a crash
    os.kill(gateway.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while not any(not c["alive"] and c["name"] == "gateway"
                  for c in manager.status(stack_settings)["components"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _, report = manager.up(stack_settings, replicas=len(state["triton"]["replicas"]))
    assert report.restarted == ["gateway"]
    healed = LocalGateway.from_state(read_state(stack_settings.stack_file) or {})
    assert healed.pid != gateway.pid
    assert healed.live() == TrafficSplit(canary_pct=20)  # the configuration it had
    assert sum(answers(state["gateway"]["grpc"], "grpc", 1.0).values()) > 0
    healed.set_weights(0)
