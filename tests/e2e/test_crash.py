"""The crash matrix: SIGKILL the promote process at each stage boundary, rerun, converge.

The release is killed in turn during the trial load, after check, mid-staging, during the
canary, mid-swap and during the bake. Each rerun is the next killed run: it must find the
dead run (same host, pid gone), take the model's lock (from the runs killed holding it,
at once: their process on this host is gone, so no lease has to run out and nothing here
unlocks by hand), mark it ``interrupted``, and
clean up after it (unload canary and trial models, put a half-swapped fleet back on what
served). The last rerun releases. Then: no trial or canary model loaded, the version
published exactly once with a verifying manifest, the fleet consistent, the aliases equal
to what serves, and the ledger telling the whole story.

The kill points are injected into the real ``modelship`` CLI process (a wrapper that
patches one function to SIGKILL its own process), so nothing in the product knows a test.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from modelship.clients import build_clients
from modelship.ledger import Ledger
from modelship.settings import Settings
from tasks.recovery import loaded_models
from tests import models
from tests.conftest import ROOT, RUNTIME_VENV, run_cli

# Eight promotions, seven of them killed: past the 600 s default on a busy machine.
pytestmark = [pytest.mark.e2e, pytest.mark.timeout(1200)]

MODEL = "crash-matrix"
POLICY: dict[str, Any] = {
    "canary": {"warmup_s": 0.5, "window_s": 2.0, "max_duration_s": 8.0, "min_samples": 200},
    "gates": [
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01},
    ],
    "bake": {"duration_s": 2.0, "window_s": 1.0, "baseline_s": 1.0,
             "max_latency_increase_pct": 400.0},
}

# Runs `modelship ARGS...` with one function patched to SIGKILL this very process.
HARNESS = textwrap.dedent("""
    import os, signal, sys, threading

    def die(*_args, **_kwargs):
        os.kill(os.getpid(), signal.SIGKILL)

    point = os.environ["CRASH_AT"]
    if point == "check":          # the trial model is loaded and has answered
        import tasks.trial_load as module
        module.compare_outputs = die
    elif point == "after-check":  # check passed; staging is about to begin
        import tasks.prefect_tasks as module
        module.stage_checked = die
    elif point == "stage":        # the first file is uploaded, the manifest is not
        from modelship.storage import S3Storage
        upload = S3Storage.upload_file_parts
        def upload_then_die(self, *args, **kwargs):
            upload(self, *args, **kwargs)
            die()
        S3Storage.upload_file_parts = upload_then_die
    elif point == "canary":       # the candidate and baseline are loaded on the canary
        import tasks.canary as module
        ready = module._wait_ready
        def ready_then_die(*args, **kwargs):
            ready(*args, **kwargs)
            die()
        module._wait_ready = ready_then_die
    elif point == "approve":      # the approval request is recorded and posted; it waits
        import tasks.approve as module
        post = module._post_request
        def post_then_die(*args, **kwargs):
            post(*args, **kwargs)
            die()
        module._post_request = post_then_die
    elif point == "swap":         # batching paused on both replicas, one switched
        from modelship.triton.client import TritonServer
        load, calls, lock = TritonServer.load_model, [], threading.Lock()
        def load_then_maybe_die(self, *args, **kwargs):
            if not str(self.name).startswith("triton-"):
                return load(self, *args, **kwargs)
            with lock:
                calls.append(self.name)
                n = len(calls)
            if n >= 4:                # the other replica's switch is never sent
                threading.Event().wait()
            result = load(self, *args, **kwargs)
            if n == 3:
                die()
            return result
        TritonServer.load_model = load_then_maybe_die
    elif point == "bake":         # the fleet serves the candidate; the bake begins
        import tasks.bake as module
        module.watch = die
    from modelship.cli import main
    sys.argv = ["modelship", *sys.argv[1:]]
    main()
""")


def _env(settings: Settings, crash_at: str) -> dict[str, str]:
    keep = {k: v for k, v in os.environ.items()
            if not k.startswith(("MODELSHIP_", "MLFLOW_TRACKING", "AWS_", "PREFECT_API"))}
    return {**keep, "MODELSHIP_HOME": str(settings.home),
            "MODELSHIP_TRITON_RUNTIME": str(RUNTIME_VENV), "CRASH_AT": crash_at}


def _promote(settings: Settings, policy: Path, version: int, crash_at: str,
             *extra: str) -> subprocess.CompletedProcess[str]:
    """One run, never refused: a killed run's lock is taken over, not waited out."""
    return subprocess.run(
        [sys.executable, "-c", HARNESS, "promote", MODEL, "--version", str(version),
         "--policy", str(policy), "--json", *extra], capture_output=True, text=True,
        env=_env(settings, crash_at), cwd=ROOT, timeout=600)


def _ledger(settings: Settings) -> Ledger:
    clients = build_clients(settings)
    assert clients.storage is not None
    return Ledger(clients.storage)


def _canary_models(settings: Settings) -> list[str]:
    clients = build_clients(settings)
    assert clients.canary is not None
    return loaded_models(clients.canary)


def test_killed_at_every_stage_the_rerun_converges(stack_settings: Settings,
                                                    tmp_path: Path) -> None:
    uri = str(stack_settings.mlflow_tracking_uri)
    policy = models.write_policy(tmp_path / "policy.yaml", POLICY)
    v1 = models.register_onnx(uri, MODEL, models.sklearn_onnx(seed=0))
    v2 = models.register_onnx(uri, MODEL, models.sklearn_onnx(seed=7))
    first = run_cli("promote", MODEL, "--version", str(v1), "--policy", str(policy), "--json",
                    home=stack_settings.home, timeout=600)
    assert first.returncode == 0, first.stderr[-3000:]
    ledger = _ledger(stack_settings)
    storage = ledger.storage
    version_prefix = f"{stack_settings.repository_prefix}/{MODEL}/{v2}/"

    killed: list[tuple[str, str]] = []  # (crash point, the stage its record stopped in)
    for point, stage in [("check", "check"), ("after-check", "stage"), ("stage", "stage"),
                         ("canary", "canary"), ("approve", "approve"), ("swap", "swap"),
                         ("bake", "bake")]:
        # the approve run needs an approval: killed while it waits, the candidate kept
        # loaded on the canary for the watcher
        extra = ("--require-approval", "--approvers", "U0CRASHAPPROVER") \
            if point == "approve" else ()
        done = _promote(stack_settings, policy, v2, point, *extra)
        assert done.returncode == -signal.SIGKILL, (point, done.returncode,
                                                    done.stdout[-2000:], done.stderr[-3000:])
        newest = ledger.records(MODEL)[0]
        assert newest.status == "running" and newest.stages[-1].name == stage, (
            point, [(s.name, s.outcome) for s in newest.stages])
        killed.append((point, newest.id))
        if point == "check":
            assert any(n.startswith(f"_trial_{MODEL}_v{v2}") for n in
                       _canary_models(stack_settings))
        if point == "stage":  # half-published: files, but no manifest, so no version
            keys = storage.list_keys(version_prefix)
            assert keys and not any(k.endswith("release.json") for k in keys), keys
        if point in ("canary", "approve"):
            assert MODEL in _canary_models(stack_settings)
        if point == "approve":
            assert newest.approvals and newest.approvals[0]["status"] == "pending"
        if point == "swap":
            status = json.loads(run_cli("status", MODEL, "--json",
                                        home=stack_settings.home).stdout)
            assert not status["consistent"], status  # mixed or paused: the next run heals

    final = _promote(stack_settings, policy, v2, "never")
    assert final.returncode == 0, final.stderr[-4000:]
    record = json.loads(final.stdout)
    assert record["status"] == "released" and record["from_version"] == v1
    recover = next(s for s in record["stages"] if s["name"] == "recover")
    assert recover["details"]["interrupted"] == [killed[-1][1]]
    assert recover["details"]["fleet"]["ok"] is True  # the bake-killed swap was undone first

    # Every killed run is on record as interrupted, at the stage it died in.
    by_id = {r.id: r for r in ledger.records(MODEL)}
    for point, release_id in killed:
        dead = by_id[release_id]
        assert dead.status == "interrupted" and dead.exit_code == 1, (point, dead.status)
        assert "died" in (dead.reason or "")
    # Each rerun cleaned up after the run before it.
    recovered = {s.details.get("interrupted", [None])[0]: s.details
                 for r in by_id.values() for s in r.stages if s.name == "recover"}
    assert any(n.startswith(f"_trial_{MODEL}") for n in recovered[killed[0][1]]["unloaded"])
    assert MODEL in recovered[killed[3][1]]["unloaded"]           # the canary's model
    assert MODEL in recovered[killed[4][1]]["unloaded"]           # kept for the approval
    # and its approval request is closed: a late click is refused, nothing waits for it
    assert by_id[killed[4][1]].approvals[0]["status"] == "interrupted"
    assert recovered[killed[5][1]]["fleet"]["to_version"] == v1    # mid-swap: back to v1
    # The runs killed holding the lock (canary, approve, swap, bake) had it taken over.
    takeovers = [n for r in by_id.values() for n in r.notes if "took over the release lock" in n]
    assert {release_id for _, release_id in killed[3:]} <= {
        release_id for release_id in by_id if any(release_id in n for n in takeovers)}

    # Converged: nothing left on the canary, one verified version, the fleet and aliases agree.
    assert not [n for n in _canary_models(stack_settings)
                if n == MODEL or n.startswith(f"_trial_{MODEL}")]
    keys = storage.list_keys(version_prefix)
    assert sum(k.endswith("release.json") for k in keys) == 1
    status = json.loads(run_cli("status", MODEL, "--json", home=stack_settings.home).stdout)
    assert status["consistent"] and status["production_version"] == v2
    assert status["aliases"]["production"] == v2 and status["aliases"]["previous"] == v1
    locks = json.loads(run_cli("locks", MODEL, "--json", home=stack_settings.home).stdout)
    assert not [lock for lock in locks["locks"] if lock.get("holder_alive")]
