"""``modelship webhooks serve``: the MLflow registry webhook receiver of the stack.

``POST /mlflow/webhook`` answers:

| Status | When |
|---|---|
| 201 | the alias ``candidate`` was set on a version: a ``promote`` deployment run was created |
| 202 | a valid delivery that asks for nothing (another event or alias) |
| 400 | a malformed header or body |
| 401 | a missing or wrong signature, or a stale timestamp |
| 409 | a delivery id seen before (a replay) |
| 413 | a body over 1 MiB |
| 503 | Prefect could not start the run (the delivery id is forgotten, so a retry works) |

``GET /health`` is 200 once the receiver is ready (and, with ``--register``, its MLflow
webhook is registered). The promote run is created with the Prefect idempotency key
``mlflow-webhook-<delivery id>``, so even two receivers never start one delivery twice.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
import urllib.error
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, Final

from modelship.errors import InfrastructureError, Unreachable, UsageError
from modelship.settings import load_settings
from modelship.webhooks.verify import (
    CANDIDATE_ALIAS,
    MAX_BODY_BYTES,
    DeliveryLog,
    Ignore,
    Rejected,
    StartPromote,
    decide,
    verify,
)

WEBHOOK_PATH = "/mlflow/webhook"
PROMOTE_DEPLOYMENT = "modelship-promote/promote"
MLFLOW_WEBHOOK_NAME = "modelship-candidate"
MLFLOW_EVENT: Final = "model_version_alias.created"


class PromoteStarter:
    """Creates ``promote`` deployment runs on one Prefect server. No I/O in the constructor.

    Args:
        api_url: Prefect API URL.
        timeout_s: Timeout of one request, in seconds.
        dry_run: The runs' ``dry_run`` parameter (False: the registry's candidate releases).
        deployment: ``flow name/deployment name`` of the promote deployment.
    """

    def __init__(self, api_url: str, *, timeout_s: float, dry_run: bool = False,
                 deployment: str = PROMOTE_DEPLOYMENT) -> None:
        self.api_url = api_url.rstrip("/")
        self.timeout_s = timeout_s
        self.dry_run = dry_run
        self.deployment = deployment

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        request = urllib.request.Request(
            f"{self.api_url}{path}", method=method,
            data=None if body is None else json.dumps(body).encode(),
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:  # noqa: S310
                return json.loads(response.read())
        except urllib.error.HTTPError as exc:
            detail = exc.read()[:500].decode(errors="replace")
            raise InfrastructureError(
                f"Prefect answered {exc.code} to {method} {path}: {detail}",
                hint="run `modelship deploy` so the promote deployment exists",
                endpoint=self.api_url, status=exc.code) from exc
        except (urllib.error.URLError, OSError) as exc:
            raise Unreachable(f"Prefect at {self.api_url} did not answer ({exc})",
                              hint="check the Prefect server (`modelship doctor`)",
                              endpoint=self.api_url) from exc

    def start(self, action: StartPromote, delivery_id: str) -> str:
        """Create the flow run; returns its id."""
        deployment = self._call("GET", f"/deployments/name/{self.deployment}")
        params = {"model": action.model, "version": action.version, "trigger": "webhook",
                  "requested_by": "mlflow-webhook", "dry_run": self.dry_run}
        run = self._call("POST", f"/deployments/{deployment['id']}/create_flow_run", {
            "parameters": {"params": params},
            "idempotency_key": f"mlflow-webhook-{delivery_id}",
            "tags": ["webhook", f"alias:{action.alias}"],
        })
        return str(run["id"])


def ensure_mlflow_webhook(tracking_uri: str, url: str, secret: str, *,
                          name: str = MLFLOW_WEBHOOK_NAME) -> str:
    """Create (or point again) the MLflow webhook that calls this receiver; returns its id."""
    # lazy: mlflow (~4 s) and its client only to register the hook; the receiver never needs them
    from mlflow.entities.webhook import WebhookEvent
    from mlflow.exceptions import MlflowException

    from model_registry.client import mlflow_client

    client = mlflow_client(tracking_uri, timeout_s=10.0)
    events: list[Any] = [WebhookEvent.from_str(MLFLOW_EVENT)]
    try:
        existing = [w for w in client.list_webhooks(max_results=100) if w.name == name]
        if existing:
            hook = client.update_webhook(existing[0].webhook_id, url=url, secret=secret,
                                         events=events, status="ACTIVE")
        else:
            hook = client.create_webhook(name=name, url=url, events=events,
                                         secret=secret,
                                         description="modelship: candidate alias -> promote")
    except MlflowException as exc:
        raise InfrastructureError(f"MLflow at {tracking_uri} refused the webhook: {exc.message}",
                                  hint="webhooks need MLflow's SQL backend, and http/loopback "
                                  "URLs need MLFLOW_WEBHOOK_ALLOWED_SCHEMES and "
                                  "MLFLOW_WEBHOOK_ALLOW_PRIVATE_IPS on the server",
                                  endpoint=tracking_uri) from exc
    return str(hook.webhook_id)


class Receiver:
    """The decisions of the endpoint, without HTTP: verify, de-duplicate, act."""

    def __init__(self, secret: str, starter: PromoteStarter, log: DeliveryLog, *,
                 alias: str = CANDIDATE_ALIAS, tolerance_s: float = 300.0) -> None:
        self.secret = secret
        self.starter = starter
        self.log = log
        self.alias = alias
        self.tolerance_s = tolerance_s
        self.started: list[dict[str, Any]] = []

    def handle(self, headers: Any, body: bytes, *, now: float) -> tuple[int, dict[str, Any]]:
        try:
            delivery = verify(self.secret, headers, body, now=now, tolerance_s=self.tolerance_s)
            action = decide(delivery.payload, alias=self.alias)
        except Rejected as exc:
            return exc.status, {"ok": False, "error": exc.reason}
        if not self.log.claim(delivery.delivery_id, now=now):
            return 409, {"ok": False, "error": f"delivery {delivery.delivery_id} was already "
                         "received: replays are refused"}
        if isinstance(action, Ignore):
            return 202, {"ok": True, "started": None, "reason": action.reason}
        try:
            run_id = self.starter.start(action, delivery.delivery_id)
        except (InfrastructureError, KeyError) as exc:
            self.log.release(delivery.delivery_id)
            return 503, {"ok": False, "error": f"could not start the promotion: {exc}"}
        started = {"flow_run_id": run_id, "model": action.model, "version": action.version,
                   "delivery_id": delivery.delivery_id}
        self.started.append(started)
        return 201, {"ok": True, "started": started}


def make_server(receiver: Receiver, host: str, port: int,
                ready: threading.Event) -> ThreadingHTTPServer:
    """The HTTP front of a :class:`Receiver` (loopback in the stack)."""

    class Handler(BaseHTTPRequestHandler):
        def setup(self) -> None:
            super().setup()
            self.connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

        def _answer(self, status: int, doc: dict[str, Any]) -> None:
            data = json.dumps(doc).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if self.path == "/health":
                self._answer(200 if ready.is_set() else 503, {"ok": ready.is_set()})
            else:
                self._answer(404, {"ok": False, "error": f"no such path {self.path}"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != WEBHOOK_PATH:
                self._answer(404, {"ok": False, "error": f"POST {WEBHOOK_PATH} only"})
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                length = -1
            if length < 0 or length > MAX_BODY_BYTES:
                self._answer(413 if length > 0 else 400,
                             {"ok": False, "error": "missing, bad or too large Content-Length"})
                return
            body = self.rfile.read(length)
            status, doc = receiver.handle(self.headers, body, now=time.time())
            print(f"{time.strftime('%H:%M:%S')} POST {WEBHOOK_PATH} -> {status} "
                  f"{json.dumps(doc)[:300]}", file=sys.stderr, flush=True)
            self._answer(status, doc)

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
            return None

    return ThreadingHTTPServer((host, port), Handler)


def serve(*, host: str, port: int, state_file: Path | None, register: bool,
          dry_run: bool) -> None:
    """Run the receiver until SIGTERM; settings (Prefect, MLflow, secret) from the stack."""
    settings = load_settings()
    secret = settings.mlflow_webhook_secret
    if secret is None or not settings.prefect_api_url:
        raise UsageError("the webhook receiver needs MODELSHIP_MLFLOW_WEBHOOK_SECRET and "
                         "a Prefect API URL", hint="run it from the stack (`modelship stack "
                         "up`) or set both")
    starter = PromoteStarter(settings.prefect_api_url, timeout_s=settings.http_timeout_s,
                             dry_run=dry_run)
    receiver = Receiver(secret.get_secret_value(), starter, DeliveryLog(state_file))
    ready = threading.Event()
    server = make_server(receiver, host, port, ready)
    url = f"http://{host}:{server.server_address[1]}{WEBHOOK_PATH}"

    def prepare() -> None:
        if register:
            deadline = time.monotonic() + 120
            while True:
                try:
                    hook = ensure_mlflow_webhook(str(settings.mlflow_tracking_uri), url,
                                                 secret.get_secret_value())
                    print(f"MLflow webhook {hook} -> {url}", file=sys.stderr, flush=True)
                    break
                except Exception as exc:  # noqa: BLE001 - MLflow may still be starting
                    if time.monotonic() > deadline:
                        print(f"could not register the MLflow webhook: {exc}",
                              file=sys.stderr, flush=True)
                        return
                    time.sleep(1)
        ready.set()

    threading.Thread(target=prepare, daemon=True).start()
    print(f"webhook receiver on {url}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--state-file", type=Path, default=None)
    parser.add_argument("--register", action="store_true",
                        help="Create the MLflow webhook that calls this receiver.")
    parser.add_argument("--dry-run", action="store_true",
                        help="Started promotions only plan (dry_run).")
    args = parser.parse_args(argv)
    serve(host=args.host, port=args.port, state_file=args.state_file, register=args.register,
          dry_run=args.dry_run)


if __name__ == "__main__":
    main()
