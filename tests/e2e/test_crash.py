"""The fault matrix: every way a release can stop ends in one true, converged state.

Each cell is one fault at one stage of a real ``modelship promote`` (DESIGN §2 item 10;
issue 18 item 6):

- **faults**: SIGKILL, SIGTERM and SIGINT of the CLI, delivered by the process to itself at
  the stage's point, so the product's own handlers run exactly there; the SIGKILL of
  MLflow, S3 (SeaweedFS), Prefect or the gateway (nginx), whole process group, at the
  stage's point, with the release going on without it and ``modelship stack up``
  restarting it once the CLI ended (the gateway: while the run still waits at its point)
  (``tests/faults.py`` injects; nothing in the product knows a test);
- **stages**: check (the trial model answered), stage (the first blob uploaded, the
  manifest not), canary (candidate and baseline loaded), progressive (``canary.traffic:
  progressive``: the first step's weight set, 5 % of the model's live requests on the
  candidate), the approval wait, swap (one replica switched, batching paused, the other in
  flight), bake (the fleet serves the candidate) and record (the bake passed).

After each fault: the faulted run ended as it must (SIGKILL: killed, its record still
``running`` in the stage, and what it leaves for the next command really left: the trial
model or the candidate on the canary, the approval request pending; a signal: 128 + the
signal, or 0 when it finished a release that had passed its bake; an outage: on its own,
with one JSON document on stdout and no traceback), and its record, if it ended, says what
serves. ``modelship status`` is true: non-zero exactly while the observed state has a
disagreement (:func:`tests.faults.disagreements`: replicas, batching, the pin, the
``production`` alias, the newest record, an unfinished record, a held lock). Then the next
command (``promote`` again, or a plain ``rollback``) exits 0 and everything converges: the
fleet, the pin and the alias agree, the version carries its release tag, the ledger tells
one continuous story with no record ``running`` or ``incomplete``, nothing is left on the
canary, ``status`` exits 0 and no lock is wedged (:func:`tests.faults.wedged`: a lock whose
holder is verified dead, such as a killed canary's slot, is taken over by the next taker
at once). A killed run ends ``interrupted`` (undone), or ``released`` when it was killed
past its point of no return (the record stage), naming the release that found it; a
killed run's lock is taken over (the promote that finds it says so), not unlocked by hand;
an approval request is closed ``interrupted``, so a late click is refused; a
half-published version is published once by the rerun, manifest last.

**Which cells.** 7 faults x 8 stages is 56 cells; these 18 are the ones whose code paths
differ:

- SIGKILL (no handler runs; the next command finds a dead run) at every kill point of the
  SIGKILL chain this file replaces: check (a trial model left on the canary), stage (a
  half-published version: a blob, no manifest; the rerun publishes it), canary (the
  candidate left on the canary, the release lock and the canary slot held), approval (a
  pending approval, the candidate kept on the canary), swap (a half-switched fleet,
  batching paused) and bake (an unbaked swap); and record (a baked, unrecorded release:
  past its point of no return, to be finished, not undone). The chain's "after-check"
  point (check passed, no file uploaded) is the staging cell's state minus one
  content-addressed blob: the record stops in ``stage`` with no intent in both, so the
  next command decides the same (``tasks.recovery.decide``: nothing to undo) and the
  rerun stages what is missing the same way.
- SIGTERM (a pod stop, a Prefect cancel) at check, the approval wait, the bake and the
  record: each a different way out (the check's own cleanup and the cancelled record;
  the approval wait closing its request and unloading the kept candidate; the release
  undone; the release finished). SIGTERM at the canary is not a cell: the canary's one
  ``except BaseException`` clause unloads the candidate for any way out of its
  measurement (``tasks.canary``), and the stop then ends the record as at the check
  (``flows.promote._stopped``).
- SIGINT (Ctrl-C) at the swap, where it arrives while worker threads switch replicas
  (issue 18 item 3). SIGINT and SIGTERM are one handler (``modelship.signals``: both raise
  ``StopRequested(signum)`` in the main thread, at the CLI entry and in the promote flow),
  so a stage's way out does not depend on which of the two came, only the exit code does
  (128 + the signal, checked in every cell): SIGINT at the swap stands for SIGTERM there,
  SIGTERM at the bake (item 2) for SIGINT there, and so on.
- MLflow down at the record, the one stage after the swap that needs it: the aliases
  cannot move, so the release is ``incomplete`` until the next command finishes it (issue
  18 item 4). Down before the swap it is an ordinary failed release.
- S3 (the ledger, the pin, the release lock, the model repository) down mid-swap (the
  second replica cannot load and the abort cannot either) and at the bake (the release
  passes its bake but cannot record it, item 5).
- Prefect (the flow run's bookkeeping) down at the bake (items 1 and 6): the release must
  end on its own, and no lock may be wedged once Prefect is back.
- A progressive step (issue 20 item 5; :func:`_check_split`): SIGTERM there (the run's own
  way out returns the weights to 100 % production, 128 + 15), and the gateway killed and
  restarted under the live run (it comes back at production only; the run's next look
  finds the split it set gone, aborts with exit 1 and returns the weights to production).
  Both times the weights read back from the gateway are production only, ``status`` shows
  exactly those (and, while the gateway is dead, that it did not answer), and the record
  says production with its step events. SIGKILL there (the split left, the next command
  restores it) is tests/e2e/test_progressive.py's.

The next command is mostly a plain ``rollback``, which must first finish or undo the dead
or incomplete run (issue 18 item 2) and is the cheapest; ``promote`` reruns the release
after the killed staging, and finishes the releases stopped at or past their record (a
no-op on the fleet that must repair the aliases and tags).

**Cost** (each cell prints where its time goes, and each CLI run its own timeline from its
record: start-up, every stage, the time between stages, the exit). The whole file runs on
the worker's session stack (``tests/stack_fixtures.py``), in four lanes side by side
(:data:`LANES`, ``tests/e2e/crash_lanes.py``): a cell's time is mostly waiting (Triton
loads, windows, a dependency's bounded timeouts), so the lanes' cells overlap. Each lane is
one model whose versions take turns: each cell promotes the version that does not serve,
from the state the cell before it in the lane settled in. Cells of different models touch
different objects, so one lane's cell cannot change what another's asserts; the cells that
kill a component (spread over the lanes, never two in a row in one lane) take the stack
alone from their fault point (the faulted run waits there,
:func:`tests.faults.wait_at_gate`; S3 mid-swap and the gateway mid-step from their stage's
start, :data:`tests.faults.GATE_AT_START`) until the component is back through ``modelship
stack up`` (same ports, same data); the rest of the cell (the faulted run's record,
``status``, the next command) shares the stack again: it touches its own model only. The
matrix leaves the stack with every component running (:func:`_heal`) and its models
converged, for the tests after it. A lane opens with a cell that needs at most one
release before it (a first release, beside the others: a rollback cell needs a version
that served before, which a lane's first promote cell leaves), and the staging cell's lane
with none: its cell half-publishes the lane's first release. Most of the matrix's CPU goes
to Triton model loads (a Python-backend stub each) and to the commands' own work, so the
policy is the smallest that still reaches every fault point: one threshold gate (the canary
stops after its first round, 0.5 s, of at least 20 requests a version, no warm-up); a bake
only where the cell's fault needs it (the bake and the record, which comes after a passed
bake): a 1-s bake of one window on errors alone (a 1-s reference is below two windows, so
no latency rule); batching paused at the swap only in the swap cells (their fault point is
after the pause: three reloads per replica; one elsewhere), and the cells' ``rollback``
with the same policy (the console script's plain ``rollback MODEL``: the default policy);
and a 30-s swap deadline (a replica that cannot load, S3 down, is given up on then, not
after the default 60 s; 8 s in the cell that kills S3 mid-swap, alone on the stack from the
swap's start, where a healthy switch has done its part before the fault). The progressive
cells hold their first step (``step_min_s`` 120) until the fault, which comes right after
its weight is set. Every ``modelship`` run is a fork of one CLI zygote
(:func:`tests.faults.cli_zygote`, ``tests/zygote.py``; the lanes' runs side by side): a
process that imported the CLI, the flows and what their stages import late (Prefect,
MLflow, GX, ONNX: 10-30 s a run) once, while the session stack came up (the stack's home is
the one variable its runs add: read when a command runs, never at import); the child is a
real process running ``modelship.cli.main`` (its own pid, signals, exit code and output).
The console script itself runs one ``status``, one ``rollback`` and one ``promote`` rerun
of the file (their exit code and JSON are the contract; :data:`LANES` names the cells, the
cheapest of each command). ``status`` is read by the CLI in the first cell of each fault
kind and otherwise in this process through the function the CLI calls
(:func:`tasks.status.status_report`; exit 1 unless ``consistent``); ``stack up`` runs only
after a component was killed. This process reads the stack through one set of clients
(:class:`StackClients`) and logs each graph once, registering it again in the other lanes
(:func:`_register`). What remains is the product's: every faulted run starts the
Prefect flow run, resolves, checks (GX, export, trial load; a check-stage fault never takes
a cached check, the others may) and, from the canary on, runs a canary.
"""

from __future__ import annotations

import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from model_registry.client import point_mlflow_at
from modelship.clients import Clients, build_clients
from modelship.ledger import Ledger
from modelship.locks import list_locks
from modelship.settings import Settings
from modelship.stack.process import is_alive
from modelship.stack.state import process_records, read_state
from modelship.traffic.select import router_for
from tasks.status import status_report
from tests import models
from tests.conftest import ROOT, cli_env, run_cli
from tests.e2e.crash_lanes import Hold, Lanes, Turns
from tests.faults import (
    Fault,
    FaultedRun,
    Observation,
    RecordState,
    cli_zygote,
    disagreements,
    json_document,
    loose_ends,
    observe,
    run_faulted,
    story_breaks,
)
from tests.policies import NO_PAUSE, ONE_WINDOW_BAKE, short_policy
from tests.zygote import Bound

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

#: The models' names: MODEL-<lane>, or MODEL-<lane>-2, ... the first the stack's registry
#: does not know yet (:func:`_fresh_name`: a run after another on one stack starts from
#: fresh models as it does on its own).
MODEL = "fault-matrix"
#: The matrix is about the ways out, not the gates: the short release (tests/policies.py),
#: no bake and no batching pause at the swap, but where the cell's fault is
#: (:attr:`Cell.policy`: a bake cell bakes, a swap cell pauses). A replica that cannot load
#: (S3 down) is given up on after ``deadline_s``, not the default 60 s (a healthy switch of
#: this model takes a few seconds even on a loaded machine, with the other lanes' releases
#: beside it).
POLICY = short_policy(swap={**NO_PAUSE, "deadline_s": 30.0})
#: The bake of the cells whose fault point is the bake or the record (the bake passed).
BAKE = ONE_WINDOW_BAKE
#: The fault points a release reaches only through its bake.
BAKED = frozenset({"bake", "record"})
#: The swap deadline of the cell that kills S3 mid-swap: both the failing switch and the
#: abort wait it out (S3 down, a load hangs), and the first replica's switch, healthy,
#: is done before the fault (a tiny model's switch takes 1-3 s on a loaded machine, the
#: cell alone on the stack from the swap's start).
S3_SWAP_DEADLINE_S = 8.0
#: The progressive cells' canary (issue 20 item 5): live weights in steps through the
#: session stack's gateway; the first step is held (nothing decides it before the fault,
#: which comes right after its weight is set), so the fault finds the candidate at 5 %.
PROGRESSIVE: dict[str, Any] = {
    "canary": {"traffic": "progressive", "steps": [5.0, 25.0, 50.0], "step_min_s": 120.0,
               "step_max_s": 240.0},
    "gates": [
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate",
         "max_rate": 0.01},
        {"name": "latency_p50", "metric": "latency_p50_ms", "test": "mann_whitney",
         "max_increase_pct": 25.0},
    ],
}
#: The variable a zygote's run adds: the stack's home (read when a command runs).
HOME = "MODELSHIP_HOME"
MANIFEST = "/release.json"
APPROVAL = ("--require-approval", "--approvers", "U0FAULTAPPROVER")
#: A faulted run ends within this (issue 18 item 4: bounded exits with a dependency down).
FAULTED_TIMEOUT_S = 300.0
#: The ledger's name of each fault point's stage.
RECORD_STAGE = {"check": "check", "stage": "stage", "canary": "canary",
                "progressive": "canary", "approval": "approve", "swap": "swap",
                "bake": "bake", "record": "record"}
#: Stages a run holds the model's release lock in (a SIGKILL there leaves it held).
LOCKED = frozenset({"canary", "progressive", "approval", "swap", "bake", "record"})


@dataclass(frozen=True)
class Cell:
    """One fault at one stage, and the command that must converge after it."""

    fault: Fault
    next_command: str  # "promote" (the rerun) or "rollback"
    #: Commands of this cell run by the console script itself ("status", the next command)
    console: frozenset[str] = frozenset()
    swap_deadline_s: float = POLICY["swap"]["deadline_s"]
    #: The killed component is restarted (``modelship stack up``) while the faulted run
    #: still waits at its fault point, which then goes on against the restarted one.
    restart_at_point: bool = False

    @property
    def id(self) -> str:
        return f"{self.fault.id}-then-{self.next_command}"

    @property
    def progressive(self) -> bool:
        return self.fault.stage == "progressive"

    @property
    def paused(self) -> bool:
        """The swap pauses batching (the swap's fault point is after the pause, at the
        switch); elsewhere one reload per replica does."""
        return self.fault.stage == "swap"

    @property
    def policy(self) -> dict[str, Any]:
        policy = {**POLICY, **PROGRESSIVE} if self.progressive else dict(POLICY)
        if self.fault.stage in BAKED:
            policy["bake"] = BAKE
        return {**policy, "swap": {**POLICY["swap"], "deadline_s": self.swap_deadline_s,
                                   "pause_batching": self.paused}}

    @property
    def policy_name(self) -> str:
        return (f"{'progressive-' if self.progressive else ''}"
                f"{'baked-' if self.fault.stage in BAKED else ''}"
                f"swap-{self.swap_deadline_s:g}s{'-paused' if self.paused else ''}")

    @property
    def rollback_policy(self) -> tuple[str, dict[str, Any]]:
        """The policy of the cell's ``rollback`` (its name, its content): the setup's, with
        the cell's batching pause (a swap cell's rollback pauses, as its release did)."""
        if not self.paused:
            return "setup", POLICY
        return "rollback-paused", {**POLICY, "swap": {**POLICY["swap"], "pause_batching": True}}

    @property
    def gated(self) -> bool:
        """A cell that kills a component: its faulted run waits at the fault point (or at
        its stage's start, :data:`tests.faults.GATE_AT_START`) until the cell has the stack
        alone."""
        return self.fault.component is not None


def _cell(kind: str, stage: str, next_command: str, *, console: tuple[str, ...] = (),
          swap_deadline_s: float = POLICY["swap"]["deadline_s"],
          restart_at_point: bool = False) -> Cell:
    return Cell(Fault(kind, stage), next_command, frozenset(console), swap_deadline_s,
                restart_at_point)


#: The cells in lanes, one model per lane, the lanes side by side on the worker's session
#: stack (tests/e2e/crash_lanes.py), each lane's cells in order: each starts from what the
#: one before it left. The cells that kill a component (K) take the stack alone from their
#: fault point (S3 mid-swap and the gateway mid-step from their stage's start) until the
#: component is back, and every other cell waits meanwhile: a K cell at its point waits
#: for the cells running beside it to end, so the K cells come where the lanes reach them
#: at about the same time, one wait for the stack for all of them. Setup releases cost what
#: a cell does, so a lane opens with a cell that needs at most one (:func:`_start`): the
#: staging cell (none: it half-publishes the lane's first release) or a promote cell (one,
#: a first release; its rerun leaves the version that served before, which a rollback cell
#: needs). So the first K cell of each lane comes right after the lane's opening promote
#: cell (two releases: what a K rollback cell needs), the K cells whose runs reach their
#: points soonest (S3 mid-swap: at the swap's start) after the longest opening cells, or
#: opens its lane (the S3 bake cell, a promote cell: alone first and briefly, while the
#: other lanes' opening cells run); the gateway, the shortest alone (restarted in
#: seconds), ends its lane. Never two K cells in a row in one lane. The console script runs
#: once per command in the file: a ``promote`` that finishes a release killed past its
#: point of no return (a no-op on the fleet: no check, no canary; a lane's opening cell),
#: and, after the K cells (its start-up is slow), a ``rollback`` and a ``status``.
LANES = {
    "a": [
        # the lane's first release, half-published: a version of its own bytes
        # (:func:`_setup_graphs`), not staged yet
        _cell("sigkill", "stage", "promote"),
        _cell("mlflow", "record", "promote"),  # K
        _cell("sigkill", "check", "rollback", console=("rollback",)),
        _cell("sigterm", "approval", "rollback"),
    ],
    "b": [
        _cell("sigkill", "record", "promote", console=("promote",)),
        _cell("s3", "swap", "rollback", swap_deadline_s=S3_SWAP_DEADLINE_S),  # K
        _cell("sigkill", "canary", "rollback"),
        _cell("sigkill", "approval", "rollback"),
        _cell("sigterm", "bake", "rollback"),
    ],
    "c": [
        _cell("sigterm", "record", "promote"),
        _cell("prefect", "bake", "rollback"),  # K
        _cell("sigkill", "swap", "rollback"),
        _cell("sigterm", "check", "rollback"),
        # K: the gateway killed while the candidate has 5 %, restarted under the live run
        _cell("gateway", "progressive", "rollback", restart_at_point=True),
    ],
    "d": [
        _cell("s3", "bake", "promote"),  # K
        _cell("sigint", "swap", "rollback"),
        _cell("sigterm", "progressive", "rollback"),
        _cell("sigkill", "bake", "rollback", console=("status",)),
    ],
}
CELLS = [cell for cells in LANES.values() for cell in cells]
LANE_OF = {cell: lane for lane, cells in LANES.items() for cell in cells}
#: The cells whose ``status`` the CLI reads: the first of each fault kind in the file, and
#: the one whose status is the console script's.
STATUS_BY_CLI = frozenset(
    {next(c.id for c in CELLS if c.fault.kind == kind) for kind in {c.fault.kind for c in CELLS}}
    | {c.id for c in CELLS if "status" in c.console})


class Clock:
    """Where a cell's time goes, printed whatever the cell ends in."""

    def __init__(self) -> None:
        self.began = self.last = time.monotonic()
        self.phases: list[tuple[str, float]] = []
        self.notes: list[str] = []  # each CLI run's own timeline

    def lap(self, phase: str) -> None:
        now = time.monotonic()
        self.phases.append((phase, now - self.last))
        self.last = now

    def line(self, name: str) -> str:
        parts = ", ".join(f"{phase} {seconds:.1f}" for phase, seconds in self.phases)
        return f"cell {name}: {time.monotonic() - self.began:.1f} s ({parts})"


def _epoch(iso: str) -> float:
    return datetime.fromisoformat(iso).timestamp()


def cpu(done: subprocess.CompletedProcess[str]) -> str:
    """A run's CPU time, said (a zygote's run reports it, :class:`tests.zygote.Completed`;
    the console script's is not measured)."""
    cpu_s = getattr(done, "cpu_s", None)
    return "" if cpu_s is None else f", {cpu_s:.1f} CPU-s"


def timeline(record: RecordState, launched: float, ended: float,
             done: subprocess.CompletedProcess[str] | None = None) -> str:
    """Where one CLI run's time went, from its record (``launched``/``ended``: wall clock
    around the run; ``done``: the run, for its CPU time): start-up until the record began
    (imports, the Prefect flow run), each stage, the gaps between them, and the exit after
    the last one."""
    if record.started_at is None:
        return f"{record.kind} {record.id}: no timings"
    began = _epoch(record.started_at)
    spans = [(name, _epoch(a), _epoch(b) if b else ended) for name, a, b in record.stage_times]
    last = max((b for _, _, b in spans), default=began)
    staged = sum(b - a for _, a, b in spans)
    parts = [f"start-up {began - launched:.1f}",
             *(f"{name} {b - a:.1f}" for name, a, b in spans),
             f"between stages {last - began - staged:.1f}", f"exit {ended - last:.1f}"]
    return (f"  {record.kind} {record.status}: {ended - launched:.1f} s"
            f"{cpu(done) if done is not None else ''} ({', '.join(parts)})")


#: The test process's own calls of the stack (MLflow's fluent API and client, boto3's
#: clients: neither is made to be set up from several threads at once), one at a time
#: across the lanes; the lanes' ``modelship`` runs are processes and go side by side.
IN_PROCESS = threading.RLock()


class StackClients:
    """The test process's clients of the stack (:func:`modelship.clients.build_clients`),
    built once for the matrix and used under :data:`IN_PROCESS`: a build costs ~0.05-0.08
    CPU-s (boto3's client above all), and a cell reads the stack about eight times. A
    component killed and restarted comes back on its ports, where the clients reconnect."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._clients: Clients | None = None

    def get(self) -> Clients:
        with IN_PROCESS:
            if self._clients is None:
                self._clients = build_clients(self.settings)
            return self._clients

    def close(self) -> None:
        with IN_PROCESS:
            if self._clients is not None:
                self._clients.close()
                self._clients = None


@dataclass
class Matrix:
    """One lane: its model, whose two versions take turns, on the shared stack."""

    settings: Settings
    model: str
    versions: tuple[int, int]
    workdir: Path
    released: list[int]  # the versions released so far, in order
    stack: StackClients  # the lanes' clients of the stack, used under IN_PROCESS
    settled: Observation | None = None  # what the last cell that passed ended in
    zygote: Bound | None = None  # runs of `modelship` (None: every run a process)
    policies: dict[str, Path] = field(default_factory=dict)  # by Cell.policy_name
    turns: Turns = field(default_factory=Turns)  # the stack, shared by the lanes
    said: list[str] = field(default_factory=list)  # lines for the current cell's output

    @property
    def home(self) -> Path:
        return self.settings.home

    def cli(self, *args: str, timeout: float = 300, console: bool = False
            ) -> subprocess.CompletedProcess[str]:
        """``modelship ARGS``: a run of the zygote (the CLI's ``main``, forked from a
        process that imported it once), or the console script itself (``console``)."""
        if console or self.zygote is None:
            return run_cli(*args, home=self.home, timeout=timeout)
        return self.zygote.run(["modelship", *args], timeout=timeout)

    def policy(self, cell: Cell | None = None, *, rollback: bool = False) -> Path:
        """The policy file of ``cell``'s release (None: of a setup release, :data:`POLICY`),
        or of its rollback (:attr:`Cell.rollback_policy`)."""
        name, policy = ("setup", POLICY) if cell is None else cell.rollback_policy \
            if rollback else (cell.policy_name, cell.policy)
        if name not in self.policies:
            self.policies[name] = models.write_policy(
                self.workdir / f"policy-{name}.yaml", policy)
        return self.policies[name]

    def locks(self) -> list[dict[str, Any]]:
        """The model's held locks (its release lock, a canary slot held for it), as
        ``modelship locks`` lists them."""
        with IN_PROCESS:
            return self._locks()

    def _locks(self) -> list[dict[str, Any]]:
        rows = list_locks(storage=self.stack.get().storage, home=self.home)
        return [row for row in rows if row.get("model") == self.model]

    def version_keys(self, version: int) -> list[str]:
        """The objects under the version's folder of the model repository."""
        with IN_PROCESS:
            return self._version_keys(version)

    def _version_keys(self, version: int) -> list[str]:
        storage = self.stack.get().storage
        assert storage is not None
        return list(storage.list_keys(
            f"{self.settings.repository_prefix}/{self.model}/{version}/"))

    def observe(self) -> Observation:
        with IN_PROCESS:
            return observe(self.settings, self.model, locks=self.locks,
                           clients=self.stack.get())

    def register(self, graph: Any) -> int:
        """A new version of the model from ``graph``."""
        with IN_PROCESS:
            return models.register_onnx(str(self.settings.mlflow_tracking_uri), self.model,
                                        graph)

    def status(self, *, cli: bool, console: bool = False) -> tuple[int, Any]:
        """``modelship status MODEL``'s exit code and document: the CLI (the console
        script when ``console``), or the function it calls
        (:func:`tasks.status.status_report`, exit 1 unless consistent) read in this
        process."""
        if cli:
            done = self.cli("status", self.model, "--json", timeout=120, console=console)
            assert "Traceback (most recent call last)" not in done.stderr, done.stderr
            self.said.append(f"status: exit {done.returncode}{cpu(done)}")
            return done.returncode, json_document(done.stdout) or done.stdout[-3000:]
        with IN_PROCESS:
            doc = status_report(self.settings, self.stack.get(), model=self.model)
        return (0 if doc["consistent"] else 1), doc

    def live_split(self) -> dict[str, float]:
        """The gateway's live weights of the model, read back from it."""
        router = router_for(self.settings)
        assert router is not None, "the session stack runs a gateway"
        return router.live().to_dict()

    def status_traffic(self) -> dict[str, Any] | None:
        """``status``'s ``traffic`` (the live weights it shows), read as the CLI reads it:
        through the configured router (:func:`tasks.status.status_report`)."""
        with IN_PROCESS:
            doc = status_report(self.settings, self.stack.get(), model=self.model,
                                router=router_for(self.settings))
        traffic: dict[str, Any] | None = doc["traffic"]
        return traffic

    def traffic_record(self, release_id: str) -> dict[str, Any]:
        """The release's ``traffic`` document in the ledger (its split and step events)."""
        with IN_PROCESS:
            storage = self.stack.get().storage
            assert storage is not None
            record = next(r for r in Ledger(storage).records(self.model) if r.id == release_id)
        return dict(record.traffic)

    def promote(self, version: int, *extra: str, cell: Cell | None = None) -> list[str]:
        return ["promote", self.model, "--version", str(version), "--policy",
                str(self.policy(cell)), "--json", *extra]

    def release(self, version: int) -> None:
        """An ordinary release of ``version`` (setup, or a cell's start)."""
        began = time.monotonic()
        done = self.cli(*self.promote(version), timeout=600)
        assert done.returncode == 0, (done.stdout[-3000:], done.stderr[-3000:])
        self.released.append(version)
        self.said.append(f"setup: promote v{version}: {time.monotonic() - began:.1f} s"
                         f"{cpu(done)}")


def _own_bytes(*, seed: int) -> Any:
    """``models.sklearn_onnx(seed)`` in bytes no other registration has (its doc string
    is unique): the blob store is content-addressed and shared by every model on the
    stack, so staging bytes another test staged before would copy its blob, not upload
    one, and the stage cell's fault point (the first upload) would never come."""
    graph = models.sklearn_onnx(seed=seed)
    graph.doc_string = f"fault matrix, seed {seed}, {uuid.uuid4().hex}"
    return graph


def _setup_graphs() -> list[Any]:
    """Two versions' ONNX graphs for each lane (:func:`_own_bytes`), MLflow's ONNX flavor
    imported. The lanes share them (each logged once, :func:`_register`), so the check of
    one lane's version is the others' cached; the staging cell, which must upload a blob,
    stages a version of its own: the lane's first version when the cell opens its lane
    (the lane's first release), else a new one (:func:`_converge`: a version is staged
    once)."""
    import mlflow.onnx  # noqa: F401 - imported here, beside the stack's start

    shared = [_own_bytes(seed=seed) for seed in (0, 7)]
    return [[_own_bytes(seed=0), shared[1]] if cells[0].fault.stage == "stage" else shared
            for cells in LANES.values()]


def _register(tracking_uri: str, model: str, graph: Any, logged: dict[int, str]) -> int:
    """A new version of ``model`` from ``graph``: logged the first time (``logged``: the
    MLflow source of each graph logged so far, by ``id``), else the artifact logged then,
    registered again (the same bytes and run: what a lane's check finds in the check
    cache, as the log of equal bytes did, for a registration instead of a log)."""
    import mlflow
    from mlflow import MlflowClient

    if id(graph) not in logged:
        version = models.register_onnx(tracking_uri, model, graph)
        client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
        logged[id(graph)] = client.get_model_version(model, str(version)).source
        return version
    point_mlflow_at(tracking_uri)
    return int(mlflow.register_model(logged[id(graph)], model).version)


def _fresh_name(tracking_uri: str, base: str) -> str:
    """``base``, or base-2, base-3...: the first name the registry does not know."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri, registry_uri=tracking_uri)
    known = {m.name for m in client.search_registered_models(f"name LIKE '{base}%'")}
    return next(name for n in range(1, len(known) + 2)
                if (name := base if n == 1 else f"{base}-{n}") not in known)


def dead_components(home: Path) -> list[str]:
    """The stack's components that are not running (by the PID and start time
    ``stack up`` recorded)."""
    state = read_state(home / "stack.json")
    assert state is not None, f"no stack.json in {home}"
    return [record.name for record in process_records(state) if not is_alive(record)]


def _heal(home: Path) -> None:
    """Leave the session stack as the tests after the matrix expect it: every component
    running (``stack up`` restarts what a cell that failed left dead)."""
    dead = dead_components(home)
    if dead:
        up = run_cli("stack", "up", "--json", home=home, timeout=300)
        print(f"healed the session stack ({', '.join(dead)} dead): exit {up.returncode}")
        assert up.returncode == 0, (up.stdout[-2000:], up.stderr[-3000:])
        assert not dead_components(home), dead_components(home)


def _selected(request: pytest.FixtureRequest) -> set[Cell]:
    """The cells this run of the file runs (``-k`` and the like leave the rest out)."""
    return {item.callspec.params["cell"] for item in request.session.items
            if getattr(item, "module", None) is request.module
            and hasattr(item, "callspec") and "cell" in item.callspec.params}


@pytest.fixture(scope="module")
def matrix(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Lanes[Cell]]:
    """The worker's session stack (2 replicas + canary), each lane's model with its two
    versions registered, nothing released (the first cells' reruns are the releases, see
    :func:`_start`), and the lanes started: each cell's test waits for its outcome. The
    CLI's zygote imports while the session stack comes up (when this is the worker's
    first test to need it); at the end every component is running."""
    workdir = tmp_path_factory.mktemp("fault-marks")
    started = time.monotonic()
    selected = _selected(request)
    lanes = {lane: [c for c in cells if c in selected] for lane, cells in LANES.items()}
    # the zygote's environment: a command's but the home, which each of its runs adds
    env = {k: v for k, v in cli_env(workdir).items() if k != HOME}
    with cli_zygote(env, ROOT, late=(HOME,)) as zygote:
        # trained (and MLflow imported) in a thread while the stack starts, which waits
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="matrix-setup") as pool:
            training = pool.submit(_setup_graphs)
            settings: Settings = request.getfixturevalue("stack_settings")
            graphs = dict(zip(LANES, training.result(), strict=True))
        print(f"session stack: {time.monotonic() - started:.1f} s")
        assert not dead_components(settings.home), dead_components(settings.home)
        uri, turns, stack = str(settings.mlflow_tracking_uri), Turns(), StackClients(settings)
        bound = zygote.bound({HOME: str(settings.home)})
        ready = zygote.wait_ready()
        print(f"zygote ready at {time.monotonic() - started:.1f} s: {ready}")
        matrices: dict[str, Matrix] = {}
        logged: dict[int, str] = {}  # id(graph) -> the MLflow source it was logged as

        def registered(lane: str) -> Matrix:
            """The lane's model and its two versions, registered by its first cell (the
            lanes one at a time, beside the others' cells)."""
            if lane not in matrices:
                with IN_PROCESS:
                    model = _fresh_name(uri, f"{MODEL}-{lane}")
                    v_a, v_b = (_register(uri, model, graph, logged) for graph in graphs[lane])
                lane_dir = workdir / lane
                lane_dir.mkdir()
                matrices[lane] = Matrix(settings, model, (v_a, v_b), lane_dir, released=[],
                                        stack=stack, zygote=bound, turns=turns)
                matrices[lane].said.append(
                    f"setup: registered v{v_a}, v{v_b} of {model} at "
                    f"{time.monotonic() - started:.1f} s")
            return matrices[lane]

        def run(lane: str, cell: Cell, lines: list[str]) -> None:
            lane_matrix = registered(lane)
            clock = Clock()
            try:
                _run_cell(lane_matrix, cell, clock)
            finally:
                lines.extend([f"lane {lane}: {clock.line(cell.id)}", *lane_matrix.said,
                              *clock.notes])
                lane_matrix.said.clear()

        runner = Lanes(lanes, run)
        runner.start()
        try:
            yield runner
        finally:
            runner.stop()
            stack.close()
            _heal(settings.home)
            print(f"matrix total (incl. setup): {time.monotonic() - started:.1f} s")


# --------------------------------------------------------------------------------------
# the cells


def _check_faulted_exit(run: FaultedRun, obs: Observation, release_id: str) -> None:
    """The faulted CLI ended as its fault says it must."""
    code, fault = run.result.returncode, run.fault
    record = obs.record(release_id)
    if fault.signal == signal.SIGKILL:
        assert code == -signal.SIGKILL, run.describe()
        # killed where it was meant to be: its record still runs, in the stage
        assert record.status == "running", (record, run.describe())
        assert record.last_stage == RECORD_STAGE[fault.stage], (record, run.describe())
        return
    # every other way out is reported, never a traceback (issue 18 item 4)
    assert "Traceback (most recent call last)" not in run.result.stderr, run.describe()
    assert json_document(run.result.stdout) is not None, run.describe()
    if fault.signal is not None:
        assert code in (128 + fault.signal, record.exit_code), run.describe()
        assert code != 0 or record.status == "released", run.describe()
    else:
        assert code >= 0, run.describe()  # not killed: it ended on its own, in time


def _check_left_behind(matrix: Matrix, cell: Cell, obs: Observation,
                       release_id: str) -> None:
    """A run stopped by SIGTERM or SIGINT cleaned up after itself: nothing of it on the
    canary (an unload may still be finishing: looked at again for a few seconds). What a
    SIGKILL leaves for the next command to clean up is really there (else the cell would
    prove nothing): the trial model or the candidate on the canary, the approval request
    pending."""
    if cell.fault.signal in (signal.SIGTERM, signal.SIGINT):
        for _ in range(5):
            if not obs.canary_leftovers:
                break
            time.sleep(1.0)
            obs = matrix.observe()
        assert not obs.canary_leftovers, obs.summary()
    if cell.fault.signal != signal.SIGKILL:
        return
    stage = cell.fault.stage
    if stage == "check":
        assert any(n.startswith(f"_trial_{matrix.model}") for n in obs.canary_leftovers), \
            obs.summary()
    if stage in ("canary", "approval"):
        assert matrix.model in obs.canary_leftovers, obs.summary()
    if stage == "approval":
        assert obs.record(release_id).requests == ("pending",), obs.record(release_id)


def _check_record_truth(obs: Observation, release_id: str, run: FaultedRun) -> None:
    """A record that ended says what serves; one that did not is an open disagreement."""
    record = obs.record(release_id)
    if record.status in ("running", "incomplete"):
        assert disagreements(obs), (run.describe(), obs.summary())
        return
    if record.status in ("released", "noop"):
        assert obs.serving == record.to_version, (record, run.describe(), obs.summary())
    else:
        assert obs.serving == record.from_version, (record, run.describe(), obs.summary())


def _check_split(matrix: Matrix, cell: Cell, run: FaultedRun, faulted: str) -> None:
    """A progressive release stopped during its first step (issue 20 item 5): the weights
    it set (5 % of the model's live requests on the candidate) are back at 100 %
    production, read back from the gateway itself, ``status`` shows exactly those live
    weights, and the record says production with its step events. SIGTERM: the run's own
    way out returned them and the run ended 128 + 15. The gateway killed and restarted
    under the live run (it comes back at production only, not the split it died with): the
    run's next look found the split it set gone, aborted as an infrastructure failure
    (exit 1) and returned the weights to production. (SIGKILL, where the next command finds
    the split and returns it: tests/e2e/test_progressive.py.)"""
    live = matrix.live_split()
    assert live["canary_pct"] == 0.0 and live["production_pct"] == 100.0, live
    shown = matrix.status_traffic()
    assert shown is not None and shown["live"] == live and shown["production_only"], shown
    traffic = matrix.traffic_record(faulted)
    events = [(e["action"], e["from_weight_pct"], e["weight_pct"])
              for e in traffic.get("events", [])]
    assert events[:1] == [("advance", 0.0, 5.0)], traffic
    assert traffic["split"]["canary_pct"] == 0.0, traffic
    if cell.fault.component is None:
        assert run.result.returncode == 128 + signal.SIGTERM, run.describe()
        assert events == [("advance", 0.0, 5.0)], traffic  # stopped, not decided
    else:
        assert run.result.returncode == 1, run.describe()
        assert events[-1][0] == "abort", traffic


def _check_found(cell: Cell, end: Observation, faulted: str, new: list[Any]) -> None:
    """The next command found the run the fault stopped, and ended it truly: a killed
    run is ``interrupted`` (undone) or, killed past its point of no return (the record
    stage), ``released``, either way naming the release that found it; a run that took
    the model's lock had it taken over, not waited out or unlocked by hand; an approval
    request is closed, so a late click is refused."""
    record = end.record(faulted)
    if cell.fault.signal == signal.SIGKILL:
        finders = [r for r in new if r.id != faulted]
        assert any(r.id in (record.reason or "") for r in finders), (record, finders)
        if record.status == "interrupted":
            assert record.exit_code == 1 and "died" in (record.reason or ""), record
        else:
            assert cell.fault.stage == "record" and record.status == "released", record
        if cell.fault.stage in LOCKED and cell.next_command == "promote":
            notes = [n for r in finders for n in r.notes if "took over the release lock" in n]
            assert any(faulted in n for n in notes), (faulted, [r.notes for r in finders])
    if cell.fault.stage == "approval":
        assert record.requests and set(record.requests) == {"interrupted"}, record


def _start(matrix: Matrix, cell: Cell) -> Observation:
    """The state a cell starts from: converged. A cell that failed before may have left
    it otherwise (even a dependency down); then the stack is brought up and the version
    that should serve is promoted again (any command finishes what a dead run left), so
    that one failing cell does not fail the ones after it.

    The staging cell may start from the fresh stack (nothing released: a first release
    is half-published); any other cell needs a release, and a rollback cell a version
    that served before it: when the cells run so far released fewer (the first cells,
    or a ``-k`` subset), they are released first."""
    settled, matrix.settled = matrix.settled, None
    try:
        obs = settled or matrix.observe()
        fresh = not obs.records and not any(r.versions for r in obs.replicas)
        healthy = fresh or (not disagreements(obs) and not loose_ends(obs))
        inherited = obs.summary()
    except Exception as exc:  # noqa: BLE001 - healed below, and said if it cannot be
        healthy, inherited = False, f"not observable: {type(exc).__name__}: {exc}"
    if not healthy:
        if dead_components(matrix.home):
            matrix.cli("stack", "up", "--json", timeout=300)
        obs = matrix.observe()
        matrix.release(obs.aliases.get("production") or obs.serving or matrix.versions[0])
        obs = matrix.observe()
        if disagreements(obs):
            pytest.fail(f"an earlier cell left the state unconverged and it could not be "
                        f"healed: {disagreements(obs)}; inherited: {inherited}")
    needed = 2 if cell.next_command == "rollback" else 0 if cell.fault.stage == "stage" else 1
    while len(set(matrix.released)) < needed:
        matrix.release(next(v for v in matrix.versions if v != obs.serving))
        obs = matrix.observe()
    return obs


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_a_fault_at_a_stage_converges_on_the_next_command(matrix: Lanes[Cell],
                                                          cell: Cell) -> None:
    """The cell ran in its lane (:func:`_run_cell`, in the ``matrix`` fixture's lanes):
    its output, and what it raised."""
    waited = time.monotonic()
    outcome = matrix.outcome(cell)
    print("\n".join([f"waited {time.monotonic() - waited:.1f} s for lane "
                     f"{LANE_OF[cell]}", *outcome.lines]), flush=True)
    if outcome.error is not None:
        raise outcome.error


def _when(path: Path, running: Future[FaultedRun]) -> bool:
    """Wait until ``path`` exists (True) or the faulted run ended first (False)."""
    while not path.exists() and not running.done():
        time.sleep(0.05)
    return path.exists()


def _faulted_run(matrix: Matrix, cell: Cell, hold: Hold, args: list[str], clock: Clock,
                 ups: list[subprocess.CompletedProcess[str]]) -> FaultedRun:
    """The faulted promote. A gated one (:attr:`Cell.gated`) runs beside the other lanes up
    to its fault point (or its stage's start), waits there until this cell has the stack
    alone, then kills. With :attr:`Cell.restart_at_point`, the run stays at its point once
    the component is dead: ``status`` is read then (the dead gateway is shown as not
    answering, never as weights it cannot know), the component comes back through
    ``modelship stack up`` (appended to ``ups``), and the run goes on against it."""
    kwargs: dict[str, Any] = {"env": cli_env(matrix.home), "cwd": ROOT,
                              "workdir": matrix.workdir, "timeout_s": FAULTED_TIMEOUT_S,
                              "zygote": matrix.zygote}
    if not cell.gated:
        return run_faulted(cell.fault, *args, **kwargs)
    gate = matrix.workdir / f"gate-{cell.id}-{time.monotonic_ns()}"
    resume = Path(f"{gate}.resume") if cell.restart_at_point else None
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="faulted") as pool:
        running = pool.submit(run_faulted, cell.fault, *args, gate=gate, resume=resume,
                              **kwargs)
        if _when(Path(f"{gate}.ready"), running):  # at its gate (else it ended before)
            clock.lap("faulted promote, to its gate")
            hold.go_alone()
            clock.lap("waiting for the stack alone")
            gate.touch()
            if resume is not None and _when(Path(f"{resume}.killed"), running):
                try:
                    clock.lap("faulted promote, to its fault point")
                    traffic = matrix.status_traffic()
                    assert traffic is not None and traffic["live"] is None \
                        and traffic.get("error"), traffic
                    ups.append(matrix.cli("stack", "up", "--json", timeout=300))
                    clock.lap("status, stack up (the run at its point)")
                finally:
                    resume.touch()
        return running.result()


def _run_cell(matrix: Matrix, cell: Cell, clock: Clock) -> None:
    hold = Hold(matrix.turns, alone=False)
    try:
        clock.lap("waiting for the stack alone" if hold.alone else "waiting for a turn")
        _converge(matrix, cell, clock, hold)
    finally:
        hold.release()


def _converge(matrix: Matrix, cell: Cell, clock: Clock, hold: Hold) -> None:
    start = _start(matrix, cell)
    current = start.serving  # None: the fresh stack, nothing released yet
    assert current in matrix.versions or not start.records, start.summary()
    candidate = next(v for v in matrix.versions if v != current)
    if cell.fault.stage == "stage" and any(k.endswith(MANIFEST)
                                           for k in matrix.version_keys(candidate)):
        # a version is staged once: a new one, to half-publish
        candidate = matrix.register(_own_bytes(seed=11))
        assert current is not None, start.summary()  # a staged candidate: released before
        matrix.versions = (current, candidate)
    before_ids = {r.id for r in start.records}
    clock.lap("start")

    extra = APPROVAL if cell.fault.stage == "approval" else ()
    ups: list[subprocess.CompletedProcess[str]] = []
    launched = time.time()
    try:
        run = _faulted_run(matrix, cell, hold, matrix.promote(candidate, *extra, cell=cell),
                           clock, ups)
    finally:  # the killed dependency comes back, whatever the run did
        ended = time.time()
        clock.lap("faulted promote")
        if cell.fault.component is not None and not ups:
            hold.go_alone()  # (already, unless the run ended before its fault point)
            ups.append(matrix.cli("stack", "up", "--json", timeout=300))
            clock.lap("stack up")
    assert [i["stage"] for i in run.injected] == [cell.fault.stage], run.describe()
    for up in ups:
        doc = json_document(up.stdout) or {}
        assert up.returncode == 0, (up.stdout[-2000:], up.stderr[-3000:])
        assert cell.fault.component in doc.get("startup", {}).get("restarted", []), doc
        assert not dead_components(matrix.home), dead_components(matrix.home)
        # the component is back: the rest of the cell touches its own model only
        hold.go_shared()
        clock.lap("waiting for a shared turn")

    # the faulted run: ended as it must; its record (if it ended) says what serves
    mid = matrix.observe()
    (faulted,) = [r.id for r in mid.records if r.id not in before_ids and r.kind == "promote"]
    clock.notes.append(timeline(mid.record(faulted), launched, ended, run.result))
    clock.notes.extend(f"  stack up: {up.returncode}{cpu(up)}" for up in ups)
    _check_faulted_exit(run, mid, faulted)
    _check_left_behind(matrix, cell, mid, faulted)
    _check_record_truth(mid, faulted, run)
    if cell.fault.stage == "stage":  # a blob uploaded, no manifest: no such version yet
        keys = matrix.version_keys(candidate)
        assert not [k for k in keys if k.endswith(MANIFEST)], keys
    if cell.progressive:
        _check_split(matrix, cell, run, faulted)
    clock.lap("observe")
    # status is true: non-zero exactly while something disagrees (the CLI once per fault
    # kind, once in the file by its console script; the function it calls otherwise)
    by_cli = cell.id in STATUS_BY_CLI
    console = "status" in cell.console
    code, doc = matrix.status(cli=by_cli, console=console)
    wrong = disagreements(mid)
    assert (code == 0) == (not wrong), (
        f"status exit {code} while the observed disagreements are {wrong}", doc,
        mid.summary(), run.describe())
    clock.lap("status (console script)" if console else "status (cli)" if by_cli else "status")

    # the next command converges
    if cell.next_command == "promote":  # the rerun, no approval asked again
        after_args = matrix.promote(candidate, cell=cell)
    else:  # the model's policy, as its releases' (the console script's: the default)
        console = "rollback" in cell.console
        after_args = ["rollback", matrix.model, "--json",
                      *(() if console else ("--policy", str(matrix.policy(cell, rollback=True))))]
    console = cell.next_command in cell.console
    launched = time.time()
    nxt = matrix.cli(*after_args, timeout=600, console=console)
    ended = time.time()
    assert nxt.returncode == 0, (cell.next_command, nxt.stdout[-3000:], nxt.stderr[-3000:],
                                 mid.summary(), run.describe())
    clock.lap(f"{cell.next_command} (console script)" if console else cell.next_command)
    end = matrix.observe()
    new = [r for r in end.records if r.id not in before_ids]
    clock.notes.extend(timeline(r, launched, ended, nxt) for r in new
                       if r.id not in {m.id for m in mid.records})
    problems = disagreements(end) + story_breaks(new, end.serving, start=current) + \
        loose_ends(end)
    assert not problems, (problems, end.summary(), run.describe())
    _check_found(cell, end, faulted, new)
    if cell.next_command == "promote":  # the release went on to the candidate
        assert end.serving == candidate, end.summary()
        assert end.aliases.get("previous") == current, end.summary()
    if cell.fault.stage == "stage":  # the rerun published it once, manifest last
        assert sum(k.endswith(MANIFEST) for k in matrix.version_keys(candidate)) == 1
    code, doc = matrix.status(cli=False)
    assert code == 0, doc
    clock.lap("observe+status")
    if end.serving is not None:
        matrix.released.append(end.serving)
    matrix.settled = end
