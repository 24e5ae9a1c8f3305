"""`modelship promote | history | rollback | locks | unlock` on the session's stack: the
release as one Prefect flow run, its record, its Slack thread.

Most commands run in the test process, through the function the console script runs
(:func:`tests.inprocess.run_inprocess`); the console script stays for the contract of
promote (one of the two releases racing for one lock is the console script, so that two
processes race: its exit code and JSON document, a record or a lock error), of the ledger
(``history --json``) and of a refused unlock (exit 1; the last two start in 2-3 s).
Promote's error document and rollback's refusal are the console's elsewhere: every
command's exit and error document against dependencies that are down in
tests/integration/test_exits.py, rollback in tests/e2e/test_fleet_cli.py.

One sequence of releases of one model (:func:`ledger`, a module fixture) is what several
tests assert: the dry run, the first release (the lock race's winner, released with Slack
unreachable), an identical version that passes the canary, a slower one rejected by it, a
corrupt one rejected by check, the rollback by the ledger, the history. The bake breach then
rolls back to the production the sequence ends with.

The canary is the subject of two releases only (an identical version passes the p95 rule,
a slower one fails it: :data:`POLICY`); every other release runs :data:`QUICK`, a canary
that stops as soon as its error rule has its samples, since what it proves happens before
(the lock) or after it (Slack, the bake, the rollback).
"""

from __future__ import annotations

import http.client
import json
import subprocess
import threading
import time
import urllib.parse
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelship.clients import build_clients
from modelship.locks import release_lock
from modelship.settings import Settings
from tests import models
from tests.conftest import MODELSHIP, ROOT, cli_env, run_cli
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
#: (179 requests, so min_samples decides), agreement, half-second windows that count as
#: stable at once (``stability_pct`` 100: the first three windows end the stability round,
#: then a sized round if the samples are short of the plan). A canary still runs on the
#: canary Triton and its gates are still judged.
QUICK: dict[str, Any] = {
    **POLICY,
    "canary": {"warmup_s": 0.25, "window_s": 0.5, "stability_pct": 100.0,
               "max_duration_s": 30.0, "min_samples": 200},
    "gates": [
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01,
         "effect": 0.03},
        {"name": "agreement", "metric": "agreement", "test": "threshold", "min": 0.98},
    ],
}

#: The lock race's releases (the model's first): :data:`QUICK` with a longer bake, which
#: keeps the winner's lock long after the loser has finished checking.
RACE: dict[str, Any] = {**QUICK, "bake": {**QUICK["bake"], "duration_s": 8.0}}

#: Slack unreachable (a closed port): the race's releases run with it, to show that it
#: never changes the outcome.
SLACK_DOWN = {"MODELSHIP_SLACK_API_URL": "http://127.0.0.1:9/"}


def _promote(settings: Settings, policy: Path, *args: str, code: int,
             env: dict[str, str] | None = None, model: str = MODEL) -> dict[str, Any]:
    """``modelship promote`` in-process: its record (also when it is an error's)."""
    done = run_inprocess("promote", model, *args, "--policy", str(policy), "--json",
                         home=settings.home, env=env)
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


@pytest.fixture(scope="module")
def race(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return models.write_policy(tmp_path_factory.mktemp("promote") / "race.yaml", RACE)


#: A poisoned row: its first feature indexes past the end of a one-element table.
POISON = 1e6

#: The bake of a poisoned version: 1-s windows, so the error rule's e-process (one bet per
#: window) reaches its bound in about half the time of 2-s windows (18 of 20 s before);
#: a reference shorter than two windows leaves latency unjudged, as POLICY's does, so the
#: breach is the errors' alone. ``alpha`` 0.05: the e-process breaches at 20 instead of
#: 100, about two thirds of the windows (log 20 / log 100), a policy's level, not what is
#: proven (the e-process itself is tests/unit's).
BREACH_BAKE: dict[str, Any] = {**POLICY["bake"], "duration_s": 20.0, "window_s": 1.0,
                               "baseline_s": 1.0, "alpha": 0.05}
#: How long the poisoned version's dynamic batcher holds a batch open for more requests,
#: in µs (the default is 100), and how often each replica's one sender sends a poisoned row,
#: in s. A probe row fails when a poisoned row arrives within 20 ms either side of it, so
#: about 2 × 20 / 80 = half of them fail (at 12.5 poisoned requests/s a replica, where eight
#: senders flooding at full speed were needed with 100-µs batches). Not all of them: a
#: replica whose every probe request fails in a window has stopped answering (the bake
#: exits 1 then, an infrastructure failure, not a breach), and a first deploy's probe must
#: get an answer through.
POISON_QUEUE_DELAY_US = 20_000
POISON_PERIOD_S = 0.08
#: The release of a poisoned version: :data:`QUICK`'s canary (the golden rows never trip
#: the poison), then :data:`BREACH_BAKE`, with batches held open
#: (:data:`POISON_QUEUE_DELAY_US`).
BREACH: dict[str, Any] = {
    **QUICK, "bake": BREACH_BAKE,
    "triton": {"dynamic_batching": {"max_queue_delay_us": POISON_QUEUE_DELAY_US}}}


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


def _send_poison(http_url: str, model: str, done: threading.Event,
                 counts: dict[str, int], lock: threading.Lock) -> None:
    """A poisoned row to one replica every :data:`POISON_PERIOD_S` over one keep-alive
    connection, until ``done``; counts what was sent and what Triton answered with an
    error."""
    row = [POISON] + [0.0] * (models.N_FEATURES - 1)
    body = json.dumps({"inputs": [{"name": "input", "shape": [1, models.N_FEATURES],
                                   "datatype": "FP32", "data": row}]}).encode()
    address = urllib.parse.urlsplit(http_url)
    connection = http.client.HTTPConnection(address.hostname or "127.0.0.1", address.port,
                                            timeout=5)
    due = time.monotonic()
    try:
        while not done.is_set():
            try:
                connection.request("POST", f"/v2/models/{model}/infer", body,
                                   {"Content-Type": "application/json"})
                response = connection.getresponse()
                response.read()  # the whole answer: the connection is free for the next
                failed = response.status >= 400
            except (OSError, http.client.HTTPException):
                connection.close()  # the next request connects again
                failed = False
            with lock:
                counts["sent"] += 1
                counts["failed"] += failed
            # never sooner than half a period after an answer: a slow answer (a loaded
            # machine) cannot make the sender cover every batch
            due = max(due + POISON_PERIOD_S, time.monotonic() + POISON_PERIOD_S / 2)
            done.wait(due - time.monotonic())
    finally:
        connection.close()


def _start_promote(settings: Settings, policy: Path, version: int,
                   env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """The console script's ``promote`` in the background (:func:`tests.conftest.start_cli`
    with ``env`` added to its environment)."""
    return subprocess.Popen([str(MODELSHIP), "promote", MODEL, "--version", str(version),
                             "--policy", str(policy), "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=cli_env(settings.home, env), cwd=ROOT)


def _poison_during_bake(settings: Settings, policy: Path, model: str,
                        version: int) -> tuple[int, Any]:
    """Promote ``version`` (in-process) and, once every replica serves it (asked every
    0.2 s), send it poisoned rows from a thread beside the release until the release ends.

    This CPU runtime (ONNX Runtime behind pytriton's backend stub) does not count a backend
    error in ``nv_inference_request_failure``, so the bake sees the breach the way its probe
    does: the dynamic batcher puts probe rows in the same batch as poisoned ones, and the
    whole batch fails. ``policy`` holds the poisoned version's batches open
    (:data:`POISON_QUEUE_DELAY_US`), so one slow sender per replica puts a poisoned row in
    about half the batches.
    """
    counts = {"sent": 0, "failed": 0}
    lock = threading.Lock()

    def poison_once_serving(done: threading.Event) -> None:
        urls = [replica.http for replica in settings.triton_replicas]
        while not live_clients.serving_everywhere(urls, model, version):
            if done.wait(0.2):  # the release ended first
                return
        with ThreadPoolExecutor(max_workers=len(urls)) as pool:
            list(pool.map(lambda url: _send_poison(url, model, done, counts, lock), urls))

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


def _checked(settings: Settings, name: str, process: subprocess.Popen[str],
             timeout_s: float = 300) -> None:
    """Wait until the console script's release (its Prefect flow run ``name``) has passed
    its check: it stages and takes the model's lock next, within a second or two; fail if
    the process ended first. (Waiting only for its flow run was not enough: on a loaded
    machine the console's check imports took 22 s more, and the release started beside
    it had released and let go of the lock before the console asked for it.) Asked every
    0.5 s, two Prefect queries each: the console's imports alone take 10-30 s."""
    api = settings.prefect_api_url
    deadline = time.monotonic() + timeout_s
    while True:
        assert process.poll() is None, _finished(process, timeout=30)
        assert time.monotonic() < deadline, f"{name!r} not checked after {timeout_s:g} s"
        runs = _post(f"{api}/flow_runs/filter", {"flow_runs": {"name": {"any_": [name]}}})
        if runs:
            tasks = _post(f"{api}/task_runs/filter",
                          {"flow_runs": {"id": {"any_": [runs[0]["id"]]}}})
            if any(t["name"].split(" ")[0] == "check" and t.get("state_type") == "COMPLETED"
                   for t in tasks):
                return
        time.sleep(0.5)


@dataclass
class Ledger:
    """What :func:`ledger`'s sequence of releases of :data:`MODEL` returned, in order."""

    plan: dict[str, Any]  # the dry run of v1's release
    race: dict[int, tuple[int, Any]]  # version -> (exit code, record): the lock race
    after_race: dict[str, Any]  # `status` once both racers ended
    versions: dict[str, int]  # v1, v1b (the racers), v2, v3 (slower), bad (corrupt)
    second: dict[str, Any]  # v2 released after the race's winner
    slow: dict[str, Any]  # v3 rejected by its gates
    status_after_slow: dict[str, Any]
    corrupt: dict[str, Any]  # rejected by check
    rolled: dict[str, Any]  # `rollback`: back to the winner
    never: subprocess.CompletedProcess[str]  # `rollback --to v3`, which never served
    history: list[dict[str, Any]]  # `history --json` (the console script) at the end

    @property
    def winner(self) -> int:
        return next(v for v, (code, _) in self.race.items() if code == 0)

    @property
    def first(self) -> dict[str, Any]:
        """The model's first release: the race's winner's record."""
        return dict(self.race[self.winner][1])


@pytest.fixture(scope="module")
def ledger(stack_settings: Settings, policy: Path, race: Path,
           tmp_path_factory: pytest.TempPathFactory) -> Ledger:
    """One model's releases, each asserted by the tests below.

    The first release is a race for the model's release lock between two processes (with
    Slack unreachable): the console script, and this process once the console script has
    passed its check (it is about to take the lock, which it keeps through its canary,
    swap and 8-s bake, while this one checks; whichever asks first wins). Then an identical
    version passes the p95 canary (:data:`POLICY`), a several times slower one fails it, a
    corrupt one fails check, the model is rolled back by the ledger (to the race's winner),
    a rollback to a version that never served is refused, and the history is read.
    """
    uri = str(stack_settings.mlflow_tracking_uri)
    base = models.onnx_graph("softmax")
    v1 = models.register_onnx(uri, MODEL, base)
    v1b = models.register_onnx(uri, MODEL, base)
    v2 = models.register_onnx(uri, MODEL, base)
    # several times slower (bake_traffic's graph; a quarter of test_canary's to check)
    v3 = models.register_onnx(uri, MODEL, slow_onnx_graph(width=512, layers=64))
    bad = models.register_directory(uri, MODEL,
                                    models.corrupt_onnx_dir(tmp_path_factory.mktemp("bad")))

    plan = _promote(stack_settings, policy, "--version", str(v1), "--dry-run", code=0)

    process = _start_promote(stack_settings, race, v1, env=SLACK_DOWN)
    try:
        _checked(stack_settings, f"promote {MODEL} v{v1}", process)
        with beside(lambda _: _finished(process)) as console:  # its pipes drained meanwhile
            here = run_inprocess("promote", MODEL, "--version", str(v1b), "--policy",
                                 str(race), "--json", home=stack_settings.home,
                                 env=SLACK_DOWN)
        raced = {v1b: _record(here.returncode, here.stdout, here.stderr),
                 v1: console.result(timeout=600)}
    finally:
        if process.poll() is None:  # only when something above failed
            process.kill()
            process.wait(timeout=30)
    after_race = _json("status", MODEL, settings=stack_settings)

    second = _promote(stack_settings, policy, "--version", str(v2), code=0)
    slow = _promote(stack_settings, policy, "--version", str(v3), code=4)
    status_after_slow = _json("status", MODEL, settings=stack_settings)
    corrupt = _promote(stack_settings, policy, "--version", str(bad), code=3)
    rolled = _json("rollback", MODEL, settings=stack_settings)
    never = run_inprocess("rollback", MODEL, "--to", str(v3), "--json",
                          home=stack_settings.home)
    history = json.loads(run_cli("history", MODEL, "--json",
                                 home=stack_settings.home).stdout)["releases"]
    return Ledger(plan=plan, race=raced, after_race=after_race,
                  versions={"v1": v1, "v1b": v1b, "v2": v2, "v3": v3, "bad": bad},
                  second=second, slow=slow, status_after_slow=status_after_slow,
                  corrupt=corrupt, rolled=rolled, never=never, history=history)


def test_promote_releases_rejects_and_rolls_back_by_the_ledger(
        stack_settings: Settings, ledger: Ledger) -> None:
    v = ledger.versions
    v2, v3, bad, winner = v["v2"], v["v3"], v["bad"], ledger.winner
    loser = v["v1b"] if winner == v["v1"] else v["v1"]
    plan = ledger.plan
    assert plan["status"] == "planned" and plan["plan"]["stages"][3] == "canary"
    assert plan["plan"]["replicas"] == ["triton-0", "triton-1"]
    assert plan["plan"]["canary"]["samples_per_version"] >= 300

    first = ledger.first
    assert first["status"] == "released" and first["from_version"] is None
    assert [s["name"] for s in first["stages"]] == [
        "resolve", "check", "stage", "canary", "gates", "approve", "swap", "bake", "record"]

    second = ledger.second
    assert second["status"] == "released" and second["from_version"] == winner
    assert second["gates"]["verdict"] == "passed" and second["gates"]["baseline"] == winner
    assert set(second["gates"]["report_keys"]) >= {"markdown", "png", "json"}
    assert second["bake"]["outcome"] == "passed" and second["bake"]["windows"]

    slow = ledger.slow
    assert slow["status"] == "rejected" and slow["exit_code"] == 4
    assert [s for s in slow["stages"] if s["outcome"] == "failed"][0]["name"] == "gates"
    status = ledger.status_after_slow
    assert status["production_version"] == v2 == status["aliases"]["production"]

    corrupt = ledger.corrupt
    assert corrupt["stages"][-1]["name"] == "check" and corrupt["status"] == "rejected"

    rolled = ledger.rolled
    assert rolled["from_version"] == v2 and rolled["to_version"] == winner
    assert rolled["aliases"] == {"production": winner, "previous": v2}

    never = ledger.never
    assert never.returncode == 2 and "never served" in json.loads(never.stdout)["message"]

    history = ledger.history
    kinds = [(r["kind"], r["to_version"], r["exit_code"]) for r in history]
    assert kinds[:4] == [("rollback", winner, 0), ("promote", bad, 3), ("promote", v3, 4),
                         ("promote", v2, 0)]
    # the racers' records (they opened within a second of each other: either order)
    assert sorted(kinds[4:]) == sorted([("promote", winner, 0), ("promote", loser, 1)])
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


def test_two_concurrent_promotions_of_one_model_one_proceeds(ledger: Ledger) -> None:
    """Two processes raced for the model's release lock (:func:`ledger`'s first release):
    one released, the other was told who holds the lock."""
    done = ledger.race
    codes = sorted(code for code, _ in done.values())
    assert codes == [0, 1], done
    _, lost = next(result for result in done.values() if result[0] == 1)
    assert lost["status"] == "failed" and "lock" in lost["reason"]
    assert ledger.first["id"] in lost["reason"]  # told who holds it
    status = ledger.after_race
    assert status["consistent"] and status["production_version"] == ledger.winner


def test_slack_down_never_changes_the_outcome(ledger: Ledger) -> None:
    """The race's winner released with Slack unreachable."""
    record = ledger.first
    assert record["status"] == "released" and record["to_version"] == ledger.winner
    assert [s["name"] for s in record["stages"]][-3:] == ["swap", "bake", "record"]
    assert any("Slack" in note for note in record["notes"])


def test_a_second_release_is_told_who_holds_the_lock(stack_settings: Settings,
                                                     quick: Path) -> None:
    model = "cli-promote-lock"  # not MODEL: its refused record stays out of ledger's history
    uri = str(stack_settings.mlflow_tracking_uri)
    version = models.register_onnx(uri, model, models.onnx_graph("softmax"))
    with release_lock(model, storage=build_clients(stack_settings).storage,
                      home=stack_settings.home, release_id="holder-test", kind="promote"):
        locked = _promote(stack_settings, quick, "--version", str(version), code=1,
                          model=model)
        assert locked["status"] == "failed" and "holder-test" in locked["reason"]
        shown = _json("locks", model, settings=stack_settings)["locks"]
        assert shown[0]["holder"]["release_id"] == "holder-test"
        assert shown[0]["holder_alive"] is True
        refused = run_cli("unlock", model, "--release", "holder-test", "--json",
                          home=stack_settings.home)
        assert refused.returncode == 1 and "alive" in json.loads(refused.stdout)["message"]


def test_a_bake_breach_rolls_back_by_itself(stack_settings: Settings, ledger: Ledger,
                                            tmp_path: Path) -> None:
    base = ledger.rolled["to_version"]  # production now (the race's winner): the target
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
