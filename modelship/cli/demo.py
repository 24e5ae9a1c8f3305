"""``modelship demo``: the whole story on the embedded stack, with a model it trains itself.

1. Train a small fraud classifier, log it to MLflow with golden inputs, register v1, and
   release it through ``promote`` (a first release: absolute gates only).
2. Train a better v2 and release it through ``promote``: check, stage, a canary against v1,
   the gates, an approval (the demo clicks Approve as an approver, a click signed as Slack
   signs it, sent to the stack's ``approvals serve``), the swap with dynamic batching
   paused, the bake, and the record.
3. Print where to look: the Prefect UI, the Slack thread in the emulator, ``history``.

Both releases are real Prefect flow runs with task runs on the stack's Prefect server.
"""

from __future__ import annotations

import getpass
import logging
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from modelship.cli._common import JsonOpt, app, finish, progress, run_reporting, settings, table
from modelship.errors import ModelshipError, UsageError
from modelship.stack.components import prefect_ui_url

DEMO_MODEL = "demo-fraud"
#: The approval step: carol asks for v2, alice (or the release-approvers group) approves.
DEMO_REQUESTER, DEMO_APPROVER = "U0CAROL", "U0ALICE"
DEMO_APPROVERS = ("U0ALICE", "S0APPROVERS")
N_FEATURES = 8


def train_and_register(tracking_uri: str, *, name: str, strength: float, seed: int) -> int:
    """Train a regularised LogisticRegression on synthetic transactions (it converges) and
    register it with golden rows; a lower ``strength`` makes a weaker model."""
    # lazy: mlflow, pandas and scikit-learn cost seconds at import; only the demo trains
    import mlflow
    import pandas as pd
    from sklearn.datasets import make_classification
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    from model_registry.client import point_mlflow_at

    x, y = make_classification(n_samples=2000, n_features=N_FEATURES, n_informative=5,
                               n_classes=2, weights=[0.7, 0.3], random_state=seed)
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(N_FEATURES)])
    train, test = frame.iloc[:1500], frame.iloc[1500:]
    model = make_pipeline(StandardScaler(), LogisticRegression(C=strength, max_iter=1000))
    model.fit(train, y[:1500])
    point_mlflow_at(tracking_uri)
    mlflow.set_experiment("modelship-demo")
    with mlflow.start_run():
        mlflow.log_metric("accuracy", float(model.score(test, y[1500:])))
        info = mlflow.sklearn.log_model(model, name="model", registered_model_name=name,
                                        input_example=test.head(8),
                                        pip_requirements=["scikit-learn"])
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "inputs.parquet"
            test.head(256).to_parquet(path)
            mlflow.log_artifact(str(path), artifact_path="golden")
    return int(info.registered_model_version)


def flow_run_links(ui: str | None, releases: list[dict[str, Any]]) -> dict[str, str]:
    """The Prefect UI page of each release's flow run (its task runs, logs, artifacts), by
    release id."""
    runs = {r["id"]: (r.get("holder") or {}).get("flow_run_id") for r in releases}
    return {release: f"{ui}/runs/flow-run/{run}" for release, run in runs.items()
            if ui and run}


def _shown(version: int | None) -> str:
    """A version as the table shows it; a first release comes from nothing."""
    return "(none)" if version is None else f"v{version}"


def _quiet_libraries() -> None:
    """The demo's terminal tells the story: no third-party INFO lines or warnings."""
    for name in ("mlflow", "alembic", "urllib3", "botocore", "great_expectations", "httpx"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore")


def _approve_in_background(current: Any, since: str, stop: Any, out: dict[str, Any]) -> None:
    """Act as the approver: click Approve as soon as the release asks (a signed click)."""
    # lazy: the approvals client pulls prefect (~3 s); only the demo's approver needs it
    from modelship.approvals.click import approve_when_asked, withdraw_pending

    try:
        out.update(approve_when_asked(current, DEMO_MODEL, user=DEMO_APPROVER, since=since,
                                      stop=stop))
    except ModelshipError as exc:
        out.update(ok=False, error=exc.message)
    if not out.get("ok") and out.get("error") != "not_asked":
        # fail closed now rather than at the approval's expiry (an hour by default)
        progress(f"the demo could not click Approve ({out.get('error')}); withdrawing v2")
        try:
            withdraw_pending(current, DEMO_MODEL, since=since, user=DEMO_REQUESTER,
                             reason=f"the demo's approval click failed: {out.get('error')}")
        except ModelshipError as exc:
            progress(f"could not withdraw it either ({exc}); it expires on its own")


def run_demo(current: Any) -> dict[str, Any]:
    """Release v1, then a better v2, each through the promote flow."""
    # lazy: a command imports its flow and tasks when it runs, so the CLI starts fast
    from flows.promote import PromoteParams, promote_flow
    from modelship.ledger import new_release_id
    from modelship.prefect_api import pointed_at

    _quiet_libraries()
    if not current.mlflow_tracking_uri:
        raise UsageError("the demo needs the embedded stack", hint="run `modelship stack up`")
    started = time.monotonic()
    requester = current.requester or getpass.getuser()
    releases: list[dict[str, Any]] = []
    clicked: dict[str, Any] = {}
    # v1 is the more regularised model (held-out accuracy 0.86 against v2's 0.89); they agree
    # on 95% of the golden rows, so v2 passes the policy's 90% agreement gate on its merits.
    # (C=0.001 made v1 so weak that they agreed on only 86%: every demo v2 failed there.)
    for label, strength in (("v1 (the current model)", 0.01), ("v2 (the candidate)", 1.0)):
        progress(f"training and registering {label}")
        version = train_and_register(current.mlflow_tracking_uri, name=DEMO_MODEL,
                                     strength=strength, seed=0)
        progress(f"promoting {DEMO_MODEL} v{version}")
        # v2 needs an approval: carol asks, alice clicks Approve (a signed Slack click)
        approval = {"require_approval": True, "approvers": list(DEMO_APPROVERS),
                    "requested_by": DEMO_REQUESTER} if releases else {
                        "requested_by": requester}
        stop = threading.Event()
        if releases:
            progress(f"v{version} will wait for an approval; the demo clicks Approve as "
                     f"{DEMO_APPROVER} through {current.approvals_url}")
            threading.Thread(target=_approve_in_background, daemon=True,
                             args=(current, new_release_id()[:16], stop, clicked)).start()
        try:
            with pointed_at(current.prefect_api_url):
                record = promote_flow(PromoteParams(model=DEMO_MODEL, version=version,
                                                    trigger="cli", **approval))
        except ModelshipError as exc:
            if not releases or "record" not in exc.details:
                raise  # v1 must serve for the story to go on
            record = exc.details["record"]  # the gates stopped v2: the record says why
        finally:
            stop.set()
        releases.append(record)
    ui = prefect_ui_url(current.prefect_api_url) if current.prefect_api_url else None
    return {"model": DEMO_MODEL, "releases": releases,
            "outcome": f"v{releases[-1]['to_version']} {releases[-1]['status']}",
            "seconds": round(time.monotonic() - started, 1), "approval_click": clicked,
            "look": {"prefect_ui": f"{ui}/runs" if ui else None,
                     "flow_runs": flow_run_links(ui, releases),
                     "slack_messages": f"{current.slack_api_url.rstrip('/')}/_emulator/messages"
                     if current.slack_api_url else None,
                     "history": f"modelship history {DEMO_MODEL}",
                     "slack_web_view": current.slack_api_url.rstrip("/").removesuffix("/api")
                     + "/" if current.slack_api_url else None,
                     "approve_by_hand": f"modelship approvals click RELEASE --as "
                     f"{DEMO_APPROVER} --approve (or --reject); the requester "
                     f"{DEMO_REQUESTER} and U0MALLORY are refused"}}


@app.command("demo")
def demo(as_json: JsonOpt = False) -> None:
    """The whole story on the embedded stack: release v1, then a better v2 via promote."""

    def render(doc: dict[str, Any]) -> str:
        rows = [(r["id"], f"{_shown(r['from_version'])} -> v{r['to_version']}", r["status"],
                 " ".join(s["name"] for s in r["stages"])) for r in doc["releases"]]
        look = doc["look"]
        return (table(["release", "versions", "status", "stages"], rows)
                + f"\n{doc['model']}: {doc['outcome']} ({doc['seconds']:.0f} s in all)"
                + f"\nPrefect UI (flow runs, task runs, artifacts): {look['prefect_ui']}"
                + "".join(f"\n  flow run of {release}: {link}"
                          for release, link in look["flow_runs"].items())
                + f"\nSlack thread (emulator): {look['slack_messages']}"
                + f"\nSlack web view (click Approve/Reject as anyone): "
                f"{look['slack_web_view']}"
                + f"\napprove by hand: `{look['approve_by_hand']}`"
                + f"\nthe ledger: `{look['history']}`; what serves: `modelship status "
                f"{doc['model']}`; roll back: `modelship rollback {doc['model']}`"
                + "\nnightly: `modelship nightly --drift 1.0` retrains on drifted data and "
                "promotes only a challenger that beats production offline (`make deploy` "
                "puts it on cron)"
                + "\nstop everything with `modelship stack down`")

    finish(run_reporting(lambda: run_demo(settings()), as_json=as_json, render=render,
                         to_json=lambda d: d))
