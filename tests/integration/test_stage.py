"""Staging against the stack's real S3 server (SeaweedFS): layout, dedup, immutability."""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path

import pytest

from modelship.clients import build_clients
from modelship.errors import CredentialsRejected, ModelNotFound, StagingError
from modelship.policy import StagingPolicy
from modelship.repository import staged_config, staged_versions, verify_staged
from modelship.settings import Settings
from modelship.signing import generate_key, sign
from modelship.storage import S3Storage
from tasks.stage import StagedVersion, prune_versions, stage_version

pytestmark = pytest.mark.integration

MiB = 1024 * 1024
# Small parts, so the 6 MiB weights exercise multipart upload and multipart copy.
POLICY = StagingPolicy(multipart_threshold_bytes=5 * MiB, multipart_chunk_bytes=5 * MiB)
CONFIG = 'name: "{model}"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
KEY = generate_key().encode()


@pytest.fixture
def storage(stack_settings: Settings) -> S3Storage:
    storage = build_clients(stack_settings).storage
    assert storage is not None
    return storage


@pytest.fixture
def names() -> tuple[str, str]:
    """A model name and a blob prefix of this test's own, so tests never share blobs."""
    tag = uuid.uuid4().hex[:8]
    return f"stage-{tag}", f"test-blobs/{tag}/sha256"


def fake_model(directory: Path, *, weights: bytes | None = None,
               graph: bytes | None = None) -> dict[str, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "model.onnx").write_bytes(graph if graph is not None else os.urandom(2048))
    (directory / "model.onnx.data").write_bytes(
        weights if weights is not None else os.urandom(6 * MiB + 123))
    return {"model.onnx": directory / "model.onnx",
            "model.onnx.data": directory / "model.onnx.data"}


def stage(storage: S3Storage, settings: Settings, model: str, blobs: str, version: int,
          files: dict[str, Path]) -> StagedVersion:
    return stage_version(
        storage, model=model, version=version, files=files,
        config_pbtxt=CONFIG.format(model=model),
        provenance={"mlflow_uri": f"models:/{model}/{version}", "run_id": "r1", "opset": 17},
        policy=POLICY, repository_prefix=settings.repository_prefix, blob_prefix=blobs,
        signing_key=KEY,
    )


def test_stage_publishes_the_triton_layout_and_verifies(
    storage: S3Storage, stack_settings: Settings, names: tuple[str, str], tmp_path: Path
) -> None:
    model, blobs = names
    prefix = stack_settings.repository_prefix
    files = fake_model(tmp_path / "v1")
    lines: list[str] = []
    staged = stage_version(
        storage, model=model, version=1, files=files, config_pbtxt=CONFIG.format(model=model),
        provenance={"mlflow_uri": f"models:/{model}/1", "run_id": "r1", "opset": 17},
        policy=POLICY, repository_prefix=prefix, blob_prefix=blobs, progress=lines.append,
        signing_key=KEY,
    )
    total = sum(p.stat().st_size for p in files.values())
    assert staged.bytes_uploaded == total
    assert staged.bytes_copied == total
    assert not staged.already_staged and staged.model_config_written
    assert staged.manifest_key == f"{prefix}/{model}/1/release.json"

    keys = set(storage.list_keys(f"{prefix}/{model}/"))
    assert keys == {f"{prefix}/{model}/config.pbtxt", f"{prefix}/{model}/1/config.pbtxt",
                    f"{prefix}/{model}/1/model.onnx", f"{prefix}/{model}/1/model.onnx.data",
                    f"{prefix}/{model}/1/release.json"}
    # The blob store lives outside the repository prefix, one object per digest.
    blob_keys = set(storage.list_keys(blobs + "/"))
    assert blob_keys == {f"{blobs}/{d.sha256}" for d in staged.files.values()}
    assert not any(k.startswith(prefix + "/") for k in blob_keys)

    manifest = json.loads(storage.get_bytes(staged.manifest_key))
    assert manifest == verify_staged(storage, model=model, version=1, repository_prefix=prefix,
                                     deep=True)
    assert manifest["schema_version"] == 1
    assert manifest["provenance"]["run_id"] == "r1"
    assert manifest["files"]["model.onnx.data"] == staged.files["model.onnx.data"].to_dict()
    head = storage.head(f"{prefix}/{model}/1/model.onnx.data")
    assert head is not None
    assert head["metadata"]["sha256"] == staged.files["model.onnx.data"].sha256
    assert staged_versions(storage, model=model, repository_prefix=prefix) == [1]
    # The manifest is the last thing written.
    assert "release.json" in lines[-2] and "staged in" in lines[-1]
    assert staged.to_dict()["bytes_uploaded"] == total


def test_restage_and_new_version_upload_nothing_unchanged(
    storage: S3Storage, stack_settings: Settings, names: tuple[str, str], tmp_path: Path
) -> None:
    model, blobs = names
    prefix = stack_settings.repository_prefix
    files = fake_model(tmp_path / "v1")
    first = stage(storage, stack_settings, model, blobs, 1, files)
    model_config = storage.get_bytes(f"{prefix}/{model}/config.pbtxt")

    again = stage(storage, stack_settings, model, blobs, 1, files)
    assert again.already_staged
    assert (again.bytes_uploaded, again.bytes_copied) == (0, 0)

    # Version 2: a new graph, the same weights. Only the graph goes up; weights are copied.
    weights = files["model.onnx.data"].read_bytes()
    v2 = fake_model(tmp_path / "v2", weights=weights)
    second = stage(storage, stack_settings, model, blobs, 2, v2)
    graph_size = v2["model.onnx"].stat().st_size
    assert second.bytes_uploaded == graph_size
    assert second.bytes_copied == graph_size + len(weights)
    uploads = [a.name for a in second.actions if a.kind == "upload"]
    assert uploads == ["model.onnx"]
    assert not second.model_config_written
    assert storage.get_bytes(f"{prefix}/{model}/config.pbtxt") == model_config
    assert first.files["model.onnx.data"] == second.files["model.onnx.data"]
    assert staged_versions(storage, model=model, repository_prefix=prefix) == [1, 2]


def test_different_content_under_a_staged_version_is_refused(
    storage: S3Storage, stack_settings: Settings, names: tuple[str, str], tmp_path: Path
) -> None:
    model, blobs = names
    files = fake_model(tmp_path / "v1")
    first = stage(storage, stack_settings, model, blobs, 1, files)
    changed = fake_model(tmp_path / "other", graph=files["model.onnx"].read_bytes())
    with pytest.raises(StagingError, match="versions are immutable") as info:
        stage(storage, stack_settings, model, blobs, 1, changed)
    message = str(info.value)
    assert f"version 1 of {model} is already staged with different content" in message
    assert "file model.onnx.data: sha " + first.files["model.onnx.data"].sha256[:12] in message
    assert info.value.hint == "register a new MLflow version instead"
    assert info.value.exit_code == 3
    # Nothing changed: the staged version still verifies.
    verify_staged(storage, model=model, version=1,
                  repository_prefix=stack_settings.repository_prefix, deep=True)


def test_a_crashed_staging_without_manifest_is_overwritten(
    storage: S3Storage, stack_settings: Settings, names: tuple[str, str], tmp_path: Path
) -> None:
    model, blobs = names
    prefix = stack_settings.repository_prefix
    files = fake_model(tmp_path / "v3")
    folder = f"{prefix}/{model}/3"
    # What a crash leaves: a half-written graph, a stray file, no release.json.
    storage.put_bytes(f"{folder}/model.onnx", b"half a graph")
    storage.put_bytes(f"{folder}/model.onnx.old", b"stray")
    assert staged_versions(storage, model=model, repository_prefix=prefix) == []
    with pytest.raises(StagingError, match="not staged"):
        verify_staged(storage, model=model, version=3, repository_prefix=prefix)

    staged = stage(storage, stack_settings, model, blobs, 3, files)
    assert not staged.already_staged
    assert f"{folder}/model.onnx.old" not in set(storage.list_keys(folder + "/"))
    assert storage.get_bytes(f"{folder}/model.onnx") == files["model.onnx"].read_bytes()
    verify_staged(storage, model=model, version=3, repository_prefix=prefix, deep=True)

    # A crash after the copies but before the manifest: the staging resumes, copying nothing.
    storage.delete_key(f"{folder}/release.json")
    resumed = stage(storage, stack_settings, model, blobs, 3, files)
    assert sorted(resumed.skipped) == ["model.onnx", "model.onnx.data"]
    assert (resumed.bytes_uploaded, resumed.bytes_copied) == (0, 0)
    assert staged_versions(storage, model=model, repository_prefix=prefix) == [3]


def test_verify_detects_a_tampered_file(
    storage: S3Storage, stack_settings: Settings, names: tuple[str, str], tmp_path: Path
) -> None:
    model, blobs = names
    prefix = stack_settings.repository_prefix
    files = fake_model(tmp_path / "v1")
    staged = stage(storage, stack_settings, model, blobs, 1, files)
    key = f"{prefix}/{model}/1/model.onnx"

    storage.put_bytes(key, b"not the graph")
    with pytest.raises(StagingError, match="failed verification") as info:
        verify_staged(storage, model=model, version=1, repository_prefix=prefix)
    assert "model.onnx has 13 bytes" in str(info.value)

    # Same size, forged digest metadata: only a deep check (download and hash) sees it.
    original = files["model.onnx"].read_bytes()
    forged = bytes([original[0] ^ 0xFF]) + original[1:]
    storage.put_bytes(key, forged, metadata={"sha256": staged.files["model.onnx"].sha256})
    verify_staged(storage, model=model, version=1, repository_prefix=prefix)
    with pytest.raises(StagingError, match=r"model.onnx has sha256 .* \(content\)"):
        verify_staged(storage, model=model, version=1, repository_prefix=prefix, deep=True)

    storage.delete_key(key)
    with pytest.raises(StagingError, match="model.onnx is missing"):
        verify_staged(storage, model=model, version=1, repository_prefix=prefix)

    storage.put_bytes(f"{prefix}/{model}/1/release.json", b"{not json")
    with pytest.raises(StagingError, match="not valid JSON"):
        verify_staged(storage, model=model, version=1, repository_prefix=prefix)


def test_prune_keeps_the_newest_and_the_protected(
    storage: S3Storage, stack_settings: Settings, names: tuple[str, str], tmp_path: Path
) -> None:
    model, blobs = names
    prefix = stack_settings.repository_prefix
    for version in range(1, 6):
        files = fake_model(tmp_path / f"v{version}", weights=os.urandom(1024))
        stage(storage, stack_settings, model, blobs, version, files)
    # A crashed folder with no manifest is a version folder too (Triton would download it).
    storage.put_bytes(f"{prefix}/{model}/10/model.onnx", b"crashed")
    assert staged_versions(storage, model=model, repository_prefix=prefix) == [1, 2, 3, 4, 5]

    # Newest 3 folders are 10, 5, 4; of the older 1, 2, 3 only production (1) survives.
    pruned = prune_versions(storage, model=model, repository_prefix=prefix, keep=3,
                            protect={1})
    assert pruned == [2, 3]
    assert staged_versions(storage, model=model, repository_prefix=prefix) == [1, 4, 5]

    pruned = prune_versions(storage, model=model, repository_prefix=prefix, keep=1,
                            protect={1, 5})
    assert pruned == [4]
    assert staged_versions(storage, model=model, repository_prefix=prefix) == [1, 5]
    keys = set(storage.list_keys(f"{prefix}/{model}/"))
    gone = tuple(f"{prefix}/{model}/{v}/" for v in (2, 3, 4))
    assert not any(k.startswith(gone) for k in keys)
    assert f"{prefix}/{model}/config.pbtxt" in keys  # the model's config is never pruned
    verify_staged(storage, model=model, version=5, repository_prefix=prefix)

    # Pruning version 1 must not touch version 10 (keys share the "1" prefix).
    assert prune_versions(storage, model=model, repository_prefix=prefix, keep=1,
                          protect={5}) == [1]
    assert f"{prefix}/{model}/10/model.onnx" in set(storage.list_keys(f"{prefix}/{model}/"))


def test_wrong_credentials_are_refused_with_an_error_naming_them(
    stack_settings: Settings, names: tuple[str, str], tmp_path: Path
) -> None:
    model, blobs = names
    forged = S3Storage(endpoint=str(stack_settings.s3_endpoint), bucket=stack_settings.bucket,
                       access_key="not-the-key", secret_key="not-the-secret", timeout_s=5)
    # The S3 client raises CredentialsRejected (a UsageError, exit 2) for a refused key.
    with pytest.raises(CredentialsRejected, match="refused the credentials") as info:
        stage(forged, stack_settings, model, blobs, 1, fake_model(tmp_path / "v1"))
    assert "AWS_ACCESS_KEY_ID" in str(info.value)
    with pytest.raises(CredentialsRejected, match="refused the credentials"):
        verify_staged(forged, model=model, version=1,
                      repository_prefix=stack_settings.repository_prefix)


def test_an_unsigned_or_forged_manifest_is_refused(
    storage: S3Storage, stack_settings: Settings, names: tuple[str, str], tmp_path: Path
) -> None:
    """Issue 10: whoever can write the bucket can rewrite both a file and its manifest."""
    model, blobs = names
    prefix = stack_settings.repository_prefix
    files = fake_model(tmp_path / "v1")
    stage(storage, stack_settings, model, blobs, 1, files)
    mkey = f"{prefix}/{model}/1/release.json"
    signed = json.loads(storage.get_bytes(mkey))
    assert signed["signature"]["alg"] == "hmac-sha256"
    verify_staged(storage, model=model, version=1, repository_prefix=prefix, signing_key=KEY,
                  deep=True)

    # A tampered graph of the same size, with its metadata and the manifest rewritten.
    original = files["model.onnx"].read_bytes()
    tampered = bytes([original[0] ^ 0xFF]) + original[1:]
    digest = hashlib.sha256(tampered).hexdigest()
    storage.put_bytes(f"{prefix}/{model}/1/model.onnx", tampered, metadata={"sha256": digest})
    forged = json.loads(json.dumps(signed))
    forged["files"]["model.onnx"]["sha256"] = digest
    cases = {
        "it is not signed": {k: v for k, v in forged.items() if k != "signature"},
        "does not match its content": forged,
        "signed with another key": sign(forged, generate_key().encode()),
    }
    for reason, manifest in cases.items():
        storage.put_bytes(mkey, json.dumps(manifest).encode())
        # without the key only the (consistent) digests are checked: the forgery passes
        verify_staged(storage, model=model, version=1, repository_prefix=prefix, deep=True)
        with pytest.raises(StagingError, match=reason) as info:
            verify_staged(storage, model=model, version=1, repository_prefix=prefix,
                          signing_key=KEY)
        assert info.value.exit_code == 3

    # The genuine manifest over the tampered bytes (metadata forged to the genuine digest):
    # only the streamed hash catches it.
    storage.put_bytes(mkey, json.dumps(signed).encode())
    storage.put_bytes(f"{prefix}/{model}/1/model.onnx", tampered,
                      metadata={"sha256": signed["files"]["model.onnx"]["sha256"]})
    with pytest.raises(StagingError, match=r"model.onnx has sha256 .* \(content\)"):
        verify_staged(storage, model=model, version=1, repository_prefix=prefix,
                      signing_key=KEY, deep=True)


def test_staged_config_tells_an_unknown_model_from_an_unstaged_version(
    storage: S3Storage, stack_settings: Settings, names: tuple[str, str], tmp_path: Path
) -> None:
    model, blobs = names
    prefix = stack_settings.repository_prefix
    with pytest.raises(ModelNotFound) as info:
        staged_config(storage, repository_prefix=prefix, model=model, version=1)
    assert f"model {model!r} is unknown" in info.value.message
    assert "not staged" not in info.value.message and info.value.exit_code == 2
    stage(storage, stack_settings, model, blobs, 1, fake_model(tmp_path / "v1"))
    with pytest.raises(ModelNotFound) as info:
        staged_config(storage, repository_prefix=prefix, model=model, version=7)
    assert "version 7 of" in info.value.message and "staged: v1" in info.value.message
    assert staged_config(storage, repository_prefix=prefix, model=model, version=1).name == model
