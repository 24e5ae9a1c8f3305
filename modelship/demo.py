"""``modelship demo``: the whole story on the embedded stack, with a model it trains itself.

1. Train a small fraud classifier, log it to MLflow with golden inputs, register v1.
2. Check, stage and release v1 to every replica (first deploy); alias ``production``.
3. Train a better v2; check and stage it; run the canary against v1 and apply the gates.
4. Swap every replica to v2 (dynamic batching paused during the swap); move the aliases.
5. Print the release report.

Every step uses the same code paths as the CLI commands, against real servers.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from model_registry.client import PREVIOUS_ALIAS, PRODUCTION_ALIAS
from modelship.clients import Clients
from modelship.policy import Policy
from modelship.settings import Settings

Progress = Callable[[str], None]
DEMO_MODEL = "demo-fraud"
N_FEATURES = 8


def train_and_register(tracking_uri: str, *, name: str, max_iter: int, seed: int) -> int:
    """Train a LogisticRegression on synthetic transactions and register it with golden rows."""
    import mlflow
    import pandas as pd
    from sklearn.datasets import make_classification
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    x, y = make_classification(n_samples=2000, n_features=N_FEATURES, n_informative=5,
                               n_classes=2, weights=[0.7, 0.3], random_state=seed)
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(N_FEATURES)])
    train, test = frame.iloc[:1500], frame.iloc[1500:]
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=max_iter))
    model.fit(train, y[:1500])
    mlflow.set_tracking_uri(tracking_uri)
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


def run_demo(settings: Settings, clients: Clients, policy: Policy, *,
             progress: Progress) -> dict[str, Any]:
    """Release v1, then a better v2 through check, stage, canary, gates and the swap."""
    from flows import fleet
    from flows.check import run_check

    assert clients.registry is not None
    started = time.monotonic()
    steps: list[dict[str, Any]] = []
    uri = clients.registry.tracking_uri
    workdir = settings.home / "runs" / f"demo-{time.strftime('%Y%m%d-%H%M%S')}"

    progress("training and registering v1 (the current model)")
    v1 = train_and_register(uri, name=DEMO_MODEL, max_iter=5, seed=0)
    report = run_check(settings, clients, policy, model=DEMO_MODEL, version=v1,
                       workdir=workdir / f"v{v1}", stage=True, progress=progress)
    steps.append({"step": f"check+stage v{v1}", "verdict": report.verdict})
    swap = fleet.swap(settings, clients, policy, model=DEMO_MODEL, target=v1, progress=progress)
    clients.registry.set_alias(DEMO_MODEL, PRODUCTION_ALIAS, v1)
    steps.append({"step": f"release v{v1}", "kind": swap["kind"], "seconds": swap["total_s"]})

    progress("training and registering v2 (the candidate)")
    v2 = train_and_register(uri, name=DEMO_MODEL, max_iter=200, seed=0)
    report = run_check(settings, clients, policy, model=DEMO_MODEL, version=v2,
                       workdir=workdir / f"v{v2}", stage=True, progress=progress)
    steps.append({"step": f"check+stage v{v2}", "verdict": report.verdict})
    canary = _canary(settings, clients, policy, candidate=v2, baseline=v1, progress=progress)
    steps.append({"step": f"canary v{v2} vs v{v1}", "verdict": canary["verdict"],
                  "report": canary.get("report")})
    if canary["verdict"] != "passed":
        return {"model": DEMO_MODEL, "released": v1, "candidate": v2, "steps": steps,
                "canary": canary,
                "outcome": f"v{v2} stopped by the gates ({canary['verdict']})",
                "seconds": round(time.monotonic() - started, 1)}
    swap = fleet.swap(settings, clients, policy, model=DEMO_MODEL, target=v2, progress=progress)
    clients.registry.set_alias(DEMO_MODEL, PREVIOUS_ALIAS, v1)
    clients.registry.set_alias(DEMO_MODEL, PRODUCTION_ALIAS, v2)
    steps.append({"step": f"swap v{v1} -> v{v2}", "kind": swap["kind"],
                  "seconds": swap["total_s"], "skew_ms": swap["skew_ms"],
                  "phases": [p["name"] for p in swap["phases"]]})
    status = fleet.status(clients, model=DEMO_MODEL)
    return {"model": DEMO_MODEL, "released": v2, "previous": v1, "steps": steps,
            "canary": canary,
            "status": status, "outcome": f"v{v2} serves on every replica",
            "seconds": round(time.monotonic() - started, 1)}


def _canary(settings: Settings, clients: Clients, policy: Policy, *, candidate: int,
            baseline: int, progress: Progress) -> dict[str, Any]:
    """The canary stage: v2 against v1, side by side on the canary Triton, then the gates."""
    from tasks.canary import run_canary

    result = run_canary(settings, clients, policy, model=DEMO_MODEL, candidate=candidate,
                        baseline=baseline, progress=progress)
    return dict(result.to_dict())
