"""Every policy number is finite: NaN or infinity is refused with exit 2, naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelship.errors import PolicyError, UsageError
from modelship.policy import FAMILY_ALPHA, Policy, default_gates, gate_rule, load_policy


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("gates:\n  - name: a\n    metric: agreement\n    min: .nan\n", "gates.0.min"),
        ("gates:\n  - name: a\n    metric: agreement\n    max: .inf\n", "gates.0.max"),
        ("gates:\n  - name: e\n    metric: error_rate\n    max_rate: .nan\n",
         "gates.0.max_rate"),
        ("gates:\n  - name: p\n    metric: latency_p50_ms\n    max_increase_pct: .inf\n",
         "gates.0.max_increase_pct"),
        ("gates:\n  - name: q\n    metric: latency_p99_ms\n    max_increase_pct: 10\n"
         "    min_effect_ms: .nan\n", "gates.0.min_effect_ms"),
        ("gates:\n  - name: q\n    metric: latency_p99_ms\n    max_increase_pct: 10\n"
         "    effect: .inf\n", "gates.0.effect"),
        ("gates:\n  - name: s\n    metric: server_latency_ratio\n    max_increase_pct: .nan\n",
         "gates.0.max_increase_pct"),
        ("gates:\n  - name: e\n    metric: error_rate\n    max_rate: 0.01\n    effect: .nan\n",
         "gates.0.effect"),
        ("gates:\n  - name: e\n    metric: error_rate\n    max_rate: 0.01\n    alpha: .nan\n",
         "gates.0.alpha"),
        ("gates:\n  - name: e\n    metric: error_rate\n    max_rate: 0.01\n    power: .nan\n",
         "gates.0.power"),
        ("canary:\n  max_duration_s: .inf\n", "canary.max_duration_s"),
        ("canary:\n  rate_rps: -.inf\n", "canary.rate_rps"),
        ("bake:\n  duration_s: .nan\n", "bake.duration_s"),
    ],
)
def test_nan_and_infinity_are_refused_naming_the_key(tmp_path: Path, text: str,
                                                      key: str) -> None:
    path = tmp_path / "policy.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert isinstance(info.value, UsageError) and info.value.exit_code == 2
    assert f"'{key}'" in info.value.message, info.value.message


def test_finite_numbers_still_load() -> None:
    rule = gate_rule(name="a", metric="agreement", min=0.98)
    assert rule.test == "threshold" and rule.min == 0.98
    with pytest.raises(ValueError, match="finite"):
        gate_rule(name="a", metric="agreement", min=float("nan"))


def test_the_default_rule_set_spends_the_stated_family_alpha() -> None:
    statistical = [r for r in default_gates() if r.test != "threshold"]
    assert sum(r.alpha for r in statistical) == pytest.approx(FAMILY_ALPHA)
    assert Policy().gates == default_gates()
