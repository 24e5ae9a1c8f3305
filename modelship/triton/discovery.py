"""Fleet discovery: which Triton replicas a swap must reach.

Triton's load API acts on one server, and a Kubernetes Service would send a control call
to one pod only (DESIGN §4), so the swap needs every replica's own address. Two sources:

- :class:`StaticDiscovery`: the list from settings or the embedded stack's ``stack.json``.
- :class:`KubernetesDiscovery`: the ``discovery.k8s.io/v1`` EndpointSlices of the Triton
  Service. Only endpoints that are ready and not terminating count, so a pod that is
  starting or draining is never part of a swap.

An empty fleet is always an error, never a silent no-op: a swap over zero replicas would
"succeed" while production keeps serving the old version.

Kubernetes client errors (``ApiException``, urllib3) are translated here, in one place:

::

    connection refused / timeout     -> Unreachable           (names the API server URL)
    401 / 403                        -> CredentialsRejected   (RBAC hint)
    404 (service or API missing)     -> UsageError            (names service and namespace)
    no slices / no ready endpoints   -> InfrastructureError
    anything else                    -> InfrastructureError
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

from modelship.errors import (
    CredentialsRejected,
    InfrastructureError,
    ModelshipError,
    Unreachable,
    UsageError,
)
from modelship.settings import TritonEndpoint

if TYPE_CHECKING:
    from kubernetes.client import ApiClient, Configuration

SERVICE_NAME_LABEL = "kubernetes.io/service-name"
"""The label the EndpointSlice controller puts on every slice of a Service."""

RBAC_HINT = (
    "grant the flow's service account a Role with apiGroups: [discovery.k8s.io], "
    "resources: [endpointslices], verbs: [list] (and apiGroups: [\"\"], resources: "
    "[services], verbs: [get]) in that namespace, bound with a RoleBinding"
)

# IPv4 before IPv6 before FQDN: on a dual-stack Service each pod appears in one slice per
# family, and the swap must address each pod once.
_ADDRESS_TYPE_ORDER = {"IPv4": 0, "IPv6": 1, "FQDN": 2}

KUBERNETES_KEYS = frozenset({
    "namespace", "service", "label_selector", "http_port_name", "grpc_port_name",
    "metrics_port_name", "timeout_s", "api_url", "kubeconfig", "context",
})
"""Keys accepted by :func:`build_discovery`'s ``kubernetes`` mapping."""


@runtime_checkable
class FleetDiscovery(Protocol):
    """The port to "where are the replicas": one read, one health check."""

    def replicas(self) -> list[TritonEndpoint]:
        """Every replica a swap must reach, sorted by name; never empty (raises instead)."""
        ...

    def ping(self) -> None:
        """Raise a :class:`~modelship.errors.ModelshipError` if the source is unusable."""
        ...


class StaticDiscovery:
    """A fixed fleet from settings (``MODELSHIP_TRITON_REPLICAS``) or ``stack.json``.

    Args:
        endpoints: The replicas, in any order.
    """

    def __init__(self, endpoints: Iterable[TritonEndpoint]) -> None:
        self.endpoints = list(endpoints)

    def replicas(self) -> list[TritonEndpoint]:
        self.ping()
        return sorted(self.endpoints, key=lambda e: e.name or e.grpc)

    def ping(self) -> None:
        """Fail on an empty list: there is nothing to reach, and nothing to swap."""
        if not self.endpoints:
            raise UsageError(
                "no Triton replicas are configured",
                hint="set MODELSHIP_TRITON_REPLICAS, run `modelship stack up`, or configure "
                "Kubernetes discovery (MODELSHIP_K8S_NAMESPACE and MODELSHIP_K8S_SERVICE)",
            )


# --------------------------------------------------------------------------------------
# The pure part: EndpointSlices -> endpoints.


def _plain(slice_: Mapping[str, Any] | Any) -> Mapping[str, Any]:
    """A slice as the API's JSON (camelCase keys), from a dict or a client model."""
    if isinstance(slice_, Mapping):
        return slice_
    to_dict = getattr(slice_, "to_dict", None)
    if callable(to_dict):
        # kubernetes>=37 models: serialize=True gives the wire (camelCase) names.
        plain = to_dict(serialize=True)
        if isinstance(plain, Mapping):
            return plain
    raise TypeError(f"not an EndpointSlice: {type(slice_).__name__}")


def _host(address: str) -> str:
    """An address as it goes into a URL: IPv6 literals need brackets."""
    return f"[{address}]" if ":" in address and not address.startswith("[") else address


def endpoints_from_slices(
    slices: Iterable[Mapping[str, Any] | Any],
    *,
    http_port_name: str = "http",
    grpc_port_name: str = "grpc",
    metrics_port_name: str = "metrics",
) -> list[TritonEndpoint]:
    """Map EndpointSlices to the replicas a swap must reach (pure).

    Only endpoints whose ``conditions.ready`` is exactly true and that are not terminating
    count. A nil ``ready`` means "unknown" to us (the API says to read it as true, but an
    unknown pod is not one we swap). Each pod counts once: endpoints are deduplicated by
    address and by pod, because slices overlap during rebalancing and a dual-stack Service
    lists each pod once per address family (IPv4 wins).

    Args:
        slices: ``discovery.k8s.io/v1`` EndpointSlices, as plain dicts (the API's JSON) or
            ``V1EndpointSlice`` objects.
        http_port_name: Name of the Service port of Triton's HTTP endpoint.
        grpc_port_name: Name of the Service port of Triton's gRPC endpoint.
        metrics_port_name: Name of the Service port of Triton's metrics endpoint.

    Returns:
        The endpoints, sorted by name (the pod name, or the address without a targetRef).
        Empty when no endpoint is ready: the caller decides how to report it.

    Raises:
        UsageError: A slice with ready endpoints lacks one of the named ports.
    """
    plain = [_plain(s) for s in slices]
    plain.sort(key=lambda s: (_ADDRESS_TYPE_ORDER.get(s.get("addressType") or "", 9),
                              (s.get("metadata") or {}).get("name") or ""))
    wanted = {"http": http_port_name, "grpc": grpc_port_name, "metrics": metrics_port_name}
    seen_addresses: set[str] = set()
    seen_names: set[str] = set()
    found: list[TritonEndpoint] = []
    for slice_ in plain:
        ready = [e for e in slice_.get("endpoints") or [] if _is_ready(e)]
        if not ready:
            continue
        ports = {p.get("name") or "": p.get("port") for p in slice_.get("ports") or []}
        missing = [name for name in wanted.values() if ports.get(name) is None]
        if missing:
            slice_name = (slice_.get("metadata") or {}).get("name") or "?"
            raise UsageError(
                f"EndpointSlice {slice_name} has no port named "
                f"{', '.join(repr(m) for m in missing)} (its ports: "
                f"{', '.join(repr(p) for p in sorted(ports)) or 'none'})",
                hint="name the Triton Service ports http, grpc and metrics, or set "
                "MODELSHIP_K8S_HTTP_PORT_NAME / _GRPC_PORT_NAME / _METRICS_PORT_NAME",
                slice=slice_name, missing=missing,
            )
        for endpoint in ready:
            address = endpoint["addresses"][0]
            target = endpoint.get("targetRef") or {}
            name = target.get("name") or address
            if address in seen_addresses or name in seen_names:
                continue
            seen_addresses.add(address)
            seen_names.add(name)
            host = _host(address)
            found.append(TritonEndpoint(
                http=f"http://{host}:{ports[wanted['http']]}",
                grpc=f"{host}:{ports[wanted['grpc']]}",
                metrics=f"http://{host}:{ports[wanted['metrics']]}/metrics",
                name=name,
            ))
    return sorted(found, key=lambda e: e.name or "")


def _is_ready(endpoint: Mapping[str, Any]) -> bool:
    conditions = endpoint.get("conditions") or {}
    return (
        conditions.get("ready") is True
        and conditions.get("terminating") is not True
        and bool(endpoint.get("addresses"))
    )


# --------------------------------------------------------------------------------------
# The Kubernetes client.


class KubernetesDiscovery:
    """Replicas from the EndpointSlices of the Triton Service (DESIGN §4).

    The constructor does no I/O. Each call makes one list request (one more, to tell a
    missing Service from an empty one, when nothing is found) with ``_request_timeout``
    and no client-side retries: retrying is the flow's decision (STYLE: retry only what
    is transient), and a hidden urllib3 retry would multiply the timeout.

    Args:
        configuration: A ``kubernetes.client.Configuration``, or a zero-argument callable
            that returns one (called once, on first use; see
            :func:`load_kube_configuration`). It is copied, never modified.
        namespace: Namespace of the Service and its slices.
        service: Name of the Triton Service; slices are selected by the label
            ``kubernetes.io/service-name=<service>``.
        label_selector: An explicit label selector for the slices, instead of ``service``.
        http_port_name: Name of the Service port of Triton's HTTP endpoint.
        grpc_port_name: Name of the Service port of Triton's gRPC endpoint.
        metrics_port_name: Name of the Service port of Triton's metrics endpoint.
        timeout_s: Timeout of one API request, in seconds (connect and read together).

    Raises:
        UsageError: Neither or both of ``service`` and ``label_selector`` are given.
    """

    def __init__(
        self,
        configuration: Configuration | Callable[[], Configuration],
        *,
        namespace: str,
        service: str | None = None,
        label_selector: str | None = None,
        http_port_name: str = "http",
        grpc_port_name: str = "grpc",
        metrics_port_name: str = "metrics",
        timeout_s: float,
    ) -> None:
        if (service is None) == (label_selector is None):
            raise UsageError(
                "Kubernetes discovery needs exactly one of a service name and a label selector",
                hint="set MODELSHIP_K8S_SERVICE (usual) or MODELSHIP_K8S_LABEL_SELECTOR",
            )
        if not namespace:
            raise UsageError("Kubernetes discovery needs a namespace",
                             hint="set MODELSHIP_K8S_NAMESPACE")
        if timeout_s <= 0:
            raise UsageError(f"the Kubernetes API timeout must be positive, not {timeout_s} s")
        self._source = configuration
        self._configuration: Configuration | None = None
        self.namespace = namespace
        self.service = service
        self.label_selector = label_selector or f"{SERVICE_NAME_LABEL}={service}"
        self.port_names = {"http_port_name": http_port_name, "grpc_port_name": grpc_port_name,
                           "metrics_port_name": metrics_port_name}
        self.timeout_s = timeout_s

    @property
    def target(self) -> str:
        """What is being discovered, for messages."""
        what = (f"service {self.service}" if self.service is not None
                else f"label selector {self.label_selector!r}")
        return f"{what} in namespace {self.namespace}"

    def replicas(self) -> list[TritonEndpoint]:
        """The ready, non-terminating replicas, sorted by name.

        Raises:
            InfrastructureError: No slice, or no ready endpoint (never an empty fleet).
            UsageError: The Service does not exist, or a named port is missing.
            CredentialsRejected: The API server refused the credentials or the RBAC.
            Unreachable: The API server did not answer within ``timeout_s``.
        """
        slices = self._list_slices(limit=None)
        endpoints = endpoints_from_slices(slices, **self.port_names)
        if endpoints:
            return endpoints
        if not slices and self.service is not None:
            self._check_service_exists()
        total = sum(len(s.get("endpoints") or []) for s in slices)
        raise InfrastructureError(
            f"no ready Triton endpoints behind {self.target}"
            + (f" ({len(slices)} EndpointSlice(s), {total} endpoint(s), none ready)"
               if slices else " (no EndpointSlices)"),
            hint="check the pods: `kubectl get pods,endpointslices -n "
            f"{self.namespace} -l {self.label_selector}` (readiness follows model readiness)",
            namespace=self.namespace, service=self.service, label_selector=self.label_selector,
            slices=len(slices), endpoints=total,
        )

    def ping(self) -> None:
        """Check that the API server answers and lets us list the slices (one small list)."""
        self._list_slices(limit=1)

    # -- transport ---------------------------------------------------------------------

    def _config(self) -> Configuration:
        if self._configuration is None:
            source = self._source
            resolved = source() if callable(source) else source
            config = copy.deepcopy(resolved)
            config.retries = 0  # one attempt per call: the timeout means what it says
            self._configuration = config
        return self._configuration

    def _api_client(self) -> ApiClient:
        from kubernetes.client import ApiClient  # lazy: the kubernetes client is big

        return ApiClient(self._config())

    def _list_slices(self, *, limit: int | None) -> list[dict[str, Any]]:
        from kubernetes.client import DiscoveryV1Api  # lazy: the kubernetes client is big

        with self._api_client() as api:
            try:
                # Raw JSON, not the generated models: plain dicts keep the mapping pure, and
                # a slice with `endpoints: null` is valid on the wire.
                response = DiscoveryV1Api(api).list_namespaced_endpoint_slice(
                    self.namespace,
                    label_selector=self.label_selector,
                    limit=limit,
                    _preload_content=False,
                    _request_timeout=self.timeout_s,
                )
                body = read_json(response)
            except transport_errors() as exc:
                raise self._translate(exc, "list EndpointSlices") from exc
        items = body.get("items") if isinstance(body, dict) else None
        if not isinstance(items, list):
            raise InfrastructureError(
                f"the Kubernetes API server at {self._config().host} answered the "
                f"EndpointSlice list of {self.target} without an items list",
                api_server=self._config().host,
            )
        return [item for item in items if isinstance(item, dict)]

    def _check_service_exists(self) -> None:
        """Tell a typo in the service name from a Service whose pods are all down."""
        # lazy: the kubernetes client is big
        from kubernetes.client import CoreV1Api
        from kubernetes.client.exceptions import ApiException

        with self._api_client() as api:
            try:
                response = CoreV1Api(api).read_namespaced_service(
                    str(self.service), self.namespace,
                    _preload_content=False, _request_timeout=self.timeout_s,
                )
                read_json(response)  # drain it, so the connection closes cleanly
            except ApiException as exc:
                if exc.status in (401, 403):
                    return  # not allowed to look: report the empty fleet instead
                raise self._translate(exc, "get the Service") from exc
            except transport_errors() as exc:
                raise self._translate(exc, "get the Service") from exc

    def _translate(self, exc: Exception, action: str) -> ModelshipError:
        """Turn a kubernetes/urllib3 error into a modelship error (the one place)."""
        # lazy: the kubernetes client is big
        import urllib3.exceptions
        from kubernetes.client.exceptions import ApiException

        host = self._config().host
        if isinstance(exc, ApiException) and exc.status:
            status = int(exc.status)
            details: dict[str, Any] = {
                "api_server": host, "status": status, "namespace": self.namespace,
                "service": self.service, "label_selector": self.label_selector,
            }
            reason = status_message(exc)
            if status == 404:
                subject = (f"service {self.service} not found in namespace {self.namespace}"
                           if action == "get the Service"
                           else f"the EndpointSlices of {self.target} were not found")
                return UsageError(
                    f"{subject} (Kubernetes API at {host}: {reason})",
                    hint="check MODELSHIP_K8S_NAMESPACE and MODELSHIP_K8S_SERVICE "
                    f"(`kubectl get svc -n {self.namespace}`); EndpointSlices need "
                    "Kubernetes >= 1.21",
                    **details,
                )
            if status == 401:
                return CredentialsRejected(
                    f"the Kubernetes API server at {host} rejected the credentials (401) "
                    f"while trying to {action} of {self.target}: {reason}",
                    hint="refresh the kubeconfig or the service account token; " + RBAC_HINT,
                    **details,
                )
            if status == 403:
                return CredentialsRejected(
                    f"the service account lacks `list endpointslices` in namespace "
                    f"{self.namespace} (403 from {host} while trying to {action}: {reason})",
                    hint=RBAC_HINT,
                    **details,
                )
            if status == 429 or status >= 500:
                return Unreachable(
                    f"the Kubernetes API server at {host} answered {status} while trying to "
                    f"{action} of {self.target}: {reason}",
                    hint="retry later; check the API server's health",
                    **details,
                )
            return InfrastructureError(
                f"the Kubernetes API server at {host} answered {status} while trying to "
                f"{action} of {self.target}: {reason}",
                **details,
            )
        if isinstance(exc, ApiException | urllib3.exceptions.HTTPError | OSError):
            cause = getattr(exc, "reason", None) or exc
            # NewConnectionError subclasses ConnectTimeoutError in urllib3, but a refused
            # connection is not a timeout.
            timed_out = isinstance(cause, urllib3.exceptions.TimeoutError | TimeoutError) and (
                not isinstance(cause, urllib3.exceptions.NewConnectionError))
            what = (f"did not answer within {self.timeout_s:g} s" if timed_out
                    else "could not be reached")
            return Unreachable(
                f"the Kubernetes API server at {host} {what} while trying to {action} of "
                f"{self.target} ({_short(cause)})",
                hint="check the API server URL, the kubeconfig context and the network "
                "(`kubectl cluster-info`)",
                api_server=host, namespace=self.namespace,
            )
        # Anything else (bad JSON, a truncated body) is the server's fault, not the user's.
        return InfrastructureError(
            f"the Kubernetes API server at {host} sent an unreadable answer while trying "
            f"to {action} of {self.target} ({type(exc).__name__}: {exc})",
            api_server=host,
        )


def transport_errors() -> tuple[type[Exception], ...]:
    """What a Kubernetes API call raises on the wire (imported lazily: the client is big)."""
    # lazy: the kubernetes client (~1 s) only for a Kubernetes discovery
    import urllib3.exceptions
    from kubernetes.client.exceptions import ApiException

    return (ApiException, urllib3.exceptions.HTTPError, OSError, json.JSONDecodeError)


def read_json(response: Any) -> Any:
    try:
        return json.loads(response.data or b"null")
    finally:
        _release(response)


def _release(response: Any) -> None:
    """Give the pooled connection back (``_preload_content=False`` leaves it checked out)."""
    response.release_conn()


def status_message(exc: Any) -> str:
    """The ``message`` of a Kubernetes Status body, else the HTTP reason."""
    try:
        body = json.loads(exc.body or "")
    except (TypeError, ValueError):
        body = None
    if isinstance(body, dict) and body.get("message"):
        return str(body["message"])
    return str(exc.reason or exc.status)


def _short(exc: object) -> str:
    text = str(exc)
    # urllib3 wraps the useful part: "<urllib3.connection.HTTPConnection ...>: Failed ..."
    if ">: " in text:
        text = text.split(">: ", 1)[1]
    return text.strip() or type(exc).__name__


# --------------------------------------------------------------------------------------
# Wiring.


def load_kube_configuration(
    *, api_url: str | None = None, kubeconfig: str | None = None, context: str | None = None
) -> Configuration:
    """Build the client configuration (reads files: call it at the edge, or lazily).

    Order: an explicit ``api_url`` (no credentials: ``kubectl proxy``, a local fake); a
    ``kubeconfig`` file or ``context``; the in-cluster service account when running in a
    pod; the default kubeconfig (``$KUBECONFIG``, ``~/.kube/config``).

    Raises:
        UsageError: No usable configuration was found (names what was tried).
    """
    # lazy: the kubernetes client (~1 s) only for a Kubernetes discovery
    from kubernetes import config as kube_config
    from kubernetes.client import Configuration
    from kubernetes.config.config_exception import ConfigException

    if api_url:
        return Configuration(host=api_url.rstrip("/"))
    configuration = Configuration()
    try:
        if kubeconfig or context or not os.environ.get("KUBERNETES_SERVICE_HOST"):
            kube_config.load_kube_config(config_file=kubeconfig, context=context,
                                         client_configuration=configuration)
        else:
            kube_config.load_incluster_config(client_configuration=configuration)
    except (ConfigException, OSError, TypeError) as exc:
        where = kubeconfig or "the in-cluster service account or ~/.kube/config"
        raise UsageError(
            f"no usable Kubernetes configuration in {where} ({exc})",
            hint="set MODELSHIP_K8S_KUBECONFIG / MODELSHIP_K8S_CONTEXT, or "
            "MODELSHIP_K8S_API_URL for `kubectl proxy`",
        ) from exc
    return configuration


def build_discovery(
    *, static: list[TritonEndpoint], kubernetes: Mapping[str, Any] | None
) -> FleetDiscovery:
    """Choose the fleet source once, in the wiring (no I/O).

    Args:
        static: Replicas from settings or ``stack.json``.
        kubernetes: Kubernetes discovery settings, or None when not configured. Keys:
            ``namespace`` (required), ``service`` or ``label_selector``,
            ``http_port_name``, ``grpc_port_name``, ``metrics_port_name``, ``timeout_s``
            (default 10), and for the client ``api_url``, ``kubeconfig``, ``context``
            (see :func:`load_kube_configuration`; the files are read on first use).

    Raises:
        UsageError: Both sources are configured, or the mapping has unknown keys.
    """
    if not kubernetes:
        return StaticDiscovery(static)
    unknown = sorted(set(kubernetes) - KUBERNETES_KEYS)
    if unknown:
        raise UsageError(
            f"unknown Kubernetes discovery setting(s): {', '.join(unknown)}",
            hint=f"use only {', '.join(sorted(KUBERNETES_KEYS))}",
        )
    if static:
        raise UsageError(
            "both a static Triton fleet and Kubernetes discovery are configured",
            hint="unset MODELSHIP_TRITON_REPLICAS (or run `modelship stack down`), or unset "
            "MODELSHIP_K8S_NAMESPACE",
        )
    options = dict(kubernetes)
    client_options = {k: options.pop(k) for k in ("api_url", "kubeconfig", "context")
                      if k in options}

    def configuration() -> Configuration:
        return load_kube_configuration(**client_options)

    return KubernetesDiscovery(
        configuration,
        namespace=options.pop("namespace", ""),
        timeout_s=float(options.pop("timeout_s", 10.0)),
        **options,
    )
