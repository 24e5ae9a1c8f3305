"""The shadow canary's I/O edges without Triton: Debian's nginx mirrors and logs real
requests (tests/unit/test_shadow_plan.py has the pure parts), and the window's executor
returns the mirror to 0 on every way out."""

from __future__ import annotations

import contextlib
import http.server
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from modelship import nginx
from modelship.errors import InfrastructureError
from modelship.policy import Policy
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit
from tasks import shadow
from tasks.shadow_plan import parse_samples
from tests.fake_router import FakeRouter


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class _Backend(http.server.ThreadingHTTPServer):
    """An upstream that answers with its own name and keeps every body it got."""

    def __init__(self, name: str) -> None:
        self.name, self.bodies = name, list[bytes]()

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 - http.server's name
                backend: Any = self.server
                backend.bodies.append(self.rfile.read(int(self.headers["Content-Length"])))
                answer = backend.name.encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(answer)))
                self.end_headers()
                self.wfile.write(answer)

            def log_message(self, *args: object) -> None:
                pass

        super().__init__(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()


@pytest.fixture
def gateway(tmp_path: Path) -> Iterator[tuple[nginx.GatewayLayout, _Backend, _Backend]]:
    """A real nginx in front of two backends, mirroring 50 % to the canary."""
    production, canary = _Backend("production"), _Backend("canary")
    (tmp_path / "tmp").mkdir()
    layout = nginx.GatewayLayout(
        http_port=_port(), grpc_port=_port(), admin_port=_port(),
        production=((f"127.0.0.1:{production.server_port}", "127.0.0.1:9"),),
        canary=(f"127.0.0.1:{canary.server_port}", "127.0.0.1:9"), prefix=str(tmp_path),
        error_log=str(tmp_path / "error.log"))
    nginx.write_config(layout, nginx.render_config(layout, 0.0, 50.0, "g1"))
    master = subprocess.Popen(nginx.command(nginx.nginx_binary(), layout))
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                nginx.read_live(layout, timeout_s=1.0)
                break
            except InfrastructureError:
                assert time.monotonic() < deadline, (tmp_path / "error.log").read_text()
                time.sleep(0.05)
        yield layout, production, canary
    finally:
        master.send_signal(signal.SIGQUIT)
        master.wait(10)
        production.shutdown()
        canary.shutdown()


def test_the_log_holds_exactly_the_mirrored_bodies_and_clients_get_production(
        gateway: tuple[nginx.GatewayLayout, _Backend, _Backend]) -> None:
    layout, production, canary = gateway
    sent = [f'{{"n":{i}}}'.encode() + bytes(range(256)) + b'"\\' for i in range(120)]
    answers = set()
    for body in sent:
        request = urllib.request.Request(
            layout.http_url + "/v2/models/m/infer", data=body, method="POST",
            headers={"Content-Type": "application/octet-stream",
                     "Inference-Header-Content-Length": "8"})
        with urllib.request.urlopen(request, timeout=10) as response:
            answers.add(response.read())
    assert answers == {b"production"}  # the mirror's answers never reach a client
    assert sorted(production.bodies) == sorted(sent)
    deadline = time.monotonic() + 5
    while True:  # the mirror's subrequests and the log line end after the answer
        found = parse_samples(layout.sample_log.read_bytes().splitlines(), "m")
        if len(found.requests) == len(canary.bodies) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    # the sampled bodies are exactly the mirrored ones, byte for byte (one draw decides both)
    assert sorted(r.body for r in found.requests) == sorted(canary.bodies)
    assert 20 <= len(canary.bodies) <= 100  # about half of 120
    assert {r.header_length for r in found.requests} == {8}


def test_the_log_holds_the_mirrored_grpc_bodies_as_replayable_requests(
        gateway: tuple[nginx.GatewayLayout, _Backend, _Backend]) -> None:
    """gRPC through the real nginx, mirroring 50 %: nginx reads a mirrored request's whole
    body before the copy, so the log holds the ModelInfer frame; each logged one decodes
    to the very tensor a client sent (the backends' gRPC ports are closed here: the calls
    fail, the log lines are written all the same)."""
    import numpy as np
    import tritonclient.grpc as grpcclient

    from tasks.shadow_plan import request_inputs

    layout = gateway[0]
    sent = [np.full((1, 4), i, dtype=np.float32) for i in range(40)]
    client = grpcclient.InferenceServerClient(layout.grpc_address)
    try:
        for array in sent:
            tensor = grpcclient.InferInput("input", [1, 4], "FP32")
            tensor.set_data_from_numpy(array)
            with contextlib.suppress(grpcclient.InferenceServerException):
                client.infer("m", [tensor], client_timeout=10)
    finally:
        client.close()
    found = parse_samples(layout.sample_log.read_bytes().splitlines(), "m")
    assert not found.left_out, found.left_out
    got = [request_inputs(r)["input"] for r in found.requests]
    assert 5 <= len(got) <= 35, len(got)  # about half of 40: the mirror's own draw
    values = sorted(float(a[0, 0]) for a in got)
    assert len(set(values)) == len(values) and set(values) <= {float(i) for i in range(40)}
    assert all(a.shape == (1, 4) and (a == a[0, 0]).all() for a in got)


class _Gateway(FakeRouter):
    """A fake router with a local gateway's sample log, whose mirror is taken away (a
    stuck gateway, someone else's change) after ``lasts`` reads."""

    def __init__(self, layout: nginx.GatewayLayout, lasts: int) -> None:
        super().__init__()
        self.layout, self.lasts = layout, lasts

    def live(self) -> TrafficSplit:
        split = super().live()
        if sum(1 for c in self.calls if c[0] == "live") > self.lasts:
            self.split = PRODUCTION_ONLY
        return split


def _window(tmp_path: Path, router: FakeRouter, monkeypatch: pytest.MonkeyPatch,
            **canary: Any) -> tuple[Any, list[dict[str, Any]]]:
    policy = Policy.model_validate({"canary": {
        "traffic": "shadow", "mirror_pct": 20.0, "warmup_s": 0.0, "window_s": 0.01,
        "max_duration_s": 2.0, "min_samples": 1, **canary}})
    clients: Any = type("C", (), {"replicas": []})()
    settings: Any = type("S", (), {"http_timeout_s": 1.0})()
    run = shadow._Shadow(settings, clients, policy, model="m", candidate=2, baseline=1,
                         router=router, canary=None, progress=lambda _: None)  # type: ignore[arg-type]
    monkeypatch.setattr(run, "tick", lambda: run.ticks.append({"canary": None}))
    monkeypatch.setattr(shadow, "LOOK_S", 0.01)
    written: list[dict[str, Any]] = []
    return run, written


def test_the_window_ends_at_its_ceiling_with_the_mirror_back_to_zero(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = nginx.GatewayLayout(1, 2, 3, (("a", "b"),), ("c", "d"), str(tmp_path),
                                 str(tmp_path / "e.log"))
    router = _Gateway(layout, lasts=10**6)
    run, written = _window(tmp_path, router, monkeypatch, max_duration_s=0.05)
    layout.sample_log.write_bytes(b"left from an earlier window\n")
    said: list[str] = []
    traffic = run.window(written.append, said.append)
    assert router.writes[:2] == [("set_weights", 0.0), ("mirror", 20.0)]
    assert router.split == PRODUCTION_ONLY and traffic["split"]["mirror_pct"] == 0.0
    # the intent was written before the mirror was set, production after
    assert [w["split"]["mirror_pct"] for w in written] == [20.0, 0.0]
    assert run.events[-1]["action"] == "end" and "ceiling" in run.events[-1]["reason"]
    assert not layout.sample_log.exists() or b"earlier" not in layout.sample_log.read_bytes()
    assert said[0].startswith("shadow: mirroring 20 %") and "mirror back to 0" in said[-1]


def test_a_mirror_taken_away_mid_window_aborts_as_infrastructure_and_returns_to_zero(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = nginx.GatewayLayout(1, 2, 3, (("a", "b"),), ("c", "d"), str(tmp_path),
                                 str(tmp_path / "e.log"))
    router = _Gateway(layout, lasts=2)
    run, written = _window(tmp_path, router, monkeypatch, max_duration_s=60.0,
                           min_samples=10**6)
    with pytest.raises(InfrastructureError, match="stuck") as err:
        run.window(written.append, lambda _: None)
    assert "mirror back to 0" in err.value.message
    assert router.split == PRODUCTION_ONLY and written[-1]["split"]["mirror_pct"] == 0.0
    assert run.events[-1]["action"] == "abort"


def test_a_router_that_dies_mid_window_is_an_infrastructure_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = nginx.GatewayLayout(1, 2, 3, (("a", "b"),), ("c", "d"), str(tmp_path),
                                 str(tmp_path / "e.log"))
    router = _Gateway(layout, lasts=10**6)
    run, written = _window(tmp_path, router, monkeypatch, max_duration_s=60.0,
                           min_samples=10**6)
    original = run.tick

    def tick() -> None:
        original()
        if len(run.ticks) == 3:
            router.dead = True

    monkeypatch.setattr(run, "tick", tick)
    with pytest.raises(InfrastructureError, match="did not answer"):
        run.window(written.append, lambda _: None)
    # production is written as the intent even though the dead router could not take it:
    # the next command restores it from the record
    assert written[-1]["split"]["mirror_pct"] == 0.0
    assert router.writes[-1] == ("set_weights", 0.0)  # the way back was tried


def test_a_first_release_under_shadow_is_replayed_and_nothing_else_changes() -> None:
    from tasks.traffic_plan import not_carried_out

    policy = Policy.model_validate({"canary": {"traffic": "shadow", "mirror_pct": 20.0,
                                               "min_samples": 321}})
    replay = shadow.replay_of(policy)
    assert replay.canary.traffic == "replay" and replay.canary.mirror_pct is None
    assert not_carried_out(policy, bake=False) is not None  # the standalone canary refuses
    assert not_carried_out(replay, bake=False) is None      # ... and runs this one
    assert replay.canary.min_samples == 321 and replay.gates == policy.gates
    assert policy.canary.traffic == "shadow"  # the release's own policy is untouched


class _Stopped(BaseException):
    """A stop request (promote's SIGTERM handler raises out of whatever runs)."""


def test_a_stop_request_mid_window_returns_the_mirror_to_zero_and_goes_on_up(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = nginx.GatewayLayout(1, 2, 3, (("a", "b"),), ("c", "d"), str(tmp_path),
                                 str(tmp_path / "e.log"))
    router = _Gateway(layout, lasts=10**6)
    run, written = _window(tmp_path, router, monkeypatch, max_duration_s=60.0,
                           min_samples=10**6)
    original = run.tick

    def tick() -> None:
        original()
        if len(run.ticks) == 3:
            assert router.split.mirror_pct == 20.0  # mirroring when the signal comes
            raise _Stopped

    monkeypatch.setattr(run, "tick", tick)
    with pytest.raises(_Stopped):
        run.window(written.append, lambda _: None)
    assert router.split == PRODUCTION_ONLY
    assert [w["split"]["mirror_pct"] for w in written] == [20.0, 0.0]


def _workers(master: int) -> list[int]:
    """The nginx master's worker PIDs (children in /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and int(
                    (entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == master:
                found.append(int(entry.name))
        except (OSError, IndexError, ValueError):
            continue
    return found


def _post(layout: nginx.GatewayLayout, n: int) -> None:
    for i in range(n):
        request = urllib.request.Request(layout.http_url + "/v2/models/m/infer",
                                         data=f'{{"n":{i}}}'.encode(), method="POST")
        urllib.request.urlopen(request, timeout=10).read()


def test_whoever_turns_the_mirror_off_deletes_the_sample_log(
        gateway: tuple[nginx.GatewayLayout, _Backend, _Backend]) -> None:
    """The log holds production's inputs: recovery or reconcile returning a killed
    shadow's mirror to 0 leaves none behind (the shadow itself read it first)."""
    from modelship.traffic.local_gateway import LocalGateway

    layout, _, _ = gateway
    pid = int(Path(layout.prefix, "nginx.pid").read_text())
    router = LocalGateway(layout, pid=pid, start_ticks=None)
    _post(layout, 40)
    deadline = time.monotonic() + 5
    while not layout.sample_log.exists() or not layout.sample_log.stat().st_size:
        assert time.monotonic() < deadline, "nothing was logged"
        time.sleep(0.05)
    router.set_weights(10.0)  # the mirror stays on: the log stays
    assert layout.sample_log.exists()
    router.mirror(0.0)
    assert router.live() == TrafficSplit(canary_pct=10.0)
    assert not layout.sample_log.exists()
    _post(layout, 5)
    assert not layout.sample_log.exists()  # nothing logs without a mirror


def test_a_dead_master_is_a_dead_gateway_even_while_its_workers_answer(
        gateway: tuple[nginx.GatewayLayout, _Backend, _Backend]) -> None:
    """A SIGKILLed master leaves its workers serving the split they had, and nothing can
    change it: live() says the gateway is dead (a release aborts at its next look)
    instead of reading the orphans' split as if all were well."""
    from modelship.traffic.local_gateway import LocalGateway

    layout, _, _ = gateway
    pid = int(Path(layout.prefix, "nginx.pid").read_text())
    workers = _workers(pid)
    assert workers
    router = LocalGateway(layout, pid=pid, start_ticks=None, timeout_s=3.0)
    assert router.live() == TrafficSplit(mirror_pct=50.0)
    try:
        os.kill(pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while Path(f"/proc/{pid}").exists() and \
                "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert nginx.read_live(layout, timeout_s=2.0)[1] == 50.0  # the orphans answer
        with pytest.raises(InfrastructureError, match="is not running"):
            router.live()
    finally:
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker, signal.SIGKILL)


def test_a_gateway_starts_at_rest_whatever_it_had(tmp_path: Path) -> None:
    """stack up (a first start or a restart of a dead gateway) renders production only
    and deletes a sample log left behind."""
    layout = nginx.GatewayLayout(1, 2, 3, (("a:1", "b:2"),), ("c:3", "d:4"), str(tmp_path),
                                 str(tmp_path / "e.log"))
    nginx.write_config(layout, nginx.render_config(layout, 20.0, 50.0, "g1"))
    layout.sample_log.write_bytes(b'{"body": "a production input"}\n')
    nginx.at_rest(layout, "g2")
    text = layout.config_path.read_text()
    assert '"canary_pct": 0.0' in text and '"mirror_pct": 0.0' in text, text
    assert "mirror /_modelship_mirror" not in text and "split_clients" not in text
    assert not layout.sample_log.exists()


def test_the_window_reads_its_samples_before_the_mirror_goes_off(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    layout = nginx.GatewayLayout(1, 2, 3, (("a", "b"),), ("c", "d"), str(tmp_path),
                                 str(tmp_path / "e.log"))

    class Forgets(_Gateway):  # as the local gateway: the mirror off deletes the log
        def mirror(self, share_pct: float) -> None:
            super().mirror(share_pct)
            if not share_pct:
                layout.sample_log.unlink(missing_ok=True)

    router = Forgets(layout, lasts=10**6)
    run, written = _window(tmp_path, router, monkeypatch, max_duration_s=0.05)
    original = run.tick

    def tick() -> None:
        original()
        if router.split.mirror_pct:
            with layout.sample_log.open("ab") as log:
                log.write(b'{"uri":"/v2/models/m/infer","body":"x"}\n')

    monkeypatch.setattr(run, "tick", tick)
    run.window(written.append, lambda _: None)
    assert not layout.sample_log.exists() and router.split == PRODUCTION_ONLY
    assert run.lines and len(parse_samples(run.lines, "m").requests) == len(run.lines)
