"""The fault matrix: every way a release can stop ends in one true, converged state.

**Not collected yet** (the name does not start with ``test_``; ``pytest
tests/e2e/fault_matrix.py`` runs it). Green on the tree with issue 18's fixes, session 18
(load 4-20 on 2 cores): sigkill-check, sigkill-swap, sigterm-bake, sigint-swap,
mlflow-record, s3-swap, s3-bake, prefect-bake; sigkill-stage, sigkill-canary and
sigterm-approval failed on harness/oracle/product faults fixed since (40bb268, 8e717ce) and
were not re-run; the other cells were not reached. To enable it: run it whole, and ``git
mv`` it over ``tests/e2e/test_crash.py`` (its kill points are all cells here).

Each cell is one fault at one stage of a real ``modelship promote`` (DESIGN §2 item 10;
issue 18 item 6):

- **faults**: SIGKILL, SIGTERM and SIGINT of the CLI, delivered by the process to itself at
  the stage's point, so the product's own handlers run exactly there; the SIGKILL of
  MLflow, S3 (SeaweedFS) or Prefect, whole process group, at the stage's point, with the
  release going on without it and ``modelship stack up`` restarting it once the CLI ended
  (``tests/faults.py`` injects; nothing in the product knows a test);
- **stages**: check (the trial model answered), stage (the first blob uploaded, the
  manifest not), canary (candidate and baseline loaded), the approval wait, swap (one
  replica switched, batching paused, the other in flight), bake (the fleet serves the
  candidate) and record (the bake passed).

After each fault: the faulted run ended as it must (SIGKILL: killed; a signal: 128 + the
signal, or 0 when it finished a release that had passed its bake; an outage: on its own,
with one JSON document on stdout and no traceback), and its record, if it ended, says what
serves. ``modelship status`` is true: non-zero exactly while the observed state has a
disagreement (:func:`tests.faults.disagreements`: replicas, batching, the pin, the
``production`` alias, the newest record, an unfinished record, a held lock). Then the next
command (``promote`` again, or a plain ``rollback``) exits 0 and everything converges: the
fleet, the pin and the alias agree, the version carries its release tag, the ledger tells
one continuous story with no record ``running`` or ``incomplete`` (a killed run ends
``interrupted``, its approval request closed), nothing is left on the canary, ``status``
exits 0 and no lock is wedged (:func:`tests.faults.wedged`: a lock whose holder is verified
dead, such as a killed canary's slot, is taken over by the next taker at once).

**Which cells.** 6 faults x 7 stages is 42 cells; these 19 are the ones whose code paths
differ:

- SIGKILL (no handler runs; the next command finds a dead run) at every kill point of the
  former SIGKILL chain: check (a trial model left on the canary), stage (a half-published
  version: a blob, no manifest; the rerun publishes it), canary (the candidate left on the
  canary, the lock held), approval (a pending approval and a kept canary candidate), swap
  (a half-switched fleet, batching paused), bake (an unbaked swap) and record (a baked,
  unrecorded release: past its point of no return, to be finished, not undone).
- SIGTERM (a pod stop, a Prefect cancel) at every stage but staging: each stage's own way
  out.
- SIGINT (Ctrl-C) at the swap (the signal arrives while worker threads switch replicas,
  issue 18 item 3) and the bake. Elsewhere SIGINT takes SIGTERM's path (both become
  ``StopRequested``).
- MLflow down at the record, the one stage after the swap that needs it: the aliases
  cannot move, so the release is ``incomplete`` until the next command finishes it (issue
  18 item 4). Down before the swap it is an ordinary failed release.
- S3 (the ledger, the pin, the release lock, the model repository) down mid-swap (the
  second replica cannot load and the abort cannot either) and at the bake (the release
  passes its bake but cannot record it, item 5).
- Prefect (the flow run's bookkeeping) down at the bake (items 1 and 6): the release must
  end on its own, and no lock may be wedged once Prefect is back.

The next command is mostly a plain ``rollback``, which must first finish or undo the dead
or incomplete run (issue 18 item 2) and is cheap; ``promote`` reruns the release after the
killed staging and approval wait, and finishes the releases stopped at or past their
record (a no-op on the fleet that must repair the aliases and tags).

**Cost.** The cells share one stack of their own (faults kill parts of it, so not the
session's) and one model whose versions take turns: each cell promotes the version that
does not serve (the staging cell registers one more). The policy is the smallest that
still runs every stage: one threshold gate (the canary stops after its first window of
100 requests), a 2-s bake on errors alone (a 1-s reference is below two windows, so no
latency rule).
"""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from modelship.clients import build_clients
from modelship.locks import list_locks
from modelship.settings import Settings
from tests import models
from tests.conftest import ROOT, RUNTIME_VENV, cli_env, run_cli
from tests.faults import (
    Fault,
    FaultedRun,
    Observation,
    disagreements,
    json_document,
    loose_ends,
    observe,
    own_stack,
    run_faulted,
    story_breaks,
)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

MODEL = "fault-matrix"
POLICY: dict[str, Any] = {
    # The matrix is about the ways out, not the gates: one threshold rule needs only
    # min_samples, so the canary ends after its first window.
    "canary": {"warmup_s": 0.3, "window_s": 1.0, "stability_pct": 100.0,
               "max_duration_s": 8.0, "min_samples": 100},
    "gates": [
        {"name": "error_rate", "metric": "error_rate", "test": "threshold", "max": 0.01},
    ],
    "bake": {"duration_s": 2.0, "window_s": 1.0, "baseline_s": 1.0,
             "max_latency_increase_pct": 400.0},
}
MANIFEST = "/release.json"
APPROVAL = ("--require-approval", "--approvers", "U0FAULTAPPROVER")
#: A faulted run ends within this (issue 18 item 4: bounded exits with a dependency down).
FAULTED_TIMEOUT_S = 300.0


@dataclass(frozen=True)
class Cell:
    """One fault at one stage, and the command that must converge after it."""

    fault: Fault
    next_command: str  # "promote" (the rerun) or "rollback"

    @property
    def id(self) -> str:
        return f"{self.fault.id}-then-{self.next_command}"


def _cell(kind: str, stage: str, next_command: str) -> Cell:
    return Cell(Fault(kind, stage), next_command)


CELLS = [
    _cell("sigkill", "check", "rollback"),
    _cell("sigkill", "stage", "promote"),
    _cell("sigkill", "canary", "rollback"),
    _cell("sigkill", "approval", "promote"),
    _cell("sigkill", "swap", "rollback"),
    _cell("sigkill", "bake", "rollback"),
    _cell("sigkill", "record", "promote"),
    _cell("sigterm", "check", "rollback"),
    _cell("sigterm", "canary", "rollback"),
    _cell("sigterm", "approval", "rollback"),
    _cell("sigterm", "swap", "rollback"),
    _cell("sigterm", "bake", "rollback"),
    _cell("sigterm", "record", "promote"),
    _cell("sigint", "swap", "rollback"),
    _cell("sigint", "bake", "rollback"),
    _cell("mlflow", "record", "promote"),
    _cell("s3", "swap", "rollback"),
    _cell("s3", "bake", "promote"),
    _cell("prefect", "bake", "rollback"),
]


@dataclass
class Matrix:
    settings: Settings
    policy: Path
    versions: tuple[int, int]
    workdir: Path
    settled: Observation | None = None  # what the last cell that passed ended in

    @property
    def home(self) -> Path:
        return self.settings.home

    def cli(self, *args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        return run_cli(*args, home=self.home, timeout=timeout)

    def locks(self) -> list[dict[str, Any]]:
        """The model's held locks (its release lock, a canary slot held for it), as
        ``modelship locks`` lists them."""
        clients = build_clients(self.settings)
        try:
            rows = list_locks(storage=clients.storage, home=self.home)
        finally:
            clients.close()
        return [row for row in rows if row.get("model") == MODEL]

    def version_keys(self, version: int) -> list[str]:
        """The objects under the version's folder of the model repository."""
        clients = build_clients(self.settings)
        try:
            assert clients.storage is not None
            return list(clients.storage.list_keys(
                f"{self.settings.repository_prefix}/{MODEL}/{version}/"))
        finally:
            clients.close()

    def observe(self) -> Observation:
        return observe(self.settings, MODEL, locks=self.locks)

    def promote(self, version: int, *extra: str) -> list[str]:
        return ["promote", MODEL, "--version", str(version), "--policy", str(self.policy),
                "--json", *extra]


@pytest.fixture(scope="module")
def matrix(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    """A 2-replica stack of its own, and MODEL released twice (v_a, then v_b), so that
    either version has one that served before it."""
    home = tmp_path_factory.mktemp("faults") / ".modelship"
    workdir = tmp_path_factory.mktemp("fault-marks")
    started = time.monotonic()
    with own_stack(home, RUNTIME_VENV, replicas=2) as settings:
        print(f"stack up: {time.monotonic() - started:.1f} s")
        uri = str(settings.mlflow_tracking_uri)
        policy = models.write_policy(workdir / "policy.yaml", POLICY)
        v_a = models.register_onnx(uri, MODEL, models.sklearn_onnx(seed=0))
        v_b = models.register_onnx(uri, MODEL, models.sklearn_onnx(seed=7))
        here = Matrix(settings, policy, (v_a, v_b), workdir)
        for version in (v_a, v_b):
            began = time.monotonic()
            done = here.cli(*here.promote(version), timeout=600)
            assert done.returncode == 0, done.stderr[-3000:]
            print(f"promote v{version}: {time.monotonic() - began:.1f} s")
        yield here


# --------------------------------------------------------------------------------------
# the cells


def _check_faulted_exit(run: FaultedRun, obs: Observation, release_id: str) -> None:
    """The faulted CLI ended as its fault says it must."""
    code, fault = run.result.returncode, run.fault
    if fault.signal == signal.SIGKILL:
        assert code == -signal.SIGKILL, run.describe()
        return
    # every other way out is reported, never a traceback (issue 18 item 4)
    assert "Traceback (most recent call last)" not in run.result.stderr, run.describe()
    assert json_document(run.result.stdout) is not None, run.describe()
    record = obs.record(release_id)
    if fault.signal is not None:
        assert code in (128 + fault.signal, record.exit_code), run.describe()
        assert code != 0 or record.status == "released", run.describe()
    else:
        assert code >= 0, run.describe()  # not killed: it ended on its own, in time


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


def _start(matrix: Matrix) -> Observation:
    """The state a cell starts from: converged. A cell that failed before may have left
    it otherwise (even a dependency down); then the stack is brought up and the version
    that should serve is promoted again (any command finishes what a dead run left), so
    that one failing cell does not fail the ones after it."""
    settled, matrix.settled = matrix.settled, None
    try:
        obs = settled or matrix.observe()
        if not disagreements(obs) and not loose_ends(obs):
            return obs
        inherited = obs.summary()
    except Exception as exc:  # noqa: BLE001 - healed below, and said if it cannot be
        inherited = f"not observable: {type(exc).__name__}: {exc}"
    matrix.cli("stack", "up", "--json", timeout=300)
    obs = matrix.observe()
    version = obs.aliases.get("production") or obs.serving or matrix.versions[0]
    matrix.cli(*matrix.promote(version), timeout=600)
    obs = matrix.observe()
    if disagreements(obs):
        pytest.fail(f"an earlier cell left the state unconverged and it could not be "
                    f"healed: {disagreements(obs)}; inherited: {inherited}")
    return obs


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_a_fault_at_a_stage_converges_on_the_next_command(matrix: Matrix, cell: Cell) -> None:
    start = _start(matrix)
    current = start.serving
    assert current in matrix.versions, start.summary()
    candidate = next(v for v in matrix.versions if v != current)
    if cell.fault.stage == "stage":  # a version is staged once: a new one, to half-publish
        candidate = models.register_onnx(str(matrix.settings.mlflow_tracking_uri), MODEL,
                                         models.sklearn_onnx(seed=11))
        matrix.versions = (current, candidate)
    before_ids = {r.id for r in start.records}

    extra = APPROVAL if cell.fault.stage == "approval" else ()
    try:
        run = run_faulted(cell.fault, *matrix.promote(candidate, *extra),
                          env=cli_env(matrix.home), cwd=ROOT, workdir=matrix.workdir,
                          timeout_s=FAULTED_TIMEOUT_S)
    finally:  # the killed dependency comes back, whatever the run did
        up = matrix.cli("stack", "up", "--json", timeout=300) \
            if cell.fault.component is not None else None
    assert [i["stage"] for i in run.injected] == [cell.fault.stage], run.describe()
    if up is not None:
        doc = json_document(up.stdout) or {}
        assert up.returncode == 0, (up.stdout[-2000:], up.stderr[-3000:])
        assert cell.fault.component in doc.get("startup", {}).get("restarted", []), doc

    # the faulted run: ended as it must; its record (if it ended) says what serves
    mid = matrix.observe()
    (faulted,) = [r.id for r in mid.records if r.id not in before_ids and r.kind == "promote"]
    _check_faulted_exit(run, mid, faulted)
    _check_record_truth(mid, faulted, run)
    if cell.fault.stage == "stage":  # a blob uploaded, no manifest: no such version yet
        keys = matrix.version_keys(candidate)
        assert not [k for k in keys if k.endswith(MANIFEST)], keys
    # status is true: non-zero exactly while something disagrees
    status = matrix.cli("status", MODEL, "--json", timeout=120)
    wrong = disagreements(mid)
    assert (status.returncode == 0) == (not wrong), (
        f"status exit {status.returncode} while the observed disagreements are {wrong}",
        status.stdout[-3000:], status.stderr[-2000:], mid.summary(), run.describe())

    # the next command converges
    if cell.next_command == "promote":  # the rerun, no approval asked again
        after_args = matrix.promote(candidate)
    else:
        after_args = ["rollback", MODEL, "--json"]
    nxt = matrix.cli(*after_args, timeout=600)
    assert nxt.returncode == 0, (cell.next_command, nxt.stdout[-3000:], nxt.stderr[-3000:],
                                 mid.summary(), run.describe())
    end = matrix.observe()
    new = [r for r in end.records if r.id not in before_ids]
    problems = disagreements(end) + story_breaks(new, end.serving, start=current) + \
        loose_ends(end)
    assert not problems, (problems, end.summary(), run.describe())
    assert end.record(faulted).pending_approvals == 0, end.record(faulted)
    if cell.fault.stage == "stage":  # the rerun published it, manifest last
        assert any(k.endswith(MANIFEST) for k in matrix.version_keys(candidate))
    status = matrix.cli("status", MODEL, "--json", timeout=120)
    assert status.returncode == 0, (status.stdout[-3000:], status.stderr[-2000:])
    matrix.settled = end
