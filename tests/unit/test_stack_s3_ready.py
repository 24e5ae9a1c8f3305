"""The stack's S3 readiness means objects read back, not only that HEAD answers.

A restarted SeaweedFS answers HEAD from its filer's metadata before its volume server has
registered its volumes, and every GET fails until then: ``stack up`` returned "restarted"
while the next read of the production pin failed with InternalError (the fault matrix's
S3 cell). ``_s3_bucket_ready`` (polled by ``wait_ready``, any exception meaning "not yet")
must therefore read the marker back.
"""

from __future__ import annotations

from typing import Any

import pytest

import modelship.storage
from modelship.errors import StorageError
from modelship.stack import manager


class FakeS3:
    """An S3 whose metadata answers and whose object reads may not, yet."""

    objects: dict[str, bytes] = {}
    readable = True

    def __init__(self, **_kwargs: Any) -> None:
        pass

    def ping(self) -> None:
        pass

    def exists(self, key: str) -> bool:
        return key in self.objects

    def put_bytes(self, key: str, data: bytes) -> None:
        self.objects[key] = data

    def get_bytes(self, key: str) -> bytes:
        if not self.readable:
            raise StorageError(f"failed to read s3://bucket/{key}: InternalError")
        return self.objects[key]


def _ready() -> bool:
    return manager._s3_bucket_ready("http://127.0.0.1:1", "bucket", "a", "s", "us-east-1",
                                    "triton")


@pytest.mark.parametrize(("marker", "readable", "ready"), [
    (False, True, True),   # a fresh stack: the marker is written and reads back
    (True, True, True),    # a restart whose volumes are registered
    (True, False, False),  # a restart whose volume server has not registered yet
])
def test_ready_only_when_the_marker_reads_back(monkeypatch: pytest.MonkeyPatch, marker: bool,
                                                readable: bool, ready: bool) -> None:
    monkeypatch.setattr(FakeS3, "objects", {f"triton/{manager.REPOSITORY_MARKER}": b"x"} if marker
                        else {})
    monkeypatch.setattr(FakeS3, "readable", readable)
    monkeypatch.setattr(modelship.storage, "S3Storage", FakeS3)
    if ready:
        assert _ready() is True
        assert FakeS3.objects  # the marker is there
    else:
        with pytest.raises(StorageError):
            _ready()
