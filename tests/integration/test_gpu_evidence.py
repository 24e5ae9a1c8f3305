"""The GPU paths of the canary and the swap against real Triton servers of the stack.

No GPU here, so each server's metrics are read through a loopback proxy that forwards the
real exposition and appends the ``nv_gpu_*`` gauges a GPU server would write, with the
used memory following what the real server has loaded: a base plus a fixed footprint per
READY version of the model. Everything else is real: the loads and unloads, the canary's
load order and scrapes, the gates, the report, the swap's preflight and phases.
"""

from __future__ import annotations

import contextlib
import http.server
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from flows.check import run_check
from modelship.clients import Clients, build_clients
from modelship.errors import ModelshipError, PreflightError
from modelship.policy import GpuPolicy, Policy, SwapPolicy
from modelship.settings import Settings
from modelship.triton.client import TritonServer
from modelship.triton.metrics import scrape_text
from tasks.canary import run_canary
from tasks.swap import SwapOptions, SwapTarget, swap_fleet
from tests import models

pytestmark = pytest.mark.integration

MODEL = "gpu_it"
MiB = 1024 * 1024
TOTAL = 24 * 1024 * MiB
BASE_USED = 2 * 1024 * MiB
FEED = {"input": np.random.default_rng(7).standard_normal((2, models.N_FEATURES))
        .astype(np.float32)}
POLICY: dict[str, Any] = {
    "canary": {"warmup_s": 0.5, "window_s": 1.0, "max_duration_s": 8.0, "min_samples": 50,
               "sequential": False},
    "gates": [
        {"name": "error_rate", "metric": "error_rate", "test": "exact_rate", "max_rate": 0.01},
        {"name": "gpu_growth", "metric": "gpu_memory_growth_pct", "max": 25.0},
        {"name": "gpu_growth_strict", "metric": "gpu_memory_growth_pct", "max": 10.0,
         "dry_run": True},
    ],
}


class GpuProxy:
    """``GET /metrics``: the upstream Triton's text plus one fake GPU whose used bytes are
    ``used_base`` plus ``footprints[v]`` per READY version of ``MODEL`` (24 GiB total)."""

    def __init__(self, upstream: TritonServer, footprints: Mapping[int, int], *,
                 used_base: int = BASE_USED) -> None:
        self.upstream, self.footprints, self.used_base = upstream, footprints, used_base
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802
                body = proxy.text().encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/metrics"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def used(self) -> int:
        ready = [int(m["version"]) for m in self.upstream.repository_index()
                 if m.get("name") == MODEL and m.get("state") == "READY"]
        return self.used_base + sum(self.footprints.get(v, 0) for v in ready)

    def text(self) -> str:
        gpu = 'gpu_uuid="GPU-00000000-1111-2222-3333-444444444444"'
        return (scrape_text(self.upstream.endpoint.metrics, 5.0)
                + "# TYPE nv_gpu_utilization gauge\n"
                + f"nv_gpu_utilization{{{gpu}}} 0.5\n"
                + "# TYPE nv_gpu_memory_total_bytes gauge\n"
                + f"nv_gpu_memory_total_bytes{{{gpu}}} {TOTAL}\n"
                + "# TYPE nv_gpu_memory_used_bytes gauge\n"
                + f"nv_gpu_memory_used_bytes{{{gpu}}} {self.used()}\n")

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def through(proxy: GpuProxy) -> TritonServer:
    """The upstream server, its metrics read through the proxy."""
    up = proxy.upstream
    endpoint = up.endpoint.model_copy(update={"metrics": proxy.url})
    return TritonServer(endpoint, timeout_s=up.timeout_s, control_timeout_s=up.control_timeout_s)


@dataclass(frozen=True)
class Staged:
    clients: Clients
    baseline: int
    candidate: int


@pytest.fixture(scope="module")
def staged(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[Staged]:
    clients = build_clients(stack_settings)
    uri = str(stack_settings.mlflow_tracking_uri)
    versions = []
    for seed in (0, 0):  # one artifact twice: the second check is the cache's pass
        version = models.register_sklearn(uri, MODEL, seed=seed, reuse=True)
        report = run_check(stack_settings, clients, Policy(), model=MODEL, version=version,
                           workdir=tmp_path_factory.mktemp(f"check{version}"), stage=True)
        assert report.verdict == "passed"
        versions.append(version)
    yield Staged(clients, versions[0], versions[1])
    for server in clients.replicas:  # leave the shared fleet as it was
        with contextlib.suppress(ModelshipError):
            server.unload_model(MODEL)
    clients.close()


def test_gpu_canary_measures_both_footprints_and_gates_on_growth(
        stack_settings: Settings, staged: Staged, tmp_path: Path) -> None:
    assert staged.clients.canary is not None
    proxy = GpuProxy(staged.clients.canary, {staged.baseline: 1000 * MiB,
                                             staged.candidate: 1200 * MiB})
    lines: list[str] = []
    try:
        clients = replace(staged.clients, canary=through(proxy))
        result = run_canary(stack_settings, clients, Policy.model_validate(POLICY), model=MODEL,
                            candidate=staged.candidate, baseline=staged.baseline,
                            progress=lines.append, report_dir=tmp_path / "report")
    finally:
        proxy.close()
    assert any("loading v" in line and "alone first" in line for line in lines), lines
    assert result.gpu is not None
    assert result.gpu.baseline_bytes == 1000 * MiB
    assert result.candidate_bytes == 1200 * MiB
    assert result.gpu.growth_pct == pytest.approx(20.0)
    assert result.gpu.load_scrapes >= 1 and result.gpu.utilization_mean == 0.5
    verdicts = {r.rule: r.verdict.value for r in result.gate_report.results}
    assert verdicts["gpu_growth"] == "passed" and verdicts["gpu_growth_strict"] == "failed"
    assert result.verdict == "passed" and result.skipped_rules == []
    assert result.cleanup == "unloaded"
    markdown = Path(result.report_paths["markdown"]).read_text()
    assert "## GPU (canary server)" in markdown and "candidate 1,200 MiB" in markdown


def _swap(stack_settings: Settings, staged: Staged, replicas: list[TritonServer], *,
          footprint_bytes: int | None, lines: list[str]) -> Any:
    assert staged.clients.storage is not None
    return swap_fleet(
        replicas,
        SwapTarget.from_settings(stack_settings, staged.clients.storage, model=MODEL,
                                 version=staged.candidate, probe_feed=FEED,
                                 probe_outputs=["label", "probabilities"],
                                 footprint_bytes=footprint_bytes),
        SwapOptions(SwapPolicy(deadline_s=60, probe_timeout_s=5.0),
                    gpu=GpuPolicy(headroom_bytes=256 * MiB),
                    http_timeout_s=stack_settings.http_timeout_s),
        progress=lines.append)


def test_swap_refuses_when_the_candidate_does_not_fit_and_swaps_when_it_does(
        stack_settings: Settings, staged: Staged) -> None:
    fleet = staged.clients.replicas
    # Tight: 1 GiB free on one replica's GPU, C needs 1200 MiB + 256 MiB.
    tight = [GpuProxy(fleet[0], {}, used_base=TOTAL - 1024 * MiB),
             *[GpuProxy(s, {}) for s in fleet[1:]]]
    lines: list[str] = []
    try:
        with pytest.raises(PreflightError) as refused:
            _swap(stack_settings, staged, [through(p) for p in tight],
                  footprint_bytes=1200 * MiB, lines=lines)
    finally:
        for proxy in tight:
            proxy.close()
    err = refused.value
    assert err.exit_code == 1
    assert f"{fleet[0].name} [GPU-00000000-1111-2222-3333-444444444444]: free 1,024 MiB, " \
           "needs 1,456 MiB (does NOT fit)" in err.message
    assert "measured" in err.message and "nothing was changed" in (err.hint or "")
    assert not [m for s in fleet for m in s.repository_index()
                if m.get("name") == MODEL and m.get("state") == "READY"], "a replica changed"

    # Roomy, no measurement: the estimate from C's initializers is used, and it fits.
    roomy = [GpuProxy(s, {}) for s in fleet]
    lines = []
    try:
        report = _swap(stack_settings, staged, [through(p) for p in roomy],
                       footprint_bytes=None, lines=lines)
    finally:
        for proxy in roomy:
            proxy.close()
    assert report.kind == "first_deploy" and not report.aborted
    assert report.headroom["footprint"]["source"] == "estimated"
    assert report.headroom["fits"] and len(report.headroom["checks"]) == len(fleet)
    assert any("(estimated:" in line for line in report.plan), report.plan
