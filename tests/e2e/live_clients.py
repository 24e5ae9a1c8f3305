"""Helpers of the e2e tests that send live traffic beside a release: the release and the
status in-process, the replicas' answers, and waiting for the swap (the live clients
themselves: :mod:`tests.e2e.organic`). Parameterized by model, for any e2e file."""

from __future__ import annotations

import json
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from modelship.clients import build_clients
from modelship.settings import Settings
from tests.inprocess import run_inprocess


def promote(settings: Settings, model: str, policy: Path, version: int) -> tuple[int, Any]:
    """The release of ``version`` (in-process): its exit code and record."""
    done = run_inprocess("promote", model, "--version", str(version), "--policy", str(policy),
                         "--json", home=settings.home)
    doc: dict[str, Any] = json.loads(done.stdout) if done.stdout.strip() else {
        "stderr": done.stderr[-4000:]}
    details: dict[str, Any] = doc.get("details") or {}
    return done.returncode, details.get("record", doc)


def status(settings: Settings, model: str) -> dict[str, Any]:
    return dict(json.loads(run_inprocess("status", model, "--json",
                                         home=settings.home).stdout))


def replica_urls(settings: Settings) -> list[str]:
    """The replicas' KServe HTTP base URLs (no client object: nothing to close)."""
    clients = build_clients(settings)
    try:
        return [r.endpoint.http for r in clients.replicas]
    finally:
        clients.close()


def serving_everywhere(urls: list[str], model: str, version: int) -> bool:
    """Every replica has ``version`` of ``model`` ready, asked over KServe HTTP.

    Not the gRPC client: these run in a thread beside an in-process release that uses gRPC
    itself, and a test worker once died of a segfault inside grpc's blocking call there."""
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/v2/models/{model}/versions/{version}/ready",
                                        timeout=5) as answer:
                if answer.status != 200:
                    return False
        except (urllib.error.URLError, OSError):
            return False
    return True


def when_serving(settings: Settings, model: str, done: threading.Event, version: int) -> bool:
    """Wait until every replica serves ``version`` (the swap is done, the bake begins);
    False when the release ended first."""
    urls = replica_urls(settings)
    deadline = time.monotonic() + 300
    while not done.is_set() and time.monotonic() < deadline:
        if serving_everywhere(urls, model, version):
            return True
        time.sleep(0.05)
    return False


def answered(urls: list[str], model: str) -> int:
    """Inferences of ``model`` the replicas answered (Triton's success counts, every
    version), asked over KServe HTTP (``/v2/models/M/stats``)."""
    total = 0
    for url in urls:
        with urllib.request.urlopen(f"{url}/v2/models/{model}/stats", timeout=5) as answer:
            stats = json.loads(answer.read())
        for entry in stats.get("model_stats") or []:
            total += int(entry.get("inference_stats", {}).get("success", {}).get("count", 0))
    return total
