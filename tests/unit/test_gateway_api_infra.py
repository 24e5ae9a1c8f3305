"""The inference HTTPRoute of infra/ and the Gateway API router agree, offline.

The route is rendered by ``kubectl kustomize`` (both overlays) and every document the
router would write to it, applied as the API server applies a merge patch, passes the
strict HTTPRoute check of tests/unit/test_infra.py (the CRD's fields and rules for what
we use: backendRefs weights, RequestMirror with percent or fraction).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest

from modelship.traffic.gateway_api import (
    build_gateway_api_router,
    route_patch,
    split_of,
)
from modelship.traffic.port import PRODUCTION_ONLY, TrafficSplit
from tests.unit.test_gateway_api import merge_patch
from tests.unit.test_infra import (
    OVERLAYS,
    httproute_errors,
    one,
    rendered,
    settings_from_configmap,
)

ROUTE = "triton-inference"
SPLITS = [(c, m) for c in (0, 1, 5, 25, 50, 100) for m in (0, 5, 100)] + [(0.5, 2.5)]


def inference_route(overlay: str) -> dict[str, Any]:
    (route,) = [d for d in rendered(overlay) if d["kind"] == "HTTPRoute"
                and d["metadata"]["name"] == ROUTE]
    return copy.deepcopy(route)


def router_target() -> Any:
    options = settings_from_configmap().gateway_api_router()
    assert options is not None, "the ConfigMap selects no Gateway API router"
    return build_gateway_api_router(options).target


def test_the_configmap_points_the_router_at_the_route_and_its_services() -> None:
    target = router_target()
    route = one("HTTPRoute", ROUTE)
    assert (target.namespace, target.name) == (route["metadata"]["namespace"], ROUTE)
    for backend in (target.production, target.canary):
        service = one("Service", backend.name)
        assert backend.port in {p["port"] for p in service["spec"]["ports"]
                                if p["name"] == "http"}, backend
    assert (target.production.name, target.canary.name) == ("triton", "triton-canary")


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_committed_route_is_production_only(overlay: str) -> None:
    route = inference_route(overlay)
    assert httproute_errors(route) == []
    assert split_of(route, router_target()) == PRODUCTION_ONLY


@pytest.mark.parametrize(("canary", "mirror"), SPLITS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_document_the_router_writes_validates(overlay: str, canary: float,
                                                    mirror: float) -> None:
    route, target = inference_route(overlay), router_target()
    patched = merge_patch(route, route_patch(route, target, canary_pct=canary,
                                             mirror_pct=mirror))
    assert httproute_errors(patched) == []
    assert split_of(patched, target) == TrafficSplit(canary_pct=canary, mirror_pct=mirror)
    back = merge_patch(patched, route_patch(patched, target, canary_pct=0, mirror_pct=0))
    assert back["spec"] == route["spec"], "the way back is the committed route exactly"


@pytest.mark.parametrize(("share", "expected"), [
    ({"percent": 101}, "percent"),
    ({"percent": 5.5}, "percent"),
    ({"percent": 5, "fraction": {"numerator": 5}}, "only one of percent or fraction"),
    ({"fraction": {"numerator": 11, "denominator": 10}}, "numerator must be <="),
    ({"fraction": {"numerator": 1, "denominator": 0}}, "denominator"),
    ({"fraction": {"numerator": -1}}, "numerator"),
    ({"fraction": {"numerator": 1, "scale": 2}}, "unknown field"),
    ({"share": 5}, "unknown field"),
])
def test_the_check_catches_mirror_mistakes(share: dict[str, Any], expected: str) -> None:
    route = inference_route("prod")
    route["spec"]["rules"][0]["filters"] = [{"type": "RequestMirror", "requestMirror": {
        "backendRef": {"name": "triton-canary", "port": 8000}, **share}}]
    assert any(expected in e for e in httproute_errors(route)), httproute_errors(route)


@pytest.mark.parametrize(("mirror", "expected"), [
    ({"type": "RequestMirror", "requestMirror": {"backendRef": {"name": "triton-canary"}}},
     "port"),
    ({"type": "URLRewrite", "urlRewrite": {}}, "only RequestMirror"),
    ({"type": "RequestMirror"}, "only RequestMirror"),
])
def test_the_check_catches_filter_mistakes(mirror: dict[str, Any], expected: str) -> None:
    route = inference_route("prod")
    route["spec"]["rules"][0]["filters"] = [mirror]
    assert any(expected in e for e in httproute_errors(route)), httproute_errors(route)
