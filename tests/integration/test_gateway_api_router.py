"""The Gateway API router over the wire: the official ``kubernetes`` client against a local
fake API server (kmock), as in tests/integration/test_discovery_k8s.py.

kmock's scaffold speaks the Kubernetes API (paths, Status errors); the fixture adds the
parts of the API server this adapter relies on, for one HTTPRoute:

- PATCH only as ``application/merge-patch+json`` (strategic merge is 415 for a CRD), applied
  as RFC 7386 (lists replaced whole);
- ``metadata.resourceVersion`` in a patch is a precondition (409 when stale); every write
  bumps it;
- the CRD's validation (the strict HTTPRoute check of tests/unit/test_infra.py): 422;
- ``old_crd``: a CRD before v1.3 that prunes ``requestMirror.percent``/``fraction``.

No stack fixture is needed: the whole file runs in seconds.
"""

from __future__ import annotations

import asyncio
import copy
import json
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import kmock
import pytest
from kubernetes import client

from modelship.errors import CredentialsRejected, InfrastructureError, Unreachable
from modelship.traffic.gateway_api import (
    GatewayApiRouter,
    RouteTarget,
    ServiceRef,
    build_gateway_api_router,
)
from modelship.traffic.port import PRODUCTION_ONLY, TrafficRouter, TrafficSplit
from tests.silent import closed_port, connections_made
from tests.unit.test_gateway_api import merge_patch, route
from tests.unit.test_infra import httproute_errors

pytestmark = pytest.mark.integration

ROUTES = "gateway.networking.k8s.io/v1/httproutes"
NS = "modelship"
NAME = "triton-inference"
TARGET = RouteTarget(namespace=NS, name=NAME, production=ServiceRef("triton", 8000),
                     canary=ServiceRef("triton-canary", 8000))


@dataclass
class FakeRoutes:
    """The fake API server's state: one store of routes, faults to inject, what it saw."""

    url: str
    loop: asyncio.AbstractEventLoop
    objects: dict[str, dict[str, Any]] = field(default_factory=dict)
    faults: dict[str, kmock.KubernetesError] = field(default_factory=dict)
    conflicts: int = 0  # the next N patches find the route changed by someone else
    conflict_at: set[int] = field(default_factory=set)  # these patches (1-based) too
    old_crd: bool = False
    patches: list[dict[str, Any]] = field(default_factory=list)
    patch_headers: list[dict[str, str]] = field(default_factory=list)
    patch_params: list[dict[str, str]] = field(default_factory=list)
    gets: int = 0

    def put(self, obj: dict[str, Any]) -> None:
        self.objects[obj["metadata"]["name"]] = copy.deepcopy(obj)

    def stored(self, name: str = NAME) -> dict[str, Any]:
        return self.objects[name]

    def router(self, timeout_s: float = 5.0) -> GatewayApiRouter:
        return GatewayApiRouter(client.Configuration(host=self.url), target=TARGET,
                                timeout_s=timeout_s)

    # -- the API server's side (on its loop) ------------------------------------------

    def fetch(self, request: kmock.Request) -> dict[str, Any]:
        self.gets += 1
        if "get" in self.faults:
            raise self.faults["get"]
        if request.name not in self.objects or request.namespace != NS:
            raise kmock.KubernetesObjectNotFoundError(
                message=f'httproutes.gateway.networking.k8s.io "{request.name}" not found')
        return self.objects[str(request.name)]

    def patch(self, request: kmock.Request) -> dict[str, Any]:
        headers = {k.lower(): v for k, v in request.headers.items()}
        self.patch_headers.append(headers)
        self.patch_params.append(dict(request.params))
        self.patches.append(json.loads(request.body))
        if "patch" in self.faults:
            raise self.faults["patch"]
        current = self.fetch(request)
        if headers.get("content-type") != "application/merge-patch+json":
            raise kmock.KubernetesError(status=415, reason="UnsupportedMediaType",
                                        message=f"the body of the request was in an unknown "
                                        f"format - accepted media types include: "
                                        f"application/merge-patch+json ({headers})")
        if self.conflicts or len(self.patches) in self.conflict_at:
            self.conflicts = max(0, self.conflicts - 1)
            self._bump(current)  # someone else wrote the route after we read it
        patch = json.loads(request.body)
        wanted = (patch.get("metadata") or {}).get("resourceVersion")
        if wanted and wanted != current["metadata"]["resourceVersion"]:
            raise kmock.KubernetesError(
                status=409, reason="Conflict",
                message=f'Operation cannot be fulfilled on httproutes.gateway.networking.k8s.io '
                f'"{request.name}": the object has been modified; please apply your changes '
                "to the latest version and try again")
        updated = merge_patch(current, patch)
        if self.old_crd:
            for rule in updated["spec"]["rules"]:
                for flt in rule.get("filters") or []:
                    for key in ("percent", "fraction"):
                        flt.get("requestMirror", {}).pop(key, None)
        errors = httproute_errors({k: v for k, v in updated.items() if k != "status"})
        if errors:
            raise kmock.KubernetesError(status=422, reason="Invalid",
                                        message=f'HTTPRoute.gateway.networking.k8s.io '
                                        f'"{request.name}" is invalid: {"; ".join(errors)}')
        updated["status"] = current.get("status", {})
        self._bump(updated)
        self.objects[str(request.name)] = updated
        return updated

    @staticmethod
    def _bump(obj: dict[str, Any]) -> None:
        meta = obj["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)
        meta["generation"] = int(meta.get("generation", 1)) + 1


@pytest.fixture
def api() -> Iterator[FakeRoutes]:
    started = threading.Event()
    box: dict[str, Any] = {}

    async def serve() -> None:
        async with kmock.KubernetesScaffold() as scaffold, kmock.Server(scaffold) as server:
            stop = asyncio.Event()
            fake = FakeRoutes(str(server.url).rstrip("/"), asyncio.get_running_loop())
            scaffold.resources[ROUTES] = kmock.ResourceInfo(kind="HTTPRoute", namespaced=True)
            scaffold[kmock.action.FETCH, kmock.resource(ROUTES)] << fake.fetch
            scaffold[kmock.action.UPDATE, kmock.resource(ROUTES)] << fake.patch
            box.update(fake=fake, stop=stop)
            started.set()
            await stop.wait()

    thread = threading.Thread(target=lambda: asyncio.run(serve()), name="kmock", daemon=True)
    thread.start()
    assert started.wait(10), "kmock did not start"
    fake: FakeRoutes = box["fake"]
    fake.put(route())
    try:
        yield fake
    finally:
        fake.loop.call_soon_threadsafe(box["stop"].set)
        thread.join(10)


def test_set_weights_mirror_and_read_back(api: FakeRoutes) -> None:
    router = api.router()
    assert isinstance(router, TrafficRouter)
    assert router.live() == PRODUCTION_ONLY

    router.set_weights(5)
    assert router.live() == TrafficSplit(canary_pct=5)
    assert [r["weight"] for r in api.stored()["spec"]["rules"][0]["backendRefs"]] == [95, 5]

    router.mirror(10)
    assert router.live() == TrafficSplit(canary_pct=5, mirror_pct=10)
    router.set_weights(25)  # the mirror stays
    assert router.live() == TrafficSplit(canary_pct=25, mirror_pct=10)
    (mirror,) = api.stored()["spec"]["rules"][0]["filters"]
    assert mirror["requestMirror"] == {"backendRef": {"name": "triton-canary", "port": 8000},
                                       "percent": 10}

    router.mirror(0)
    router.set_weights(0)
    assert router.live() == PRODUCTION_ONLY
    assert api.stored()["spec"] == route()["spec"], "back to the committed route exactly"

    # Every write was one merge patch with the resourceVersion it read, validated strictly.
    assert len(api.patches) == 5
    assert {h["content-type"] for h in api.patch_headers} == {"application/merge-patch+json"}
    assert all(p["metadata"]["resourceVersion"] for p in api.patches)
    assert all(p == {"fieldValidation": "Strict", "fieldManager": "modelship"}
               for p in api.patch_params)


def test_an_unchanged_split_sends_no_patch(api: FakeRoutes) -> None:
    router = api.router()
    router.set_weights(50)
    router.set_weights(50)
    router.mirror(0)
    router.set_weights(50.0)
    assert len(api.patches) == 1
    assert api.stored()["metadata"]["resourceVersion"] == "8"


@pytest.mark.parametrize(("canary", "mirror"), [(0, 0), (1, 5), (25, 100), (100, 0),
                                                (0.5, 2.5)])
def test_the_wire_holds_what_was_asked(api: FakeRoutes, canary: float, mirror: float) -> None:
    router = api.router()
    router.mirror(mirror)
    router.set_weights(canary)
    assert router.live() == TrafficSplit(canary_pct=canary, mirror_pct=mirror)


def test_a_conflict_is_read_again_and_retried(api: FakeRoutes) -> None:
    api.conflicts = 2
    api.router().set_weights(5)
    assert api.router().live() == TrafficSplit(canary_pct=5)
    assert len(api.patches) == 3
    # each retry carried the version it had just read
    assert [p["metadata"]["resourceVersion"] for p in api.patches] == ["7", "8", "9"]


def test_a_route_that_keeps_changing_is_an_error(api: FakeRoutes) -> None:
    api.conflicts = 10
    with pytest.raises(InfrastructureError, match="409 Conflict") as info:
        api.router().set_weights(5)
    assert "--show-managed-fields" in str(info.value.hint)
    assert len(api.patches) == 3


def test_a_missing_route_is_an_infrastructure_error(api: FakeRoutes) -> None:
    api.objects.clear()
    for call in (lambda r: r.live(), lambda r: r.set_weights(5), lambda r: r.mirror(0)):
        with pytest.raises(InfrastructureError, match=f"HTTPRoute {NS}/{NAME} was not found"
                           ) as info:
            call(api.router())
        assert not isinstance(info.value, Unreachable)
        assert "infra/base/traffic" in str(info.value.hint)
        assert info.value.details["status"] == 404


def test_an_invalid_patch_is_refused_and_named(api: FakeRoutes) -> None:
    # A route whose split rule also has a filter the CRD refuses: the server answers 422.
    broken = route(filters=[{"type": "RequestMirror", "requestMirror": {
        "backendRef": {"name": "audit", "port": 8000}, "percent": 101}}])
    api.put(broken)
    with pytest.raises(InfrastructureError, match="422") as info:
        api.router().set_weights(5)
    assert "percent" in info.value.message and info.value.details["status"] == 422


def test_an_old_crd_that_drops_the_share_leaves_no_mirror(api: FakeRoutes) -> None:
    api.old_crd = True
    with pytest.raises(InfrastructureError, match="dropped fields") as info:
        api.router().mirror(5)
    assert "v1.3" in str(info.value.hint)
    assert "the mirror was removed" in info.value.message
    assert api.router().live() == PRODUCTION_ONLY, "a pruned 5 % would have mirrored all"


def test_the_pruned_mirror_is_removed_even_through_a_conflict(api: FakeRoutes) -> None:
    api.old_crd = True
    api.conflict_at = {2}  # someone writes the route between our patch and its removal
    with pytest.raises(InfrastructureError, match="the mirror was removed"):
        api.router().mirror(5)
    assert api.router().live() == PRODUCTION_ONLY
    assert len(api.patches) == 3


@pytest.mark.parametrize(("status", "error", "hint"), [
    (403, CredentialsRejected, "patch"),
    (401, CredentialsRejected, "token"),
    (503, Unreachable, "retry later"),
    (429, Unreachable, "retry later"),
])
def test_api_errors_are_translated(api: FakeRoutes, status: int, error: type[Exception],
                                   hint: str) -> None:
    api.faults["patch"] = kmock.KubernetesError(status=status, reason="x",
                                                message=f"answered {status}")
    with pytest.raises(error) as info:
        api.router().set_weights(5)
    assert f"answered {status}" in str(info.value)
    assert hint in str(getattr(info.value, "hint", ""))


@pytest.mark.parametrize("status", ["False", "Unknown"])
def test_a_route_its_gateway_refuses_gets_no_traffic(api: FakeRoutes, status: str) -> None:
    refused = route()
    refused["status"]["parents"][0]["conditions"][0].update(
        status=status, reason="NotAllowedByListeners",
        message="no listener allows routes from namespace modelship")
    api.put(refused)
    router = api.router()
    with pytest.raises(InfrastructureError, match="NotAllowedByListeners") as info:
        router.live()
    assert "kubectl -n modelship describe httproute triton-inference" in str(info.value.hint)
    with pytest.raises(InfrastructureError, match="Accepted="):
        router.set_weights(5)
    with pytest.raises(InfrastructureError, match="Accepted="):
        router.mirror(5)
    assert api.patches == [], "no traffic moved onto a route the Gateway ignores"


def test_the_way_back_is_written_even_on_a_refused_route(api: FakeRoutes) -> None:
    refused = route(weights=(75, 25), filters=[{"type": "RequestMirror", "requestMirror": {
        "backendRef": {"name": "triton-canary", "port": 8000}, "percent": 10}}])
    refused["status"] = {"parents": []}
    api.put(refused)
    api.router().set_weights(0)
    api.router().mirror(0)
    assert api.stored()["spec"] == route()["spec"]
    assert len(api.patches) == 2


def test_a_step_back_on_a_refused_route_is_written(api: FakeRoutes) -> None:
    refused = route(weights=(50, 50))
    refused["status"]["parents"][0]["conditions"][1]["status"] = "False"
    api.put(refused)
    api.router().set_weights(5)  # less canary: allowed
    assert [r["weight"] for r in api.stored()["spec"]["rules"][0]["backendRefs"]] == [95, 5]
    with pytest.raises(InfrastructureError, match="ResolvedRefs=False"):
        api.router().set_weights(25)  # more canary: refused


def test_an_api_server_that_is_down_is_unreachable_quickly() -> None:
    url = f"http://127.0.0.1:{closed_port()}"
    timeout_s = 30.0  # never waited for: a refused connection fails at once
    router = build_gateway_api_router({"route": f"{NS}/{NAME}", "api_url": url,
                                       "timeout_s": timeout_s})
    start = time.monotonic()
    with pytest.raises(Unreachable, match=f"API server at {url} could not be reached") as info:
        router.set_weights(5)
    assert time.monotonic() - start < timeout_s / 3  # far below it, on a loaded machine too
    assert "kubectl cluster-info" in str(info.value.hint)


def test_an_api_server_that_never_answers_times_out_once() -> None:
    with socket.socket() as sock:  # accepts connections (backlog) but never replies
        sock.bind(("127.0.0.1", 0))
        sock.listen(8)
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        router = build_gateway_api_router({"route": f"{NS}/{NAME}", "api_url": url,
                                           "timeout_s": 0.5})
        start = time.monotonic()
        with pytest.raises(Unreachable, match=f"{url} did not answer within 0.5 s"):
            router.live()
        elapsed = time.monotonic() - start
        # One attempt (urllib3's default retries would have opened 4 connections),
        # counted, not timed: the time also holds building the client on a busy machine.
        assert connections_made(sock) == 1
    assert 0.4 < elapsed < 20 * 0.5  # it waited for the answer, about 0.5 s, not more
