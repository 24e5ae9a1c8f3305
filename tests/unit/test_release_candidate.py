"""The release candidate (issue 19 item 1): the stage hands over the manifest it verified
and the sha256 of its bytes as read back, so the candidate is built without reading the
manifest again; its digest is the one the swap and the approvals bind to."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelship.candidate import GoldenInputs, ResolvedVersion
from modelship.errors import StagingError
from modelship.policy import StagingPolicy
from modelship.repository import CONFIG_NAME, manifest_key, read_verified
from tasks.check import CheckReport
from tasks.evidence import read_candidate_digest, release_candidate
from tasks.stage import stage_version

KEY = b"k" * 32
RESOLVED = ResolvedVersion(name="m", version=3, flavor="onnx", flavors=("onnx",),
                           source="models:/m-1", run_id="r", signature=None, metrics={},
                           aliases=(), tags={}, local_dir=Path("/nowhere"))


class MemoryS3:
    """An in-memory bucket with S3Storage's calls; ``reads`` lists every GET, in order."""

    bucket = "mem"

    def __init__(self) -> None:
        self.objects: dict[str, tuple[bytes, dict[str, str]]] = {}
        self.reads: list[str] = []

    def exists(self, key: str) -> bool:
        return key in self.objects

    def head(self, key: str) -> dict[str, Any] | None:
        if key not in self.objects:
            return None
        data, meta = self.objects[key]
        return {"size": len(data), "metadata": dict(meta)}

    def put_bytes(self, key: str, data: bytes, *, metadata: dict[str, str] | None = None
                  ) -> None:
        self.objects[key] = (bytes(data), dict(metadata or {}))

    def get_bytes(self, key: str) -> bytes:
        self.reads.append(key)
        return self.objects[key][0]

    def iter_bytes(self, key: str, *, chunk_bytes: int = 1 << 20) -> Iterator[bytes]:
        self.reads.append(key)
        yield self.objects[key][0]

    def upload_file_parts(self, path: Path, key: str, *,
                          metadata: dict[str, str] | None = None, **_: Any) -> None:
        self.put_bytes(key, path.read_bytes(), metadata=metadata)

    def copy_object(self, source_key: str, key: str, *,
                    metadata: dict[str, str] | None = None, **_: Any) -> None:
        data, meta = self.objects[source_key]
        self.objects[key] = (data, dict(metadata if metadata is not None else meta))

    def delete_key(self, key: str) -> None:
        self.objects.pop(key, None)

    def list_keys(self, prefix: str) -> Iterator[str]:
        yield from sorted(k for k in self.objects if k.startswith(prefix))


def _stage(storage: MemoryS3, tmp_path: Path) -> dict[str, Any]:
    onnx = tmp_path / "model.onnx"
    onnx.write_bytes(b"graph bytes")
    staged = stage_version(storage, model="m", version=3,  # type: ignore[arg-type]
                           files={"model.onnx": onnx}, config_pbtxt='name: "m"\n',
                           provenance={"uri": "models:/m/3"}, policy=StagingPolicy(),
                           repository_prefix="P", signing_key=KEY)
    return staged.to_dict()


def _report(staged: dict[str, Any] | None, feed: dict[str, Any] | None = None,
            **fields: Any) -> CheckReport:
    """What run_check(stage=True) hands over."""
    found: dict[str, Any] = {"resolved": RESOLVED, "config_pbtxt": 'name: "m"\n',
                             "golden": GoldenInputs("artifact", Path("/nowhere/g.parquet"),
                                                    100), **fields}
    return CheckReport(model="m", version=3, verdict="passed", staged=staged,
                       feed=feed or {}, **found)


def _candidate(staged: dict[str, Any] | None, feed: dict[str, Any] | None = None) -> Any:
    return release_candidate(_report(staged, feed))


def test_the_stage_reads_its_manifest_back_once_and_hands_over_its_digest(
        tmp_path: Path) -> None:
    storage = MemoryS3()
    staged = _stage(storage, tmp_path)
    mkey = manifest_key("P", "m", 3)
    # the publish check: manifest and config read back once each, nothing else read
    assert storage.reads == [mkey, f"P/m/3/{CONFIG_NAME}"]
    assert staged["manifest_sha256"] == hashlib.sha256(storage.objects[mkey][0]).hexdigest()

    storage.reads.clear()
    release = _candidate(staged)
    assert storage.reads == []  # the candidate reads nothing
    assert release.digest == read_candidate_digest(  # the digest the swap binds to
        storage, repository_prefix="P", model="m", version=3)  # type: ignore[arg-type]
    assert release.digest["onnx_sha256"] == hashlib.sha256(b"graph bytes").hexdigest()


def test_staging_the_same_content_again_hands_over_the_same_digest(tmp_path: Path) -> None:
    storage = MemoryS3()
    first = _stage(storage, tmp_path)
    storage.reads.clear()
    again = _stage(storage, tmp_path)
    # the plan reads the manifest (and finds it staged), the verification reuses that read
    assert storage.reads == [manifest_key("P", "m", 3), f"P/m/3/{CONFIG_NAME}"]
    assert again["already_staged"] and again["manifest_sha256"] == first["manifest_sha256"]
    assert _candidate(again).digest == _candidate(first).digest


def test_the_candidate_carries_the_manifest_probe(tmp_path: Path) -> None:
    staged = _stage(MemoryS3(), tmp_path)
    probe = {"inputs": {"x": [[1.0]]}}
    release = _candidate({**staged, "manifest": {**staged["manifest"], "probe": probe}})
    assert release.probe == probe
    assert (release.model, release.version, release.feed_source) == ("m", 3, "artifact")


@pytest.mark.parametrize(("rows", "expected"), [(64, 64), (1, 1), (100, 100), (500, 100)])
def test_rows_are_the_first_rows_of_the_feed(tmp_path: Path, rows: int,
                                             expected: int) -> None:
    feed = {"x": np.arange(200, dtype=np.float32).reshape(100, 2),
            "y": np.arange(100, dtype=np.int64)}
    release = _candidate(_stage(MemoryS3(), tmp_path), feed)
    got = release.rows(rows)
    assert {k: v.shape[0] for k, v in got.items()} == {"x": expected, "y": expected}
    np.testing.assert_array_equal(got["x"], feed["x"][:expected])


@pytest.mark.parametrize("change", [
    {"manifest_sha256": None},  # a stage that verified nothing
    {"manifest_sha256": "ab"},
    {"manifest": None},
    {"manifest": {"model": "m", "version": 4}},  # another version's manifest
    {"manifest": {"model": "other", "version": 3}},
])
def test_a_stage_without_a_verified_manifest_of_this_version_is_refused(
        tmp_path: Path, change: dict[str, Any]) -> None:
    staged = {**_stage(MemoryS3(), tmp_path), **change}
    with pytest.raises(StagingError, match="no verified manifest"):
        _candidate(staged)


@pytest.mark.parametrize("staged", [None, {"dry_run": True, "plan": []}])
def test_a_check_that_did_not_stage_is_no_candidate(staged: dict[str, Any] | None) -> None:
    with pytest.raises(StagingError, match="no verified manifest"):
        _candidate(staged)


@pytest.mark.parametrize("missing", ["resolved", "golden", "config_pbtxt"])
def test_a_check_without_its_findings_is_no_candidate(tmp_path: Path, missing: str) -> None:
    staged = _stage(MemoryS3(), tmp_path)
    with pytest.raises(StagingError, match="no verified manifest"):
        release_candidate(_report(staged, **{missing: None}))


def test_a_manifest_handed_to_the_verification_is_verified_all_the_same(
        tmp_path: Path) -> None:
    storage = MemoryS3()
    staged = _stage(storage, tmp_path)
    forged = {**staged["manifest"], "config_sha256": "0" * 64}  # its signature no longer fits
    with pytest.raises(StagingError, match="refused"):
        read_verified(storage, model="m", version=3, repository_prefix="P",  # type: ignore[arg-type]
                      signing_key=KEY, deep=False, manifest_read=(forged, "f" * 64))
    found = read_verified(storage, model="m", version=3, repository_prefix="P",  # type: ignore[arg-type]
                          signing_key=KEY, deep=False,
                          manifest_read=(staged["manifest"], staged["manifest_sha256"]))
    assert found.manifest_sha256 == staged["manifest_sha256"]
