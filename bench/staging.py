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
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from modelship.policy import StagingPolicy
from modelship.signing import generate_key
from modelship.stack import components as c
from modelship.stack.process import LOOPBACK, free_ports, start_process, stop_process, wait_ready
from modelship.storage import S3Storage
from tasks.stage import StagedVersion, stage_version

RESULTS = Path(__file__).resolve().parent / "results" / "staging.json"
BUCKET = "bench"
CONFIG_PBTXT = 'name: "bench"\nbackend: "onnxruntime"\nmax_batch_size: 8\n'
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


def _write_random(path: Path, size_bytes: int) -> None:
    """Incompressible bytes, written in 8 MiB blocks (constant memory)."""
    block = 8 * MiB
    with open(path, "wb") as fh:
        left = size_bytes
        while left > 0:
            n = min(block, left)
            fh.write(os.urandom(n))
            left -= n


def _mbps(size_bytes: int, seconds: float) -> float:
    return round(size_bytes / 1e6 / seconds, 1) if seconds > 0 else float("inf")


def run(mb: int, workdir: Path, *, rounds: int = 1) -> dict[str, Any]:
    """Time plain boto3 against stage_version on one private SeaweedFS; the figures."""
    signing_key = generate_key().encode()
    policy = StagingPolicy()
    size = mb * MiB
    files = _model_files(workdir / "model", size)
    total = size + 4096

    with seaweed(workdir / "seaweedfs") as server:
        storage = server.storage(policy)
        # Warm the server up (volume allocation) so neither side pays for it.
        storage.put_bytes("warmup/blob", os.urandom(4 * MiB))
        plain_s: list[float] = []
        stage_s: list[float] = []
        first = None
        for i in range(rounds):
            t0 = time.monotonic()
            for name, path in files.items():  # boto3 defaults: 8 MiB parts, 10 threads
                storage.client.upload_file(str(path), BUCKET, f"plain/{i}/{name}")
            plain_s.append(time.monotonic() - t0)

            # A fresh blob store per round, so every round really uploads.
            staged = _stage(storage, files, policy, signing_key, version=1 + 10 * i, round_=i)
            stage_s.append(staged.seconds)
            first = first or staged
        assert first is not None
        restaged = _stage(storage, files, policy, signing_key, version=1, round_=0)
        next_version = _stage(storage, files, policy, signing_key, version=2, round_=0)

    plain_best, stage_best = min(plain_s), min(stage_s)
    return {
        "benchmark": "staging",
        "created_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "server": "SeaweedFS weed mini (loopback)",
        "model_bytes": total,
        "rounds": rounds,
        "policy": {"multipart_threshold_bytes": policy.multipart_threshold_bytes,
                   "multipart_chunk_bytes": policy.multipart_chunk_bytes},
        "plain_upload": {"seconds": [round(s, 3) for s in plain_s],
                         "mb_per_s": _mbps(total, plain_best)},
        "stage_first": {"seconds": [round(s, 3) for s in stage_s],
                        "mb_per_s": _mbps(total, stage_best),
                        "bytes_uploaded": first.bytes_uploaded,
                        "bytes_copied": first.bytes_copied},
        "throughput_ratio": round(plain_best / stage_best, 3),
        "throughput_ratio_median": round(statistics.median(plain_s) / statistics.median(stage_s),
                                         3),
        "restage": {"seconds": round(restaged.seconds, 3),
                    "bytes_uploaded": restaged.bytes_uploaded,
                    "bytes_copied": restaged.bytes_copied,
                    "already_staged": restaged.already_staged},
        "new_version_same_weights": {"seconds": round(next_version.seconds, 3),
                                     "bytes_uploaded": next_version.bytes_uploaded,
                                     "bytes_copied": next_version.bytes_copied},
    }


def _model_files(model_dir: Path, size_bytes: int) -> dict[str, Path]:
    """An ONNX-shaped model of random bytes: a 4 KiB graph and ``size_bytes`` of weights."""
    model_dir.mkdir()
    weights = model_dir / "model.onnx.data"
    graph = model_dir / "model.onnx"
    _write_random(weights, size_bytes)
    _write_random(graph, 4096)
    return {"model.onnx": graph, "model.onnx.data": weights}


def _stage(storage: S3Storage, files: dict[str, Path], policy: StagingPolicy,
           signing_key: bytes, *, version: int, round_: int) -> StagedVersion:
    """stage_version of the bench model into round ``round_``'s own blob store."""
    return stage_version(
        storage, model="bench", version=version, files=files, config_pbtxt=CONFIG_PBTXT,
        provenance={"bench": "staging", "round": round_}, policy=policy,
        repository_prefix=REPOSITORY_PREFIX, blob_prefix=f"blobs-{round_}/sha256",
        signing_key=signing_key,
    )


def _table(r: dict[str, Any]) -> str:
    rows = [
        ("plain boto3 upload_file", r["plain_upload"]["seconds"], r["plain_upload"]["mb_per_s"],
         r["model_bytes"], 0),
        ("stage_version (new)", r["stage_first"]["seconds"], r["stage_first"]["mb_per_s"],
         r["stage_first"]["bytes_uploaded"], r["stage_first"]["bytes_copied"]),
        ("stage_version (again)", [r["restage"]["seconds"]], "-",
         r["restage"]["bytes_uploaded"], r["restage"]["bytes_copied"]),
        ("stage_version (v2, same)", [r["new_version_same_weights"]["seconds"]], "-",
         r["new_version_same_weights"]["bytes_uploaded"],
         r["new_version_same_weights"]["bytes_copied"]),
    ]
    lines = [f"{'run':<26} {'best s':>8} {'MB/s':>8} {'uploaded B':>12} {'copied B':>12}"]
    for name, secs, mbps, up, copied in rows:
        lines.append(f"{name:<26} {min(secs):>8.2f} {mbps!s:>8} {up:>12} {copied:>12}")
    lines.append(f"throughput ratio ours/plain, first staging: {r['throughput_ratio']} (best "
                 f"of {r['rounds']}), {r['throughput_ratio_median']} (median)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.staging", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--mb", type=int, default=500, help="model size in MiB (default 500)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="timed rounds of each upload; the best counts (default 3)")
    parser.add_argument("--out", type=Path, default=RESULTS, help="where the JSON goes")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="modelship-bench-") as tmp:
        result = run(args.mb, Path(tmp), rounds=args.rounds)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(_table(result))
    print(f"figures written to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
