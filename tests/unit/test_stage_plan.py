"""Staging plans, immutability checks and pruning are pure: tables, no S3."""

from __future__ import annotations

from pathlib import Path

import pytest

from modelship.errors import StagingError, UsageError
from modelship.repository import FileDigest, blob_key
from modelship.storage import S3Storage
from tasks.stage import (
    StagingAction,
    manifest_conflicts,
    plan_staging,
    prepare_staging,
    sha256_file,
    versions_to_prune,
)

A = FileDigest("a" * 64, 100)
B = FileDigest("b" * 64, 2_000)
VP = "triton/fraud/7"
BLOBS = "blobs/sha256"


def kinds(actions: list[StagingAction]) -> list[tuple[str, str]]:
    return [(a.kind, a.key) for a in actions]


@pytest.mark.parametrize(
    ("case", "digests", "blobs", "existing", "expected"),
    [
        (
            "new content: upload each blob, then copy it into place",
            {"model.onnx": A, "model.onnx.data": B}, {}, {},
            [("upload", f"{BLOBS}/{A.sha256}"), ("upload", f"{BLOBS}/{B.sha256}"),
             ("copy", f"{VP}/model.onnx"), ("copy", f"{VP}/model.onnx.data")],
        ),
        (
            "same weights as an earlier version: copy only, nothing uploaded",
            {"model.onnx": A, "model.onnx.data": B}, {B.sha256: B}, {},
            [("upload", f"{BLOBS}/{A.sha256}"),
             ("copy", f"{VP}/model.onnx"), ("copy", f"{VP}/model.onnx.data")],
        ),
        (
            "two files with the same bytes: one upload, two copies",
            {"a.bin": A, "b.bin": A}, {}, {},
            [("upload", f"{BLOBS}/{A.sha256}"), ("copy", f"{VP}/a.bin"), ("copy", f"{VP}/b.bin")],
        ),
        (
            "a blob whose size disagrees is uploaded again",
            {"model.onnx": A}, {A.sha256: FileDigest(A.sha256, 99)}, {},
            [("upload", f"{BLOBS}/{A.sha256}"), ("copy", f"{VP}/model.onnx")],
        ),
        (
            "a blob without digest metadata is uploaded again",
            {"model.onnx": A}, {A.sha256: FileDigest("", A.size)}, {},
            [("upload", f"{BLOBS}/{A.sha256}"), ("copy", f"{VP}/model.onnx")],
        ),
        (
            "crashed staging: intact files are skipped, wrong ones recopied, strays deleted",
            {"model.onnx": A, "model.onnx.data": B}, {A.sha256: A, B.sha256: B},
            {"model.onnx": A, "model.onnx.data": FileDigest("", 5), "old.bin": B,
             "config.pbtxt": FileDigest("c" * 64, 10)},
            [("skip", f"{VP}/model.onnx"), ("copy", f"{VP}/model.onnx.data"),
             ("delete", f"{VP}/old.bin")],
        ),
        (
            "a file in place but missing from the blob store is still skipped",
            {"model.onnx": A}, {}, {"model.onnx": A},
            [("skip", f"{VP}/model.onnx")],
        ),
    ],
)
def test_plan_staging(
    case: str,
    digests: dict[str, FileDigest],
    blobs: dict[str, FileDigest],
    existing: dict[str, FileDigest],
    expected: list[tuple[str, str]],
) -> None:
    plan = plan_staging(digests, existing_blobs=blobs, existing_files=existing,
                        version_prefix=VP, blob_prefix=BLOBS)
    assert kinds(plan) == expected, case


def test_plan_actions_carry_sources_and_sizes() -> None:
    plan = plan_staging({"model.onnx": A}, existing_blobs={}, existing_files={},
                        version_prefix=VP, blob_prefix="blobs/sha256/")
    upload, copy = plan
    assert upload.source == "model.onnx" and upload.size == A.size
    assert copy.source == blob_key("blobs/sha256", A.sha256) == f"{BLOBS}/{A.sha256}"
    assert "server-side" in copy.describe() and "upload model.onnx" in upload.describe()


@pytest.mark.parametrize(
    ("manifest", "digests", "config", "expected"),
    [
        ({"files": {"m": A.to_dict()}, "config_sha256": "c" * 64}, {"m": A}, "c" * 64, []),
        ({"files": {"m": A.to_dict()}, "config_sha256": "c" * 64}, {"m": B}, "c" * 64,
         [f"file m: sha {'a' * 12} != {'b' * 12}"]),
        ({"files": {"m": A.to_dict()}, "config_sha256": "c" * 64}, {"m": A, "n": B}, "c" * 64,
         [f"file n: sha absent != {'b' * 12}"]),
        ({"files": {"m": A.to_dict(), "n": B.to_dict()}, "config_sha256": "c" * 64},
         {"m": A}, "c" * 64, [f"file n: sha {'b' * 12} != absent"]),
        ({"files": {"m": A.to_dict()}, "config_sha256": "c" * 64}, {"m": A}, "d" * 64,
         [f"file config.pbtxt: sha {'c' * 12} != {'d' * 12}"]),
    ],
)
def test_manifest_conflicts(
    manifest: dict[str, object], digests: dict[str, FileDigest], config: str,
    expected: list[str],
) -> None:
    assert manifest_conflicts(manifest, digests, config) == expected


@pytest.mark.parametrize(
    ("existing", "keep", "protect", "expected"),
    [
        ([], 3, set(), []),
        ([1, 2], 3, set(), []),
        ([1, 2, 3], 3, set(), []),
        ([1, 2, 3, 4, 5], 3, set(), [1, 2]),
        ([5, 3, 1, 4, 2], 3, set(), [1, 2]),            # order of listing does not matter
        ([1, 2, 3, 4, 5], 3, {1}, [2]),                 # production is old: kept anyway
        ([1, 2, 3, 4, 5], 2, {2, 3}, [1]),              # production and previous protected
        ([1, 2, 3, 4, 5], 2, {5, 4}, [1, 2, 3]),        # protected among the newest
        ([1, 2, 3, 4, 5], 1, {1, 2, 3, 4, 5}, []),      # everything protected
        ([1, 2, 10, 11], 2, {7}, [1, 2]),               # a protected version that is absent
        ([2, 2, 3, 1], 2, set(), [1]),                  # duplicates count once
    ],
)
def test_versions_to_prune(
    existing: list[int], keep: int, protect: set[int], expected: list[int]
) -> None:
    assert versions_to_prune(existing, keep, protect) == expected


def test_versions_to_prune_refuses_keep_below_one() -> None:
    with pytest.raises(UsageError, match="keep must be at least 1"):
        versions_to_prune([1, 2], 0, set())


def test_sha256_file_is_streamed_and_exact(tmp_path: Path) -> None:
    import hashlib

    path = tmp_path / "blob"
    data = b"x" * (3 * 1024 * 1024 + 7)
    path.write_bytes(data)
    assert sha256_file(path) == FileDigest(hashlib.sha256(data).hexdigest(), len(data))


# Nothing listens on port 9: these inputs must be refused before any request is made.
OFFLINE = S3Storage(endpoint="http://127.0.0.1:9", bucket="b", access_key="k", secret_key="s")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"blob_prefix": "triton/blobs"}, "outside the repository prefix"),
        ({"blob_prefix": "triton"}, "outside the repository prefix"),
        ({"model": "a/b"}, "cannot be a Triton model folder"),
        ({"version": 0}, "cannot be a Triton version folder"),
        ({"files": {"release.json": Path("x")}}, "cannot go into a Triton version folder"),
        ({"files": {"../model.onnx": Path("x")}}, "cannot go into a Triton version folder"),
        ({"files": {}}, "no files given"),
    ],
)
def test_bad_inputs_are_refused_before_any_request(
    kwargs: dict[str, object], message: str
) -> None:
    args: dict[str, object] = {"model": "fraud", "version": 7,
                               "files": {"model.onnx": Path("x")}, "config_pbtxt": "",
                               "repository_prefix": "triton", "blob_prefix": "blobs/sha256"}
    args.update(kwargs)
    with pytest.raises(UsageError, match=message):
        prepare_staging(OFFLINE, **args)  # type: ignore[arg-type]


def test_an_unreadable_local_file_is_a_staging_error(tmp_path: Path) -> None:
    with pytest.raises(StagingError, match="cannot read .*missing.onnx"):
        sha256_file(tmp_path / "missing.onnx")
