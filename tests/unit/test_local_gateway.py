"""The local gateway: its nginx configuration rendered from a TrafficSplit (table tests,
each checked by Debian's ``nginx -t``), the read-back's parsing, and the adapter's failures
(a dead master, a stuck admin port, a stack without a gateway), all without Triton."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelship import nginx
from modelship.errors import InfrastructureError, UsageError
from modelship.split_scope import SplitScope
from modelship.stack.state import status_document
from modelship.traffic.local_gateway import LocalGateway, as_live, render
from modelship.traffic.port import PRODUCTION_ONLY, TrafficRouter, TrafficSplit


def layout(tmp: Path, admin_port: int = 9) -> nginx.GatewayLayout:
    (tmp / "tmp").mkdir(parents=True, exist_ok=True)
    return nginx.GatewayLayout(
        http_port=18000, grpc_port=18001, admin_port=admin_port,
        production=(("127.0.0.1:18100", "127.0.0.1:18101"),
                    ("127.0.0.1:18110", "127.0.0.1:18111")),
        canary=("127.0.0.1:18120", "127.0.0.1:18121"),
        prefix=str(tmp), error_log=str(tmp / "error.log"))


def location(text: str, server: str) -> str:
    """The body of ``location /`` in the server block commented ``server``."""
    block = text.split(f"# {server}", 1)[1]
    return block.split("location / {", 1)[1].split("\n        }", 1)[0]


# canary, mirror -> the backend of `location /`, the route chooser, the mirror chooser
CASES = [
    (0, 0, "production", None, None),
    (5, 0, "${modelship_route}", "5% canary", None),
    (0.5, 0, "${modelship_route}", "0.5% canary", None),
    (33.333, 0, "${modelship_route}", "33.33% canary", None),
    (0.004, 0, "production", None, None),      # below nginx's 0.01 %: production only
    (99.996, 0, "canary", None, None),         # rounds to 100
    (100, 0, "canary", None, None),
    (0, 10, "production", None, "10% 1"),
    (25, 100, "${modelship_route}", "25% canary", None),
    (100, 50, "canary", None, "50% 1"),
]


@pytest.mark.parametrize(("canary", "mirror", "backend", "route", "mirrored"), CASES)
def test_the_config_routes_and_mirrors_as_the_split_says(
        tmp_path: Path, canary: float, mirror: float, backend: str, route: str | None,
        mirrored: str | None) -> None:
    gw = layout(tmp_path)
    text = render(gw, TrafficSplit(canary_pct=canary, mirror_pct=mirror), "g1")
    http, grpc = location(text, "KServe HTTP/REST"), location(text, "KServe gRPC")
    assert f"proxy_pass http://{backend}_http;" in http
    assert f"grpc_pass grpc://{backend}_grpc;" in grpc
    routes = re.findall(r'split_clients "\$\{request_id\}" \$modelship_route \{\s*([^;]*);',
                        text)
    assert routes == ([route] if route else [])
    mirrors = re.findall(r'split_clients "\$\{request_id\}mirror" \$modelship_mirror '
                         r'\{\s*([^;]*);', text)
    assert mirrors == ([mirrored] if mirrored else [])
    live = as_live(TrafficSplit(canary_pct=canary, mirror_pct=mirror))
    mirror_on = live.mirror_pct > 0
    assert ("mirror /_modelship_mirror;" in http) is mirror_on
    assert ("mirror /_modelship_mirror;" in grpc) is mirror_on
    # the share outside the mirror answers 204 without touching the canary
    assert text.count("if ($modelship_mirror = 0) { return 204; }") == (
        2 if 0 < live.mirror_pct < 100 else 0)
    # the admin port answers with the quantized split and the generation
    body = re.search(r"return 200 '(\{.*\})\\n';", text)
    assert body is not None
    assert nginx.parse_live(body.group(1)) == (live.canary_pct, live.mirror_pct, "g1")


def test_the_upstreams_are_the_replicas_and_the_canary(tmp_path: Path) -> None:
    text = render(layout(tmp_path), PRODUCTION_ONLY, "g")

    def servers(name: str) -> list[str]:
        return re.findall(r"server (\S+);", text.split(f"upstream {name} {{", 1)[1]
                          .split("}", 1)[0])

    assert servers("production_http") == ["127.0.0.1:18100", "127.0.0.1:18110"]
    assert servers("production_grpc") == ["127.0.0.1:18101", "127.0.0.1:18111"]
    assert servers("canary_http") == ["127.0.0.1:18120"]
    assert servers("canary_grpc") == ["127.0.0.1:18121"]
    # the gRPC mirror keeps the call's path (the subrequest's own URI is the mirror's)
    assert "_modelship_mirror" not in text  # no mirror: no subrequest location at all
    mirrored = render(layout(tmp_path), TrafficSplit(mirror_pct=10), "g")
    assert "rewrite ^ $request_uri break;" in mirrored
    assert "listen 127.0.0.1:18001 http2;" in text


@pytest.mark.parametrize(("canary", "mirror"), [(c[0], c[1]) for c in CASES])
def test_nginx_accepts_every_rendered_config(tmp_path: Path, canary: float,
                                             mirror: float) -> None:
    gw = layout(tmp_path)
    nginx.check_config(nginx.nginx_binary(), gw,
                       render(gw, TrafficSplit(canary_pct=canary, mirror_pct=mirror), "g"))


def test_nginx_t_refuses_a_broken_config(tmp_path: Path) -> None:
    gw = layout(tmp_path)
    with pytest.raises(InfrastructureError, match="nginx refused"):
        nginx.check_config(nginx.nginx_binary(), gw, "http { upstream x { } ")


def test_a_split_outside_0_100_is_refused_before_any_rendering() -> None:
    with pytest.raises(UsageError):
        TrafficSplit(canary_pct=101)


@pytest.mark.parametrize(("body", "parsed"), [
    ('{"canary_pct": 5, "mirror_pct": 0, "generation": "a"}\n', (5.0, 0.0, "a")),
    (b'{"canary_pct": 0.25, "mirror_pct": 100, "generation": "b"}', (0.25, 100.0, "b")),
    ("<html>502 Bad Gateway</html>", None),
    ('{"canary_pct": 5}', None),
    ('{"canary_pct": "x", "mirror_pct": 0, "generation": "a"}', None),
])
def test_the_read_back_is_parsed_or_refused(body: str | bytes,
                                            parsed: tuple[float, float, str] | None) -> None:
    if parsed is None:
        with pytest.raises(InfrastructureError, match="not a split"):
            nginx.parse_live(body)
    else:
        assert nginx.parse_live(body) == parsed


def test_the_gateway_is_a_traffic_router(tmp_path: Path) -> None:
    gateway = LocalGateway(layout(tmp_path), pid=os.getpid(), start_ticks=None)
    assert isinstance(gateway, TrafficRouter) and gateway.name == "local-gateway"


def _state(gw: nginx.GatewayLayout, pid: int) -> dict[str, object]:
    return {"gateway": {"http": gw.http_url, "grpc": gw.grpc_address, "admin": gw.admin_url,
                        "layout": gw.to_dict()},
            "processes": [{"name": "gateway", "pid": pid, "start_ticks": None,
                           "ports": [], "log": ""}]}


def test_status_shows_the_gateway_url_and_its_grpc_address(tmp_path: Path) -> None:
    gw = layout(tmp_path)
    doc = status_document(_state(gw, 1), {"gateway": True})
    assert doc["gateway_url"] == "http://127.0.0.1:18000"
    assert doc["gateway"]["grpc"] == "127.0.0.1:18001"
    assert status_document({}, {})["gateway_url"] is None


def test_a_stack_without_a_gateway_is_an_infrastructure_error() -> None:
    with pytest.raises(InfrastructureError, match="no gateway") as err:
        LocalGateway.from_state({"processes": []})
    assert "stack up" in (err.value.hint or "")


def test_a_dead_gateway_is_an_infrastructure_error_with_a_hint(tmp_path: Path) -> None:
    proc = subprocess.Popen(["true"])
    proc.wait()
    gw = layout(tmp_path, admin_port=_closed_port())
    gateway = LocalGateway.from_state(_state(gw, proc.pid), timeout_s=2.0)
    started = time.monotonic()
    with pytest.raises(InfrastructureError) as err:
        gateway.set_weights(5)
    assert time.monotonic() - started < 3.0
    assert "stack up" in (err.value.hint or "")


@pytest.fixture
def stuck_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a stuck proxy)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield int(server.getsockname()[1])
    finally:
        stop.set()
        thread.join()
        for conn in held:
            conn.close()
        server.close()


@pytest.mark.parametrize("call", ["live", "set_weights", "mirror"])
def test_a_stuck_gateway_times_out_as_an_infrastructure_error(
        tmp_path: Path, stuck_port: int, call: str) -> None:
    gateway = LocalGateway(layout(tmp_path, admin_port=stuck_port), pid=os.getpid(),
                           start_ticks=None, timeout_s=0.5)
    started = time.monotonic()
    with pytest.raises(InfrastructureError, match="did not answer") as err:
        getattr(gateway, call)(*([] if call == "live" else [5]))
    assert time.monotonic() - started < 2.0
    assert "stack up" in (err.value.hint or "")


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_settings_take_the_gateway_from_the_stack_file(tmp_path: Path) -> None:
    from modelship.settings import settings_from_stack_state

    values = settings_from_stack_state(_state(layout(tmp_path), 1))
    assert values["gateway_url"] == "http://127.0.0.1:18000"
    assert values["gateway_grpc"] == "127.0.0.1:18001"
    assert "gateway_url" not in settings_from_stack_state({})


def test_the_workers_user_is_rendered_only_when_given(tmp_path: Path) -> None:
    from dataclasses import replace

    gw = layout(tmp_path)
    assert "\nuser " not in render(gw, PRODUCTION_ONLY, "g")
    as_root = replace(gw, user="root")
    assert "\nuser root;\n" in render(as_root, PRODUCTION_ONLY, "g")
    assert nginx.GatewayLayout.from_dict(as_root.to_dict()) == as_root
    assert nginx.GatewayLayout.from_dict(gw.to_dict()) == gw


def test_the_router_is_the_route_when_configured_else_the_stack_gateway(tmp_path: Path) -> None:
    from modelship.settings import Settings
    from modelship.traffic.gateway_api import GatewayApiRouter
    from modelship.traffic.select import router_for

    state = _state(layout(tmp_path), 1)
    local = router_for(Settings(home=tmp_path), state)
    assert isinstance(local, LocalGateway) and local.layout.http_port == 18000
    assert router_for(Settings(home=tmp_path), {"processes": []}) is None
    assert router_for(Settings(home=tmp_path / "none")) is None  # no stack.json
    k8s = Settings(home=tmp_path, k8s_route="modelship/triton-inference")
    assert isinstance(router_for(k8s, state), GatewayApiRouter)


def test_a_read_during_a_reload_waits_for_the_retiring_workers(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """While the old workers still take connections (a reload in progress), live() does not
    answer: an old worker would give the split being replaced after a new one gave the new
    one (a killed release's 5 % read back as 0 % in the suite). It reads once only the
    configured number of workers accept."""
    accepting = [nginx.WORKER_PROCESSES + 1] * 3 + [nginx.WORKER_PROCESSES]
    reads: list[int] = []
    monkeypatch.setattr(nginx, "accepting_workers", lambda pid: accepting.pop(0))

    def read_live(layout: nginx.GatewayLayout, timeout_s: float) -> tuple[float, float, str]:
        reads.append(len(accepting))
        return 5.0, 0.0, "g2"

    monkeypatch.setattr(nginx, "read_live", read_live)
    gateway = LocalGateway(layout(tmp_path), pid=os.getpid(), start_ticks=None, timeout_s=5)
    assert gateway.live() == TrafficSplit(canary_pct=5.0, mirror_pct=0.0)
    assert reads == [0]  # read once, after the fourth look found no retiring worker


def test_a_reload_that_never_settles_still_answers_within_the_bound(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Old workers that never stop (stuck) bound the wait by the call's timeout."""
    monkeypatch.setattr(nginx, "accepting_workers", lambda pid: nginx.WORKER_PROCESSES + 1)
    monkeypatch.setattr(nginx, "read_live", lambda layout, timeout_s: (0.0, 0.0, "g1"))
    gateway = LocalGateway(layout(tmp_path), pid=os.getpid(), start_ticks=None,
                           timeout_s=0.3)
    started = time.monotonic()
    assert gateway.live() == TrafficSplit(canary_pct=0.0, mirror_pct=0.0)
    assert 0.3 <= time.monotonic() - started < 3.0


# --------------------------------------------------------------------------------------
# a split scoped to one model (another model's requests never reach the canary)

SCOPED = SplitScope("fraud.v2")
# canary, mirror, scope -> the HTTP backend, the gRPC backend, whether gRPC is mirrored
SCOPED_CASES = [
    (25, 0, SCOPED, "${modelship_http_route}", "production", False),
    (100, 0, SCOPED, "${modelship_http_route}", "production", False),
    (0, 50, SCOPED, "production", "production", False),
    (25, 100, SCOPED, "${modelship_http_route}", "production", False),
    (25, 50, SplitScope("fraud.v2", grpc=True), "${modelship_http_route}",
     "${modelship_route}", True),
    (100, 0, SplitScope("fraud.v2", grpc=True), "${modelship_http_route}", "canary",
     False),
    (0, 0, SCOPED, "production", "production", False),  # at rest: nothing to scope
]


@pytest.mark.parametrize(("canary", "mirror", "scope", "http_to", "grpc_to", "grpc_copied"),
                         SCOPED_CASES)
def test_a_scoped_split_routes_and_mirrors_only_its_models_requests(
        tmp_path: Path, canary: float, mirror: float, scope: SplitScope, http_to: str,
        grpc_to: str, grpc_copied: bool) -> None:
    gw = layout(tmp_path)
    text = render(gw, TrafficSplit(canary_pct=canary, mirror_pct=mirror), "g", scope)
    nginx.check_config(nginx.nginx_binary(), gw, text)
    http, grpc = location(text, "KServe HTTP/REST"), location(text, "KServe gRPC")
    assert f"proxy_pass http://{http_to}_http;" in http
    assert f"grpc_pass grpc://{grpc_to}_grpc;" in grpc
    assert ("mirror /_modelship_mirror;" in grpc) is grpc_copied
    if canary or mirror:
        assert f'"~{scope.uri_pattern}" 1;' in text
    if mirror:  # a copy (and a logged body) only of the scope's requests
        assert "if ($modelship_copy = 0) { return 204; }" in text
        assert "modelship_sample if=$modelship_copy;" in http
    body = re.search(r"return 200 '(\{.*\})\\n';", text)
    assert body is not None
    live = as_live(TrafficSplit(canary, mirror))
    assert nginx.parse_live(body.group(1)) == (live.canary_pct, live.mirror_pct, "g")
    assert json.loads(body.group(1))["scope"] == scope.to_dict()  # what the workers hold
    assert nginx.parse_scope(body.group(1)) == scope  # what status reports


def test_an_unscoped_split_reports_no_scope(tmp_path: Path) -> None:
    text = render(layout(tmp_path), TrafficSplit(canary_pct=25.0), "g", None)
    body = re.search(r"return 200 '(\{.*\})\\n';", text)
    assert body is not None and nginx.parse_scope(body.group(1)) is None
    assert nginx.parse_scope("not json") is None and nginx.parse_scope("[1]") is None


@pytest.mark.parametrize(("uri", "scoped"), [
    ("/v2/models/fraud.v2/infer", True),
    ("/v2/models/fraud.v2/versions/3/infer", True),
    ("/v2/models/fraud.v2", True),
    ("/v2/models/fraud.v2?verbose=1", True),
    ("/v2/models/fraudxv2/infer", False),   # '.' is a dot, not any character
    ("/v2/models/fraud.v20/infer", False),  # another model whose name starts the same
    ("/v2/models/other/infer", False),
    ("/v2/health/ready", False),
])
def test_the_scope_pattern_matches_its_models_paths_only(uri: str, scoped: bool) -> None:
    assert bool(re.match(SCOPED.uri_pattern, uri)) is scoped


@pytest.mark.parametrize("name", ["a b", 'x"y', "m;n", "", "p{1}"])
def test_a_model_name_nginx_could_misread_is_refused(name: str) -> None:
    """Such a name cannot be a Triton model: a usage error (exit 2), not infrastructure."""
    with pytest.raises(UsageError, match="cannot be scoped to model") as caught:
        SplitScope(name)
    assert caught.value.exit_code == 2


@pytest.mark.parametrize(("doc", "scope"), [
    ({"model": "fraud.v2", "grpc": False}, SplitScope("fraud.v2")),
    ({"model": "m", "grpc": True}, SplitScope("m", grpc=True)),
    (None, None),                          # an unscoped split
    ({"model": "a b", "grpc": True}, None),  # not a scope nginx could have rendered
    ({"grpc": True}, None),
    ("fraud", None),
])
def test_a_reported_scope_is_read_back(doc: object, scope: SplitScope | None) -> None:
    assert SplitScope.from_dict(doc) == scope
    if scope is not None:
        assert SplitScope.from_dict(scope.to_dict()) == scope
