"""The release candidate (issue 19 item 1): built once from the check and the staged
manifest (one read), its rows the bake replays."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from modelship.candidate import ResolvedVersion
from modelship.errors import ModelNotFound
from modelship.repository import manifest_key
from tasks.evidence import read_candidate_digest, release_candidate

RESOLVED = ResolvedVersion(name="m", version=3, flavor="onnx", flavors=("onnx",),
                           source="models:/m-1", run_id="r", signature=None, metrics={},
                           aliases=(), tags={}, local_dir=Path("/nowhere"))
MANIFEST = {"model": "m", "version": 3, "files": {"model.onnx": {"sha256": "a" * 64,
                                                                "size": 1}},
            "probe": {"inputs": {"x": [[1.0]]}}}


class FakeStorage:
    """Objects in a dict; counts the reads."""

    def __init__(self, objects: dict[str, bytes]) -> None:
        self.objects: dict[str, bytes] = objects
        self.reads: list[str] = []

    def exists(self, key: str) -> bool:
        return key in self.objects

    def get_bytes(self, key: str) -> bytes:
        self.reads.append(key)
        return self.objects[key]


def _storage(manifest: Any = MANIFEST) -> tuple[FakeStorage, bytes]:
    body = json.dumps(manifest).encode()
    return FakeStorage({manifest_key("P", "m", 3): body}), body


def test_the_candidate_reads_its_manifest_once_and_carries_digest_and_probe() -> None:
    storage, body = _storage()
    feed = {"x": np.arange(200, dtype=np.float32).reshape(100, 2)}
    release = release_candidate(storage, repository_prefix="P",  # type: ignore[arg-type]
                                resolved=RESOLVED, feed=feed, feed_source="artifact",
                                config_pbtxt='name: "m"')
    assert storage.reads == [manifest_key("P", "m", 3)]
    assert release.digest == {"model": "m", "version": 3, "onnx_sha256": "a" * 64,
                              "manifest_sha256": hashlib.sha256(body).hexdigest()}
    assert release.digest == read_candidate_digest(  # the same digest the swap binds to
        storage, repository_prefix="P", model="m", version=3)  # type: ignore[arg-type]
    assert release.probe == MANIFEST["probe"]
    assert (release.model, release.version, release.feed_source) == ("m", 3, "artifact")


@pytest.mark.parametrize(("rows", "expected"), [(64, 64), (1, 1), (100, 100), (500, 100)])
def test_rows_are_the_first_rows_of_the_feed(rows: int, expected: int) -> None:
    storage, _ = _storage()
    feed = {"x": np.arange(200, dtype=np.float32).reshape(100, 2),
            "y": np.arange(100, dtype=np.int64)}
    release = release_candidate(storage, repository_prefix="P",  # type: ignore[arg-type]
                                resolved=RESOLVED, feed=feed, feed_source="synthetic",
                                config_pbtxt="")
    got = release.rows(rows)
    assert {k: v.shape[0] for k, v in got.items()} == {"x": expected, "y": expected}
    np.testing.assert_array_equal(got["x"], feed["x"][:expected])


@pytest.mark.parametrize("manifest", [[1, 2], "text"])
def test_a_manifest_that_is_no_object_gives_a_digest_without_files(manifest: Any) -> None:
    storage, _ = _storage(manifest)
    release = release_candidate(storage, repository_prefix="P",  # type: ignore[arg-type]
                                resolved=RESOLVED, feed={}, feed_source="artifact",
                                config_pbtxt="")
    assert release.digest["onnx_sha256"] is None and release.probe is None


def test_an_unstaged_candidate_is_not_found() -> None:
    with pytest.raises(ModelNotFound, match="not staged"):
        release_candidate(FakeStorage({}), repository_prefix="P",  # type: ignore[arg-type]
                          resolved=RESOLVED, feed={}, feed_source="artifact", config_pbtxt="")
