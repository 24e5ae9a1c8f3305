"""Kubernetes discovery against a real local API server (kmock) and the official client.

kmock serves the Kubernetes API on a free loopback port from its own event loop in a
thread, because the official client is synchronous. kmock 0.8 ignores ``labelSelector``
on lists, so the fixture adds that part of the API server (equality selectors, the kind
Services use): without it, a test could not tell whether the selector was sent at all.
No stack fixture is needed.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import kmock
import pytest
from kubernetes import client

from modelship.errors import CredentialsRejected, InfrastructureError, Unreachable, UsageError
from modelship.triton.discovery import KubernetesDiscovery, build_discovery
from tests.silent import closed_port, connections_made

pytestmark = pytest.mark.integration

SLICES = "discovery.k8s.io/v1/endpointslices"
SERVICES = "v1/services"
NS = "ml"
PORTS: list[dict[str, Any]] = [
    {"name": "http", "port": 8000, "protocol": "TCP"},
    {"name": "grpc", "port": 8001, "protocol": "TCP"},
    {"name": "metrics", "port": 8002, "protocol": "TCP"},
]


def _matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors (``a=b,c!=d,e``), as the API server applies them."""
    for term in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in term:
            key, value = term.split("!=", 1)
            if labels.get(key.strip()) == value.strip():
                return False
        elif "=" in term:
            key, value = term.replace("==", "=").split("=", 1)
            if labels.get(key.strip()) != value.strip():
                return False
        elif term.startswith("!"):
            if term[1:] in labels:
                return False
        elif term not in labels:
            return False
    return True


@dataclass
class FakeApiServer:
    """A kmock Kubernetes emulator served from a background thread."""

    emulator: kmock.KubernetesEmulator
    url: str
    loop: asyncio.AbstractEventLoop
    faults: dict[str, Exception]

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the server's loop: its object store is not thread-safe."""
        async def run() -> Any:
            return fn()

        return asyncio.run_coroutine_threadsafe(run(), self.loop).result(timeout=5)

    def put(self, resource: str, obj: dict[str, Any]) -> None:
        meta = obj["metadata"]

        def store() -> None:
            self.emulator.objects[resource, meta.get("namespace"), meta["name"]] = obj

        self.call(store)

    def list_requests(self) -> list[dict[str, str]]:
        """Query parameters of every EndpointSlice list request so far."""
        return self.call(lambda: [dict(r.params) for r in self.emulator
                                  if r.resource is not None and r.resource.plural ==
                                  "endpointslices"])

    def configuration(self) -> client.Configuration:
        return client.Configuration(host=self.url)


@pytest.fixture
def api_server() -> Iterator[FakeApiServer]:
    started = threading.Event()
    box: dict[str, Any] = {}
    faults: dict[str, Exception] = {}

    async def serve() -> None:
        async with kmock.KubernetesEmulator() as emulator, kmock.Server(emulator) as server:
            stop = asyncio.Event()

            def list_slices(request: kmock.Request) -> dict[str, Any]:
                if "list" in faults:
                    raise faults["list"]
                selector = request.params.get("labelSelector", "")
                items = [
                    obj.raw for (_, namespace, _), obj in emulator.objects.items()
                    if not obj.deleted and namespace == request.namespace
                    and _matches(obj.raw.get("metadata", {}).get("labels") or {}, selector)
                ]
                return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSliceList",
                        "metadata": {"resourceVersion": "1"}, "items": items}

            emulator[kmock.action.LIST, kmock.resource(SLICES)] << list_slices
            emulator.resources[SERVICES] = kmock.ResourceInfo(kind="Service", namespaced=True)
            box.update(emulator=emulator, url=str(server.url).rstrip("/"),
                       loop=asyncio.get_running_loop(), stop=stop)
            started.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), name="kmock", daemon=True)
    thread.start()
    assert started.wait(10), "kmock did not start"
    try:
        yield FakeApiServer(box["emulator"], box["url"], box["loop"], faults)
    finally:
        box["loop"].call_soon_threadsafe(box["stop"].set)
        thread.join(10)


def endpoint(ip: str, pod: str, *, ready: bool, terminating: bool = False) -> dict[str, Any]:
    return {"addresses": [ip], "nodeName": "node-1",
            "conditions": {"ready": ready, "serving": ready or terminating,
                           "terminating": terminating},
            "targetRef": {"kind": "Pod", "namespace": NS, "name": pod, "uid": f"uid-{pod}"}}


def endpoint_slice(name: str, service: str | None, endpoints: list[dict[str, Any]] | None,
                   *, labels: dict[str, str] | None = None,
                   ports: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    all_labels = {**({"kubernetes.io/service-name": service} if service else {}),
                  "endpointslice.kubernetes.io/managed-by": "endpointslice-controller.k8s.io",
                  **(labels or {})}
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": NS, "labels": all_labels},
            "addressType": "IPv4", "endpoints": endpoints,
            "ports": PORTS if ports is None else ports}


def service(name: str) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Service", "metadata": {"name": name, "namespace": NS},
            "spec": {"selector": {"app": name}, "ports": [
                {"name": p["name"], "port": p["port"], "targetPort": p["port"]}
                for p in PORTS]}}


def discovery(server: FakeApiServer, **kwargs: Any) -> KubernetesDiscovery:
    options: dict[str, Any] = {"namespace": NS, "timeout_s": 5.0, **kwargs}
    if "label_selector" not in options:
        options.setdefault("service", "triton")
    return KubernetesDiscovery(server.configuration(), **options)


def test_lists_only_ready_non_terminating_endpoints(api_server: FakeApiServer) -> None:
    api_server.put(SERVICES, service("triton"))
    api_server.put(SLICES, endpoint_slice("triton-a1", "triton", [
        endpoint("10.1.0.12", "triton-7c9f-zq2", ready=True),
        endpoint("10.1.0.11", "triton-7c9f-abc", ready=True),
        endpoint("10.1.0.13", "triton-7c9f-new", ready=False),  # still loading models
    ]))
    api_server.put(SLICES, endpoint_slice("triton-b2", "triton", [
        endpoint("10.1.0.14", "triton-7c9f-old", ready=False, terminating=True),
        endpoint("10.1.0.11", "triton-7c9f-abc", ready=True),  # duplicate across slices
    ]))
    # Another Service's slice in the same namespace must not leak in.
    api_server.put(SLICES, endpoint_slice("canary-x", "triton-canary", [
        endpoint("10.1.0.99", "triton-canary-0", ready=True)]))

    replicas = discovery(api_server).replicas()

    assert [(r.name, r.grpc) for r in replicas] == [
        ("triton-7c9f-abc", "10.1.0.11:8001"), ("triton-7c9f-zq2", "10.1.0.12:8001")]
    assert replicas[0].http == "http://10.1.0.11:8000"
    assert replicas[0].metrics == "http://10.1.0.11:8002/metrics"
    assert api_server.list_requests()[-1]["labelSelector"] == "kubernetes.io/service-name=triton"


def test_ready_but_terminating_is_excluded(api_server: FakeApiServer) -> None:
    # publishNotReadyAddresses keeps a draining pod "ready": it still must not be swapped.
    api_server.put(SLICES, endpoint_slice("triton-a1", "triton", [
        endpoint("10.1.0.1", "triton-0", ready=True, terminating=True),
        endpoint("10.1.0.2", "triton-1", ready=True),
    ]))
    assert [r.name for r in discovery(api_server).replicas()] == ["triton-1"]


def test_maps_custom_port_names(api_server: FakeApiServer) -> None:
    ports = [{"name": "triton-grpc", "port": 9001}, {"name": "triton-http", "port": 9000},
             {"name": "prom", "port": 9002}]
    api_server.put(SLICES, endpoint_slice("triton-a1", "triton",
                                          [endpoint("10.1.0.1", "triton-0", ready=True)],
                                          ports=ports))
    [replica] = discovery(api_server, http_port_name="triton-http",
                          grpc_port_name="triton-grpc", metrics_port_name="prom").replicas()
    assert (replica.http, replica.grpc, replica.metrics) == (
        "http://10.1.0.1:9000", "10.1.0.1:9001", "http://10.1.0.1:9002/metrics")
    with pytest.raises(UsageError, match="no port named 'http', 'grpc', 'metrics'"):
        discovery(api_server).replicas()


def test_label_selector_mode(api_server: FakeApiServer) -> None:
    api_server.put(SLICES, endpoint_slice("gpu-a", None, [endpoint("10.2.0.1", "gpu-0",
                                                                   ready=True)],
                                          labels={"app": "triton", "pool": "gpu"}))
    api_server.put(SLICES, endpoint_slice("cpu-a", None, [endpoint("10.2.0.2", "cpu-0",
                                                                   ready=True)],
                                          labels={"app": "triton", "pool": "cpu"}))
    found = discovery(api_server, label_selector="app=triton,pool=gpu").replicas()
    assert [r.name for r in found] == ["gpu-0"]
    assert api_server.list_requests()[-1]["labelSelector"] == "app=triton,pool=gpu"

    with pytest.raises(InfrastructureError, match="no ready Triton endpoints behind label "
                       "selector 'pool=tpu' in namespace ml"):
        discovery(api_server, label_selector="pool=tpu").replicas()


def test_service_with_no_slices_is_an_error(api_server: FakeApiServer) -> None:
    api_server.put(SERVICES, service("triton"))
    with pytest.raises(InfrastructureError) as info:
        discovery(api_server).replicas()
    assert type(info.value) is InfrastructureError
    assert info.value.message.startswith(
        "no ready Triton endpoints behind service triton in namespace ml")


def test_service_with_no_ready_endpoints_is_an_error(api_server: FakeApiServer) -> None:
    api_server.put(SERVICES, service("triton"))
    api_server.put(SLICES, endpoint_slice("triton-a1", "triton", [
        endpoint("10.1.0.1", "triton-0", ready=False),
        endpoint("10.1.0.2", "triton-1", ready=True, terminating=True)]))
    api_server.put(SLICES, endpoint_slice("triton-a2", "triton", None))  # endpoints: null
    with pytest.raises(InfrastructureError, match="behind service triton in namespace ml "
                       r"\(2 EndpointSlice\(s\), 2 endpoint\(s\), none ready\)"):
        discovery(api_server).replicas()


def test_missing_service_is_a_usage_error_naming_it(api_server: FakeApiServer) -> None:
    api_server.put(SERVICES, service("triton"))
    with pytest.raises(UsageError, match="service tritn not found in namespace ml") as info:
        discovery(api_server, service="tritn").replicas()
    assert info.value.details["status"] == 404


def test_ping_checks_reachability_not_readiness(api_server: FakeApiServer) -> None:
    discovery(api_server).ping()  # no slices yet: reachable and allowed is enough
    assert api_server.list_requests()[-1]["limit"] == "1"


@pytest.mark.parametrize("status", [401, 403])
def test_refused_credentials_name_the_rbac_fix(api_server: FakeApiServer, status: int) -> None:
    api_server.faults["list"] = kmock.KubernetesError(
        status=status, reason="Forbidden" if status == 403 else "Unauthorized",
        message='endpointslices.discovery.k8s.io is forbidden: User '
        '"system:serviceaccount:ml:modelship" cannot list resource "endpointslices"')
    with pytest.raises(CredentialsRejected) as info:
        discovery(api_server).replicas()
    assert "endpointslices" in info.value.message
    assert info.value.hint is not None and "verbs: [list]" in info.value.hint


REFUSED_TIMEOUT_S = 30.0  # never waited for: a refused connection fails at once


def test_api_server_down_is_unreachable_quickly() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    start = time.monotonic()
    with pytest.raises(Unreachable, match=f"API server at {url} could not be reached"):
        KubernetesDiscovery(client.Configuration(host=url), namespace=NS, service="triton",
                            timeout_s=REFUSED_TIMEOUT_S).replicas()
    # a refused connection fails at once: far below the timeout, on a loaded machine too
    assert time.monotonic() - start < REFUSED_TIMEOUT_S / 3


def test_api_server_that_never_answers_times_out_once() -> None:
    with socket.socket() as sock:  # accepts connections (backlog) but never replies
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        discovery_ = build_discovery(static=[], kubernetes={
            "namespace": NS, "service": "triton", "api_url": url, "timeout_s": 0.5})
        start = time.monotonic()
        with pytest.raises(Unreachable, match=f"{url} did not answer within 0.5 s"):
            discovery_.ping()
        elapsed = time.monotonic() - start
        # One attempt (urllib3's default retries would have opened 4 connections),
        # counted, not timed: the time also holds building the client on a busy machine.
        assert connections_made(sock) == 1
    assert 0.4 < elapsed < 20 * 0.5  # it waited for the answer, about 0.5 s, not more
