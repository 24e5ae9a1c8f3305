"""EndpointSlices -> Triton endpoints (pure), static discovery and the wiring."""

from __future__ import annotations

from typing import Any

import pytest
from kubernetes import client

from modelship.errors import UsageError
from modelship.settings import TritonEndpoint
from modelship.triton.discovery import (
    FleetDiscovery,
    KubernetesDiscovery,
    StaticDiscovery,
    build_discovery,
    endpoints_from_slices,
)

PORTS: list[dict[str, Any]] = [
    {"name": "http", "port": 8000}, {"name": "grpc", "port": 8001},
    {"name": "metrics", "port": 8002},
]


def ep(address: str, pod: str | None = None, *, ready: bool | None = True,
       terminating: bool | None = None) -> dict[str, Any]:
    conditions = {k: v for k, v in {"ready": ready, "terminating": terminating}.items()
                  if v is not None}
    endpoint: dict[str, Any] = {"addresses": [address], "conditions": conditions}
    if pod:
        endpoint["targetRef"] = {"kind": "Pod", "name": pod, "namespace": "ml"}
    return endpoint


def eps(endpoints: list[dict[str, Any]] | None, *, name: str = "triton-abcde",
        ports: list[dict[str, Any]] | None = None, address_type: str = "IPv4") -> dict[str, Any]:
    return {"apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice",
            "metadata": {"name": name, "namespace": "ml",
                         "labels": {"kubernetes.io/service-name": "triton"}},
            "addressType": address_type, "endpoints": endpoints,
            "ports": PORTS if ports is None else ports}


def names(endpoints: list[TritonEndpoint]) -> list[str | None]:
    return [e.name for e in endpoints]


def test_maps_named_ports_to_the_three_urls() -> None:
    [only] = endpoints_from_slices([eps([ep("10.0.0.7", "triton-0")])])
    assert only == TritonEndpoint(http="http://10.0.0.7:8000", grpc="10.0.0.7:8001",
                                  metrics="http://10.0.0.7:8002/metrics", name="triton-0")


@pytest.mark.parametrize(
    ("endpoint", "counted"),
    [
        (ep("10.0.0.1", "p", ready=True), True),
        (ep("10.0.0.1", "p", ready=False), False),
        (ep("10.0.0.1", "p", ready=None), False),  # unknown readiness is not a replica
        (ep("10.0.0.1", "p", ready=True, terminating=True), False),  # publishNotReady + drain
        (ep("10.0.0.1", "p", ready=True, terminating=False), True),
        ({"addresses": ["10.0.0.1"]}, False),  # no conditions at all
        ({"addresses": [], "conditions": {"ready": True}}, False),
    ],
    ids=["ready", "not-ready", "ready-nil", "ready-terminating", "ready-not-terminating",
         "no-conditions", "no-address"],
)
def test_only_ready_non_terminating_endpoints_count(endpoint: dict[str, Any],
                                                    counted: bool) -> None:
    assert len(endpoints_from_slices([eps([endpoint])])) == (1 if counted else 0)


def test_sorted_by_pod_name_and_deduplicated_across_slices() -> None:
    slices = [
        eps([ep("10.0.0.3", "triton-c"), ep("10.0.0.1", "triton-a")], name="s1"),
        # Rebalancing: the same pod is briefly listed in two slices.
        eps([ep("10.0.0.1", "triton-a"), ep("10.0.0.2", "triton-b")], name="s2"),
    ]
    assert names(endpoints_from_slices(slices)) == ["triton-a", "triton-b", "triton-c"]


def test_dual_stack_lists_each_pod_once_and_prefers_ipv4() -> None:
    slices = [
        eps([ep("fd00::1", "triton-a")], name="triton-v6", address_type="IPv6"),
        eps([ep("10.0.0.1", "triton-a")], name="triton-v4"),
    ]
    [only] = endpoints_from_slices(slices)
    assert only.grpc == "10.0.0.1:8001"


def test_ipv6_addresses_are_bracketed() -> None:
    [only] = endpoints_from_slices([eps([ep("fd00::7", "p")], address_type="IPv6")])
    assert (only.http, only.grpc, only.metrics) == (
        "http://[fd00::7]:8000", "[fd00::7]:8001", "http://[fd00::7]:8002/metrics")


def test_name_falls_back_to_the_address_without_target_ref() -> None:
    assert names(endpoints_from_slices([eps([ep("10.0.0.9")])])) == ["10.0.0.9"]


def test_custom_port_names() -> None:
    ports = [{"name": "triton-http", "port": 18000}, {"name": "triton-grpc", "port": 18001},
             {"name": "prom", "port": 18002}, {"name": "http", "port": 1}]
    [only] = endpoints_from_slices([eps([ep("10.0.0.1", "p")], ports=ports)],
                                   http_port_name="triton-http", grpc_port_name="triton-grpc",
                                   metrics_port_name="prom")
    assert (only.http, only.grpc, only.metrics) == (
        "http://10.0.0.1:18000", "10.0.0.1:18001", "http://10.0.0.1:18002/metrics")


def test_missing_named_port_is_a_usage_error_naming_it() -> None:
    ports = [{"name": "http", "port": 8000}, {"name": "grpc", "port": 8001}]
    with pytest.raises(UsageError, match="no port named 'metrics'") as info:
        endpoints_from_slices([eps([ep("10.0.0.1", "p")], ports=ports)])
    assert "'grpc', 'http'" in info.value.message
    assert info.value.hint and "METRICS_PORT_NAME" in info.value.hint


def test_missing_port_on_a_slice_without_ready_endpoints_is_ignored() -> None:
    slices = [eps([ep("10.0.0.1", "old", ready=False)], name="old", ports=[]),
              eps([ep("10.0.0.2", "new")], name="new")]
    assert names(endpoints_from_slices(slices)) == ["new"]


@pytest.mark.parametrize("endpoints", [None, []], ids=["null", "empty"])
def test_slice_without_endpoints_gives_nothing(endpoints: list[dict[str, Any]] | None) -> None:
    # The API sends `endpoints: null` for an empty slice; both mean "nobody".
    assert endpoints_from_slices([eps(endpoints)]) == []
    assert endpoints_from_slices([]) == []


def test_accepts_client_models() -> None:
    model = client.V1EndpointSlice(
        address_type="IPv4",
        metadata=client.V1ObjectMeta(name="triton-x"),
        endpoints=[
            client.V1Endpoint(addresses=["10.0.0.5"],
                              conditions=client.V1EndpointConditions(ready=True),
                              target_ref=client.V1ObjectReference(kind="Pod", name="triton-1")),
            client.V1Endpoint(addresses=["10.0.0.6"],
                              conditions=client.V1EndpointConditions(ready=True,
                                                                     terminating=True)),
        ],
        ports=[client.DiscoveryV1EndpointPort(name=p["name"], port=p["port"]) for p in PORTS],
    )
    assert endpoints_from_slices([model]) == [TritonEndpoint(
        http="http://10.0.0.5:8000", grpc="10.0.0.5:8001",
        metrics="http://10.0.0.5:8002/metrics", name="triton-1")]


def test_static_discovery_sorts_and_refuses_an_empty_fleet() -> None:
    b = TritonEndpoint(http="http://h:2", grpc="h:3", metrics="http://h:4/metrics", name="b")
    a = TritonEndpoint(http="http://h:5", grpc="h:6", metrics="http://h:7/metrics", name="a")
    discovery = StaticDiscovery([b, a])
    discovery.ping()
    assert names(discovery.replicas()) == ["a", "b"]
    assert isinstance(discovery, FleetDiscovery)
    with pytest.raises(UsageError, match="no Triton replicas are configured"):
        StaticDiscovery([]).replicas()


def test_build_discovery_chooses_one_source_without_io() -> None:
    static = [TritonEndpoint(http="http://h:1", grpc="h:2", metrics="http://h:3/metrics")]
    assert isinstance(build_discovery(static=static, kubernetes=None), StaticDiscovery)
    # A kubeconfig that does not exist: nothing is read until the first call.
    k8s = build_discovery(static=[], kubernetes={
        "namespace": "ml", "service": "triton", "kubeconfig": "/nonexistent/kubeconfig",
        "timeout_s": 2})
    assert isinstance(k8s, KubernetesDiscovery)
    assert k8s.label_selector == "kubernetes.io/service-name=triton"
    with pytest.raises(UsageError, match="no usable Kubernetes configuration"):
        k8s.ping()


@pytest.mark.parametrize(
    ("static_count", "kubernetes", "message"),
    [
        (1, {"namespace": "ml", "service": "triton"}, "both a static Triton fleet"),
        (0, {"namespace": "ml", "service": "triton", "svc": "x"}, "unknown Kubernetes"),
        (0, {"namespace": "ml"}, "exactly one of a service name and a label selector"),
        (0, {"namespace": "ml", "service": "t", "label_selector": "a=b"}, "exactly one"),
        (0, {"service": "triton"}, "needs a namespace"),
    ],
    ids=["both-sources", "unknown-key", "no-target", "two-targets", "no-namespace"],
)
def test_build_discovery_refuses_ambiguous_settings(
    static_count: int, kubernetes: dict[str, Any], message: str
) -> None:
    static = [TritonEndpoint(http="http://h:1", grpc="h:2", metrics="http://h:3/metrics")]
    with pytest.raises(UsageError, match=message):
        build_discovery(static=static[:static_count], kubernetes=kubernetes)
