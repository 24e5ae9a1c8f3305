"""The local gateway (nginx) in the session stack, in front of the real Tritons.

One tiny ONNX model, ``gw``, is put in the stack's S3 repository and loaded as version 1 on
the replicas (production) and version 2 on the canary Triton, so every answer names the
backend that gave it. The module unloads and deletes it at the end.

- weights route, the mirror copies, and ``live()`` reads both back from nginx;
- a split scoped to ``gw`` leaves another model's requests (``gw-other``, on the replicas
  only) on production, and ``gw``'s gRPC requests too on a fleet serving another model;
- moving the weights and the mirror several times under HTTP and gRPC load (the project's
  load generator, through the gateway) fails no request;
- the gateway killed during a progressive step: the release aborts at its next look
  (exit 1) although the orphaned workers still route its split, and ``stack up`` brings
  the gateway back at production only, which status reads;
- a killed gateway comes back on ``stack up`` at production only, never the split it died
  with (last: it restarts it).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
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

from bench.traffic import MODEL, PAYLOAD, _triton, model_config, serve_two_versions
from modelship import nginx
from modelship.clients import build_clients
from modelship.errors import InfrastructureError
from modelship.loadgen import LoadReport, LoadSpec, run_load, run_load_sync
from modelship.settings import Settings
from modelship.split_scope import SplitScope
from modelship.stack import manager
from modelship.stack.local_triton import mlp_classifier_onnx
from modelship.stack.state import read_state
from modelship.traffic.local_gateway import LocalGateway
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit
from tasks.progressive import Progressive, run_progressive
from tasks.traffic_plan import ProgressivePlan, Status
from tasks.traffic_state import live_traffic

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


#: Requests per second of :func:`answers`: who answers is the subject there, not load, so
#: an open loop (a closed loop of 4 ran as fast as the two cores allowed, thousands a
#: second through nginx, the client and Triton): 400 in a second, 1,200 for a 3-s share.
ANSWERS_RPS = 400.0


def answers(target: str, protocol: str, seconds: float = 2.0) -> Counter[str]:
    """The answering versions of the requests sent through the gateway for ``seconds``."""
    report = run_load_sync([target], MODEL, PAYLOAD, LoadSpec(
        protocol=protocol, rate_rps=ANSWERS_RPS, duration_s=seconds, warmup_s=0.0,
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
    running: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = []
    started = threading.Event()

    def load() -> None:
        async def both() -> None:
            stop = asyncio.Event()
            running.append((asyncio.get_running_loop(), stop))
            started.set()
            http, grpc = await asyncio.gather(*[
                run_load([target], MODEL, PAYLOAD,
                         LoadSpec(protocol=protocol, concurrency=4, duration_s=9.0,
                                  warmup_s=0.0, timeout_s=10.0), stop=stop)
                for protocol, target in (("http", state["gateway"]["http"]),
                                         ("grpc", state["gateway"]["grpc"]))])
            reports["http"], reports["grpc"] = http, grpc

        asyncio.run(both())

    thread = threading.Thread(target=load)
    thread.start()
    assert started.wait(30)
    time.sleep(1.0)
    for step in steps:
        gateway.set_weights(step.canary_pct)
        gateway.mirror(step.mirror_pct)
        assert gateway.live() == step
        time.sleep(0.8)
    # the load ends 0.8 s after the last move (at 9 s at the latest), not at 9 s whatever
    # the moves took: what comes after them is no part of the test
    loop, stop = running[0]
    with contextlib.suppress(RuntimeError):  # its loop is closed: the load ended at 9 s
        loop.call_soon_threadsafe(stop.set)
    thread.join(timeout=60)
    assert not thread.is_alive()
    for protocol, report in reports.items():
        failed = [r.error for r in report.records if not r.ok]
        assert len(report.records) > 100, protocol
        assert failed == [], f"{protocol}: {len(failed)} failed, e.g. {failed[:3]}"
        # both backends answered during the run: the weights really moved
        assert {r.model_version for r in report.records} == {"1", "2"}, protocol


OTHER = "gw-other"


def test_a_split_scoped_to_one_model_leaves_other_models_requests_on_production(
        gateway: LocalGateway, stack_settings: Settings) -> None:
    """``gw-other`` is served by the replicas only. Unscoped at 100 %, its requests would
    reach the canary Triton, which does not serve it, and fail; scoped to ``gw`` (as a
    release scopes its router: tasks/live_traffic.split_scope), they stay on production,
    while ``gw``'s HTTP requests go to the canary and its gRPC ones stay on production
    (gRPC names the model in the body, and the fleet serves another model)."""
    state = read_state(stack_settings.stack_file)
    assert state is not None
    http, grpc = state["gateway"]["http"], state["gateway"]["grpc"]
    storage = build_clients(stack_settings).storage
    assert storage is not None
    prefix = f"{stack_settings.repository_prefix}/{OTHER}"
    storage.put_bytes(f"{prefix}/config.pbtxt", f'name: "{OTHER}"\n'.encode())
    storage.put_bytes(f"{prefix}/1/model.onnx", mlp_classifier_onnx(4)[0].SerializeToString())
    replicas = [_triton(r["http"]) for r in state["triton"]["replicas"]]
    for replica in replicas:
        replica.load_model(OTHER, config=json.dumps({**model_config(1), "name": OTHER}))
    scoped = LocalGateway.from_state(state, scope=SplitScope(MODEL))
    try:
        scoped.set_weights(100)
        assert scoped.live() == TrafficSplit(canary_pct=100)
        live, scope = scoped.live_scoped()  # status's read: the workers' own scope
        assert live == TrafficSplit(canary_pct=100)
        assert (scope["model"], scope["grpc"]) == (MODEL, False)
        assert scope["applies_to"].startswith(f"{MODEL}'s HTTP requests")
        assert set(answers(http, "http")) == {"2"}  # gw over HTTP: the canary
        assert set(answers(grpc, "grpc")) == {"1"}  # gw over gRPC: production
        other = run_load_sync([http], OTHER, PAYLOAD, LoadSpec(
            protocol="http", rate_rps=ANSWERS_RPS, duration_s=2.0, warmup_s=0.0,
            timeout_s=10.0))
        assert len(other.records) >= 20
        assert [r.error for r in other.records if not r.ok] == []
        assert {r.model_version for r in other.records} == {"1"}
    finally:
        scoped.set_weights(0)
        for replica in replicas:
            replica.unload_model(OTHER)
        storage.delete_prefix(prefix + "/")
    assert gateway.live() == PRODUCTION_ONLY


def _heal(settings: Settings, dead: LocalGateway) -> LocalGateway:
    """`stack up` restarts the dead gateway; the router of the new one."""
    state = read_state(settings.stack_file)
    assert state is not None
    deadline = time.monotonic() + 10
    while not any(not c["alive"] and c["name"] == "gateway"
                  for c in manager.status(settings)["components"]):
        assert time.monotonic() < deadline
        time.sleep(0.1)
    _, report = manager.up(settings, replicas=len(state["triton"]["replicas"]))
    assert report.restarted == ["gateway"]
    healed = LocalGateway.from_state(read_state(settings.stack_file) or {})
    assert healed.pid != dead.pid
    return healed


def test_the_gateway_killed_during_a_progressive_step_is_exit_1_and_heals_to_production(
        gateway: LocalGateway, stack_settings: Settings) -> None:
    """nginx's master dies while the first step (5 %) is live: its orphaned workers still
    send 5 % to the canary, but nothing can change the split any more. The release aborts
    at its next look (an infrastructure failure, exit 1: not the candidate's verdict),
    having written production as its intent; `stack up` brings the gateway back at
    production only, and status says so."""
    state = read_state(stack_settings.stack_file)
    assert state is not None
    written: list[dict[str, Any]] = []
    killed: list[float] = []

    def judge(step: int) -> Status:
        if not killed:
            os.kill(gateway.pid, signal.SIGKILL)
            killed.append(time.monotonic())
        return "continue"

    plan = ProgressivePlan(steps=(5.0, 50.0), min_s=60.0, max_s=120.0)
    with pytest.raises(InfrastructureError) as err:
        run_progressive(Progressive(plan, gateway, judge, written.append, look_s=0.2))
    took = time.monotonic() - killed[0]
    assert err.value.exit_code == 1 and "not running" in err.value.message, err.value
    assert took < 10.0, took  # at the next look, not at the step's ceiling
    events = written[-1]["events"]
    assert [(e["action"], e["weight_pct"]) for e in events] == [("advance", 5.0),
                                                                 ("abort", 0.0)], events
    assert written[-1]["split"]["canary_pct"] == 0.0  # the record says production
    # what was at stake: the orphaned workers still send 5 % to the canary
    assert nginx.read_live(gateway.layout, timeout_s=2.0)[0] == 5.0
    dead = live_traffic(gateway)  # status: the router did not answer, and why
    assert dead is not None and dead["live"] is None and "not running" in dead["error"]
    healed = _heal(stack_settings, gateway)
    assert healed.live() == PRODUCTION_ONLY
    shown = live_traffic(healed)
    assert shown is not None and shown["production_only"], shown
    assert set(answers(state["gateway"]["http"], "http", 1.0)) == {"1"}  # production only


def test_a_killed_gateway_comes_back_on_stack_up_at_production_only(
        gateway: LocalGateway, stack_settings: Settings) -> None:
    """A restarted gateway never resumes the split it died with: the release that held it
    aborted on the dead gateway and unloaded its candidate, so that share would fail. The
    shadow's sample log (production's inputs) does not survive it either."""
    state = read_state(stack_settings.stack_file)
    assert state is not None
    router = LocalGateway.from_state(state)  # the fixture's may have been restarted
    router.set_weights(20)
    router.mirror(50)
    answers(state["gateway"]["http"], "http", 1.0)
    assert router.layout.sample_log.exists()
    os.kill(router.pid, signal.SIGKILL)  # the master alone: its workers hold the ports
    healed = _heal(stack_settings, router)
    assert healed.live() == PRODUCTION_ONLY
    assert not healed.layout.sample_log.exists()
    assert set(answers(state["gateway"]["grpc"], "grpc", 1.0)) == {"1"}
