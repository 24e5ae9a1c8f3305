"""The check cache (tasks/check_cache.py): which inputs change the key, the artifact's
digest, and an entry that is corrupt is discarded, never trusted."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from modelship.policy import Policy
from tasks.check_cache import (
    CheckCache,
    CheckInputs,
    artifact_digest,
    cache_key,
    mlmodel_content,
    policy_digest,
)

BASE = CheckInputs(artifact="a" * 64, flavor="sklearn", golden="g" * 64, policy="p" * 64,
                   modelship="m" * 64, libraries=(("onnx", "1.17.0"), ("skl2onnx", "1.18")),
                   triton='{"version": "2.51.0"}')


@pytest.mark.parametrize(("field", "value"), [
    ("artifact", "b" * 64),
    ("flavor", "onnx"),
    ("golden", "h" * 64),
    ("policy", "q" * 64),
    ("modelship", "n" * 64),
    ("libraries", (("onnx", "1.18.0"), ("skl2onnx", "1.18"))),
    ("triton", '{"version": "2.52.0"}'),
])
def test_every_input_changes_the_key(field: str, value: object) -> None:
    assert cache_key(dataclasses.replace(BASE, **{field: value})) != cache_key(BASE)


def test_the_same_inputs_give_the_same_key() -> None:
    same = CheckInputs(**dataclasses.asdict(BASE) | {"libraries": BASE.libraries})
    assert cache_key(same) == cache_key(BASE)
    assert len(cache_key(BASE)) == 64


def test_policy_digest_reads_only_the_check_sections() -> None:
    policy = Policy()
    canary = policy.model_copy(update={"canary": policy.canary.model_copy(
        update={"warmup_s": policy.canary.warmup_s + 1})})
    parity = policy.model_copy(update={"export": policy.export.model_copy(
        update={"parity": policy.export.parity.model_copy(update={"atol": 0.5})})})
    assert policy_digest(canary) == policy_digest(policy)
    assert policy_digest(parity) != policy_digest(policy)


MLMODEL = """artifact_path: /x/models/m-1/artifacts
flavors:
  sklearn: {pickled_model: model.skops, serialization_format: skops}
model_id: m-1
model_uuid: m-1
run_id: r1
utc_time_created: '2026-12-02 03:06:40'
signature: {inputs: '[{"type": "double", "name": "f0"}]'}
"""


def _version_dir(root: Path, mlmodel: str, model: bytes) -> Path:
    root.mkdir()
    (root / "MLmodel").write_text(mlmodel)
    (root / "model.skops").write_bytes(model)
    return root


def test_artifact_digest_ignores_what_mlflow_writes_per_registration(tmp_path: Path) -> None:
    again = MLMODEL.replace("m-1", "m-2").replace("r1", "r2").replace("03:06:40", "04:00:00")
    first = artifact_digest(_version_dir(tmp_path / "a", MLMODEL, b"weights"))
    assert artifact_digest(_version_dir(tmp_path / "b", again, b"weights")) == first
    assert artifact_digest(_version_dir(tmp_path / "c", MLMODEL, b"weightz")) != first
    other_flavor = MLMODEL.replace("serialization_format: skops", "serialization_format: pickle")
    assert artifact_digest(_version_dir(tmp_path / "d", other_flavor, b"weights")) != first
    assert "run_id" not in mlmodel_content(MLMODEL) and "flavors" in mlmodel_content(MLMODEL)


def test_artifact_digest_ignores_the_registered_name_and_version(tmp_path: Path) -> None:
    """A download of models:/NAME/N holds MLflow's registered_model_meta (NAME, N): two
    versions of the same bytes must share a key; a file of the model itself still counts."""
    digests = []
    for name, version in (("a", 1), ("b", 7)):
        folder = _version_dir(tmp_path / name, MLMODEL, b"weights")
        (folder / "registered_model_meta").write_text(
            f"model_name: {name}\nmodel_version: '{version}'\n")
        digests.append(artifact_digest(folder))
    assert digests[0] == digests[1]
    (tmp_path / "b" / "extra.txt").write_text("a file of the model")
    assert artifact_digest(tmp_path / "b") != digests[0]


PASSED = {"inputs": {"success": True, "evaluated": 3, "docs_path": None},
          "outputs": {"success": True, "evaluated": 2, "docs_path": None},
          "trial_load": {"success": True, "server": "canary", "load_s": 0.4}}


def _store(cache: CheckCache, tmp_path: Path, key: str = "k" * 64,
           checks: dict[str, object] = PASSED) -> bool:
    graph = tmp_path / "model.onnx"
    graph.write_bytes(b"graph bytes")
    return cache.store(key, subject="m v1", stored_at="2026-12-02T03:00:00+00:00",
                       files={"model.onnx": graph}, opset=17, parity={"passed": True},
                       checks=checks, outputs={"label": np.array([0, 1, 1])})


def test_a_stored_pass_reads_back_verified(tmp_path: Path) -> None:
    cache = CheckCache(tmp_path / "cache")
    assert cache.load("k" * 64) is None
    assert _store(cache, tmp_path)
    hit = cache.load("k" * 64)
    assert hit is not None
    assert hit.files["model.onnx"].read_bytes() == b"graph bytes"
    np.testing.assert_array_equal(hit.outputs["label"], [0, 1, 1])
    assert hit.opset == 17 and hit.checks == PASSED
    assert hit.describe() == {"hit": True, "key": "k" * 64, "from": "m v1",
                              "stored_at": "2026-12-02T03:00:00+00:00"}
    assert not _store(cache, tmp_path), "an existing entry is not overwritten"
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["k" * 64]


@pytest.mark.parametrize("damage", ["graph", "outputs", "entry", "key", "failed_check"])
def test_a_damaged_entry_is_discarded_not_trusted(tmp_path: Path, damage: str) -> None:
    cache = CheckCache(tmp_path / "cache")
    assert _store(cache, tmp_path)
    folder = tmp_path / "cache" / ("k" * 64)
    entry = json.loads((folder / "entry.json").read_text())
    if damage == "graph":
        (folder / "files" / "model.onnx").write_bytes(b"graph bytez")
    elif damage == "outputs":
        (folder / "outputs.npz").write_bytes(b"truncated")
    elif damage == "entry":
        (folder / "entry.json").write_text('{"format": 1, "key"')
    elif damage == "key":
        (folder / "entry.json").write_text(json.dumps(entry | {"key": "x" * 64}))
    else:
        checks = entry["checks"] | {"trial_load": {"server": "canary"}}
        (folder / "entry.json").write_text(json.dumps(entry | {"checks": checks}))
    assert cache.load("k" * 64) is None
    assert not folder.exists() and cache.last_discarded
    assert _store(cache, tmp_path) and cache.load("k" * 64) is not None  # rebuilt


def test_answers_that_are_not_plain_arrays_are_not_stored(tmp_path: Path) -> None:
    cache = CheckCache(tmp_path / "cache")
    graph = tmp_path / "model.onnx"
    graph.write_bytes(b"g")
    assert not cache.store("k" * 64, subject="m v1", stored_at="t", files={"model.onnx": graph},
                           opset=17, parity={}, checks=PASSED,
                           outputs={"label": np.array(["a", None], dtype=object)})
    assert cache.load("k" * 64) is None
