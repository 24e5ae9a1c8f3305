"""Fault injection for the e2e fault matrix, and one way to tell a converged release.

Two halves, both small:

- **Injecting a fault at a stage** of a real ``modelship`` CLI process. ``python -m
  tests.faults ARGS...`` runs ``modelship ARGS...`` with one function of the product wrapped
  at the stage's point (``FAULT_STAGE``); when the release gets there, the wrapper does the
  fault (``FAULT``): it sends SIGKILL, SIGTERM or SIGINT to its own process (so the
  product's own handlers run, exactly there), or SIGKILLs a stack component's whole process
  group (MLflow, SeaweedFS or Prefect, by the PID and start time in ``stack.json``) and lets
  the release go on without it. Before acting it writes ``FAULT_MARK`` (a JSON line), so
  a test can tell that the fault really happened where it meant. Nothing in the product
  knows a test: :func:`run_faulted` starts that process, :func:`restart_stack` brings the
  killed component back through ``modelship stack up`` (which restarts only the dead and
  reconciles).
- **Telling a converged release** from what is observed directly, not from what
  ``modelship status`` concludes: :func:`observe` reads every replica (the versions it
  reports READY and whether its live config batches), the signed production pin, the
  MLflow aliases and the release tag, the ledger, the lock rows of ``modelship locks`` and
  what is left on the canary. :func:`disagreements` and :func:`story_breaks` are pure
  functions of that observation (table-tested in ``tests/unit/test_faults_oracle.py``):
  the first lists what makes the state untrue now (the test compares it with the exit
  code of ``modelship status``), the second checks that the ledger tells one continuous
  story that ends in what serves; :func:`loose_ends` adds the release tag and the canary.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

#: The stage points a fault can be injected at, in release order (see :func:`_install`;
#: ``progressive``: a progressive canary's first step, in place of the replay canary).
STAGES = ("check", "stage", "canary", "progressive", "approval", "swap", "bake", "record")
#: Faults delivered to the CLI process itself.
CLI_SIGNALS: dict[str, signal.Signals] = {
    "sigkill": signal.SIGKILL, "sigterm": signal.SIGTERM, "sigint": signal.SIGINT}
#: Faults of a stack dependency: the component name in ``stack.json``.
DEPENDENCIES = {"mlflow": "mlflow", "s3": "seaweedfs", "prefect": "prefect",
                "gateway": "gateway"}
#: Stages whose fault point lies inside a deadline of the release (the swap's phases) or
#: holds what other releases wait for (the canary slot, in the progressive canary): a
#: gated dependency fault (``FAULT_GATE``) waits for its go at the stage's start instead,
#: before the function named here (module, attribute) is called, and does its fault at the
#: point without waiting again.
GATE_AT_START = {"swap": ("tasks.fleet", "swap_unlocked"),
                 "progressive": ("tasks.progressive", "canary_and_router")}
#: Statuses of a fleet-changing record after which its ``to_version`` serves.
SERVES_TO = frozenset({"released", "noop"})
#: Statuses of a record that has not ended (a live run, a dead one, or one to finish).
UNFINISHED = frozenset({"running", "incomplete"})
FLEET_KINDS = frozenset({"promote", "swap", "rollback"})
RELEASE_ID_TAG = "modelship.release_id"


# --------------------------------------------------------------------------------------
# injecting: the CLI side (runs inside the faulted `modelship` process)


def kill_component(home: Path, name: str, *, deadline_s: float = 10.0) -> dict[str, Any]:
    """SIGKILL a stack component's process group (as a crashed container) and wait until
    it is gone and its ports are closed. Only the process ``stack up`` recorded (PID and
    start time) is signalled."""
    from modelship.stack.process import is_alive, port_open
    from modelship.stack.state import process_records, read_state

    state = read_state(home / "stack.json")
    assert state is not None, f"no stack.json in {home}"
    record = next(r for r in process_records(state) if r.name == name)
    assert is_alive(record), f"{name} (pid {record.pid}) is not running"
    os.killpg(record.pid, signal.SIGKILL)
    end = time.monotonic() + deadline_s
    while (is_alive(record) or any(port_open(p, timeout_s=0.2) for p in record.ports)) \
            and time.monotonic() < end:
        time.sleep(0.05)
    return {"component": name, "pid": record.pid, "ports": list(record.ports)}


#: How long a gated fault waits for its go (``FAULT_GATE``) before it acts anyway.
GATE_WAIT_S = 900.0


def wait_at_gate(gate: Path, *, wait_s: float = GATE_WAIT_S) -> None:
    """Say the run is at its fault point (``GATE.ready``), then wait until ``GATE``
    exists: a test that shares one stack between several releases kills a component only
    once the others are out of its way."""
    Path(f"{gate}.ready").write_text(str(os.getpid()))
    end = time.monotonic() + wait_s
    while not gate.exists() and time.monotonic() < end:
        time.sleep(0.05)


def _act(fault: str, stage: str, mark: Path, gate: Path | None = None) -> None:
    """Do the fault now, after saying so in ``mark`` (a dependency's once ``gate`` says
    go, when there is one). With ``FAULT_RESUME`` set, a killed dependency's run stays at
    its point (``RESUME.killed`` written) until ``RESUME`` exists: the test restarts the
    component while the release waits there, then lets it go on."""
    if fault in DEPENDENCIES and gate is not None:
        wait_at_gate(gate)
    entry: dict[str, Any] = {"fault": fault, "stage": stage, "at": time.time(),
                             "thread": threading.current_thread().name}
    if fault in DEPENDENCIES:
        entry["killed"] = kill_component(Path(os.environ["MODELSHIP_HOME"]),
                                         DEPENDENCIES[fault])
        with mark.open("a") as handle:
            handle.write(json.dumps(entry) + "\n")
        if os.environ.get("FAULT_RESUME"):
            resume = Path(os.environ["FAULT_RESUME"])
            Path(f"{resume}.killed").write_text(str(os.getpid()))
            end = time.monotonic() + GATE_WAIT_S
            while not resume.exists() and time.monotonic() < end:
                time.sleep(0.05)
        return
    with mark.open("a") as handle:
        handle.write(json.dumps(entry) + "\n")
    os.kill(os.getpid(), CLI_SIGNALS[fault])
    # SIGTERM/SIGINT: the handler raises in the main thread at its next bytecode (right
    # here, when this is the main thread); SIGKILL never returns.


def _after(module: Any, name: str, act: Callable[[], None], *, before: bool = False) -> None:
    """Wrap ``module.name`` so that ``act`` runs once, after (or before) its first call."""
    original = getattr(module, name)
    done = threading.Event()

    def wrapped(*args: Any, **kwargs: Any) -> Any:
        if before and not done.is_set():
            done.set()
            act()
        result = original(*args, **kwargs)
        if not before and not done.is_set():
            done.set()
            act()
        return result

    setattr(module, name, wrapped)


def _install(stage: str, act: Callable[[], None]) -> None:
    """Put the fault at the stage's point:

    - ``check``: the trial model is loaded on the canary Triton and has answered;
    - ``stage``: the version's first file is uploaded (a content-addressed blob), its
      manifest is not (half-published);
    - ``canary``: the candidate and the baseline are loaded on the canary;
    - ``progressive``: a progressive canary set its first step's weight (the candidate on
      the canary Triton takes that share of the model's live requests);
    - ``approval``: the request is recorded and posted, and the run waits (1 s into it);
    - ``swap``: batching paused on both replicas, one switched, the other's switch in
      flight (held until the fault is done);
    - ``bake``: the fleet serves the candidate and the bake begins;
    - ``record``: the bake passed; the record (tags, aliases, ledger) begins.
    """
    if stage == "check":
        import tasks.trial_load as trial_load

        _after(trial_load, "compare_outputs", act, before=True)
    elif stage == "stage":
        from modelship.storage import S3Storage

        _after(S3Storage, "upload_file_parts", act)
    elif stage == "canary":
        import tasks.canary as canary

        _after(canary, "wait_ready", act)
    elif stage == "progressive":
        import tasks.progressive as progressive

        _after(progressive, "_set_weight", act)
    elif stage == "approval":
        import tasks.approve as approve

        _after(approve, "_post_request", lambda: threading.Timer(1.0, act).start())
    elif stage == "swap":
        from modelship.triton.client import TritonServer

        load, calls, lock, acted = TritonServer.load_model, [], threading.Lock(), \
            threading.Event()

        def load_at_the_switch(self: Any, *args: Any, **kwargs: Any) -> Any:
            if not str(self.name).startswith("triton-") or acted.is_set():
                return load(self, *args, **kwargs)
            with lock:
                calls.append(self.name)
                n = len(calls)
            if n >= 4:  # the second replica's switch waits until the fault is done
                acted.wait()
                time.sleep(0.5)
            result = load(self, *args, **kwargs)
            if n == 3:
                try:
                    act()
                finally:
                    acted.set()
            return result

        TritonServer.load_model = load_at_the_switch  # type: ignore[method-assign]
    elif stage == "bake":
        import tasks.bake as bake

        _after(bake, "watch", act, before=True)
    elif stage == "record":
        import tasks.fleet as fleet

        _after(fleet, "record_release", act, before=True)
    else:
        raise ValueError(f"unknown stage {stage!r}; one of {', '.join(STAGES)}")


def cli_main() -> None:
    """``modelship`` (``sys.argv``), with the fault installed when ``FAULT`` is set: what
    ``python -m tests.faults`` runs, and each run of a :func:`cli_zygote`."""
    fault = os.environ.get("FAULT")
    if fault is not None:
        stage = os.environ["FAULT_STAGE"]
        if fault not in CLI_SIGNALS and fault not in DEPENDENCIES:
            raise SystemExit(f"unknown FAULT {fault!r}")
        mark = Path(os.environ["FAULT_MARK"])
        gate = Path(os.environ["FAULT_GATE"]) if fault in DEPENDENCIES \
            and os.environ.get("FAULT_GATE") else None
        if gate is not None and stage in GATE_AT_START:
            import importlib

            module, name = GATE_AT_START[stage]
            at_start = gate
            _after(importlib.import_module(module), name,
                   lambda: wait_at_gate(at_start), before=True)
            gate = None  # waited for at the start: the fault acts at its point at once
        at_point = gate
        _install(stage, lambda: _act(fault, stage, mark, at_point))
    from modelship.cli import main as cli_main

    cli_main()


def main() -> None:
    """``python -m tests.faults ARGS...``: ``modelship ARGS...`` with the fault installed."""
    sys.argv = ["modelship", *sys.argv[1:]]
    cli_main()


#: What a CLI zygote imports once (:func:`cli_zygote`): the CLI, the release and rollback
#: flows (and with them gRPC and the canary's load generator), what their stages import
#: late (check: GX, pandas, ONNX, MLflow's flavors, the golden rows' parquet reader; the
#: canary report: matplotlib), and what Prefect's flow call and MLflow's exit import late
#: (each run imported them again: ~4% of the runs' samples in a profile of the suite). Not
#: tritonclient.http: it imports gevent, whose hub is not known to be fork-safe, so a run
#: imports it itself.
CLI_PRELOAD = ("modelship.cli", "flows.promote", "flows.standalone", "tasks.check",
               "tasks.expectations", "tasks.export", "tasks.validate", "tasks.trial_load",
               "tasks.status", "tasks.recovery", "tasks.reconcile", "model_registry.golden",
               "mlflow", "mlflow.onnx", "mlflow.pyfunc", "mlflow.sklearn", "pandas", "onnx",
               "onnxruntime", "great_expectations", "great_expectations.expectations",
               "matplotlib.figure", "matplotlib.backends.backend_agg", "pyarrow.parquet",
               "prefect.flow_engine", "prefect.task_engine", "prefect.utilities.visualization",
               "mlflow.tracing.processor.base_mlflow", "mlflow.tracking.request_header.registry")
#: Variables a zygote's run may add: read when it runs (by :func:`cli_main`, and the
#: check cache's switch by the settings), not at import.
FAULT_ENV = ("FAULT", "FAULT_STAGE", "FAULT_MARK", "FAULT_GATE", "FAULT_RESUME",
             "MODELSHIP_CHECK_CACHE")


def cli_defaults() -> None:
    """The environment defaults ``modelship`` sets before it imports anything heavy (Prefect
    reads them at import): the CLI's own ``main`` run once with ``--version`` (it sets
    them, then prints the version), so a zygote's imports see exactly what a
    ``modelship`` process's imports see."""
    import contextlib
    import io

    from modelship.cli import main as modelship_main

    assert "prefect" not in sys.modules, "Prefect imported before the CLI's defaults"
    sys.argv = ["modelship", "--version"]
    with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
        modelship_main()


@contextmanager
def cli_zygote(env: Mapping[str, str], cwd: Path, *, late: Sequence[str] = ()
               ) -> Iterator[Any]:
    """A :class:`tests.zygote.Zygote` whose runs are ``modelship`` (with a fault when the
    run sets ``FAULT``), started in the background: its imports overlap whatever the
    caller does next (``run`` waits for them). ``late``: variables a run may add besides
    :data:`FAULT_ENV` (read when a command runs, never at import)."""
    from tests.zygote import Zygote

    with Zygote(target="tests.faults:cli_main", preload=CLI_PRELOAD, env=env, cwd=cwd,
                late_env=(*FAULT_ENV, *late), prepare="tests.faults:cli_defaults") as zygote:
        yield zygote


# --------------------------------------------------------------------------------------
# injecting: the test side


@dataclass(frozen=True)
class Fault:
    """One fault at one stage: ``sigkill``/``sigterm``/``sigint`` of the CLI, or the
    SIGKILL of a dependency (``mlflow``, ``s3``, ``prefect``, ``gateway``)."""

    kind: str
    stage: str

    def __post_init__(self) -> None:
        assert self.kind in CLI_SIGNALS or self.kind in DEPENDENCIES, self.kind
        assert self.stage in STAGES, self.stage

    @property
    def id(self) -> str:
        return f"{self.kind}-{self.stage}"

    @property
    def component(self) -> str | None:
        """The stack component this fault kills (None: a signal to the CLI)."""
        return DEPENDENCIES.get(self.kind)

    @property
    def signal(self) -> signal.Signals | None:
        return CLI_SIGNALS.get(self.kind)


@dataclass
class FaultedRun:
    """A finished faulted CLI run: its result, how long it took, and where the fault hit
    (``injected`` is empty when the release never got to the stage)."""

    fault: Fault
    result: subprocess.CompletedProcess[str]
    elapsed_s: float
    injected: list[dict[str, Any]] = field(default_factory=list)

    def describe(self) -> str:
        return (f"{self.fault.id}: exit {self.result.returncode} after {self.elapsed_s:.1f} s; "
                f"injected {self.injected}\nstdout: {self.result.stdout[-2000:]}\n"
                f"stderr: {self.result.stderr[-3000:]}")


def run_faulted(fault: Fault, *args: str, env: Mapping[str, str], cwd: Path,
                workdir: Path, timeout_s: float, zygote: Any = None,
                gate: Path | None = None, resume: Path | None = None) -> FaultedRun:
    """Run ``modelship ARGS...`` with ``fault`` at its stage (``env``: the CLI's
    environment, as :func:`tests.conftest.cli_env` builds it): a ``python -m
    tests.faults`` process, or a run of ``zygote`` (:func:`cli_zygote`, started with
    ``env``). ``gate``: a dependency's fault waits at its point for that file
    (:func:`wait_at_gate`); ``resume``: a killed dependency's run waits at its point for
    that file (:func:`_act`)."""
    mark = workdir / f"fault-{fault.id}-{time.monotonic_ns()}.jsonl"
    marks = {"FAULT": fault.kind, "FAULT_STAGE": fault.stage, "FAULT_MARK": str(mark)}
    if gate is not None:
        marks["FAULT_GATE"] = str(gate)
    if resume is not None:
        marks["FAULT_RESUME"] = str(resume)
    if fault.stage == "check":  # a cached pass would skip the check, and its fault point
        marks["MODELSHIP_CHECK_CACHE"] = "0"
    started = time.monotonic()
    if zygote is not None:
        result = zygote.run(["modelship", *args], env=marks, timeout=timeout_s)
    else:
        result = subprocess.run(
            [sys.executable, "-m", "tests.faults", *args], capture_output=True, text=True,
            env={**env, **marks}, cwd=cwd, timeout=timeout_s)
    injected = [json.loads(line) for line in mark.read_text().splitlines()] \
        if mark.exists() else []
    return FaultedRun(fault, result, time.monotonic() - started, injected)


def json_document(text: str) -> dict[str, Any] | None:
    """The one JSON document a ``--json`` command printed, or None when stdout is not one."""
    try:
        doc = json.loads(text)
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


# --------------------------------------------------------------------------------------
# observing


@dataclass(frozen=True)
class ReplicaState:
    """One production replica: the versions it reports READY and whether its live config
    batches (None: it serves nothing); ``error`` when it did not answer."""

    name: str
    versions: tuple[int, ...] = ()
    batching: bool | None = None
    error: str | None = None


@dataclass(frozen=True)
class RecordState:
    """What the matrix needs of one ledger record."""

    id: str
    kind: str
    status: str
    from_version: int | None
    to_version: int | None
    exit_code: int | None
    dry_run: bool = False
    pid_alive: bool | None = None
    pending_approvals: int = 0
    reason: str | None = None
    last_stage: str | None = None  # the stage it was in when it ended (or died)
    requests: tuple[str, ...] = ()  # the status of each approval request it made
    notes: tuple[str, ...] = ()
    started_at: str | None = None  # ISO 8601, as the ledger keeps them (where time goes)
    stage_times: tuple[tuple[str, str, str | None], ...] = ()  # (name, started, ended)

    @classmethod
    def of(cls, record: Any, *, pid_alive: bool | None = None) -> RecordState:
        requests = tuple(str(a.get("status")) for a in record.approvals
                         if a.get("kind") == "request")
        return cls(record.id, record.kind, record.status, record.from_version,
                   record.to_version, record.exit_code, record.dry_run, pid_alive,
                   requests.count("pending"), record.reason,
                   record.stages[-1].name if record.stages else None, requests,
                   tuple(record.notes), record.started_at,
                   tuple((st.name, st.started_at, st.ended_at) for st in record.stages))


@dataclass(frozen=True)
class Observation:
    """Everything the matrix compares, read directly from each source."""

    model: str
    replicas: tuple[ReplicaState, ...]
    pin_version: int | None
    pin_batching: bool | None
    aliases: Mapping[str, int]
    tag_release_id: str | None
    records: tuple[RecordState, ...]  # oldest first
    locks: tuple[Mapping[str, Any], ...]
    canary_leftovers: tuple[str, ...]

    @property
    def serving(self) -> int | None:
        """The one version every replica serves, else None."""
        served = {r.versions for r in self.replicas}
        if len(served) == 1 and not any(r.error for r in self.replicas):
            (versions,) = served
            return versions[0] if len(versions) == 1 else None
        return None

    def record(self, release_id: str) -> RecordState:
        return next(r for r in self.records if r.id == release_id)

    def summary(self) -> str:
        return json.dumps({
            "replicas": [(r.name, r.versions, r.batching, r.error) for r in self.replicas],
            "pin": [self.pin_version, self.pin_batching], "aliases": dict(self.aliases),
            "tag": self.tag_release_id, "locks": list(self.locks),
            "canary_leftovers": list(self.canary_leftovers),
            "records": [(r.id, r.kind, r.status, r.from_version, r.to_version, r.exit_code)
                        for r in self.records[-6:]]}, default=str)


def _pid_alive(holder: Mapping[str, Any]) -> bool | None:
    import socket

    from modelship.procinfo import process_start_ticks

    pid = holder.get("pid")
    if holder.get("host") != socket.gethostname() or not isinstance(pid, int):
        return None
    return process_start_ticks(pid) is not None


def observe(settings: Any, model: str, *, locks: Callable[[], Sequence[Mapping[str, Any]]],
            clients: Any = None) -> Observation:
    """Read every source now (``locks``: the rows of ``modelship locks MODEL --json``),
    through ``clients`` (:class:`modelship.clients.Clients`; None: built for this read)."""
    from modelship.clients import build_clients
    from modelship.ledger import Ledger
    from modelship.signing import key_bytes
    from tasks.reconcile import read_pin

    own = clients is None
    clients = build_clients(settings) if own else clients
    try:
        assert clients.storage is not None and clients.registry is not None
        replicas = tuple(_replica(server, model) for server in clients.replicas)
        pin = read_pin(clients.storage, repository_prefix=settings.repository_prefix,
                       model=model, signing_key=key_bytes(settings.manifest_signing_key))
        aliases = clients.registry.aliases(model)
        production = aliases.get("production")
        tag = _release_tag(str(settings.mlflow_tracking_uri), model, production)
        records = tuple(RecordState.of(r, pid_alive=_pid_alive(r.holder))
                        for r in reversed(Ledger(clients.storage).records(model)))
        leftovers: tuple[str, ...] = ()
        if clients.canary is not None:
            from tasks.recovery import loaded_models

            leftovers = tuple(n for n in loaded_models(clients.canary)
                              if n == model or n.startswith(f"_trial_{model}"))
        return Observation(
            model, replicas, pin.version if pin else None,
            pin.config.HasField("dynamic_batching") if pin else None, dict(aliases), tag,
            records, tuple(locks()), leftovers)
    finally:
        if own:
            clients.close()


def _release_tag(tracking_uri: str, model: str, version: int | None) -> str | None:
    from mlflow import MlflowClient

    if version is None:
        return None
    # the registry named too: a process-wide registry URI (set for another stack) wins
    # over the tracking URI otherwise
    tags = MlflowClient(tracking_uri, registry_uri=tracking_uri).get_model_version(
        model, str(version)).tags
    return tags.get(RELEASE_ID_TAG)


def _replica(server: Any, model: str) -> ReplicaState:
    from modelship.errors import ModelshipError

    try:
        metadata = server.model_metadata(model)
        listed = sorted(int(v) for v in (metadata or {}).get("versions", []) if str(v).isdigit())
        versions = tuple(v for v in listed if server.is_model_ready(model, str(v)))
        batching = "dynamic_batching" in server.model_config(model) if versions else None
    except ModelshipError as exc:
        return ReplicaState(server.name, error=exc.message)
    return ReplicaState(server.name, versions, batching)


# --------------------------------------------------------------------------------------
# judging (pure)


def served_after(record: RecordState) -> int | None:
    """What a finished fleet-changing record left serving, by its own word."""
    return record.to_version if record.status in SERVES_TO else record.from_version


def _fleet_records(records: Iterable[RecordState]) -> list[RecordState]:
    return [r for r in records if r.kind in FLEET_KINDS and not r.dry_run
            and r.to_version is not None and r.status != "planned"]


def disagreements(obs: Observation) -> list[str]:
    """Why the state is not one true release now (empty: converged). What ``modelship
    status`` must exit non-zero for: the replicas, their batching, the pin, the
    ``production`` alias and the newest finished record disagree, a record is unfinished
    (a live, dead or incomplete run), or a lock is :func:`wedged`."""
    found = []
    v = obs.serving
    if v is None:
        found.append("the replicas do not serve one version: "
                     + "; ".join(f"{r.name} {list(r.versions)}{' ' + r.error if r.error else ''}"
                                 for r in obs.replicas))
    if obs.pin_version != v:
        found.append(f"the production pin says v{obs.pin_version}, the replicas v{v}")
    if obs.aliases.get("production") != v:
        found.append(f"the production alias says v{obs.aliases.get('production')}, "
                     f"the replicas v{v}")
    off = [r.name for r in obs.replicas if r.versions and r.batching != obs.pin_batching]
    if off:
        found.append(f"dynamic batching on {', '.join(off)} differs from the pin's "
                     f"({'on' if obs.pin_batching else 'off'})")
    for r in obs.records:
        if r.status in UNFINISHED:
            alive = {True: "alive", False: "its process is gone", None: "?"}[r.pid_alive]
            found.append(f"{r.kind} {r.id} is {r.status} ({alive})")
    finished = [r for r in _fleet_records(obs.records) if r.status not in UNFINISHED]
    if finished and served_after(finished[-1]) != v:
        last = finished[-1]
        found.append(f"the newest finished record {last.id} ({last.status}, "
                     f"v{last.from_version} -> v{last.to_version}) says "
                     f"v{served_after(last)} serves, the replicas v{v}")
    held = [row for row in obs.locks if wedged(row)]
    if held:
        found.append(f"a lock is held: {held}")
    return found


def wedged(row: Mapping[str, Any]) -> bool:
    """A row of ``modelship locks`` that stops the next taker: held by a live holder, or
    by one nobody can tell dead. A holder verified dead (its process on this host is
    gone) is taken over by the next release or canary at once, so it wedges nothing."""
    return bool(row.get("held")) and (row.get("holder_alive") is not False
                                      or bool(row.get("unreadable")))


def story_breaks(records: Sequence[RecordState], serving: int | None, *,
                 start: int | None) -> list[str]:
    """Where fleet records (oldest first) do not tell one continuous story: the first
    starts from ``start`` (what served before them), each next one from what the one
    before left serving, none is unfinished, and the last leaves what serves now."""
    breaks = []
    left = start
    for r in _fleet_records(records):
        if r.status in UNFINISHED:
            breaks.append(f"{r.kind} {r.id} is still {r.status}")
            continue
        if r.from_version != left:
            breaks.append(f"{r.kind} {r.id} ({r.status}) started from v{r.from_version}, "
                          f"but v{left} served before it")
        left = served_after(r)
    if left != serving:
        breaks.append(f"the ledger's last word is v{left} serving; the replicas serve "
                      f"v{serving}")
    return breaks


def loose_ends(obs: Observation) -> list[str]:
    """What a converged release leaves tidy besides the disagreements: the production
    version tagged by a release of it, and nothing of the model on the canary."""
    found = []
    v = obs.serving
    tagged = next((r for r in obs.records if r.id == obs.tag_release_id), None)
    if v is not None and (tagged is None or tagged.to_version != v
                          or tagged.status not in SERVES_TO):
        found.append(f"v{v}'s {RELEASE_ID_TAG} tag is {obs.tag_release_id!r}, not a "
                     f"release of v{v} ({tagged})")
    if obs.canary_leftovers:
        found.append(f"left on the canary: {list(obs.canary_leftovers)}")
    return found


if __name__ == "__main__":
    main()
