"""Retrain and deploy, every night (DESIGN §1): promote only a challenger that beats the champion.

train → register → compare (offline, on held-out rows) → record → promote | skip.

1. **train**: the trainer (``module:function``, default :func:`tasks.train.train_builtin`)
   fits on tonight's data and logs the model with its golden inputs and held-out rows.
2. **register**: a new version of the model in MLflow (no alias: setting ``candidate``
   would also fire the registry webhook, a second trigger for the same release).
3. **compare**: the champion (the ``production`` alias) and the challenger both predict the
   challenger's held-out rows; MLflow's ``validate_evaluation_results`` judges the metric
   with the margin of :class:`NightlyParams`.
4. **record**: the comparison goes on the version (tags) and its run (metrics).
5. **promote** as a subflow (trigger ``schedule``) when better; otherwise a "skipped" notice
   with the numbers in Slack, and exit 0. Production is never touched by a skip.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from prefect import flow, get_run_logger, task
from prefect.cache_policies import NO_CACHE
from prefect.context import FlowRunContext
from pydantic import BaseModel, Field

from flows.promote import PromoteParams, promote_flow
from modelship.clients import Clients, build_clients, notifier_for
from modelship.errors import ModelshipError, UsageError
from modelship.policy import NightlyPolicy, Policy, policy_for
from modelship.settings import Settings, load_settings
from tasks import train as training
from tasks.retry import TRANSIENT_RETRIES, retry_transient

DEFAULT_MODEL = "demo-fraud"


class NightlyParams(BaseModel):
    """One night: which model, which trainer, tonight's data, and the promotion margin."""

    model: str = Field(default=DEFAULT_MODEL, description="Registered model name.")
    train: str = Field(default=training.BUILTIN_TRAINER, description="Training entry point "
                       "`module:function` (takes a TrainRequest, returns a logged model URI).")
    drift: float = Field(default=0.0, ge=0, description="How far tonight's data has drifted "
                         "(built-in trainer: 0 = the original pattern, 1 = a quarter turn).")
    seed: int | None = Field(default=None, description="Tonight's data seed; default: the "
                             "day number (UTC), so successive nights differ.")
    rows: int = Field(default=3000, ge=50, description="Training rows to generate.")
    metric: Literal["accuracy", "f1_macro"] | None = Field(
        default=None, description="Held-out metric compared (higher is better); default: "
        "the policy's nightly.metric.")
    min_absolute_change: float | None = Field(
        default=None, ge=0, description="Promote only when the challenger beats the champion "
        "by at least this much (metric units); default: the policy's "
        "nightly.min_absolute_change.")
    min_relative_change: float | None = Field(
        default=None, ge=0, description="... or by at least this fraction of the champion; "
        "default: the policy's nightly.min_relative_change.")
    threshold: float | None = Field(default=None, description="Absolute floor of the metric; "
                                    "default: the policy's nightly.threshold.")
    policy_file: str | None = Field(default=None, description="Release policy YAML for the "
                                    "promotion; default policies/MODEL.nightly.yaml, else "
                                    "policies/MODEL.yaml, else the defaults.")
    requested_by: str = Field(default="nightly", description="Requester on the release record.")
    dry_run: bool = Field(default=False, description="Train, register and compare; never "
                          "promote and post nothing.")

    def rule(self, policy: NightlyPolicy | None = None) -> training.ComparisonRule:
        """The policy's ``nightly`` rule, with what these parameters set overriding it."""
        base = policy or NightlyPolicy()
        return training.ComparisonRule(
            metric=self.metric or base.metric,
            min_absolute_change=_first(self.min_absolute_change, base.min_absolute_change),
            min_relative_change=_first(self.min_relative_change, base.min_relative_change),
            threshold=_first(self.threshold, base.threshold))


def _first(override: float | None, default: float | None) -> float | None:
    return default if override is None else override


def nightly_policy_file(params: NightlyParams, policies_dir: Path) -> str | None:
    """The release policy of a nightly promotion: the explicit file, else
    ``policies_dir/MODEL.nightly.yaml`` when it exists, else None (the model's own policy)."""
    if params.policy_file:
        return params.policy_file
    candidate = policies_dir / f"{params.model}.nightly.yaml"
    return str(candidate.resolve()) if candidate.is_file() else None


def _night_seed() -> int:
    return int(time.time() // 86400)


# --------------------------------------------------------------------------------------
# tasks: one side effect each


@task(name="train", task_run_name="train {model}", cache_policy=NO_CACHE)
def train_task(request: training.TrainRequest, entry_point: str, model: str) -> str:
    """Fit and log tonight's challenger; returns the logged model URI."""
    uri = training.load_trainer(entry_point)(request)
    if not isinstance(uri, str) or not uri:
        raise UsageError(f"the trainer {entry_point} returned {uri!r}, not a model URI",
                         hint="return the logged model's URI, e.g. info.model_uri")
    return uri


@task(name="register", task_run_name="register {model}", cache_policy=NO_CACHE,
      retries=TRANSIENT_RETRIES, retry_condition_fn=retry_transient)
def register_task(tracking_uri: str, model_uri: str, model: str) -> dict[str, Any]:
    """A new registered version of the challenger (no alias)."""
    return training.register(tracking_uri, model_uri, model)


@task(name="compare", task_run_name="compare {model} v{version}", cache_policy=NO_CACHE,
      retries=TRANSIENT_RETRIES, retry_condition_fn=retry_transient)
def compare_task(tracking_uri: str, model: str, version: int, run_id: str,
                 rule: training.ComparisonRule, workdir: Path) -> training.Comparison:
    """Champion and challenger on the challenger's held-out rows, judged by the rule."""
    return training.champion_vs_challenger(tracking_uri, model=model, version=version,
                                           run_id=run_id, rule=rule, workdir=workdir)


@task(name="record-comparison", task_run_name="record comparison {model} v{version}",
      cache_policy=NO_CACHE, retries=TRANSIENT_RETRIES, retry_condition_fn=retry_transient)
def record_comparison_task(tracking_uri: str, model: str, version: int, run_id: str,
                           comparison: training.Comparison) -> None:
    """The verdict and the numbers as version tags and run metrics."""
    training.record_comparison(tracking_uri, model=model, version=version, run_id=run_id,
                               comparison=comparison)


@task(name="notify-skipped", task_run_name="notify skipped {model} v{version}",
      cache_policy=NO_CACHE)
def notify_skipped_task(settings: Settings, clients: Clients, policy: Policy, model: str,
                        version: int, comparison: training.Comparison) -> dict[str, Any]:
    """Post the "skipped" notice; a Slack failure is reported, never the night's outcome."""
    text = skipped_notice(model, version, comparison)
    notifier = notifier_for(clients, settings, policy)
    try:
        ts = notifier.post(text)
    except ModelshipError as exc:
        get_run_logger().warning(f"the skipped notice could not be posted: {exc}")
        return {"posted": False, "text": text, "error": exc.message}
    return {"posted": ts is not None, "channel": notifier.channel, "ts": ts, "text": text}


def skipped_notice(model: str, version: int, comparison: training.Comparison) -> str:
    """The Slack line of a skipped night, with the numbers (pure)."""
    metric = comparison.rule.metric
    mine = comparison.challenger.get(metric)
    theirs = (comparison.champion or {}).get(metric)
    champion = (f"champion v{comparison.champion_version} {theirs:.4f}"
                if theirs is not None else "no champion")
    challenger = f"{mine:.4f}" if mine is not None else "n/a"
    return (f":zzz: nightly {model}: skipped v{version} ({comparison.verdict}). "
            f"Held-out {metric} on {comparison.rows} rows: challenger {challenger} vs "
            f"{champion}; rule: {comparison.rule.describe()}. Production is unchanged.")


# --------------------------------------------------------------------------------------
# the flow


@flow(name="modelship-nightly", flow_run_name="nightly {params.model}", log_prints=True)
def nightly_flow(params: NightlyParams) -> dict[str, Any]:
    """Retrain, register, compare offline, and promote only a better challenger."""
    settings = load_settings()
    if not settings.mlflow_tracking_uri:
        raise UsageError("the nightly run needs MLflow", hint="run `modelship stack up` or "
                         "set MLFLOW_TRACKING_URI")
    clients = build_clients(settings)
    logger = get_run_logger()
    try:
        policy_file = nightly_policy_file(params, settings.policies_dir)
        policy = policy_for(params.model, settings.policies_dir,
                            Path(policy_file) if policy_file else None)
        uri = settings.mlflow_tracking_uri
        request = training.TrainRequest(
            tracking_uri=uri, model=params.model, drift=params.drift, rows=params.rows,
            seed=_night_seed() if params.seed is None else params.seed)
        model_uri = train_task(request, params.train, params.model)
        registered = register_task(uri, model_uri, params.model)
        version, run_id = int(registered["version"]), str(registered["run_id"])
        with tempfile.TemporaryDirectory(prefix="modelship-nightly-") as tmp:
            comparison = compare_task(uri, params.model, version, run_id,
                                      params.rule(policy.nightly), Path(tmp))
        record_comparison_task(uri, params.model, version, run_id, comparison)
        logger.info(f"nightly {params.model} v{version}: {comparison.verdict}: "
                    f"{comparison.reason}")
        report: dict[str, Any] = {
            "model": params.model, "version": version, "model_uri": model_uri,
            "run_id": run_id, "seed": request.seed, "drift": request.drift,
            "trainer": params.train, "comparison": comparison.to_dict(), "release": None,
            "notice": None, "flow_run_id": _flow_run_id(), "dry_run": params.dry_run}
        if params.dry_run:
            would = "would promote" if comparison.promote else "would skip"
            return {**report, "status": "planned", "exit_code": 0,
                    "reason": f"dry run: {would} v{version}; nothing was promoted"}
        if not comparison.promote:
            notice = notify_skipped_task(settings, clients, policy, params.model, version,
                                         comparison)
            return {**report, "status": "skipped", "exit_code": 0, "notice": notice,
                    "reason": comparison.reason}
        release = PromoteParams(model=params.model, version=version,
                                policy_file=policy_file, trigger="schedule",
                                requested_by=params.requested_by)
        try:
            record = promote_flow(release)
        except ModelshipError as exc:
            record = exc.details.get("record") or {}
            return {**report, "status": "rejected" if exc.exit_code != 1 else "failed",
                    "exit_code": exc.exit_code, "release": record,
                    "reason": f"the promotion of v{version} stopped: {exc.message}",
                    "hint": exc.hint}
        status = "promoted" if record.get("status") == "released" else str(record.get("status"))
        return {**report, "status": status, "exit_code": int(record.get("exit_code") or 0),
                "release": record, "reason": comparison.reason}
    finally:
        clients.close()


def _flow_run_id() -> str | None:
    context = FlowRunContext.get()
    return str(context.flow_run.id) if context and context.flow_run else None
