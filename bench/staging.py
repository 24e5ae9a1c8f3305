"""Staging benchmark: content-addressed staging against a plain boto3 upload.

Starts its own SeaweedFS (``weed mini``) on free loopback ports in a temporary directory,
writes a random-bytes "model" of ``--mb`` MiB, then, against the same server:

1. ``plain``: boto3 ``upload_file`` with default settings (the baseline);
2. ``stage``: :func:`tasks.stage.stage_version` of version 1 (hash, upload the blob,
   server-side copy into the Triton version folder, manifest, verify);
3. ``restage``: the same version again (goal: 0 bytes uploaded);
4. ``new version``: version 2 with the same weights (goal: 0 bytes uploaded, copy only).

Throughput is file bytes / wall seconds (MB/s, 1 MB = 10^6 bytes). The figures go to
``bench/results/staging.json``; a short table goes to stdout. The server is always stopped.

Run: ``.venv/bin/python -m bench.staging [--mb 500]``.
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelship.policy import StagingPolicy
from modelship.stack import components as c
from modelship.stack.process import LOOPBACK, free_ports, start_process, stop_process, wait_ready
from modelship.storage import S3Storage

RESULTS = Path(__file__).resolve().parent / "results" / "staging.json"
BUCKET = "bench"
REPOSITORY_PREFIX = "triton"
MiB = 1024 * 1024


@dataclass(frozen=True)
class Server:
    """Where the benchmark's own S3 server listens, and its keys."""

    endpoint: str
    access_key: str
    secret_key: str

    def storage(self, policy: StagingPolicy) -> S3Storage:
        return S3Storage(
            endpoint=self.endpoint, bucket=BUCKET, access_key=self.access_key,
            secret_key=self.secret_key, timeout_s=60.0,
            multipart_threshold_bytes=policy.multipart_threshold_bytes,
            multipart_chunk_bytes=policy.multipart_chunk_bytes,
        )


def _weed() -> Path:
    found = shutil.which("weed", path=str(Path(sys.executable).parent)) or shutil.which("weed")
    if not found:
        raise SystemExit("the SeaweedFS binary `weed` was not found; run `make install`")
    return Path(found)


@contextmanager
def seaweed(workdir: Path) -> Iterator[Server]:
    """A private ``weed mini`` for the benchmark, stopped (by PID) whatever happens."""
    ports = dict(zip(c.SEAWEED_PORT_NAMES, free_ports(len(c.SEAWEED_PORT_NAMES)), strict=True))
    server = Server(f"http://{LOOPBACK}:{ports['s3']}", "bench" + secrets.token_hex(6),
                    secrets.token_hex(20))
    (workdir / "data").mkdir(parents=True, exist_ok=True)
    base_env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    proc, record = start_process(
        "seaweedfs",
        c.seaweed_command(_weed(), data_dir=workdir / "data", bucket=BUCKET, ports=ports),
        env=c.seaweed_env(base_env, access_key=server.access_key, secret_key=server.secret_key),
        log_path=workdir / "seaweedfs.log",
        ports=list(ports.values()),
    )
    try:
        probe = server.storage(StagingPolicy())

        def ready() -> bool:
            probe.ping()
            return True

        wait_ready(record, proc, ready, deadline_s=60.0)
        yield server
    finally:
        stop_process(record)
        try:
            proc.wait(timeout=5)
        except Exception:  # noqa: BLE001 - already reaped by stop_process
            pass
