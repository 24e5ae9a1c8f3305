"""The canary's traffic mode and the bake's holdback in the policy (issue 20 item 3).

``replay`` stays the default and every existing policy means the same; a key of another
mode, or an incoherent combination, is refused with exit 2 and the key named, never
ignored or rewritten.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from modelship.errors import PolicyError
from modelship.policy import (
    DEFAULT_MIRROR_PCT,
    DEFAULT_STEPS,
    CanaryPolicy,
    Policy,
    load_policy,
)

POLICIES = Path(__file__).resolve().parents[2] / "policies"


def write(tmp_path: Path, data: dict[str, Any]) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(data), encoding="utf-8")
    return path


def refused(tmp_path: Path, data: dict[str, Any]) -> PolicyError:
    with pytest.raises(PolicyError) as caught:
        load_policy(write(tmp_path, data))
    assert caught.value.exit_code == 2
    return caught.value


def test_replay_is_the_default_and_shares_are_off() -> None:
    canary = Policy().canary
    assert canary.traffic == "replay"
    assert canary.mirror_share_pct == 0.0
    assert canary.progressive_steps == ()
    assert Policy().bake.holdback_pct == 0.0


@pytest.mark.parametrize("path", sorted(POLICIES.glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_policy_is_still_replay_without_holdback(path: Path) -> None:
    policy = load_policy(path)
    assert policy.canary.traffic == "replay"
    assert policy.bake.holdback_pct == 0.0


@pytest.mark.parametrize(
    ("canary", "mirror", "steps"),
    [
        ({"traffic": "shadow"}, DEFAULT_MIRROR_PCT, ()),
        ({"traffic": "shadow", "mirror_pct": 2.5}, 2.5, ()),
        ({"traffic": "shadow", "mirror_pct": 100}, 100.0, ()),
        ({"traffic": "progressive"}, 0.0, DEFAULT_STEPS),
        ({"traffic": "progressive", "steps": [2, 10, 50]}, 0.0, (2.0, 10.0, 50.0)),
        ({"traffic": "progressive", "steps": [99.5]}, 0.0, (99.5,)),
    ],
)
def test_coherent_modes_load(tmp_path: Path, canary: dict[str, Any], mirror: float,
                             steps: tuple[float, ...]) -> None:
    policy = load_policy(write(tmp_path, {"canary": canary}))
    assert policy.canary.traffic == canary["traffic"]
    assert policy.canary.mirror_share_pct == mirror
    assert policy.canary.progressive_steps == steps
    assert Policy.model_validate(policy.model_dump()) == policy


def test_step_bounds_default_and_given(tmp_path: Path) -> None:
    default = CanaryPolicy(traffic="progressive")
    assert default.step_bounds_s == (10.0, 60.0)
    given = load_policy(write(tmp_path, {"canary": {"traffic": "progressive", "step_min_s": 5,
                                                    "step_max_s": 5}}))
    assert given.canary.step_bounds_s == (5.0, 5.0)


@pytest.mark.parametrize(
    ("canary", "key", "says"),
    [
        ({"mirror_pct": 5}, "canary.mirror_pct", "traffic: shadow"),
        ({"traffic": "progressive", "mirror_pct": 5}, "canary.mirror_pct", "traffic: shadow"),
        ({"steps": [1, 5]}, "canary.steps", "traffic: progressive"),
        ({"traffic": "shadow", "steps": [1, 5]}, "canary.steps", "traffic: progressive"),
        ({"step_min_s": 3}, "canary.step_min_s", "traffic: progressive"),
        ({"traffic": "shadow", "step_max_s": 30}, "canary.step_max_s", "traffic: progressive"),
        ({"traffic": "progressive", "steps": []}, "canary.steps", "at least one weight"),
        ({"traffic": "progressive", "steps": [1, 5, 100]}, "canary.steps", "(0, 100)"),
        ({"traffic": "progressive", "steps": [0, 5]}, "canary.steps", "(0, 100)"),
        ({"traffic": "progressive", "steps": [-1]}, "canary.steps", "(0, 100)"),
        ({"traffic": "progressive", "steps": [5, 5, 25]}, "canary.steps", "strictly increase"),
        ({"traffic": "progressive", "steps": [25, 5]}, "canary.steps", "strictly increase"),
        ({"traffic": "progressive", "step_min_s": 30, "step_max_s": 10}, "canary.step_min_s",
         "ceiling"),
        ({"traffic": "mirror"}, "canary.traffic", "replay"),
        ({"traffic": "shadow", "mirror_pct": 0}, "canary.mirror_pct", ""),
        ({"traffic": "shadow", "mirror_pct": 101}, "canary.mirror_pct", ""),
        ({"traffic": "progressive", "step_min_s": 0}, "canary.step_min_s", ""),
    ],
)
def test_incoherent_canary_traffic_is_refused_naming_the_key(
        tmp_path: Path, canary: dict[str, Any], key: str, says: str) -> None:
    error = refused(tmp_path, {"canary": canary})
    assert key in error.message, error.message
    assert says in error.message, error.message


def test_every_problem_is_named_at_once(tmp_path: Path) -> None:
    error = refused(tmp_path, {"canary": {"mirror_pct": 5, "steps": [5, 1]}})
    for key in ("canary.mirror_pct", "canary.steps", "strictly increase"):
        assert key in error.message, error.message


@pytest.mark.parametrize(
    ("bake", "key", "says"),
    [
        ({"holdback_pct": 5, "duration_s": 0}, "bake.holdback_pct", "needs a bake"),
        ({"holdback_pct": 60}, "bake.holdback_pct", ""),
        ({"holdback_pct": -1}, "bake.holdback_pct", ""),
    ],
)
def test_incoherent_holdback_is_refused(tmp_path: Path, bake: dict[str, Any], key: str,
                                        says: str) -> None:
    error = refused(tmp_path, {"bake": bake})
    assert key in error.message, error.message
    assert says in error.message, error.message


@pytest.mark.parametrize("holdback", [0, 5, 50])
def test_a_holdback_with_a_bake_loads(tmp_path: Path, holdback: float) -> None:
    policy = load_policy(write(tmp_path, {"bake": {"holdback_pct": holdback,
                                                   "duration_s": 30}}))
    assert policy.bake.holdback_pct == holdback


def test_a_policy_without_a_bake_and_no_holdback_still_loads(tmp_path: Path) -> None:
    assert load_policy(write(tmp_path, {"bake": {"duration_s": 0}})).bake.duration_s == 0
