"""The release policy: defaults, the example file, and errors that name the file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelship.errors import PolicyError
from modelship.policy import (
    Policy,
    default_gates,
    gate_rule,
    load_policy,
    policy_for,
    policy_reference_markdown,
)

REPO = Path(__file__).resolve().parents[2]
POLICIES = REPO / "policies"


def write(tmp_path: Path, text: str, name: str = "fraud.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def test_defaults_apply_without_a_file(tmp_path: Path) -> None:
    policy = policy_for("fraud", tmp_path)
    assert policy == Policy()
    assert policy.triton.max_batch_size == 32
    assert policy.triton.dynamic_batching.max_queue_delay_us == 100
    assert policy.triton.target == "cpu"
    assert policy.export.max_opset == 21
    assert policy.approval.required is False
    assert policy.swap.pause_batching is True
    assert [(g.metric, g.test) for g in policy.gates] == [
        ("latency_p50_ms", "mann_whitney"),
        ("latency_p99_ms", "quantile"),
        ("error_rate", "exact_rate"),
        ("agreement", "threshold"),
        ("server_latency_ratio", "server_ratio"),
    ]
    assert policy.gates[1].max_increase_pct == 10
    assert policy.gates[2].max_rate == 0.001
    assert policy.gates[3].min == 0.98


@pytest.mark.parametrize("text", ["", "# only a comment\n", "triton:\n  # all defaults\n"])
def test_empty_file_or_section_means_defaults(tmp_path: Path, text: str) -> None:
    assert load_policy(write(tmp_path, text)) == Policy()


def test_example_loads_and_differs_from_defaults() -> None:
    policy = load_policy(POLICIES / "example.yaml")
    assert policy.triton.dynamic_batching.preferred_batch_sizes == [8, 16]
    assert policy.approval.required is True
    assert policy.gates[2].test == "threshold"  # inferred from min
    assert policy.gates[3].dry_run is True


@pytest.mark.parametrize("policy", [Policy(), load_policy(POLICIES / "example.yaml")])
def test_model_dump_round_trips(policy: Policy) -> None:
    assert Policy.model_validate(policy.model_dump()) == policy
    assert Policy.model_validate_json(policy.model_dump_json()) == policy


def test_readme_reference_matches_the_code() -> None:
    readme = (POLICIES / "README.md").read_text(encoding="utf-8")
    begin = "<!-- BEGIN GENERATED: policy reference -->\n"
    end = "<!-- END GENERATED: policy reference -->"
    generated = readme[readme.index(begin) + len(begin) : readme.index(end)]
    assert generated == policy_reference_markdown()


@pytest.mark.parametrize(
    ("text", "expected", "hint_has"),
    [
        ("tritn:\n  max_batch_size: 8\n", "unknown key 'tritn'", "triton"),
        (
            "triton:\n  dynamic_batching:\n    max_queue_delay: 5\n",
            "unknown key 'triton.dynamic_batching.max_queue_delay'",
            "max_queue_delay_us",
        ),
        (
            "gates:\n  - name: e\n    metric: error_rate\n    max_rte: 0.01\n",
            "unknown key 'gates.0.max_rte' (did you mean 'max_rate'?)",
            "max_rate",
        ),
        (
            "validation:\n  inputs:\n    columns:\n      amount:\n        mni: 0\n",
            "unknown key 'validation.inputs.columns.amount.mni'",
            "min",
        ),
    ],
)
def test_unknown_key_names_file_and_dotted_path(
    tmp_path: Path, text: str, expected: str, hint_has: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError) as info:
        load_policy(path)
    assert info.value.message.startswith(f"{path}: ")
    assert expected in info.value.message
    assert info.value.hint is not None and hint_has in info.value.hint


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("triton:\n  max_batch_size: lots\n", "'triton.max_batch_size'"),
        ("triton:\n  target: tpu\n", "'triton.target'"),
        ("approval:\n  approvers: U1\n", "'approval.approvers'"),
        ("gates:\n  - name: a\n    metric: agreement\n    min: high\n", "'gates.0.min'"),
        ("staging:\n  keep_versions: 1\n", "'staging.keep_versions'"),
    ],
)
def test_wrong_type_names_the_key(tmp_path: Path, text: str, key: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError, match=str(path)) as info:
        load_policy(path)
    assert key in info.value.message


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("triton:\n  max_batch_size: 8\n   target: cpu\n", 3),
        ("gates: [\n", 2),
        ("triton: {}\ntriton: {}\n", 2),  # duplicate keys would silently overwrite
    ],
)
def test_yaml_syntax_error_gives_the_line(tmp_path: Path, text: str, line: int) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError, match=rf"YAML syntax error at line {line}\b") as info:
        load_policy(path)
    assert info.value.details["line"] == line


@pytest.mark.parametrize(("text", "kind"), [("- a\n- b\n", "a list"), ("hello\n", "a string")])
def test_non_mapping_file(tmp_path: Path, text: str, kind: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(PolicyError, match=f"must be a mapping of sections, got {kind}"):
        load_policy(path)


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="not found"):
        policy_for("fraud", tmp_path, explicit=tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("files", "explicit", "expected_mbs"),
    [
        ({}, None, 32),
        ({"fraud.yaml": "triton:\n  max_batch_size: 8\n"}, None, 8),
        ({"fraud.yml": "triton:\n  max_batch_size: 4\n"}, None, 4),
        ({"other.yaml": "triton:\n  max_batch_size: 8\n"}, None, 32),
        (
            {
                "fraud.yaml": "triton:\n  max_batch_size: 8\n",
                "x.yaml": "triton:\n  max_batch_size: 2\n",
            },
            "x.yaml",
            2,
        ),
    ],
)
def test_policy_for_precedence(
    tmp_path: Path, files: dict[str, str], explicit: str | None, expected_mbs: int
) -> None:
    for name, text in files.items():
        write(tmp_path, text, name)
    chosen = tmp_path / explicit if explicit else None
    assert policy_for("fraud", tmp_path, chosen).triton.max_batch_size == expected_mbs


@pytest.mark.parametrize("model", ["../etc/passwd", "a/b", ""])
def test_policy_for_rejects_path_like_names(tmp_path: Path, model: str) -> None:
    with pytest.raises(PolicyError):
        policy_for(model, tmp_path)


@pytest.mark.parametrize(
    ("rule", "test"),
    [
        ({"metric": "latency_p95_ms", "max_increase_pct": 5}, "quantile"),
        ({"metric": "latency_p50_ms", "max_increase_pct": 5}, "mann_whitney"),
        ({"metric": "latency_p99_ms", "max": 50}, "threshold"),
        ({"metric": "error_rate", "max_rate": 0.01}, "exact_rate"),
        ({"metric": "error_rate", "max": 0.01}, "threshold"),
        ({"metric": "throughput_ratio", "min": 0.9}, "threshold"),
    ],
)
def test_gate_test_is_inferred(rule: dict[str, object], test: str) -> None:
    assert gate_rule({"name": "r", **rule}).test == test


@pytest.mark.parametrize(
    ("text", "error"),
    [
        (
            "gates:\n  - {name: a, metric: agreement, min: 0.9}\n"
            "  - {name: a, metric: agreement, min: 0.8}\n",
            "repeated: a",
        ),
        ("gates: []\n", "at least 1 item"),
        ("triton:\n  max_batch_size: 0\n", "needs max_batch_size > 0"),
        (
            "triton:\n  dynamic_batching:\n    preferred_batch_sizes: [64]\n",
            "exceed max_batch_size",
        ),
        ("triton:\n  instance_group:\n    kind: gpu\n", "cannot run on target 'cpu'"),
        ("approval:\n  required: true\n", "nobody could approve"),
        ("export:\n  target_opset: 23\n", "must lie within"),
        ("canary:\n  window_s: 400\n", "exceed max_duration_s"),
        ("swap:\n  deadline_s: 3\n", "must be below deadline_s"),
        ("notifications:\n  slack_channel: releases\n", "'notifications.slack_channel'"),
    ],
)
def test_cross_field_rules(tmp_path: Path, text: str, error: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy(write(tmp_path, text))
    assert error in info.value.message


def test_batching_off_allows_max_batch_size_zero(tmp_path: Path) -> None:
    text = "triton:\n  max_batch_size: 0\n  dynamic_batching:\n    enabled: false\n"
    assert load_policy(write(tmp_path, text)).triton.max_batch_size == 0


def test_default_gates_are_fresh_objects() -> None:
    first, second = default_gates(), default_gates()
    assert first == second and first[0] is not second[0]
