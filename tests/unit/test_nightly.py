"""The nightly's pure parts: tonight's data, the scores, the champion/challenger rule as a
table (MLflow's own validation), the skipped notice, trainer entry points, prefect.yaml."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import yaml

from flows.nightly import NightlyParams, skipped_notice
from modelship.errors import UsageError
from tasks import train as training
from tests.conftest import ROOT

RULE = training.ComparisonRule(metric="accuracy", min_absolute_change=0.01)


def test_tonights_data_is_reproducible_and_drift_turns_the_pattern() -> None:
    a, ya = training.transactions(2000, seed=4, drift=0.0)
    b, yb = training.transactions(2000, seed=4, drift=0.0)
    assert a.equals(b) and np.array_equal(ya, yb)
    assert list(a.columns) == [f"f{i}" for i in range(training.N_FEATURES)]
    assert 0.2 < ya.mean() < 0.6
    _, drifted = training.transactions(2000, seed=4, drift=1.0)  # same rows, other labels
    assert 0.1 < np.mean(drifted != ya) < 0.5


@pytest.mark.parametrize(("rows", "drift"), [(0, 0.0), (10, -0.1), (10, math.nan)])
def test_bad_data_requests_are_usage_errors(rows: int, drift: float) -> None:
    with pytest.raises(UsageError):
        training.transactions(rows, seed=0, drift=drift)


def test_a_champion_trained_before_the_drift_loses_to_a_retrained_challenger() -> None:
    from sklearn.linear_model import LogisticRegression

    old_x, old_y = training.transactions(3000, seed=1, drift=0.0)
    new_x, new_y = training.transactions(3000, seed=2, drift=1.0)
    test_x, test_y = training.transactions(1000, seed=3, drift=1.0)
    champion = LogisticRegression().fit(old_x, old_y)
    challenger = LogisticRegression().fit(new_x, new_y)
    mine = training.score(challenger.predict(test_x), test_y)
    theirs = training.score(champion.predict(test_x), test_y)
    assert mine["accuracy"] > theirs["accuracy"] + 0.05


@pytest.mark.parametrize(("predicted", "truth", "accuracy", "f1"), [
    ([1, 0, 1, 0], [1, 0, 1, 0], 1.0, 1.0),
    ([1, 1, 1, 1], [1, 0, 1, 0], 0.5, (2 / 3 + 0) / 2),
    ([], [], math.nan, math.nan),
    ([1, 0], [1, 0, 1], math.nan, math.nan),
])
def test_score(predicted: list[int], truth: list[int], accuracy: float, f1: float) -> None:
    got = training.score(predicted, truth)
    for key, want in (("accuracy", accuracy), ("f1_macro", f1)):
        assert (math.isnan(got[key]) and math.isnan(want)) or got[key] == pytest.approx(want)


@pytest.mark.parametrize(("rule", "challenger", "champion", "rows", "verdict"), [
    (RULE, 0.90, 0.85, 100, "better"),
    (RULE, 0.86, 0.85, 100, "better"),            # exactly the margin: MLflow's >=
    (RULE, 0.855, 0.85, 100, "not_better"),       # better, but not by the margin
    (RULE, 0.80, 0.85, 100, "not_better"),
    (RULE, 0.90, None, 100, "no_champion"),
    (RULE, math.nan, 0.85, 100, "inconclusive"),  # no data is never better
    (RULE, 0.90, math.nan, 100, "inconclusive"),
    (RULE, 0.90, 0.85, 0, "inconclusive"),
    (training.ComparisonRule(min_absolute_change=None, min_relative_change=0.1),
     0.90, 0.85, 100, "not_better"),              # +5.9% < 10%
    (training.ComparisonRule(min_absolute_change=None, min_relative_change=0.05),
     0.90, 0.85, 100, "better"),
    (training.ComparisonRule(threshold=0.95), 0.93, None, 100, "not_better"),  # the floor
    (training.ComparisonRule(threshold=0.95), 0.97, 0.90, 100, "better"),
    (training.ComparisonRule(threshold=0.95), 0.94, 0.90, 100, "not_better"),
])
def test_the_champion_challenger_rule(rule: training.ComparisonRule, challenger: float,
                                      champion: float | None, rows: int, verdict: str) -> None:
    result = training.compare(
        rule, {"accuracy": challenger},
        None if champion is None else {"accuracy": champion},
        champion_version=None if champion is None else 3, rows=rows)
    assert result.verdict == verdict, result.reason
    assert result.promote == (verdict in ("better", "no_champion"))
    assert result.to_dict()["rule"] == rule.describe()


def test_the_skipped_notice_names_the_numbers() -> None:
    comparison = training.compare(RULE, {"accuracy": 0.81234}, {"accuracy": 0.9},
                                  champion_version=4, rows=700)
    text = skipped_notice("fraud", 9, comparison)
    for part in ("fraud", "v9", "not_better", "0.8123", "champion v4 0.9000", "700 rows",
                 "by >= 0.01", "unchanged"):
        assert part in text


@pytest.mark.parametrize(("entry", "message"), [
    ("no-colon", "not module:function"),
    ("no_such_module_xyz:train", "cannot import"),
    ("tasks.train:no_such_function", "has no function"),
    ("tasks.train:N_FEATURES", "has no function"),
])
def test_bad_training_entry_points(entry: str, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        training.load_trainer(entry)


def test_the_builtin_trainer_is_the_default_entry_point() -> None:
    assert training.load_trainer(NightlyParams().train) is training.train_builtin


def test_nightly_params_refuse_negative_drift_and_tiny_data() -> None:
    with pytest.raises(ValueError):
        NightlyParams(drift=-1)
    with pytest.raises(ValueError):
        NightlyParams(rows=10)
    assert NightlyParams(min_absolute_change=0.02).rule().min_absolute_change == 0.02


def test_the_margin_is_the_policys_unless_a_parameter_overrides_it() -> None:
    from modelship.policy import NightlyPolicy

    policy = NightlyPolicy(metric="f1_macro", min_absolute_change=0.05, threshold=0.7)
    rule = NightlyParams().rule(policy)
    assert (rule.metric, rule.min_absolute_change, rule.threshold) == ("f1_macro", 0.05, 0.7)
    rule = NightlyParams(min_absolute_change=0.0, metric="accuracy").rule(policy)
    assert (rule.metric, rule.min_absolute_change, rule.threshold) == ("accuracy", 0.0, 0.7)
    assert NightlyParams().rule().min_absolute_change == 0.01  # the documented default


def test_prefect_yaml_nightly_deployment() -> None:
    doc = yaml.safe_load((ROOT / "prefect.yaml").read_text())
    pools = {p["name"] for p in doc["definitions"]["work_pools"].values()}
    deployments = {d["name"]: d for d in doc["deployments"]}
    assert {"promote", "rollback", "nightly"} <= set(deployments)
    assert all(d["work_pool"]["name"] in pools for d in deployments.values())
    nightly = deployments["nightly"]
    assert nightly["entrypoint"] == "flows/nightly.py:nightly_flow"
    assert nightly["concurrency_limit"]["limit"] == 1
    [schedule] = nightly["schedules"]
    assert schedule["cron"] == "30 2 * * *" and schedule["timezone"] == "Europe/Berlin"
    # No deployment changes production by default: a Quick Run of nightly only compares,
    # the schedule itself releases, and every default parameter set validates.
    assert nightly["parameters"]["params"]["dry_run"] is True
    assert schedule["parameters"]["params"]["dry_run"] is False
    NightlyParams.model_validate(nightly["parameters"]["params"])
    NightlyParams.model_validate(schedule["parameters"]["params"])
    for name in ("promote", "swap", "rollback"):
        assert deployments[name]["parameters"]["params"]["dry_run"] is True


def test_the_nightly_policy_file_is_preferred(tmp_path: Path) -> None:
    from flows.nightly import nightly_policy_file

    assert nightly_policy_file(NightlyParams(model="m"), tmp_path) is None
    (tmp_path / "m.nightly.yaml").write_text("{}\n")
    assert nightly_policy_file(NightlyParams(model="m"), tmp_path) == \
        str((tmp_path / "m.nightly.yaml").resolve())
    assert nightly_policy_file(NightlyParams(model="m", policy_file="x.yaml"), tmp_path) == \
        "x.yaml"
    shipped = ROOT / "policies" / "demo-fraud.nightly.yaml"
    from modelship.policy import load_policy

    gates = {g.name: g for g in load_policy(shipped).gates}
    assert gates["agreement"].dry_run and not gates["error_rate"].dry_run
