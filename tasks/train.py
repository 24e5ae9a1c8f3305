"""Nightly training: generated data, the built-in trainer, the offline champion/challenger rule.

The training step is pluggable. A trainer is an importable ``module:function`` that takes a
:class:`TrainRequest` and returns the URI of the model it logged to MLflow. Its run carries
two artifacts the rest of the night relies on:

- ``golden/inputs.parquet``: the golden inputs promote replays (export parity, GX, canary);
- ``heldout/data.parquet``: rows the model never trained on, with a ``label`` column; the
  champion and the challenger are both scored on them.

:func:`log_candidate` logs a fitted estimator that way, so a user's trainer only fits.
:func:`train_builtin` is the default (and the demo): a regularised logistic regression on
synthetic card transactions whose fraud pattern turns as ``drift`` grows, so a champion
trained on yesterday's data loses accuracy on tonight's.

The comparison is MLflow's own rule (``mlflow.validate_evaluation_results`` with
``MetricThreshold``) on metrics computed here; no data (NaN, no rows) is never "better".
"""

from __future__ import annotations

import importlib
import math
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from model_registry.client import mlflow_client, point_mlflow_at
from modelship.errors import InfrastructureError, UsageError

N_FEATURES = 8
LABEL = "label"
GOLDEN_ARTIFACT_DIR = "golden"
HELDOUT_ARTIFACT = "heldout/data.parquet"
BUILTIN_TRAINER = "tasks.train:train_builtin"
#: Seeds of the fixed fraud pattern (the weights before and after the drift).
_PATTERN_SEED = 20261201

Verdict = Literal["better", "not_better", "no_champion", "inconclusive"]


@dataclass(frozen=True)
class TrainRequest:
    """What a trainer gets: where to log, which model, and tonight's knobs.

    Attributes:
        tracking_uri: The MLflow tracking server.
        model: The registered model name the candidate is for (the trainer logs; the
            nightly flow registers).
        experiment: The MLflow experiment of the training runs.
        seed: Tonight's seed (a different sample of the same world).
        drift: How far tonight's fraud pattern has turned from the original one; 0 is the
            original, 1 a quarter turn. Unitless, >= 0.
        rows: Rows to generate for training (the held-out and golden sets come on top).
    """

    tracking_uri: str
    model: str
    experiment: str = "modelship-nightly"
    seed: int = 0
    drift: float = 0.0
    rows: int = 3000


Trainer = Callable[[TrainRequest], str]


def transactions(rows: int, *, seed: int, drift: float) -> tuple[Any, np.ndarray]:
    """Synthetic card transactions, ~40% fraud; the pattern turns with ``drift`` (pure).

    Returns:
        (features as a DataFrame with columns f0..f7, float64; labels 0/1 as int64).
    """
    import pandas as pd  # lazy: pandas costs ~0.8 s at import; flows.nightly does not load it

    if rows < 1 or not math.isfinite(drift) or drift < 0:
        raise UsageError(f"cannot generate {rows} rows with drift {drift}",
                         hint="rows >= 1 and a finite drift >= 0, e.g. --drift 0.5")
    pattern = np.random.default_rng(_PATTERN_SEED)
    before = pattern.standard_normal(N_FEATURES)
    after = pattern.standard_normal(N_FEATURES)
    after -= before * (after @ before) / (before @ before)  # orthogonal: a real turn
    after *= np.linalg.norm(before) / np.linalg.norm(after)
    angle = drift * math.pi / 4
    weights = math.cos(angle) * before + math.sin(angle) * after
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, N_FEATURES))
    logits = 1.6 * (x @ weights) - 1.4 + rng.logistic(size=rows) * 0.8
    frame = pd.DataFrame(x, columns=[f"f{i}" for i in range(N_FEATURES)])
    return frame, (logits > 0).astype(np.int64)


def log_candidate(estimator: Any, request: TrainRequest, *, train: Any, train_labels: Any,
                  heldout: Any, heldout_labels: Any,
                  params: dict[str, Any] | None = None) -> str:
    """Log a fitted sklearn estimator with its golden inputs and held-out set.

    Returns:
        The logged model's URI (``models:/m-...``), for the nightly flow to register.
    """
    import mlflow  # lazy: mlflow costs ~4 s at import; only the MLflow calls need it

    point_mlflow_at(request.tracking_uri)
    mlflow.set_experiment(request.experiment)
    with mlflow.start_run(run_name=f"nightly {request.model} seed={request.seed} "
                          f"drift={request.drift:g}"):
        mlflow.log_params({"seed": request.seed, "drift": request.drift,
                           "rows": len(train), **(params or {})})
        mlflow.log_metric("train_accuracy", float(np.mean(
            np.asarray(estimator.predict(train)) == np.asarray(train_labels))))
        info = mlflow.sklearn.log_model(estimator, name="model",
                                        input_example=heldout.head(8),
                                        pip_requirements=["scikit-learn"])
        with tempfile.TemporaryDirectory() as tmp:
            golden = Path(tmp) / "inputs.parquet"
            heldout.head(256).to_parquet(golden)
            mlflow.log_artifact(str(golden), artifact_path=GOLDEN_ARTIFACT_DIR)
            data = Path(tmp) / Path(HELDOUT_ARTIFACT).name
            heldout.assign(**{LABEL: np.asarray(heldout_labels)}).to_parquet(data)
            mlflow.log_artifact(str(data), artifact_path=str(Path(HELDOUT_ARTIFACT).parent))
    return str(info.model_uri)


def train_builtin(request: TrainRequest) -> str:
    """The default trainer: scaler + logistic regression on tonight's transactions."""
    # lazy: scikit-learn costs ~2 s at import; only the built-in trainer needs it
    from sklearn.linear_model import LogisticRegression
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    heldout_rows = max(500, request.rows // 3)
    frame, labels = transactions(request.rows + heldout_rows, seed=request.seed,
                                 drift=request.drift)
    train, heldout = frame.iloc[:request.rows], frame.iloc[request.rows:].reset_index(drop=True)
    model = make_pipeline(StandardScaler(), LogisticRegression(C=1.0, max_iter=1000))
    model.fit(train, labels[:request.rows])
    return log_candidate(model, request, train=train, train_labels=labels[:request.rows],
                         heldout=heldout, heldout_labels=labels[request.rows:],
                         params={"trainer": BUILTIN_TRAINER, "C": 1.0})


def load_trainer(entry_point: str) -> Trainer:
    """Import ``module:function``; a bad entry point is a usage error that says why."""
    module_name, _, attr = entry_point.partition(":")
    if not module_name or not attr:
        raise UsageError(f"training entry point {entry_point!r} is not module:function",
                         hint=f"e.g. --train {BUILTIN_TRAINER}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"cannot import the training module {module_name!r}: {exc}",
                         hint="put it on PYTHONPATH (the worker's working directory is the "
                         "repository)") from exc
    trainer = getattr(module, attr, None)
    if not callable(trainer):
        raise UsageError(f"{entry_point!r}: {module_name} has no function {attr!r}",
                         hint="name a function that takes a TrainRequest and returns the "
                         "logged model URI")
    return trainer


# --------------------------------------------------------------------------------------
# scoring and the champion/challenger rule


def score(predictions: Any, labels: Any) -> dict[str, float]:
    """Accuracy and macro F1 of predicted labels (pure); NaN when there are no rows."""
    predicted = np.asarray(predictions).reshape(-1)
    truth = np.asarray(labels).reshape(-1)
    if predicted.size == 0 or predicted.size != truth.size:
        return {"accuracy": math.nan, "f1_macro": math.nan}
    f1s = []
    for cls in np.unique(truth):
        tp = float(np.sum((predicted == cls) & (truth == cls)))
        fp = float(np.sum((predicted == cls) & (truth != cls)))
        fn = float(np.sum((predicted != cls) & (truth == cls)))
        f1s.append(0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn))
    return {"accuracy": float(np.mean(predicted == truth)), "f1_macro": float(np.mean(f1s))}


@dataclass(frozen=True)
class ComparisonRule:
    """When a challenger counts as better (MLflow's ``MetricThreshold`` fields).

    Attributes:
        metric: The held-out metric compared (``accuracy`` or ``f1_macro``).
        min_absolute_change: The challenger must beat the champion by at least this much
            (metric units), or None.
        min_relative_change: ... or by at least this fraction of the champion's value.
        threshold: An absolute floor for the challenger, or None.
        greater_is_better: The metric's direction.
    """

    metric: str = "accuracy"
    min_absolute_change: float | None = 0.01
    min_relative_change: float | None = None
    threshold: float | None = None
    greater_is_better: bool = True

    def describe(self) -> str:
        parts = [f"{self.metric} {'higher' if self.greater_is_better else 'lower'} is better"]
        if self.min_absolute_change is not None:
            parts.append(f"by >= {self.min_absolute_change:g}")
        if self.min_relative_change is not None:
            parts.append(f"by >= {self.min_relative_change:.1%} relative")
        if self.threshold is not None:
            parts.append(f"floor {self.threshold:g}")
        return ", ".join(parts)


@dataclass
class Comparison:
    """The offline verdict on one challenger, with the numbers behind it."""

    verdict: Verdict
    reason: str
    rule: ComparisonRule
    challenger: dict[str, float]
    champion: dict[str, float] | None
    champion_version: int | None
    rows: int
    details: dict[str, Any] = field(default_factory=dict)

    @property
    def promote(self) -> bool:
        return self.verdict in ("better", "no_champion")

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.verdict, "reason": self.reason, "rule": self.rule.describe(),
                "metric": self.rule.metric, "challenger": self.challenger,
                "champion": self.champion, "champion_version": self.champion_version,
                "rows": self.rows, **self.details}


def compare(rule: ComparisonRule, challenger: dict[str, float],
            champion: dict[str, float] | None, *, champion_version: int | None,
            rows: int) -> Comparison:
    """Judge the challenger against the champion with MLflow's validation rule.

    No held-out rows, or a NaN metric on either side, is ``inconclusive``: never better.
    """
    # lazy: mlflow costs ~4 s at import; only the MLflow calls need it
    import mlflow
    from mlflow.models import MetricThreshold
    from mlflow.models.evaluation.base import EvaluationResult
    from mlflow.models.evaluation.validation import ModelValidationFailedException

    name = rule.metric
    mine = challenger.get(name)
    theirs = None if champion is None else champion.get(name)

    def made(verdict: Verdict, reason: str) -> Comparison:
        return Comparison(verdict, reason, rule, challenger, champion, champion_version, rows)

    if rows == 0 or mine is None or not math.isfinite(mine):
        return made("inconclusive", f"the challenger has no {name} on the held-out set "
                    f"({rows} rows): nothing to compare")
    threshold = MetricThreshold(threshold=rule.threshold,
                                min_absolute_change=rule.min_absolute_change,
                                min_relative_change=rule.min_relative_change,
                                greater_is_better=rule.greater_is_better)
    if champion is None:
        if rule.threshold is not None and not (
                mine >= rule.threshold if rule.greater_is_better else mine <= rule.threshold):
            return made("not_better", f"no champion serves, but the challenger's {name} "
                        f"{mine:.4f} misses the floor {rule.threshold:g}")
        return made("no_champion", f"no champion serves yet; challenger {name} {mine:.4f}")
    if theirs is None or not math.isfinite(theirs):
        return made("inconclusive", f"the champion v{champion_version} has no {name} on the "
                    "held-out set: nothing to compare")
    delta = mine - theirs
    try:
        mlflow.validate_evaluation_results(
            {name: threshold}, EvaluationResult(metrics=dict(challenger), artifacts={}),
            EvaluationResult(metrics=dict(champion), artifacts={}))
    except ModelValidationFailedException as exc:
        return made("not_better", f"challenger {name} {mine:.4f} vs champion "
                    f"v{champion_version} {theirs:.4f} (change {delta:+.4f}); the rule "
                    f"({rule.describe()}) says not better: {exc.message.strip()}")
    return made("better", f"challenger {name} {mine:.4f} vs champion v{champion_version} "
                f"{theirs:.4f} (change {delta:+.4f}): better ({rule.describe()})")


# --------------------------------------------------------------------------------------
# the MLflow side of the night: register, score both versions, record the verdict


def _client(tracking_uri: str) -> Any:
    """The one MLflow client factory; artifact uploads get a minute per request."""
    return mlflow_client(tracking_uri, timeout_s=60.0)


def _translated(what: str, tracking_uri: str, exc: Exception) -> Exception:
    from mlflow.exceptions import MlflowException  # lazy: mlflow (~4 s), as above

    if isinstance(exc, MlflowException):
        return InfrastructureError(f"MLflow at {tracking_uri} failed to {what}: {exc.message}",
                                   hint="see the MLflow server log", endpoint=tracking_uri)
    return exc


def register(tracking_uri: str, model_uri: str, model: str) -> dict[str, Any]:
    """Register ``model_uri`` as a new version of ``model``; returns version and run id."""
    import mlflow  # lazy: mlflow costs ~4 s at import; only the MLflow calls need it

    _client(tracking_uri)
    try:
        registered = mlflow.register_model(model_uri, model)
    except Exception as exc:
        raise _translated(f"register {model_uri} as {model}", tracking_uri, exc) from exc
    if not registered.run_id:
        raise UsageError(f"{model_uri} has no training run, so its held-out set is unknown",
                         hint="log the model inside mlflow.start_run() (see log_candidate)")
    return {"version": int(registered.version), "run_id": registered.run_id,
            "source": registered.source}


def heldout_set(tracking_uri: str, run_id: str, workdir: Path) -> tuple[Any, Any]:
    """The held-out rows (features, labels) the trainer logged on its run."""
    # lazy: mlflow (~4 s) and pandas (~0.8 s) at import; only the MLflow calls need them
    import mlflow.artifacts
    import pandas as pd

    try:
        path = mlflow.artifacts.download_artifacts(
            run_id=run_id, artifact_path=HELDOUT_ARTIFACT, dst_path=str(workdir),
            tracking_uri=tracking_uri)
    except Exception as exc:
        raise UsageError(f"run {run_id} has no {HELDOUT_ARTIFACT} ({exc})",
                         hint=f"the trainer must log its held-out rows with a {LABEL!r} "
                         "column (tasks.train.log_candidate does)") from exc
    frame = pd.read_parquet(path)
    if LABEL not in frame.columns:
        raise UsageError(f"{HELDOUT_ARTIFACT} of run {run_id} has no {LABEL!r} column",
                         hint="add the true labels as a column named 'label'")
    return frame.drop(columns=[LABEL]), frame[LABEL].to_numpy()


def predict(tracking_uri: str, model: str, version: int, features: Any) -> Any:
    """Predicted labels of one registered version (its MLflow pyfunc)."""
    import mlflow.pyfunc  # lazy: mlflow costs ~4 s at import; only the MLflow calls need it

    _client(tracking_uri)
    try:
        loaded = mlflow.pyfunc.load_model(f"models:/{model}/{version}")
    except Exception as exc:
        raise _translated(f"load {model} v{version}", tracking_uri, exc) from exc
    output = loaded.predict(features)
    if hasattr(output, "to_numpy"):
        output = output.to_numpy()
    output = np.asarray(output)
    return output.argmax(axis=1) if output.ndim == 2 and output.shape[1] > 1 else output


def champion_vs_challenger(tracking_uri: str, *, model: str, version: int, run_id: str,
                           rule: ComparisonRule, workdir: Path) -> Comparison:
    """Score the challenger and the production champion on the same held-out rows."""
    from mlflow.exceptions import MlflowException  # lazy: mlflow (~4 s), as above

    client = _client(tracking_uri)
    try:
        aliases = dict(client.get_registered_model(model).aliases)
    except MlflowException as exc:
        raise _translated(f"read the aliases of {model}", tracking_uri, exc) from exc
    champion_version = int(aliases["production"]) if "production" in aliases else None
    features, labels = heldout_set(tracking_uri, run_id, workdir)
    challenger = score(predict(tracking_uri, model, version, features), labels)
    champion = None
    if champion_version is not None and champion_version != version:
        champion = score(predict(tracking_uri, model, champion_version, features), labels)
    return compare(rule, challenger, champion, champion_version=champion_version,
                   rows=len(labels))


def record_comparison(tracking_uri: str, *, model: str, version: int, run_id: str,
                      comparison: Comparison) -> None:
    """Tags on the version (``nightly.*``) and ``heldout_*`` metrics on its run."""
    client = _client(tracking_uri)
    tags = {"nightly.verdict": comparison.verdict, "nightly.reason": comparison.reason[:4000],
            "nightly.rule": comparison.rule.describe(), "nightly.metric": comparison.rule.metric,
            "nightly.heldout_rows": str(comparison.rows),
            "nightly.champion_version": "" if comparison.champion_version is None
            else str(comparison.champion_version)}
    metrics: dict[str, float] = {}
    for name, value in comparison.challenger.items():
        tags[f"nightly.challenger.{name}"] = f"{value:.6f}"
        metrics[f"heldout_{name}"] = value
    for name, value in (comparison.champion or {}).items():
        tags[f"nightly.champion.{name}"] = f"{value:.6f}"
        metrics[f"champion_heldout_{name}"] = value
    try:
        for key, text in tags.items():
            client.set_model_version_tag(model, str(version), key, text)
        for key, number in metrics.items():
            if math.isfinite(number):
                client.log_metric(run_id, key, number)
    except Exception as exc:
        raise _translated(f"record the comparison on {model} v{version}", tracking_uri,
                          exc) from exc
