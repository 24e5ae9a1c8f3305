"""The local gateway's raw client: Debian's nginx in front of the Triton fleet.

The embedded stack starts it (:mod:`modelship.stack.manager`) and the local adapter of the
TrafficRouter port (:mod:`modelship.traffic.local_gateway`) steers it; both sit above this
module, which knows nginx and nothing of either:

- :class:`GatewayLayout`: what never changes while the stack runs (ports, upstreams, paths);
- a :class:`~modelship.split_scope.SplitScope` limits a split to one model's requests;
- :func:`render_config`: the whole ``nginx.conf`` for a layout and a split (pure);
- :func:`parse_live`: the split the running workers answer with (pure);
- :func:`check_config`, :func:`reload`, :func:`read_live`: the I/O, each with a timeout.

Why nginx and how a split becomes live: docs/gateway.md. In short, a split is rendered into
the configuration (``split_clients`` on the request id for the weights, ``mirror`` to a
location that forwards a share to the canary) and made live by a graceful reload (SIGHUP):
the new workers take new connections, the old ones finish what they started. The running
workers answer ``GET /modelship/split`` on the admin port with the split compiled into
their own configuration, so a read-back is the proxy's word, never a file or a cache.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelship.errors import InfrastructureError
from modelship.split_scope import SplitScope

#: Where the admin port answers with the live split.
SPLIT_PATH = "/modelship/split"
#: nginx's ``split_clients`` takes percentages with two decimals.
RESOLUTION_PCT = 0.01
#: Worker processes of the gateway (a 2-core machine shares them with the whole stack).
WORKER_PROCESSES = 1
#: The log of mirrored requests' bodies, HTTP and gRPC (shadow canaries sample real inputs
#: from it), in the gateway's prefix.
SAMPLE_LOG = "mirror-samples.log"
#: One JSON object per mirrored request (a gRPC one has its method as ``uri``;
#: ``escape=json``: a body's bytes >= 0x80 are written raw, below 0x20 as ``\u00XX``, so
#: ``latin-1`` decoding gives the bytes back).
#: ``$request_body`` is empty when the body did not fit in ``client_body_buffer_size``.
SAMPLE_FORMAT = ('{"msec":"$msec","uri":"$request_uri","content_type":"$content_type",'
                 '"header_length":"$http_inference_header_content_length",'
                 '"status":"$status","body":"$request_body"}')
#: Debian's nginx, also when /usr/sbin is not on PATH (a non-root shell).
DEBIAN_NGINX = Path("/usr/sbin/nginx")
INSTALL_HINT = "run `make install` (it installs Debian's nginx with apt)"


@dataclass(frozen=True)
class GatewayLayout:
    """What the gateway is made of, fixed for the life of a stack.

    Attributes:
        http_port: KServe HTTP/REST for clients (HTTP/1.1).
        grpc_port: KServe gRPC for clients (cleartext HTTP/2, h2c).
        admin_port: the live split (:data:`SPLIT_PATH`); never for clients.
        production: ``(http host:port, grpc host:port)`` of each replica.
        canary: the same for the canary Triton.
        prefix: nginx's prefix directory (its pid file and request-body buffers).
        error_log: where nginx writes its log.
        user: the workers' user when the master runs as root (nginx's default, ``nobody``,
            could not write request bodies into the prefix, which is private to its owner).
    """

    http_port: int
    grpc_port: int
    admin_port: int
    production: tuple[tuple[str, str], ...]
    canary: tuple[str, str]
    prefix: str
    error_log: str
    host: str = "127.0.0.1"
    user: str | None = None

    @property
    def config_path(self) -> Path:
        return Path(self.prefix) / "nginx.conf"

    @property
    def sample_log(self) -> Path:
        """Where the mirrored HTTP requests' bodies are logged while a mirror is on."""
        return Path(self.prefix) / SAMPLE_LOG

    @property
    def http_url(self) -> str:
        return f"http://{self.host}:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"{self.host}:{self.grpc_port}"

    @property
    def admin_url(self) -> str:
        return f"http://{self.host}:{self.admin_port}"

    def to_dict(self) -> dict[str, Any]:
        return {"http_port": self.http_port, "grpc_port": self.grpc_port,
                "admin_port": self.admin_port,
                "production": [list(p) for p in self.production],
                "canary": list(self.canary), "prefix": self.prefix,
                "error_log": self.error_log, "host": self.host, "user": self.user}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> GatewayLayout:
        return cls(http_port=int(data["http_port"]), grpc_port=int(data["grpc_port"]),
                   admin_port=int(data["admin_port"]),
                   production=tuple((str(h), str(g)) for h, g in data["production"]),
                   canary=(str(data["canary"][0]), str(data["canary"][1])),
                   prefix=str(data["prefix"]), error_log=str(data["error_log"]),
                   host=str(data.get("host", "127.0.0.1")),
                   user=str(data["user"]) if data.get("user") else None)


def quantize_pct(value: float) -> float:
    """A share as nginx can hold it: two decimals (0.004 % is 0, 99.996 % is 100)."""
    return round(round(float(value) / RESOLUTION_PCT) * RESOLUTION_PCT, 2)


def _pct(value: float) -> str:
    return f"{value:.2f}".rstrip("0").rstrip(".")


def _chooser(variable: str, key: str, share: float, hit: str, miss: str) -> str:
    """A ``split_clients`` block giving ``hit`` to ``share`` % of requests (0 < share < 100).

    The key is the request id (random per request); a different salt per chooser keeps the
    weight's and the mirror's draws independent."""
    return (f'    split_clients "${{request_id}}{key}" ${variable} {{\n'
            f"        {_pct(share)}% {hit};\n        * {miss};\n    }}\n")


def _backend(canary: float) -> str:
    """Which upstream pair answers: fixed at 0 and 100 %, drawn per request between."""
    if canary <= 0:
        return "production"
    if canary >= 100:
        return "canary"
    return "${modelship_route}"


def _upstreams(name: str, servers: Sequence[str], keepalive: int) -> str:
    lines = "".join(f"        server {s};\n" for s in servers)
    return f"    upstream {name} {{\n{lines}        keepalive {keepalive};\n    }}\n"


def _mirror_location(kind: str, copy: str) -> str:
    """The internal location a mirrored copy goes to; its answer is thrown away.

    With a ``copy`` variable (the share below 100 %, or a scope) it answers 204 itself (no
    upstream is touched) for the requests it does not copy. The copy has short timeouts:
    nginx holds a client's keep-alive connection until its mirror subrequest ends, so a
    stuck canary must not hold production."""
    skip = f"            if ({copy} = 0) {{ return 204; }}\n" if copy else ""
    if kind == "http":
        forward = ("            proxy_pass http://canary_http$request_uri;\n"
                   "            proxy_http_version 1.1;\n"
                   '            proxy_set_header Connection "";\n'
                   "            proxy_connect_timeout 1s;\n"
                   "            proxy_send_timeout 5s;\n"
                   "            proxy_read_timeout 5s;\n")
    else:
        forward = ("            rewrite ^ $request_uri break;\n"
                   "            grpc_pass grpc://canary_grpc;\n"
                   "            grpc_connect_timeout 1s;\n"
                   "            grpc_send_timeout 5s;\n"
                   "            grpc_read_timeout 5s;\n")
    return (f"        location = /_modelship_mirror {{\n            internal;\n{skip}{forward}"
            "        }\n")


def _http_settings(prefix: str) -> str:
    """The ``http`` block's settings that do not depend on the split: no access log but the
    shadow's sample format, temp paths under the gateway's prefix, and client limits."""
    temp = "".join(f"    {kind}_temp_path {prefix}/tmp/{kind};\n"
                   for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi"))
    return ("    access_log off;\n"
            f"    log_format modelship_sample escape=json '{SAMPLE_FORMAT}';\n"
            "    server_tokens off;\n"
            f"{temp}"
            "    client_max_body_size 256m;\n"
            "    client_body_buffer_size 1m;\n"
            "    # A client's keep-alive connection is closed only by the client, a reload or "
            "idle\n    # time: nginx's default (1000 requests) makes every 1000th request race "
            "a close.\n"
            "    keepalive_requests 1000000;\n"
            "    keepalive_timeout 75s;\n"
            "    http2_max_concurrent_streams 1024;\n")


def _scoped_choice(variable: str, drawn: str | None, hit: str, miss: str) -> str:
    """A ``map`` giving ``hit`` to the scope's requests whose draw ``drawn`` (a chooser's
    variable) also gave ``hit`` (all of the scope's when None), ``miss`` to the rest."""
    key = f'"$modelship_scoped{drawn}"' if drawn else "$modelship_scoped"
    picked = f'"1{hit}"' if drawn else "1"
    return (f"    map {key} ${variable} {{\n        {picked} {hit};\n"
            f"        default {miss};\n    }}\n")


@dataclass(frozen=True)
class _Routes:
    """Where a split sends each kind of request, and which requests are mirrored and
    sampled: the variable part of the rendered configuration."""

    choosers: str
    """The ``split_clients``/``map`` blocks that draw and scope the shares."""
    http_backend: str
    grpc_backend: str
    http_mirror: bool
    grpc_mirror: bool
    http_copy: str
    """What draws an HTTP request's copy for the mirror: the scope's choice, the mirror's
    share, or '' (every request)."""
    sampled: str
    """The HTTP location's sample log line (the mirrored share's bodies), or ''."""
    grpc_sampled: str


def _routes(layout: GatewayLayout, canary: float, mirror: float,
            scope: SplitScope | None) -> _Routes:
    """The routes of quantized shares ``canary`` and ``mirror`` (pure)."""
    http_backend = grpc_backend = _backend(canary)
    choosers = ""
    if 0 < canary < 100:
        choosers += _chooser("modelship_route", "", canary, "canary", "production")
    if 0 < mirror < 100:
        choosers += _chooser("modelship_mirror", "mirror", mirror, "1", "0")
    copy = "$modelship_mirror" if 0 < mirror < 100 else ""  # the mirror's per-request draw
    http_mirror = grpc_mirror = mirror > 0
    if scope is not None and (canary > 0 or mirror > 0):
        choosers += (f'    map $request_uri $modelship_scoped {{\n'
                     f'        "~{scope.uri_pattern}" 1;\n        default 0;\n    }}\n')
        if canary > 0:
            drawn = "$modelship_route" if canary < 100 else None
            choosers += _scoped_choice("modelship_http_route", drawn, "canary", "production")
            http_backend = "${modelship_http_route}"
        if mirror > 0:
            choosers += _scoped_choice("modelship_copy", copy or None, "1", "0")
            copy = "$modelship_copy"
        if not scope.grpc:
            grpc_backend, grpc_mirror = "production", False
    sampled = grpc_sampled = ""
    if mirror > 0:  # the mirrored share's bodies, for the shadow canary's agreement
        only = f" if={copy}" if copy else ""
        sampled = (f"            access_log {layout.sample_log} modelship_sample{only};\n")
        # gRPC's copies are drawn by the mirror alone (its scope is all or nothing); nginx
        # reads a mirrored request's whole body first, so $request_body holds the gRPC
        # frame (a ModelInferRequest), logged with the method as its URI
        grpc_only = " if=$modelship_mirror" if 0 < mirror < 100 else ""
        grpc_sampled = (f"            access_log {layout.sample_log} "
                        f"modelship_sample{grpc_only};\n")
    return _Routes(choosers=choosers, http_backend=http_backend, grpc_backend=grpc_backend,
                   http_mirror=http_mirror, grpc_mirror=grpc_mirror, http_copy=copy,
                   sampled=sampled, grpc_sampled=grpc_sampled)


_MIRROR_ON = "            mirror /_modelship_mirror;\n"


def _client_servers(layout: GatewayLayout, routes: _Routes, mirror: float) -> str:
    """The two servers clients talk to: KServe HTTP/REST and KServe gRPC (pure)."""
    return (
        "    server {  # KServe HTTP/REST\n"
        f"        listen {layout.host}:{layout.http_port};\n"
        "        location / {\n"
        f"{_MIRROR_ON if routes.http_mirror else ''}{routes.sampled}"
        f"            proxy_pass http://{routes.http_backend}_http;\n"
        "            proxy_http_version 1.1;\n"
        '            proxy_set_header Connection "";\n'
        "            proxy_read_timeout 300s;\n"
        "        }\n"
        + (_mirror_location("http", routes.http_copy) if routes.http_mirror else "")
        + "    }\n"
        "    server {  # KServe gRPC (h2c)\n"
        f"        listen {layout.host}:{layout.grpc_port} http2;\n"
        "        location / {\n"
        f"{_MIRROR_ON + routes.grpc_sampled if routes.grpc_mirror else ''}"
        f"            grpc_pass grpc://{routes.grpc_backend}_grpc;\n"
        "            grpc_read_timeout 300s;\n"
        "        }\n"
        # gRPC's copies are drawn by the mirror's share alone (its scope is all or nothing)
        + (_mirror_location("grpc", "$modelship_mirror" if 0 < mirror < 100 else "")
           if routes.grpc_mirror else "")
        + "    }\n"
    )


def _admin_server(layout: GatewayLayout, live: str) -> str:
    """The admin server: answers :data:`SPLIT_PATH` with ``live``, never serves clients."""
    return (
        "    server {  # admin: the live split, never for clients\n"
        f"        listen {layout.host}:{layout.admin_port};\n"
        f"        location = {SPLIT_PATH} {{\n"
        "            default_type application/json;\n"
        f"            return 200 '{live}\\n';\n"
        "        }\n"
        "        location / {\n            return 404;\n        }\n"
        "    }\n"
    )


def render_config(layout: GatewayLayout, canary_pct: float, mirror_pct: float,
                  generation: str, scope: SplitScope | None = None) -> str:
    """The whole ``nginx.conf`` for ``layout`` with this split (pure).

    Shares are quantized to nginx's two decimals (:func:`quantize_pct`); the admin port
    answers with exactly the rendered (quantized) shares, the scope and ``generation``, so
    a caller can tell when the workers running this configuration are the ones answering.
    With a ``scope``, the split applies to its requests only (:class:`SplitScope`).
    """
    canary, mirror = quantize_pct(canary_pct), quantize_pct(mirror_pct)
    routes = _routes(layout, canary, mirror, scope)
    live = json.dumps({"canary_pct": canary, "mirror_pct": mirror, "generation": generation,
                       "scope": scope.to_dict() if scope is not None else None},
                      sort_keys=True)
    prefix = layout.prefix
    return (
        f"# Rendered by modelship (generation {generation}); it is rewritten on every change\n"
        "# of the traffic split: edit modelship/nginx.py instead.\n"
        + (f"user {layout.user};\n" if layout.user else "")
        + f"worker_processes {WORKER_PROCESSES};\n"
        "daemon off;\n"
        f"pid {prefix}/nginx.pid;\n"
        f"error_log {layout.error_log} warn;\n"
        "events {\n    worker_connections 4096;\n}\n"
        "http {\n"
        + _http_settings(prefix)
        + _upstreams("production_http", [h for h, _ in layout.production], 64)
        + _upstreams("production_grpc", [g for _, g in layout.production], 64)
        + _upstreams("canary_http", [layout.canary[0]], 32)
        + _upstreams("canary_grpc", [layout.canary[1]], 32)
        + routes.choosers
        + _client_servers(layout, routes, mirror)
        + _admin_server(layout, live)
        + "}\n"
    )


def parse_live(body: bytes | str) -> tuple[float, float, str]:
    """``(canary_pct, mirror_pct, generation)`` from the admin port's answer (pure).

    Raises:
        InfrastructureError: the answer is not the document :func:`render_config` renders.
    """
    try:
        doc = json.loads(body)
        return float(doc["canary_pct"]), float(doc["mirror_pct"]), str(doc["generation"])
    except (ValueError, TypeError, KeyError) as exc:
        raise InfrastructureError(
            f"the local gateway's admin port answered something that is not a split "
            f"({exc}: {str(body)[:120]!r})",
            hint="another process may hold the gateway's admin port: run `modelship stack "
            "status` and check the gateway component") from exc


def nginx_binary() -> Path:
    """Debian's nginx.

    Raises:
        InfrastructureError: it is not installed.
    """
    found = shutil.which("nginx") or (str(DEBIAN_NGINX) if DEBIAN_NGINX.is_file() else None)
    if not found:
        raise InfrastructureError("nginx (the local gateway) is not installed",
                                  hint=INSTALL_HINT, component="gateway")
    return Path(found)


def command(binary: Path, layout: GatewayLayout) -> list[str]:
    """The master process's command line (it stays in the foreground: ``daemon off``)."""
    return [str(binary), "-p", layout.prefix, "-c", str(layout.config_path),
            "-e", layout.error_log]


def check_config(binary: Path, layout: GatewayLayout, text: str, *,
                 timeout_s: float = 10.0) -> None:
    """``nginx -t`` on ``text`` before it replaces the live file.

    Raises:
        InfrastructureError: nginx refuses it, or did not answer within ``timeout_s``.
    """
    fd, tmp = tempfile.mkstemp(dir=layout.prefix, prefix=".check-", suffix=".conf")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        done = subprocess.run([str(binary), "-t", "-q", "-p", layout.prefix, "-c", tmp,
                               "-e", layout.error_log], capture_output=True, text=True,
                              timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired as exc:
        raise InfrastructureError(
            f"`nginx -t` did not finish within {timeout_s:g} s",
            hint="the machine may be overloaded; retry", component="gateway") from exc
    finally:
        Path(tmp).unlink(missing_ok=True)
    if done.returncode != 0:
        raise InfrastructureError(
            f"nginx refused the rendered gateway configuration: {done.stderr.strip()[-400:]}",
            hint="a bug in modelship/nginx.py's rendering: report it with this message",
            component="gateway")


def write_config(layout: GatewayLayout, text: str) -> None:
    """Replace the configuration file atomically (a restart reads a whole one)."""
    Path(layout.prefix, "tmp").mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=layout.prefix, prefix=".nginx-", suffix=".conf")
    try:
        with os.fdopen(fd, "w") as handle:
            handle.write(text)
        os.replace(tmp, layout.config_path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def forget_samples(layout: GatewayLayout) -> None:
    """Delete the shadow's sample log: it holds production's inputs, and exists only while
    a mirror is on (every way the mirror goes off deletes it)."""
    layout.sample_log.unlink(missing_ok=True)


def at_rest(layout: GatewayLayout, generation: str) -> None:
    """The configuration file at production only, nothing mirrored, and no sample log:
    what a gateway (re)starts with. A restart is never a release's way to hold a split:
    a release whose gateway died aborts (exit 1) and its candidate is unloaded, so the
    split the dead gateway had would send live requests to a canary that no longer serves
    them."""
    write_config(layout, render_config(layout, 0.0, 0.0, generation))
    forget_samples(layout)


def reload(pid: int) -> None:
    """Ask the master to reload gracefully (SIGHUP): new workers on the new file, the old
    ones finish what they started.

    Raises:
        InfrastructureError: the master is gone.
    """
    try:
        os.kill(pid, signal.SIGHUP)
    except ProcessLookupError as exc:
        raise InfrastructureError(
            f"the local gateway (nginx, pid {pid}) is not running",
            hint="run `modelship stack up`: it restarts the gateway", component="gateway",
        ) from exc


def accepting_workers(master_pid: int) -> int:
    """How many of the master's workers still take new connections (from /proc).

    After a reload the old workers close their listening sockets when they see the
    master's QUIT, and retitle themselves ``worker process is shutting down``; until then
    they may accept a new connection and route it by the old configuration."""
    count = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            if int(stat[1]) != master_pid or stat[0] == "Z":
                continue
            title = (entry / "cmdline").read_bytes().replace(b"\0", b" ")
        except (OSError, IndexError, ValueError):
            continue
        if b"worker process" in title and b"shutting down" not in title:
            count += 1
    return count


def parse_scope(body: bytes | str) -> SplitScope | None:
    """The scope in the admin port's answer (pure; None: unscoped, or an answer without
    one). Read after :func:`parse_live` accepted the same body."""
    try:
        return SplitScope.from_dict(json.loads(body).get("scope"))
    except (ValueError, AttributeError):
        return None


def read_live(layout: GatewayLayout, *, timeout_s: float) -> tuple[float, float, str]:
    """The split the running workers answer with, on a new connection.

    Raises:
        InfrastructureError: no answer within ``timeout_s``, or not a split.
    """
    return parse_live(_split_body(layout, timeout_s))


def read_live_scoped(layout: GatewayLayout, *, timeout_s: float
                     ) -> tuple[float, float, str, SplitScope | None]:
    """:func:`read_live` and the scope the same workers were configured with (one answer).

    Raises:
        InfrastructureError: no answer within ``timeout_s``, or not a split.
    """
    body = _split_body(layout, timeout_s)
    return (*parse_live(body), parse_scope(body))


def _split_body(layout: GatewayLayout, timeout_s: float) -> bytes:
    url = layout.admin_url + SPLIT_PATH
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310
            body = response.read()
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        raise InfrastructureError(
            f"the local gateway did not answer at {url} within {timeout_s:g} s ({exc})",
            hint="run `modelship stack status`; `modelship stack up` restarts a dead gateway, "
            f"and its log is {layout.error_log}", component="gateway", url=url) from exc
    return body
