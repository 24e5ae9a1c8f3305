"""Gate rules: one class per test, discriminated on ``test``.

An incoherent rule (a key of another test, a metric its test does not take, a missing
bound) is refused with exit 2, naming the dotted key and what to write instead; a rule is
never rewritten into another test.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from modelship.errors import PolicyError, UsageError
from modelship.policy import (
    ExactRateRule,
    GateRule,
    MannWhitneyRule,
    Policy,
    QuantileRule,
    ServerRatioRule,
    ThresholdRule,
    gate_rule,
    load_policy,
)

REPO = Path(__file__).resolve().parents[2]

OK_P50 = {"name": "p50", "metric": "latency_p50_ms", "max_increase_pct": 10}
OK_ERR = {"name": "err", "metric": "error_rate", "max_rate": 0.01}


def refused(tmp_path: Path, *rules: dict[str, Any]) -> PolicyError:
    """The error of loading a policy whose ``gates`` are ``rules``."""
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"gates": list(rules)}, sort_keys=False), encoding="utf-8")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    error = info.value
    assert isinstance(error, UsageError) and error.exit_code == 2
    assert error.message.startswith(f"{path}: ")
    return error


# One row per incoherent combination: the rule, the key the error must name, and what the
# message or its hint must tell the user to write instead.
INCOHERENT = [
    pytest.param({"name": "r", "metric": "latency_p99_ms", "test": "mann_whitney",
                  "max_increase_pct": 10}, "gates.0.metric", "test: quantile",
                 id="mann_whitney-on-p99"),
    pytest.param({"name": "r", "metric": "latency_p95_ms", "test": "mann_whitney",
                  "max_increase_pct": 10}, "gates.0.metric", "test: quantile",
                 id="mann_whitney-on-p95"),
    pytest.param({"name": "r", "metric": "latency_p90_ms", "test": "mann_whitney",
                  "max_increase_pct": 10}, "gates.0.metric", "test: quantile",
                 id="mann_whitney-on-p90"),
    pytest.param({"name": "r", "metric": "latency_p50_ms", "test": "quantile",
                  "max_increase_pct": 10}, "gates.0.metric", "test: mann_whitney",
                 id="quantile-on-p50"),
    pytest.param({"name": "r", "metric": "error_rate", "test": "quantile",
                  "max_increase_pct": 10}, "gates.0.metric", "test: exact_rate",
                 id="quantile-on-error_rate"),
    pytest.param({"name": "r", "metric": "latency_mean_ms", "test": "server_ratio",
                  "max_increase_pct": 10}, "gates.0.metric", "test: mann_whitney",
                 id="server_ratio-on-mean"),
    pytest.param({"name": "r", "metric": "gpu_utilization", "test": "exact_rate",
                  "max_rate": 0.1}, "gates.0.metric", "test: threshold",
                 id="exact_rate-on-gpu"),
    pytest.param({"name": "r", "metric": "agreement", "max_increase_pct": 5},
                 "gates.0.metric", "test: threshold", id="inferred-mann_whitney-on-agreement"),
    pytest.param({"name": "r", "metric": "agreement", "test": "threshold", "min": 0.9,
                  "max_rate": 0.1}, "gates.0.max_rate", "test: exact_rate",
                 id="threshold-with-max_rate"),
    pytest.param({"name": "r", "metric": "agreement", "min": 0.9, "max_rate": 0.1},
                 "gates.0.max_rate", "names no test", id="inferred-threshold-with-max_rate"),
    pytest.param({"name": "r", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01,
                  "max_increase_pct": 5}, "gates.0.max_increase_pct", "test: mann_whitney",
                 id="exact_rate-with-max_increase_pct"),
    pytest.param({"name": "r", "metric": "latency_p99_ms", "test": "quantile",
                  "max_increase_pct": 10, "max_rate": 0.01}, "gates.0.max_rate",
                 "test: exact_rate", id="quantile-with-max_rate"),
    pytest.param({"name": "r", "metric": "latency_p50_ms", "test": "mann_whitney",
                  "max_increase_pct": 10, "min": 1}, "gates.0.min", "test: threshold",
                 id="mann_whitney-with-min"),
    pytest.param({"name": "r", "metric": "server_latency_ratio", "test": "server_ratio",
                  "max_increase_pct": 10, "min_effect_ms": 1}, "gates.0.min_effect_ms",
                 "mann_whitney and quantile", id="server_ratio-with-min_effect_ms"),
    pytest.param({"name": "r", "metric": "server_latency_ratio", "max_increase_pct": 10,
                  "power": 0.9}, "gates.0.power", "drop 'power'", id="server_ratio-with-power"),
    pytest.param({"name": "r", "metric": "server_latency_ratio", "max_increase_pct": 10,
                  "effect": 5}, "gates.0.effect", "drop 'effect'", id="server_ratio-with-effect"),
    pytest.param({"name": "r", "metric": "agreement", "min": 0.9, "alpha": 0.01},
                 "gates.0.alpha", "drop 'alpha'", id="threshold-with-alpha"),
    pytest.param({"name": "r", "metric": "agreement", "min": 0.9, "power": 0.9},
                 "gates.0.power", "drop 'power'", id="threshold-with-power"),
    pytest.param({"name": "r", "metric": "error_rate", "test": "exact_rate"},
                 "gates.0.max_rate", "highest tolerated error rate", id="exact_rate-no-max_rate"),
    pytest.param({"name": "r", "metric": "latency_p99_ms", "test": "quantile"},
                 "gates.0.max_increase_pct", "tolerated slowdown", id="quantile-no-tolerance"),
    pytest.param({"name": "r", "metric": "server_latency_ratio"}, "gates.0.max_increase_pct",
                 "tolerated slowdown", id="server_ratio-no-tolerance"),
    pytest.param({"name": "r", "metric": "agreement", "test": "threshold"}, "gates.0",
                 "at least one of min or max", id="threshold-no-bound"),
    pytest.param({"name": "r", "metric": "agreement", "min": 0.9, "max": 0.8}, "gates.0",
                 "greater than max", id="threshold-min-above-max"),
    pytest.param({"name": "r", "metric": "latency_p99_ms", "test": "t_test",
                  "max_increase_pct": 10}, "gates.0.test", "write one of: mann_whitney",
                 id="unknown-test"),
    pytest.param({"name": "r", "metric": "p99", "min": 1}, "gates.0.metric",
                 "unknown metric 'p99'", id="unknown-metric"),
    pytest.param({"name": "r", "metric": "latency_p99", "max": 1}, "gates.0.metric",
                 "did you mean 'latency_p99_ms'", id="misspelt-metric"),
    pytest.param({"name": "r", "metric": "error_rate", "max_rate": 2}, "gates.0.max_rate",
                 "less than or equal to 1", id="max_rate-out-of-range"),
]


@pytest.mark.parametrize(("rule", "key", "instead"), INCOHERENT)
def test_an_incoherent_rule_is_refused_naming_the_key_and_what_to_write(
        tmp_path: Path, rule: dict[str, Any], key: str, instead: str) -> None:
    error = refused(tmp_path, rule)
    keys = [d["key"] for d in error.details["errors"]]
    assert key in keys, (keys, error.message)
    said = f"{error.message} | {error.hint}"
    assert instead.lower() in said.lower(), said
    # The key path is the one a user writes: the test pydantic chose is not in it.
    for test in ("mann_whitney.", "quantile.", "server_ratio.", "exact_rate.", "threshold."):
        assert f"gates.0.{test}" not in error.message


@pytest.mark.parametrize(("rule", "key", "instead"), INCOHERENT)
def test_an_incoherent_rule_is_refused_in_code_too(rule: dict[str, Any], key: str,
                                                    instead: str) -> None:
    with pytest.raises(ValidationError):
        gate_rule(rule)


def test_the_index_in_the_key_is_the_rules_place_in_the_list(tmp_path: Path) -> None:
    bad = {"name": "tail", "metric": "latency_p99_ms", "test": "mann_whitney",
           "max_increase_pct": 10}
    error = refused(tmp_path, OK_P50, OK_ERR, bad)
    assert "'gates.2.metric'" in error.message
    assert [d["key"] for d in error.details["errors"]] == ["gates.2.metric"]


def test_mann_whitney_on_a_tail_metric_is_refused_never_read_as_quantile(
        tmp_path: Path) -> None:
    """The old rule silently became a quantile rule; now the file must say what it means."""
    rule = {"name": "latency_p99", "metric": "latency_p99_ms", "test": "mann_whitney",
            "max_increase_pct": 10, "min_effect_ms": 0.5}
    error = refused(tmp_path, rule)
    assert "stochastic order" in error.message
    assert "write `test: quantile`" in error.message
    with pytest.raises(ValidationError, match="test: quantile"):
        gate_rule(rule)
    # What the message says to write loads, as a quantile rule on the p99.
    fixed = gate_rule({**rule, "test": "quantile"})
    assert isinstance(fixed, QuantileRule) and fixed.metric == "latency_p99_ms"


def test_a_gate_rule_that_is_not_a_mapping_is_refused(tmp_path: Path) -> None:
    error = refused(tmp_path, "latency_p99")  # type: ignore[arg-type]
    assert "'gates.0': a gate rule is a mapping" in error.message


# One row per valid variant: the rule as a file says it, its class and what it holds.
VALID = [
    pytest.param({"name": "p50", "metric": "latency_p50_ms", "test": "mann_whitney",
                  "max_increase_pct": 10, "min_effect_ms": 0.05, "alpha": 0.01,
                  "power": 0.95, "effect": 15}, MannWhitneyRule,
                 {"max_increase_pct": 10.0, "min_effect_ms": 0.05}, id="mann_whitney"),
    pytest.param({"name": "mean", "metric": "latency_mean_ms", "max_increase_pct": 5},
                 MannWhitneyRule, {"max_increase_pct": 5.0, "min_effect_ms": None},
                 id="mann_whitney-inferred-on-mean"),
    pytest.param({"name": "p99", "metric": "latency_p99_ms", "test": "quantile",
                  "max_increase_pct": 10, "dry_run": True}, QuantileRule,
                 {"max_increase_pct": 10.0, "min_effect_ms": None}, id="quantile"),
    pytest.param({"name": "p90", "metric": "latency_p90_ms", "max_increase_pct": 20,
                  "effect": 30}, QuantileRule,
                 {"max_increase_pct": 20.0, "min_effect_ms": None}, id="quantile-inferred"),
    pytest.param({"name": "srv", "metric": "server_latency_ratio", "test": "server_ratio",
                  "max_increase_pct": 10, "alpha": 0.01}, ServerRatioRule,
                 {"max_increase_pct": 10.0}, id="server_ratio"),
    pytest.param({"name": "err", "metric": "error_rate", "test": "exact_rate",
                  "max_rate": 0.0, "effect": 0.001}, ExactRateRule, {"max_rate": 0.0},
                 id="exact_rate"),
    pytest.param({"name": "err", "metric": "error_rate", "max_rate": 0.001}, ExactRateRule,
                 {"max_rate": 0.001}, id="exact_rate-inferred"),
    pytest.param({"name": "agree", "metric": "agreement", "test": "threshold", "min": 0.98},
                 ThresholdRule, {"min": 0.98, "max": None}, id="threshold"),
    pytest.param({"name": "p99abs", "metric": "latency_p99_ms", "max": 50}, ThresholdRule,
                 {"min": None, "max": 50.0}, id="threshold-on-a-latency"),
    pytest.param({"name": "err_abs", "metric": "error_rate", "min": 0, "max": 0.01},
                 ThresholdRule, {"min": 0.0, "max": 0.01}, id="threshold-on-error_rate"),
]


@pytest.mark.parametrize(("rule", "cls", "bounds"), VALID)
def test_each_variant_parses_into_its_class_with_only_its_keys(
        tmp_path: Path, rule: dict[str, Any], cls: type, bounds: dict[str, Any]) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump({"gates": [rule]}), encoding="utf-8")
    loaded = load_policy(path).gates[0]
    assert type(loaded) is cls and loaded == gate_rule(rule)
    assert loaded.test == cls.TEST  # type: ignore[attr-defined]
    assert loaded.bounds() == bounds
    others = {"min", "max", "max_rate", "max_increase_pct", "min_effect_ms", "alpha", "power",
              "effect"} - set(cls.model_fields)  # type: ignore[attr-defined]
    assert not set(loaded.model_dump()) & others
    # A dump loads back to the same rule, in a file or in code.
    assert gate_rule(loaded.model_dump()) == loaded
    assert Policy.model_validate_json(Policy(gates=[loaded]).model_dump_json()).gates == [loaded]


@pytest.mark.parametrize(("rule", "cls", "bounds"), VALID)
def test_a_stated_test_is_kept_and_an_omitted_one_inferred(
        rule: dict[str, Any], cls: type, bounds: dict[str, Any]) -> None:
    assert gate_rule(rule).test == rule.get("test", cls.TEST)  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", sorted((REPO / "policies").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_policy_loads(path: Path) -> None:
    gates = load_policy(path).gates
    assert gates and all(g.test in ("mann_whitney", "quantile", "server_ratio", "exact_rate",
                                    "threshold") for g in gates)


def test_the_json_schema_has_one_closed_object_per_test() -> None:
    schema = Policy.model_json_schema()
    text = json.dumps(schema)
    defs = schema["$defs"]
    for name, test in (("MannWhitneyRule", "mann_whitney"), ("QuantileRule", "quantile"),
                       ("ServerRatioRule", "server_ratio"), ("ExactRateRule", "exact_rate"),
                       ("ThresholdRule", "threshold")):
        assert defs[name]["additionalProperties"] is False
        assert defs[name]["properties"]["test"]["const"] == test
    assert defs["MannWhitneyRule"]["properties"]["metric"]["enum"] == ["latency_p50_ms",
                                                                       "latency_mean_ms"]
    assert "max_rate" not in defs["ThresholdRule"]["properties"]
    assert "alpha" not in defs["ThresholdRule"]["properties"]
    assert "power" not in defs["ServerRatioRule"]["properties"]
    assert "stochastic order" in text
    rule_schema = TypeAdapter(GateRule).json_schema()
    assert len(rule_schema["oneOf"]) == 5
