"""`modelship promote | history | rollback | locks | unlock` on the session's stack: the
release as one Prefect flow run, its record, its Slack thread.

Most commands run in the test process, through the function the console script runs
(:func:`tests.inprocess.run_inprocess`); the console script stays for the contract of
promote (the dry-run's exit code and JSON plan), of the ledger (``history --json``) and of
a refused unlock (exit 1; the last two start in 2-3 s), and for one of the two releases
racing for one lock, so that two processes race (its exit code and JSON document: a
record or a lock error). Promote's error document and rollback's refusal are the
console's elsewhere: every command's exit and error document against dependencies that
are down in tests/integration/test_exits.py, rollback in tests/e2e/test_fleet_cli.py.

The canary is the subject of two releases only (an identical version passes the p95 rule,
a slower one fails it: :data:`POLICY`); every other release runs :data:`QUICK`, a canary
that stops as soon as its error rule has its samples, since what it proves happens before
(the lock) or after it (Slack, the bake, the rollback).
"""

from __future__ import annotations

import json
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelship.clients import build_clients
from modelship.locks import release_lock
from modelship.settings import Settings
from tests import models
from tests.conftest import run_cli, start_cli
from tests.e2e import live_clients
from tests.inprocess import beside, run_inprocess
from tests.integration.test_canary import slow_onnx_graph

pytestmark = pytest.mark.e2e

MODEL = "cli-promote"
POLICY: dict[str, Any] = {
    # The canary stops as soon as the gates have their samples; the long ceiling is for the
    # slow candidate on a busy machine, which must fail its gates, not run out of time.
    # The gates are sized for what this file asserts (a candidate several times slower is
    # rejected, an identical one passes), not for the tightest regression: the p95 rule
    # plans 620 requests per version (the p99 rule 3,100: 53 s of canary beside another
    # worker), and the error rule, sized to catch 3% errors rather than 2%, 315 (982). The
    # p99 rule's plan and power are tested in tests/integration/test_canary.py and the units.
    # Windows count as stable at once (stability_pct 100; the stability round itself is
    # tested in test_canary.py): at the default 10% a busy machine held the first round to
    # its cap, 48 of a 51-55 s canary (the slow candidate's, the Slack-down release's).
    "canary": {"warmup_s": 1.0, "window_s": 2.0, "stability_pct": 100.0,
               "max_duration_s": 120.0, "min_samples": 300},
    "gates": [
        {"name": "latency_p95", "metric": "latency_p95_ms", "test": "quantile",
         "max_increase_pct": 15.0, "min_effect_ms": 1.0, "effect": 185.0},
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01,
         "effect": 0.02},
        {"name": "agreement", "metric": "agreement", "test": "threshold", "min": 0.98},
    ],
    "bake": {"duration_s": 4.0, "window_s": 2.0, "baseline_s": 2.0,
             "max_latency_increase_pct": 400.0},
}

#: The releases whose subject is not the canary: one error rule sized to catch 4% errors
#: (179 requests, so min_samples decides), agreement, 1-s windows that count as stable at
#: once (``stability_pct`` 100: the first three windows end the stability round). A
#: canary still runs on the canary Triton and its gates are still judged.
QUICK: dict[str, Any] = {
    **POLICY,
    "canary": {"warmup_s": 0.5, "window_s": 1.0, "stability_pct": 100.0,
               "max_duration_s": 30.0, "min_samples": 200},
    "gates": [
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01,
         "effect": 0.03},
        {"name": "agreement", "metric": "agreement", "test": "threshold", "min": 0.98},
    ],
}


def _promote(settings: Settings, policy: Path, *args: str, code: int,
             env: dict[str, str] | None = None,
             run: Callable[..., subprocess.CompletedProcess[str]] = run_inprocess
             ) -> dict[str, Any]:
    """``modelship promote`` in-process, or through the console script with ``run=run_cli``."""
    done = run("promote", MODEL, *args, "--policy", str(policy), "--json",
               home=settings.home, env=env, timeout=600)
    assert done.returncode == code, done.stderr[-4000:]
    doc = json.loads(done.stdout)
    return doc.get("details", {}).get("record", doc) if "error" in doc else doc


def _json(*args: str, settings: Settings) -> Any:
    """A reporting command's JSON document, in-process."""
    return json.loads(run_inprocess(*args, "--json", home=settings.home).stdout)


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def _post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


@pytest.fixture(scope="module")
def policy(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_policy(tmp_path_factory.mktemp("promote") / "policy.yaml", POLICY)


@pytest.fixture(scope="module")
def quick(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_policy(tmp_path_factory.mktemp("promote") / "quick.yaml", QUICK)


def test_promote_releases_rejects_and_rolls_back_by_the_ledger(
        stack_settings: Settings, policy: Path, quick: Path, tmp_path: Path) -> None:
    uri = str(stack_settings.mlflow_tracking_uri)
    base = models.onnx_graph("softmax")
    v1 = models.register_onnx(uri, MODEL, base)
    v2 = models.register_onnx(uri, MODEL, base)
    # several times slower (bake_traffic's graph; a quarter of test_canary's to check)
    v3 = models.register_onnx(uri, MODEL, slow_onnx_graph(width=512, layers=64))
    bad = models.register_directory(uri, MODEL, models.corrupt_onnx_dir(tmp_path))

    plan = _promote(stack_settings, policy, "--version", str(v1), "--dry-run", code=0,
                    run=run_cli)
    assert plan["status"] == "planned" and plan["plan"]["stages"][3] == "canary"
    assert plan["plan"]["replicas"] == ["triton-0", "triton-1"]
    assert plan["plan"]["canary"]["samples_per_version"] >= 300

    first = _promote(stack_settings, quick, "--version", str(v1), code=0)
    assert first["status"] == "released" and first["from_version"] is None
    assert [s["name"] for s in first["stages"]] == [
        "resolve", "check", "stage", "canary", "gates", "approve", "swap", "bake", "record"]

    second = _promote(stack_settings, policy, "--version", str(v2), code=0)
    assert second["status"] == "released" and second["from_version"] == v1
    assert second["gates"]["verdict"] == "passed" and second["gates"]["baseline"] == v1
    assert set(second["gates"]["report_keys"]) >= {"markdown", "png", "json"}
    assert second["bake"]["outcome"] == "passed" and second["bake"]["windows"]

    slow = _promote(stack_settings, policy, "--version", str(v3), code=4)
    assert slow["status"] == "rejected" and slow["exit_code"] == 4
    assert [s for s in slow["stages"] if s["outcome"] == "failed"][0]["name"] == "gates"
    status = _json("status", MODEL, settings=stack_settings)
    assert status["production_version"] == v2 == status["aliases"]["production"]

    corrupt = _promote(stack_settings, policy, "--version", str(bad), code=3)
    assert corrupt["stages"][-1]["name"] == "check" and corrupt["status"] == "rejected"

    rolled = _json("rollback", MODEL, settings=stack_settings)
    assert rolled["from_version"] == v2 and rolled["to_version"] == v1
    assert rolled["aliases"] == {"production": v1, "previous": v2}

    never = run_inprocess("rollback", MODEL, "--to", str(v3), "--json",
                          home=stack_settings.home)
    assert never.returncode == 2 and "never served" in json.loads(never.stdout)["message"]

    history = json.loads(run_cli("history", MODEL, "--json",
                                 home=stack_settings.home).stdout)["releases"]
    kinds = [(r["kind"], r["to_version"], r["exit_code"]) for r in history]
    assert kinds == [("rollback", v1, 0), ("promote", bad, 3), ("promote", v3, 4),
                     ("promote", v2, 0), ("promote", v1, 0)]
    assert history[2]["gates"]["verdict"] == "failed"

    # One Prefect flow run per promotion, with a task run per stage.
    run_id = second["holder"]["flow_run_id"]
    api = stack_settings.prefect_api_url
    flow_run = _get(f"{api}/flow_runs/{run_id}")
    assert flow_run["name"] == f"promote {MODEL} v{v2}"
    tasks = _post(f"{api}/task_runs/filter", {"flow_runs": {"id": {"any_": [run_id]}}})
    assert {"resolve", "check", "stage", "canary", "gates", "swap", "bake", "record"} <= {
        t["name"].split(" ")[0] for t in tasks}

    # One Slack thread per release: a parent updated in place, one reply per stage.
    messages = _get(f"{stack_settings.slack_api_url}/_emulator/messages")
    messages = messages.get("messages", messages)
    parent = second["slack"]["ts"]
    replies = [m for m in messages if m.get("thread_ts") == parent]
    assert {"canary ok", "swap ok", "bake ok"} <= {m["text"] for m in replies}
    roots = [m for m in messages if m.get("ts") == parent]
    assert roots and "released" in roots[-1]["text"]


def test_a_second_release_is_told_who_holds_the_lock(stack_settings: Settings,
                                                     quick: Path) -> None:
    uri = str(stack_settings.mlflow_tracking_uri)
    version = models.register_onnx(uri, MODEL, models.onnx_graph("softmax"))
    with release_lock(MODEL, storage=build_clients(stack_settings).storage,
                      home=stack_settings.home, release_id="holder-test", kind="promote"):
        locked = _promote(stack_settings, quick, "--version", str(version), code=1)
        assert locked["status"] == "failed" and "holder-test" in locked["reason"]
        shown = _json("locks", MODEL, settings=stack_settings)["locks"]
        assert shown[0]["holder"]["release_id"] == "holder-test"
        assert shown[0]["holder_alive"] is True
        refused = run_cli("unlock", MODEL, "--release", "holder-test", "--json",
                          home=stack_settings.home)
        assert refused.returncode == 1 and "alive" in json.loads(refused.stdout)["message"]


@pytest.fixture(scope="module")
def released_with_slack_down(stack_settings: Settings, quick: Path) -> tuple[int, Any]:
    """A version released with Slack unreachable: its version and record. It is also the
    production a bake breach rolls back to (:func:`test_a_bake_breach_rolls_back_by_itself`)."""
    uri = str(stack_settings.mlflow_tracking_uri)
    version = models.register_onnx(uri, MODEL, models.onnx_graph("softmax"))
    dead = {"MODELSHIP_SLACK_API_URL": "http://127.0.0.1:9/"}
    return version, _promote(stack_settings, quick, "--version", str(version), code=0,
                             env=dead)


def test_slack_down_never_changes_the_outcome(
        released_with_slack_down: tuple[int, Any]) -> None:
    version, record = released_with_slack_down
    assert record["status"] == "released" and record["to_version"] == version
    assert [s["name"] for s in record["stages"]][-3:] == ["swap", "bake", "record"]
    assert any("Slack" in note for note in record["notes"])


#: A poisoned row: its first feature indexes past the end of a one-element table.
POISON = 1e6

#: The bake of a poisoned version: 1-s windows, so the error rule's e-process (one bet per
#: window) reaches its bound in about half the time of 2-s windows (18 of 20 s before);
#: a reference shorter than two windows leaves latency unjudged, as POLICY's does, so the
#: breach is the errors' alone.
BREACH_BAKE: dict[str, Any] = {**POLICY["bake"], "duration_s": 20.0, "window_s": 1.0,
                               "baseline_s": 1.0}
#: The release of a poisoned version: :data:`QUICK`'s canary (the golden rows never trip
#: the poison), then :data:`BREACH_BAKE`.
BREACH: dict[str, Any] = {**QUICK, "bake": BREACH_BAKE}


def poison_onnx_graph(n_features: int = models.N_FEATURES) -> Any:
    """``tests.models.onnx_graph("softmax")``'s answers for every ordinary row, and a runtime
    error (ONNX Runtime's Gather bounds check) for a row whose first feature is ~``POISON``.

    The canary's golden rows never trip it, so the candidate passes its gates; poisoned
    traffic after the swap makes Triton count failures for the new version, as a model that
    breaks on real inputs would.
    """
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(3)  # the same weights as onnx_graph: identical answers
    inits = [
        numpy_helper.from_array(rng.standard_normal((n_features, 3)).astype(np.float32), "W"),
        numpy_helper.from_array(np.array(0, np.int64), "first"),
        numpy_helper.from_array(np.array([POISON / 10], np.float32), "limit"),
        numpy_helper.from_array(np.zeros(1, np.float32), "table"),
        numpy_helper.from_array(np.array([1], np.int64), "axis1"),
    ]
    nodes = [
        helper.make_node("MatMul", ["input", "W"], ["raw"]),
        helper.make_node("Gather", ["input", "first"], ["head"], axis=1),
        helper.make_node("Sub", ["head", "limit"], ["over"]),
        helper.make_node("Relu", ["over"], ["excess"]),
        helper.make_node("Cast", ["excess"], ["index"], to=7),  # int64
        helper.make_node("Gather", ["table", "index"], ["zero"], axis=0),
        helper.make_node("Unsqueeze", ["zero", "axis1"], ["column"]),
        helper.make_node("Add", ["raw", "column"], ["logits"]),
        helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1),
        helper.make_node("ArgMax", ["probabilities"], ["label"], axis=1, keepdims=0),
    ]
    return models.classifier_graph(nodes, inits, name="poison_candidate",
                                   n_features=n_features)


def _send_poison(http_url: str, model: str = MODEL) -> bool:
    """One poisoned request; True when Triton answered it with an error."""
    row = [POISON] + [0.0] * (models.N_FEATURES - 1)
    body = {"inputs": [{"name": "input", "shape": [1, models.N_FEATURES],
                        "datatype": "FP32", "data": row}]}
    request = urllib.request.Request(f"{http_url}/v2/models/{model}/infer",
                                     data=json.dumps(body).encode(), method="POST",
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=5):
            return False
    except urllib.error.HTTPError:
        return True
    except OSError:
        return False


def _start_promote(settings: Settings, policy: Path, version: int,
                   model: str = MODEL) -> subprocess.Popen[str]:
    return start_cli("promote", model, "--version", str(version), "--policy", str(policy),
                     "--json", home=settings.home)


def _poison_during_bake(settings: Settings, policy: Path, model: str,
                        version: int) -> tuple[int, Any]:
    """Promote ``version`` (in-process) and, once every replica serves it, flood it with
    poisoned rows from a thread beside the release until the release ends.

    This CPU runtime (ONNX Runtime behind pytriton's backend stub) does not count a backend
    error in ``nv_inference_request_failure``, so the bake sees the breach the way its probe
    does: the dynamic batcher puts probe rows in the same batch as poisoned ones, and the
    whole batch fails. Four senders per replica keep poisoned rows in most batches.
    """
    counts = {"sent": 0, "failed": 0}
    lock = threading.Lock()

    def poison_once_serving(done: threading.Event) -> None:
        def flood(url: str) -> None:
            while not done.is_set():
                failed = _send_poison(url, model)
                with lock:
                    counts["sent"] += 1
                    counts["failed"] += failed

        if not live_clients.when_serving(settings, model, done, version):
            return
        urls = [url for url in live_clients.replica_urls(settings) for _ in range(4)]
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            list(pool.map(flood, urls))

    with beside(poison_once_serving) as poisoning:
        done = run_inprocess("promote", model, "--version", str(version), "--policy",
                             str(policy), "--json", home=settings.home)
    poisoning.result()
    result = _record(done.returncode, done.stdout, done.stderr)
    assert counts["failed"] > 0, f"no poisoned request reached v{version} ({counts})"
    return result


def _finished(process: subprocess.Popen[str], timeout: float = 600) -> tuple[int, Any]:
    out, err = process.communicate(timeout=timeout)
    return _record(process.returncode, out, err)


def _record(code: int, out: str, err: str) -> tuple[int, Any]:
    doc = json.loads(out) if out.strip() else {"stderr": err[-4000:]}
    return code, doc.get("details", {}).get("record", doc)


def test_a_bake_breach_rolls_back_by_itself(
        stack_settings: Settings, released_with_slack_down: tuple[int, Any],
        tmp_path: Path) -> None:
    base, _ = released_with_slack_down  # production now, the rollback's target
    assert _json("status", MODEL, settings=stack_settings)["production_version"] == base
    uri = str(stack_settings.mlflow_tracking_uri)
    poison = models.register_onnx(uri, MODEL, poison_onnx_graph())
    policy = models.write_policy(tmp_path / "bake.yaml", BREACH)

    # The swap is done when every replica serves the poisoned version; then the bake
    # watches it, and real traffic that trips it arrives.
    code, record = _poison_during_bake(stack_settings, policy, MODEL, poison)
    assert code == 4, record.get("bake")
    assert record["status"] == "rolled_back" and record["bake"]["outcome"] == "breach"
    assert "error rate" in record["bake"]["reason"]
    assert record["bake"]["rolled_back"]
    status = _json("status", MODEL, settings=stack_settings)
    assert status["consistent"] and status["production_version"] == base
    assert status["aliases"]["production"] == base  # the alias moves last: it never moved
    latest = _json("history", MODEL, settings=stack_settings)["releases"][0]
    assert (latest["to_version"], latest["status"], latest["exit_code"]) == \
        (poison, "rolled_back", 4)


def _flow_run_started(settings: Settings, name: str, process: subprocess.Popen[str],
                      timeout_s: float = 300) -> None:
    """Wait until the console script's release has its Prefect flow run (its imports are
    done and its record is about to open); fail if the process ended first."""
    deadline = time.monotonic() + timeout_s
    while not _post(f"{settings.prefect_api_url}/flow_runs/filter",
                    {"flow_runs": {"name": {"any_": [name]}}}):
        assert process.poll() is None, _finished(process, timeout=30)
        assert time.monotonic() < deadline, f"no flow run {name!r} after {timeout_s:g} s"
        time.sleep(0.2)


def test_two_concurrent_promotions_of_one_model_one_proceeds(
        stack_settings: Settings, tmp_path: Path) -> None:
    """Two processes race for the model's release lock: the console script, and this
    process once the console script's flow run has started (so both check at once,
    whichever wins)."""
    uri = str(stack_settings.mlflow_tracking_uri)
    first = models.register_onnx(uri, MODEL, models.onnx_graph("softmax"))
    second = models.register_onnx(uri, MODEL, models.onnx_graph("softmax"))
    # A longer bake keeps the winner's lock long after the loser has finished checking.
    policy = models.write_policy(tmp_path / "long-bake.yaml", {
        **QUICK, "bake": {**QUICK["bake"], "duration_s": 8.0}})
    process = _start_promote(stack_settings, policy, first)
    try:
        _flow_run_started(stack_settings, f"promote {MODEL} v{first}", process)
        with beside(lambda _: _finished(process)) as console:  # its pipes drained meanwhile
            here = run_inprocess("promote", MODEL, "--version", str(second), "--policy",
                                 str(policy), "--json", home=stack_settings.home)
        done = {second: _record(here.returncode, here.stdout, here.stderr),
                first: console.result(timeout=600)}
    finally:
        if process.poll() is None:  # only when something above failed
            process.kill()
            process.wait(timeout=30)
    codes = sorted(code for code, _ in done.values())
    assert codes == [0, 1], done
    winner = next(v for v, (code, _) in done.items() if code == 0)
    _, lost = next(result for result in done.values() if result[0] == 1)
    assert lost["status"] == "failed" and "lock" in lost["reason"]
    assert done[winner][1]["id"] in lost["reason"]  # told who holds it
    status = _json("status", MODEL, settings=stack_settings)
    assert status["consistent"] and status["production_version"] == winner


def test_a_first_release_that_breaches_its_bake_is_withdrawn(stack_settings: Settings,
                                                             tmp_path: Path) -> None:
    """Nothing served before, so the rollback is to nothing: every replica unloads the
    model and the production pin goes, so reconcile cannot bring the candidate back."""
    model = "cli-promote-first"
    uri = str(stack_settings.mlflow_tracking_uri)
    poison = models.register_onnx(uri, model, poison_onnx_graph())
    policy = models.write_policy(tmp_path / "bake.yaml", BREACH)
    code, record = _poison_during_bake(stack_settings, policy, model, poison)
    assert code == 4, record
    assert record["from_version"] is None and record["bake"]["rolled_back"]["ok"]
    assert record["bake"]["rolled_back"]["kind"] == "withdraw"
    status = _json("status", model, settings=stack_settings)
    assert status["production_version"] is None and not status["served"]
    assert [r["ready_versions"] for r in status["replicas"]] == [[], []]
    healed = _json("reconcile", model, settings=stack_settings)
    assert healed["changed"] == 0 and "no production recorded" in healed["models"][0]["status"]
