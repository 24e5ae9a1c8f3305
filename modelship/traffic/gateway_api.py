"""The Kubernetes Gateway API adapter of the TrafficRouter port.

Shaped like Flagger's Gateway API router: one ``HTTPRoute`` (gateway.networking.k8s.io/v1)
carries a rule whose ``backendRefs`` name the production Service (the fleet) and the canary
Service, each with a weight; the canary's share is its weight over their sum. Shadowing is
a ``RequestMirror`` filter on the same rule whose ``backendRef`` is the canary Service; its
share is ``percent`` (an integer 0-100) or ``fraction`` (numerator/denominator), both in the
standard channel since Gateway API v1.3 (GEP-3171; one of them at most). A mirror filter
without either mirrors every request, so an older CRD that prunes ``percent`` would turn
"5 %" into "100 %": every write is read back from the API server's answer and compared.

The patch documents are built by pure functions (:func:`weights_for`, :func:`mirror_filter`,
:func:`split_rules`, :func:`route_patch`) and read back by :func:`split_of` and
:func:`route_problems`; :class:`GatewayApiRouter` only moves them over the wire.

Why a JSON merge patch (RFC 7386, ``application/merge-patch+json``): an HTTPRoute is a
custom resource, and the API server refuses strategic merge patches for custom resources
(415): strategic merge needs the list merge keys of Go structs compiled into the API
server. A merge patch replaces a list whole, so the patch carries the route's whole
``spec.rules`` (built from what was just read, other rules and fields kept as they were)
plus ``metadata.resourceVersion``: the API server then applies it only to the version we
read and answers 409 to a route changed in between, instead of overwriting someone's edit.
A conflict is read again and retried (a few times, as client-go's ``RetryOnConflict``).
A JSON patch (RFC 6902) would address a rule by its index, which an edit can shift.
``fieldValidation=Strict`` makes the API server refuse a field its CRD lacks (400)
instead of pruning it; the read-back catches a server that prunes all the same.

Every call has ``_request_timeout`` and no urllib3 retries. Errors, translated here:

    connection refused / timeout / 429 / 5xx   -> Unreachable (InfrastructureError)
    401 / 403                                  -> CredentialsRejected (the RBAC to grant)
    404 (route or the CRD missing)             -> InfrastructureError (what to apply)
    409 after the retries, 422, anything else  -> InfrastructureError
    route not Accepted / refs not resolved     -> InfrastructureError (kubectl describe)
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from modelship.errors import (
    CredentialsRejected,
    InfrastructureError,
    ModelshipError,
    Unreachable,
    UsageError,
)
from modelship.faults import is_timeout
from modelship.traffic.port import TrafficSplit
from modelship.triton.discovery import (
    load_kube_configuration,
    read_json,
    status_message,
    transport_errors,
)

if TYPE_CHECKING:
    from kubernetes.client import Configuration

GROUP = "gateway.networking.k8s.io"
VERSION = "v1"
PLURAL = "httproutes"
MERGE_PATCH = "application/merge-patch+json"
MIRROR = "RequestMirror"
FINE_SCALE = 10_000
"""Weights and mirror fractions for a share that is not a whole percent: basis points, so
the resolution of a share is 0.01 %."""
CONFLICT_ATTEMPTS = 3
RBAC_HINT = (
    "grant the flow runs' service account `get` and `patch` on httproutes.gateway.networking"
    ".k8s.io in the route's namespace (infra/base/traffic/role.yaml)"
)


@dataclass(frozen=True)
class ServiceRef:
    """A Service port an HTTPRoute sends to (a backendRef of the core group)."""

    name: str
    port: int

    @classmethod
    def parse(cls, text: str, *, setting: str) -> ServiceRef:
        """``name:port`` as in settings (``triton:8000``)."""
        name, _, port = text.strip().rpartition(":")
        if not name or not port.isdigit() or not 1 <= int(port) <= 65535:
            raise UsageError(f"{setting}: {text!r} is not a Service as name:port",
                             hint=f"set {setting} like triton:8000")
        return cls(name, int(port))

    def matches(self, ref: Mapping[str, Any]) -> bool:
        """Does a backendRef point at this Service port (core group, kind Service)?"""
        return (ref.get("group", "") == "" and ref.get("kind", "Service") == "Service"
                and ref.get("name") == self.name and ref.get("port") == self.port)

    def ref(self) -> dict[str, Any]:
        return {"name": self.name, "port": self.port}


@dataclass(frozen=True)
class RouteTarget:
    """Which HTTPRoute to drive, and its two backends."""

    namespace: str
    name: str
    production: ServiceRef
    canary: ServiceRef

    def __post_init__(self) -> None:
        if not self.namespace or not self.name:
            raise UsageError("the Gateway API router needs the HTTPRoute as namespace/name",
                             hint="set MODELSHIP_K8S_ROUTE like modelship/triton-inference")
        if self.production == self.canary:
            raise UsageError(f"the production and canary backends are both {self.canary}",
                             hint="set MODELSHIP_K8S_ROUTE_CANARY to the canary Service")

    def __str__(self) -> str:
        return f"HTTPRoute {self.namespace}/{self.name}"


# --------------------------------------------------------------------------------------
# Pure: the documents.


def _basis_points(pct: float, name: str) -> int:
    TrafficSplit(**{name: pct})  # refuses what is not a percentage in [0, 100]
    return int(round(pct * 100))


def weights_for(canary_pct: float) -> tuple[int, int]:
    """(production, canary) backendRef weights for a canary share in percent.

    Whole percents are weights out of 100 (``95/5``), as Flagger writes them and a human
    reads them in ``kubectl get``; other shares are basis points out of 10,000.
    """
    bp = _basis_points(canary_pct, "canary_pct")
    if bp % 100 == 0:
        return 100 - bp // 100, bp // 100
    return FINE_SCALE - bp, bp


def mirror_filter(canary: ServiceRef, share_pct: float) -> dict[str, Any] | None:
    """The RequestMirror filter copying ``share_pct`` % of requests to the canary (None at 0).

    ``percent`` for a whole percent, else ``fraction`` in basis points; 100 % is written
    as ``percent: 100`` too, never as a filter without a share.
    """
    bp = _basis_points(share_pct, "mirror_pct")
    if bp == 0:
        return None
    share: dict[str, Any] = ({"percent": bp // 100} if bp % 100 == 0 else
                             {"fraction": {"numerator": bp, "denominator": FINE_SCALE}})
    return {"type": MIRROR, "requestMirror": {"backendRef": canary.ref(), **share}}


def _is_canary_mirror(flt: Mapping[str, Any], canary: ServiceRef) -> bool:
    mirror = flt.get("requestMirror")
    return (flt.get("type") == MIRROR and isinstance(mirror, Mapping)
            and canary.matches(mirror.get("backendRef") or {}))


def split_rule_indexes(route: Mapping[str, Any], target: RouteTarget) -> list[int]:
    """The rules that carry the split: those sending to the production backend.

    Raises:
        InfrastructureError: No such rule, or one that also sends to a third backend (its
            weights would not be shares of production and canary).
    """
    rules = (route.get("spec") or {}).get("rules") or []
    found = []
    for i, rule in enumerate(rules):
        refs = rule.get("backendRefs") or []
        if not any(target.production.matches(r) for r in refs):
            continue
        others = [r.get("name") for r in refs
                  if not (target.production.matches(r) or target.canary.matches(r))]
        if others:
            raise InfrastructureError(
                f"{target} rule {i} also sends to {', '.join(map(str, others))}: the split "
                f"needs a rule whose backendRefs are only {target.production.name} and "
                f"{target.canary.name}",
                hint="give the other backends a rule of their own (infra/base/traffic/"
                "httproute.yaml is the shape)", route=str(target), rule=i)
        found.append(i)
    if not found:
        raise InfrastructureError(
            f"{target} has no rule sending to {target.production.name}:"
            f"{target.production.port}",
            hint="check MODELSHIP_K8S_ROUTE_PRODUCTION against the route's backendRefs "
            f"(`kubectl -n {target.namespace} get httproute {target.name} -o yaml`)",
            route=str(target))
    return found


def _with_split(rule: Mapping[str, Any], target: RouteTarget,
                canary_pct: float | None, mirror_pct: float | None) -> dict[str, Any]:
    new = copy.deepcopy(dict(rule))
    if canary_pct is not None:
        production_w, canary_w = weights_for(canary_pct)
        refs = new.get("backendRefs") or []
        production = next(r for r in refs if target.production.matches(r))
        canary = next((r for r in refs if target.canary.matches(r)), None)
        canary = {**target.canary.ref(), **(canary or {})}
        new["backendRefs"] = [{**production, "weight": production_w},
                              {**canary, "weight": canary_w}]
    if mirror_pct is not None:
        filters = [f for f in new.get("filters") or [] if not _is_canary_mirror(f, target.canary)]
        added = mirror_filter(target.canary, mirror_pct)
        filters += [added] if added else []
        if filters:
            new["filters"] = filters
        else:
            new.pop("filters", None)
    return new


def split_rules(route: Mapping[str, Any], target: RouteTarget, *,
                canary_pct: float | None = None,
                mirror_pct: float | None = None) -> list[dict[str, Any]]:
    """The route's whole ``spec.rules`` with the split set on every split rule.

    None leaves that half of the split as it is (``set_weights`` keeps the mirror,
    ``mirror`` keeps the weights); other rules and fields are kept unchanged.
    """
    rules = (route.get("spec") or {}).get("rules") or []
    chosen = set(split_rule_indexes(route, target))
    return [_with_split(rule, target, canary_pct, mirror_pct) if i in chosen
            else copy.deepcopy(rule) for i, rule in enumerate(rules)]


def route_patch(route: Mapping[str, Any], target: RouteTarget, *,
                canary_pct: float | None = None,
                mirror_pct: float | None = None) -> dict[str, Any]:
    """The JSON merge patch that sets the split on ``route`` (as read, with its
    resourceVersion: the API server answers 409 if the route changed since)."""
    patch: dict[str, Any] = {"spec": {"rules": split_rules(
        route, target, canary_pct=canary_pct, mirror_pct=mirror_pct)}}
    version = (route.get("metadata") or {}).get("resourceVersion")
    if version:
        patch["metadata"] = {"resourceVersion": version}
    return patch


def _mirror_pct(flt: Mapping[str, Any]) -> float:
    mirror = flt["requestMirror"]
    if "percent" in mirror:
        return float(mirror["percent"])
    fraction = mirror.get("fraction")
    if isinstance(fraction, Mapping):
        return 100.0 * fraction.get("numerator", 0) / (fraction.get("denominator") or 100)
    return 100.0  # a mirror without a share copies every request (Gateway API)


def _rule_split(rule: Mapping[str, Any], target: RouteTarget, where: str) -> TrafficSplit:
    refs = rule.get("backendRefs") or []
    production = sum(int(r.get("weight", 1)) for r in refs if target.production.matches(r))
    canary = sum(int(r.get("weight", 1)) for r in refs if target.canary.matches(r))
    if production + canary == 0:
        raise InfrastructureError(
            f"{where} weighs both backends 0: the Gateway answers 500 to every request",
            hint=f"set the production weight back (`kubectl -n {target.namespace} edit "
            f"httproute {target.name}`), then run `modelship reconcile`", route=str(target))
    mirrors = [_mirror_pct(f) for f in rule.get("filters") or []
               if _is_canary_mirror(f, target.canary)]
    return TrafficSplit(canary_pct=round(100.0 * canary / (production + canary), 4),
                        mirror_pct=round(min(100.0, sum(mirrors)), 4))


def split_of(route: Mapping[str, Any], target: RouteTarget) -> TrafficSplit:
    """What the route asks of the Gateway: the canary's weight share and mirror share.

    Raises:
        InfrastructureError: No split rule, both weights 0, or split rules that disagree.
    """
    rules = (route.get("spec") or {}).get("rules") or []
    splits = {i: _rule_split(rules[i], target, f"{target} rule {i}")
              for i in split_rule_indexes(route, target)}
    if len(set(splits.values())) > 1:
        shown = "; ".join(f"rule {i}: {s.to_dict()}" for i, s in splits.items())
        raise InfrastructureError(
            f"{target}'s split rules disagree ({shown})",
            hint="run `modelship reconcile` to return the route to 100% production",
            route=str(target))
    return next(iter(splits.values()))


def route_problems(route: Mapping[str, Any]) -> list[str]:
    """Why the Gateway does not serve the route as written, from ``status.parents``.

    Every parent (Gateway) must report ``Accepted`` and ``ResolvedRefs`` True; a route no
    Gateway has reported on yet is a problem too (no controller, or a wrong parentRef).
    """
    parents = (route.get("status") or {}).get("parents") or []
    if not parents:
        return ["no Gateway reports on the route (status.parents is empty): no Gateway "
                "controller watches it, or its parentRefs name no Gateway"]
    problems = []
    for parent in parents:
        ref = parent.get("parentRef") or {}
        who = f"Gateway {ref.get('namespace', '')}/{ref.get('name', '?')}".replace(" /", " ")
        conditions = {c.get("type"): c for c in parent.get("conditions") or []}
        for kind in ("Accepted", "ResolvedRefs"):
            condition = conditions.get(kind)
            if condition is None:
                problems.append(f"{who} reports no {kind} condition")
            elif condition.get("status") != "True":
                problems.append(f"{who}: {kind}={condition.get('status')} "
                                f"({condition.get('reason')}: {condition.get('message')})")
    return problems


# --------------------------------------------------------------------------------------
# The adapter.


class GatewayApiRouter:
    """The TrafficRouter of a Kubernetes cluster: one HTTPRoute, patched in place.

    The constructor does no I/O. Each method reads the route, patches it when it must
    change (an unchanged split sends nothing) and checks the API server's answer.

    Args:
        configuration: A ``kubernetes.client.Configuration``, or a zero-argument callable
            returning one (called once, on first use). Copied, never modified.
        target: The route and its two backends.
        timeout_s: Timeout of one API request, in seconds (connect and read together).
    """

    name = "gateway-api"

    def __init__(self, configuration: Configuration | Callable[[], Configuration], *,
                 target: RouteTarget, timeout_s: float) -> None:
        if not (math.isfinite(timeout_s) and timeout_s > 0):
            raise UsageError(f"the Kubernetes API timeout must be positive, not {timeout_s} s")
        self._source = configuration
        self._configuration: Configuration | None = None
        self.target = target
        self.timeout_s = timeout_s

    def set_weights(self, canary_pct: float) -> None:
        self._apply(canary_pct=canary_pct, mirror_pct=None)

    def mirror(self, share_pct: float) -> None:
        self._apply(canary_pct=None, mirror_pct=share_pct)

    def live(self) -> TrafficSplit:
        route = self._get()
        self._check_served(route)
        return split_of(route, self.target)

    def live_scoped(self) -> tuple[TrafficSplit, dict[str, Any]]:
        """:meth:`live` and the requests it applies to: the route is one model's, so its
        weights and mirror apply to every request its rules match (HTTP; gRPC clients go
        through a GRPCRoute, which this router does not drive)."""
        return self.live(), {"route": str(self.target), "grpc": False,
                             "applies_to": f"requests matched by {self.target}'s rules that "
                             f"reference Service {self.target.production.name}:"
                             f"{self.target.production.port} (HTTP only; gRPC "
                             "through a GRPCRoute is not split)"}

    def ping(self) -> None:
        """The route exists, we may read it, and its Gateway accepts it."""
        self.live()

    # -- the write ---------------------------------------------------------------------

    def _apply(self, *, canary_pct: float | None, mirror_pct: float | None) -> None:
        for attempt in range(1, CONFLICT_ATTEMPTS + 1):
            route = self._get()
            patch = route_patch(route, self.target, canary_pct=canary_pct,
                                mirror_pct=mirror_pct)
            wanted = split_of(patch, self.target)  # as the documents round it
            current = split_of(route, self.target)
            if current == wanted:
                return  # idempotent: nothing is sent
            if (wanted.canary_pct > current.canary_pct
                    or wanted.mirror_pct > current.mirror_pct):
                # More traffic onto a route its Gateway ignores would measure nothing; a
                # step back towards production is written whatever the route's status.
                self._check_served(route)
            try:
                answer = self._patch(patch)
            except _Conflict:
                if attempt == CONFLICT_ATTEMPTS:
                    raise InfrastructureError(
                        f"{self.target} changed under each of {CONFLICT_ATTEMPTS} patches "
                        "(409 Conflict): something else keeps rewriting it",
                        hint="find who else writes the route (`kubectl -n "
                        f"{self.target.namespace} get httproute {self.target.name} "
                        "--show-managed-fields -o yaml`), e.g. a Flagger canary or a GitOps "
                        "sync, and keep it off this route", route=str(self.target)) from None
                continue
            self._verify(answer, wanted)
            return

    def _verify(self, answer: Mapping[str, Any], wanted: TrafficSplit) -> None:
        """The API server's answer must hold the split we wrote: a CRD older than v1.3
        prunes ``percent``/``fraction`` silently, leaving a mirror of every request."""
        got = split_of(answer, self.target)
        if got == wanted:
            return
        message = (f"{self.target} holds {got.to_dict()} after a patch for "
                   f"{wanted.to_dict()}: the API server dropped fields it does not know")
        if got.mirror_pct > wanted.mirror_pct:
            try:  # never leave more mirrored than asked (read again, retried on conflict)
                self.mirror(0)
                message += "; the mirror was removed"
            except ModelshipError as exc:
                message += f"; removing the mirror failed too ({exc})"
        raise InfrastructureError(
            message, hint="install the Gateway API CRDs v1.3 or newer (standard channel: "
            "requestMirror.percent and fraction), then run `modelship reconcile`",
            route=str(self.target))

    def _check_served(self, route: Mapping[str, Any]) -> None:
        problems = route_problems(route)
        if problems:
            raise InfrastructureError(
                f"the Gateway does not serve {self.target} as written: {'; '.join(problems)}",
                hint=f"`kubectl -n {self.target.namespace} describe httproute "
                f"{self.target.name}`: check parentRefs against the Gateway's listeners "
                "(allowedRoutes, hostnames), and that the backend Services exist (or a "
                "ReferenceGrant allows them)", route=str(self.target), problems=problems)

    # -- transport ---------------------------------------------------------------------

    def _config(self) -> Configuration:
        if self._configuration is None:
            source = self._source
            config = copy.deepcopy(source() if callable(source) else source)
            config.retries = 0  # one attempt per call: the timeout means what it says
            self._configuration = config
        return self._configuration

    def _call(self, action: str, call: Callable[[Any], Any]) -> dict[str, Any]:
        # lazy: the kubernetes client is big, and only a cluster setup needs it
        from kubernetes.client import ApiClient, CustomObjectsApi

        with ApiClient(self._config()) as api:
            try:
                body = read_json(call(CustomObjectsApi(api)))
            except transport_errors() as exc:
                raise self._translate(exc, action) from exc
        if not isinstance(body, dict):
            raise InfrastructureError(
                f"the Kubernetes API server at {self._config().host} answered {action} of "
                f"{self.target} with no object", route=str(self.target))
        return body

    def _get(self) -> dict[str, Any]:
        t = self.target
        return self._call("get", lambda api: api.get_namespaced_custom_object(
            GROUP, VERSION, t.namespace, PLURAL, t.name,
            _preload_content=False, _request_timeout=self.timeout_s))

    def _patch(self, patch: dict[str, Any]) -> dict[str, Any]:
        t = self.target
        return self._call("patch", lambda api: api.patch_namespaced_custom_object(
            GROUP, VERSION, t.namespace, PLURAL, t.name, patch,
            field_validation="Strict", field_manager="modelship",
            _content_type=MERGE_PATCH, _preload_content=False,
            _request_timeout=self.timeout_s))

    def _translate(self, exc: Exception, action: str) -> ModelshipError | _Conflict:
        """A kubernetes/urllib3 error as a modelship error (the one place)."""
        # lazy: the kubernetes client is big
        import urllib3.exceptions
        from kubernetes.client.exceptions import ApiException

        host = self._config().host
        where = f"the Kubernetes API server at {host}"
        details: dict[str, Any] = {"api_server": host, "route": str(self.target)}
        if isinstance(exc, ApiException) and exc.status:
            status = int(exc.status)
            reason = status_message(exc)
            details["status"] = status
            if status == 409 and action == "patch":
                return _Conflict()
            if status == 404:
                return InfrastructureError(
                    f"{self.target} was not found ({where}: {reason})",
                    hint="apply the route (`kubectl apply -k infra/overlays/prod`, "
                    "infra/base/traffic) and the Gateway API CRDs (v1.3+, standard "
                    "channel), or fix MODELSHIP_K8S_ROUTE", **details)
            if status in (401, 403):
                return CredentialsRejected(
                    f"{where} refused to {action} {self.target} ({status}: {reason})",
                    hint=(RBAC_HINT if status == 403 else
                          "refresh the kubeconfig or the service account token"), **details)
            if status == 429 or status >= 500:
                return Unreachable(f"{where} answered {status} to {action} {self.target}: "
                                   f"{reason}",
                                   hint="retry later; check the API server's health",
                                   **details)
            return InfrastructureError(
                f"{where} refused to {action} {self.target} ({status}: {reason})",
                hint="the route or the Gateway API CRD is not what modelship expects: "
                "check the CRD version (v1.3+, standard channel) and the route's rules "
                f"(`kubectl -n {self.target.namespace} get httproute {self.target.name} "
                "-o yaml`)", **details)
        if isinstance(exc, urllib3.exceptions.HTTPError | OSError):
            cause = getattr(exc, "reason", None) or exc
            what = (f"did not answer within {self.timeout_s:g} s" if is_timeout(cause)
                    else "could not be reached")
            return Unreachable(
                f"{where} {what} while trying to {action} {self.target} ({cause})",
                hint="check the API server URL, the kubeconfig context and the network "
                "(`kubectl cluster-info`); until it answers, the route keeps its last split",
                **details)
        # An unreadable body (json.JSONDecodeError) is the server's fault, not the user's.
        return InfrastructureError(
            f"{where} sent an unreadable answer to {action} {self.target} ({exc})", **details)


class _Conflict(Exception):
    """409 on a patch: the route changed since it was read (read again and retry)."""


# --------------------------------------------------------------------------------------
# Wiring.


ROUTER_KEYS = frozenset({"route", "production", "canary", "api_url", "kubeconfig", "context",
                         "timeout_s"})


def build_gateway_api_router(options: Mapping[str, Any]) -> GatewayApiRouter:
    """The router from ``Settings.gateway_api_router()`` (no I/O; files read on first use).

    Keys: ``route`` (``namespace/name``), ``production`` and ``canary`` (``service:port``),
    ``timeout_s``, and for the client ``api_url``, ``kubeconfig``, ``context``.

    Raises:
        UsageError: Unknown keys, or a route or backend that does not parse.
    """
    unknown = sorted(set(options) - ROUTER_KEYS)
    if unknown:
        raise UsageError(f"unknown Gateway API router setting(s): {', '.join(unknown)}",
                         hint=f"use only {', '.join(sorted(ROUTER_KEYS))}")
    namespace, _, name = str(options.get("route", "")).partition("/")
    target = RouteTarget(
        namespace=namespace, name=name,
        production=ServiceRef.parse(str(options.get("production", "triton:8000")),
                                    setting="MODELSHIP_K8S_ROUTE_PRODUCTION"),
        canary=ServiceRef.parse(str(options.get("canary", "triton-canary:8000")),
                                setting="MODELSHIP_K8S_ROUTE_CANARY"))
    client_options = {k: options[k] for k in ("api_url", "kubeconfig", "context")
                      if options.get(k)}
    return GatewayApiRouter(lambda: load_kube_configuration(**client_options), target=target,
                            timeout_s=float(options.get("timeout_s", 10.0)))

