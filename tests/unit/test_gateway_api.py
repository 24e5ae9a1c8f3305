"""The Gateway API router's documents, exactly: the merge patches it sends to an HTTPRoute
and what it reads back from one (modelship/traffic/gateway_api.py). Pure, no API server;
tests/integration/test_gateway_api_router.py drives the same code over the wire."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest

from modelship.errors import InfrastructureError, UsageError
from modelship.settings import Settings
from modelship.traffic.gateway_api import (
    GatewayApiRouter,
    RouteTarget,
    ServiceRef,
    build_gateway_api_router,
    mirror_filter,
    route_patch,
    route_problems,
    split_of,
    split_rules,
    weights_for,
)
from modelship.traffic.port import PRODUCTION_ONLY, TrafficRouter, TrafficSplit

PROD = ServiceRef("triton", 8000)
CANARY = ServiceRef("triton-canary", 8000)
TARGET = RouteTarget(namespace="modelship", name="triton-inference", production=PROD,
                     canary=CANARY)
MATCHES = [{"path": {"type": "PathPrefix", "value": "/v2/"}}]
ACCEPTED = {"parents": [{
    "parentRef": {"name": "public", "namespace": "gateway-system"},
    "controllerName": "example.net/gateway",
    "conditions": [{"type": "Accepted", "status": "True", "reason": "Accepted"},
                   {"type": "ResolvedRefs", "status": "True", "reason": "ResolvedRefs"}]}]}


def route(*, weights: tuple[int, int] = (100, 0), filters: list[dict[str, Any]] | None = None,
          version: str = "7") -> dict[str, Any]:
    """The committed infra route as the API server returns it (metadata and status too)."""
    rule: dict[str, Any] = {"matches": MATCHES, "backendRefs": [
        {"name": "triton", "port": 8000, "weight": weights[0]},
        {"name": "triton-canary", "port": 8000, "weight": weights[1]}]}
    if filters is not None:
        rule["filters"] = filters
    return {"apiVersion": "gateway.networking.k8s.io/v1", "kind": "HTTPRoute",
            "metadata": {"name": "triton-inference", "namespace": "modelship",
                         "resourceVersion": version, "generation": 3},
            "spec": {"parentRefs": [{"name": "public", "namespace": "gateway-system"}],
                     "rules": [rule]},
            "status": copy.deepcopy(ACCEPTED)}


def mirror_of(share: dict[str, Any]) -> dict[str, Any]:
    return {"type": "RequestMirror", "requestMirror": {
        "backendRef": {"name": "triton-canary", "port": 8000}, **share}}


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386, as the API server applies application/merge-patch+json."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


# --------------------------------------------------------------------------------------
# Weights and mirror shares.


@pytest.mark.parametrize(("pct", "weights"), [
    (0, (100, 0)), (1, (99, 1)), (5, (95, 5)), (25, (75, 25)), (50, (50, 50)),
    (100, (0, 100)), (0.5, (9950, 50)), (12.34, (8766, 1234)), (99.99, (1, 9999)),
    (5.0, (95, 5)), (0.001, (100, 0)),
])
def test_weights_for(pct: float, weights: tuple[int, int]) -> None:
    assert weights_for(pct) == weights


@pytest.mark.parametrize("pct", [-1, 100.5, math.nan, math.inf])
def test_weights_refuse_what_is_no_percentage(pct: float) -> None:
    with pytest.raises(UsageError, match="canary_pct"):
        weights_for(pct)
    with pytest.raises(UsageError, match="mirror_pct"):
        mirror_filter(CANARY, pct)


@pytest.mark.parametrize(("pct", "share"), [
    (1, {"percent": 1}), (5, {"percent": 5}), (25, {"percent": 25}), (100, {"percent": 100}),
    (2.5, {"fraction": {"numerator": 250, "denominator": 10_000}}),
    (0.01, {"fraction": {"numerator": 1, "denominator": 10_000}}),
])
def test_mirror_filter(pct: float, share: dict[str, Any]) -> None:
    assert mirror_filter(CANARY, pct) == mirror_of(share)


def test_no_mirror_filter_at_zero() -> None:
    assert mirror_filter(CANARY, 0) is None
    assert mirror_filter(CANARY, 0.004) is None  # below the 0.01 % resolution


# --------------------------------------------------------------------------------------
# The exact patch documents.


@pytest.mark.parametrize("pct", [0, 1, 5, 25, 50, 100])
def test_weight_patch_is_exactly(pct: int) -> None:
    assert route_patch(route(), TARGET, canary_pct=pct) == {
        "metadata": {"resourceVersion": "7"},
        "spec": {"rules": [{"matches": MATCHES, "backendRefs": [
            {"name": "triton", "port": 8000, "weight": 100 - pct},
            {"name": "triton-canary", "port": 8000, "weight": pct}]}]}}


@pytest.mark.parametrize(("pct", "share"), [
    (1, {"percent": 1}), (5, {"percent": 5}), (25, {"percent": 25}), (50, {"percent": 50}),
    (100, {"percent": 100}), (0.5, {"fraction": {"numerator": 50, "denominator": 10_000}}),
])
def test_mirror_on_patch_is_exactly(pct: float, share: dict[str, Any]) -> None:
    assert route_patch(route(), TARGET, mirror_pct=pct) == {
        "metadata": {"resourceVersion": "7"},
        "spec": {"rules": [{"matches": MATCHES, "backendRefs": [
            {"name": "triton", "port": 8000, "weight": 100},
            {"name": "triton-canary", "port": 8000, "weight": 0}],
            "filters": [mirror_of(share)]}]}}


def test_mirror_off_patch_drops_the_filter() -> None:
    mirrored = route(filters=[mirror_of({"percent": 10})])
    patch = route_patch(mirrored, TARGET, mirror_pct=0)
    assert patch == {"metadata": {"resourceVersion": "7"},
                     "spec": {"rules": [{"matches": MATCHES, "backendRefs": [
                         {"name": "triton", "port": 8000, "weight": 100},
                         {"name": "triton-canary", "port": 8000, "weight": 0}]}]}}
    # Merge patch replaces the rules list whole: the filter is gone on the server too.
    assert "filters" not in merge_patch(mirrored, patch)["spec"]["rules"][0]


def test_weights_keep_the_mirror_and_the_mirror_keeps_the_weights() -> None:
    mirrored = route(filters=[mirror_of({"percent": 10})])
    weighted = route_patch(mirrored, TARGET, canary_pct=5)["spec"]["rules"][0]
    assert weighted["filters"] == [mirror_of({"percent": 10})]
    assert [r["weight"] for r in weighted["backendRefs"]] == [95, 5]

    shifted = route(weights=(75, 25))
    rule = route_patch(shifted, TARGET, mirror_pct=20)["spec"]["rules"][0]
    assert [r["weight"] for r in rule["backendRefs"]] == [75, 25]
    assert rule["filters"] == [mirror_of({"percent": 20})]


@pytest.mark.parametrize(("canary", "mirror"), [(0, 0), (5, 10), (25, 0), (0, 100),
                                                (50, 50), (100, 0), (1.5, 0.25)])
def test_both_together_and_idempotent(canary: float, mirror: float) -> None:
    start = route(filters=[mirror_of({"percent": 3})])
    first = route_patch(start, TARGET, canary_pct=canary, mirror_pct=mirror)
    after = merge_patch(start, first)
    assert split_of(after, TARGET) == TrafficSplit(canary_pct=canary, mirror_pct=mirror)
    # The same request on the patched route builds the same rules: nothing would change.
    again = route_patch(after, TARGET, canary_pct=canary, mirror_pct=mirror)
    assert again["spec"] == first["spec"]
    assert merge_patch(after, again) == after


def test_other_rules_and_filters_are_kept_in_place() -> None:
    header = {"type": "RequestHeaderModifier",
              "requestHeaderModifier": {"set": [{"name": "x-fleet", "value": "triton"}]}}
    other_mirror = {"type": "RequestMirror", "requestMirror": {
        "backendRef": {"name": "audit", "port": 9000}}}
    docs = {"matches": [{"path": {"type": "PathPrefix", "value": "/docs/"}}],
            "backendRefs": [{"name": "docs", "port": 80}]}
    start = route(filters=[header, other_mirror, mirror_of({"percent": 3})])
    start["spec"]["rules"].insert(0, docs)
    rules = split_rules(start, TARGET, canary_pct=5, mirror_pct=10)
    assert rules[0] == docs
    assert rules[1]["filters"] == [header, other_mirror, mirror_of({"percent": 10})]
    assert rules[1]["matches"] == MATCHES
    assert start["spec"]["rules"][1]["filters"][2] == mirror_of({"percent": 3}), "input mutated"


def test_every_rule_to_production_is_split_alike() -> None:
    start = route()
    grpc_like = copy.deepcopy(start["spec"]["rules"][0])
    grpc_like["matches"] = [{"path": {"type": "PathPrefix", "value": "/v2/health"}}]
    del grpc_like["backendRefs"][1]  # no canary ref yet: the split adds it
    start["spec"]["rules"].append(grpc_like)
    rules = split_rules(start, TARGET, canary_pct=25)
    assert [[r["weight"] for r in rule["backendRefs"]] for rule in rules] == [[75, 25], [75, 25]]
    assert rules[1]["backendRefs"][1] == {"name": "triton-canary", "port": 8000, "weight": 25}


def test_backend_fields_other_than_the_weight_are_kept() -> None:
    start = route()
    start["spec"]["rules"][0]["backendRefs"][0].update(group="", kind="Service")
    rules = split_rules(start, TARGET, canary_pct=1)
    assert rules[0]["backendRefs"][0] == {"name": "triton", "port": 8000, "weight": 99,
                                          "group": "", "kind": "Service"}


def test_no_resource_version_no_precondition() -> None:
    start = route()
    del start["metadata"]["resourceVersion"]
    assert "metadata" not in route_patch(start, TARGET, canary_pct=5)


@pytest.mark.parametrize(("rules", "message"), [
    ([{"backendRefs": [{"name": "docs", "port": 80}]}], "no rule sending to triton:8000"),
    ([{"backendRefs": [{"name": "triton", "port": 9000}]}], "no rule sending to triton:8000"),
    ([{"backendRefs": [{"name": "triton", "port": 8000}, {"name": "triton-b", "port": 8000},
                       {"name": "triton-canary", "port": 8000}]}], "also sends to triton-b"),
    ([], "no rule"),
])
def test_a_route_without_a_clean_split_rule_is_refused(rules: list[dict[str, Any]],
                                                       message: str) -> None:
    start = route()
    start["spec"]["rules"] = rules
    with pytest.raises(InfrastructureError, match=message) as info:
        route_patch(start, TARGET, canary_pct=5)
    assert info.value.hint


# --------------------------------------------------------------------------------------
# Reading back.


@pytest.mark.parametrize(("weights", "filters", "expected"), [
    ((100, 0), None, PRODUCTION_ONLY),
    ((95, 5), None, TrafficSplit(canary_pct=5)),
    ((0, 100), None, TrafficSplit(canary_pct=100)),
    ((9950, 50), None, TrafficSplit(canary_pct=0.5)),
    ((2, 1), None, TrafficSplit(canary_pct=33.3333)),
    ((100, 0), [mirror_of({"percent": 10})], TrafficSplit(mirror_pct=10)),
    ((100, 0), [mirror_of({"fraction": {"numerator": 1}})], TrafficSplit(mirror_pct=1)),
    ((100, 0), [mirror_of({"fraction": {"numerator": 1, "denominator": 1000}})],
     TrafficSplit(mirror_pct=0.1)),
    ((100, 0), [mirror_of({})], TrafficSplit(mirror_pct=100)),  # no share: every request
    ((75, 25), [mirror_of({"percent": 50})], TrafficSplit(canary_pct=25, mirror_pct=50)),
])
def test_split_of(weights: tuple[int, int], filters: list[dict[str, Any]] | None,
                  expected: TrafficSplit) -> None:
    assert split_of(route(weights=weights, filters=filters), TARGET) == expected


def test_a_mirror_to_another_backend_is_not_the_canary_share() -> None:
    audit = {"type": "RequestMirror", "requestMirror": {
        "backendRef": {"name": "audit", "port": 8000}, "percent": 50}}
    assert split_of(route(filters=[audit]), TARGET) == PRODUCTION_ONLY


def test_weights_default_to_one() -> None:
    start = route()
    for ref in start["spec"]["rules"][0]["backendRefs"]:
        del ref["weight"]
    assert split_of(start, TARGET) == TrafficSplit(canary_pct=50)


def test_both_weights_zero_is_an_error() -> None:
    with pytest.raises(InfrastructureError, match="weighs both backends 0"):
        split_of(route(weights=(0, 0)), TARGET)


def test_split_rules_that_disagree_are_an_error() -> None:
    start = route()
    start["spec"]["rules"].append(route(weights=(50, 50))["spec"]["rules"][0])
    with pytest.raises(InfrastructureError, match="disagree") as info:
        split_of(start, TARGET)
    assert "reconcile" in str(info.value.hint)


def _status(*parents: tuple[str, str, str]) -> dict[str, Any]:
    return {"status": {"parents": [{
        "parentRef": {"name": name, "namespace": "gateway-system"},
        "conditions": [{"type": "Accepted", "status": accepted, "reason": "NotAllowedByListeners",
                        "message": "listener https does not allow this namespace"},
                       {"type": "ResolvedRefs", "status": resolved, "reason": "BackendNotFound",
                        "message": "service triton-canary not found"}]}
        for name, accepted, resolved in parents]}}


@pytest.mark.parametrize(("route_status", "problems"), [
    (_status(("public", "True", "True")), []),
    (_status(("public", "False", "True")),
     ["Gateway gateway-system/public: Accepted=False (NotAllowedByListeners: listener https "
      "does not allow this namespace)"]),
    (_status(("public", "True", "False")),
     ["Gateway gateway-system/public: ResolvedRefs=False (BackendNotFound: service "
      "triton-canary not found)"]),
    (_status(("public", "True", "True"), ("internal", "Unknown", "True")),
     ["Gateway gateway-system/internal: Accepted=Unknown (NotAllowedByListeners: listener "
      "https does not allow this namespace)"]),
    ({"status": {"parents": [{"parentRef": {"name": "public"}, "conditions": []}]}},
     ["Gateway public reports no Accepted condition",
      "Gateway public reports no ResolvedRefs condition"]),
])
def test_route_problems(route_status: dict[str, Any], problems: list[str]) -> None:
    assert route_problems(route_status) == problems


@pytest.mark.parametrize("route_status", [{}, {"status": {}}, {"status": {"parents": []}}])
def test_a_route_no_gateway_reports_on_is_a_problem(route_status: dict[str, Any]) -> None:
    (problem,) = route_problems(route_status)
    assert "no Gateway reports on the route" in problem


# --------------------------------------------------------------------------------------
# Settings and wiring.


@pytest.mark.parametrize(("text", "ref"), [
    ("triton:8000", ServiceRef("triton", 8000)), (" triton-canary:1 ", ServiceRef(
        "triton-canary", 1))])
def test_service_ref_parses(text: str, ref: ServiceRef) -> None:
    assert ServiceRef.parse(text, setting="X") == ref


@pytest.mark.parametrize("text", ["triton", "triton:", ":8000", "triton:0", "triton:65536",
                                  "triton:http"])
def test_service_ref_refuses(text: str) -> None:
    with pytest.raises(UsageError, match="MODELSHIP_K8S_ROUTE_CANARY"):
        ServiceRef.parse(text, setting="MODELSHIP_K8S_ROUTE_CANARY")


def test_route_target_refuses_a_half_name_and_one_backend_twice() -> None:
    with pytest.raises(UsageError, match="namespace/name"):
        RouteTarget(namespace="", name="r", production=PROD, canary=CANARY)
    with pytest.raises(UsageError, match="both"):
        RouteTarget(namespace="n", name="r", production=PROD, canary=PROD)


def test_settings_select_the_router_by_the_route(monkeypatch: pytest.MonkeyPatch,
                                                 tmp_path: Any) -> None:
    for name in ("MODELSHIP_K8S_ROUTE", "MODELSHIP_K8S_API_URL", "MODELSHIP_K8S_KUBECONFIG",
                 "MODELSHIP_K8S_CONTEXT"):
        monkeypatch.delenv(name, raising=False)
    assert Settings(home=tmp_path).gateway_api_router() is None  # the local gateway
    monkeypatch.setenv("MODELSHIP_K8S_ROUTE", "ml/inference")
    monkeypatch.setenv("MODELSHIP_K8S_ROUTE_CANARY", "canary:9000")
    monkeypatch.setenv("MODELSHIP_K8S_API_URL", "http://127.0.0.1:8001")
    options = Settings(home=tmp_path, http_timeout_s=4).gateway_api_router()
    assert options == {"route": "ml/inference", "production": "triton:8000",
                       "canary": "canary:9000", "api_url": "http://127.0.0.1:8001",
                       "timeout_s": 4.0}
    router = build_gateway_api_router(options)
    assert isinstance(router, TrafficRouter) and router.name == "gateway-api"
    assert router.target == RouteTarget(namespace="ml", name="inference", production=PROD,
                                        canary=ServiceRef("canary", 9000))
    assert router.timeout_s == 4.0


def test_wiring_refuses_unknown_keys_and_bad_routes() -> None:
    with pytest.raises(UsageError, match="unknown Gateway API router setting"):
        build_gateway_api_router({"route": "ml/r", "weight": 5})
    with pytest.raises(UsageError, match="namespace/name"):
        build_gateway_api_router({"route": "just-a-name"})


@pytest.mark.parametrize("timeout", [0, -1, math.nan])
def test_the_timeout_must_be_positive(timeout: float) -> None:
    with pytest.raises(UsageError, match="timeout"):
        GatewayApiRouter(lambda: None, target=TARGET, timeout_s=timeout)
