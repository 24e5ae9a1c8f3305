"""`modelship swap` outside a release sizes the GPU headroom by the footprint C's canary
measured, read from the release ledger when the staged digest matches, else estimates it;
the plan and the JSON say which. The stack's real replicas, their metrics read through
loopback proxies that add a GPU (tests/integration/test_gpu_evidence.py); dry runs, so
nothing on the shared fleet changes."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from flows import standalone
from flows.check import run_check
from modelship.clients import Clients, build_clients
from modelship.errors import PreflightError
from modelship.ledger import Ledger, ReleaseRecord
from modelship.policy import Policy
from modelship.settings import Settings
from tasks.evidence import read_candidate_digest
from tests import models
from tests.integration.test_gpu_evidence import TOTAL, GpuProxy, through

pytestmark = pytest.mark.integration

MODEL = "gpu_ledger_it"
MiB = 1024 * 1024


@pytest.fixture(scope="module")
def staged(stack_settings: Settings, tmp_path_factory: pytest.TempPathFactory
           ) -> Iterator[tuple[Clients, int]]:
    clients = build_clients(stack_settings)
    # reuse: the check of these bytes may be in the cache (the ledger is the subject)
    version = models.register_sklearn(str(stack_settings.mlflow_tracking_uri), MODEL, seed=1,
                                      reuse=True)
    report = run_check(stack_settings, clients, Policy(), model=MODEL, version=version,
                       workdir=tmp_path_factory.mktemp("check"), stage=True)
    assert report.verdict == "passed"
    yield clients, version
    clients.close()


def _record(clients: Clients, settings: Settings, version: int, *, candidate_bytes: int,
            restaged: bool = False) -> ReleaseRecord:
    """A standalone canary's record of ``version`` that measured C's GPU footprint."""
    assert clients.storage is not None
    digest = read_candidate_digest(clients.storage, repository_prefix=settings.repository_prefix,
                                   model=MODEL, version=version)
    if restaged:
        digest = {**digest, "manifest_sha256": "0" * 64}
    record = ReleaseRecord.start("canary", MODEL, from_version=None, to_version=version,
                                 candidate=digest)
    record.gates = {"verdict": "passed", "baseline": None, "candidate": version,
                    "gpu": {"candidate_bytes": candidate_bytes, "baseline_bytes": None}}
    record.finish("passed", 0)
    Ledger(clients.storage).write(record)
    return record


def _dry_swap(settings: Settings, clients: Clients, version: int,
              proxies: list[GpuProxy]) -> dict[str, object]:
    gpu_clients = replace(clients, replicas=[through(p) for p in proxies])
    return standalone.swap(settings, gpu_clients, Policy(), model=MODEL, target=version,
                      force=True, dry_run=True)


def test_the_swap_sizes_headroom_by_the_recorded_measurement_else_the_estimate(
        stack_settings: Settings, staged: tuple[Clients, int], tmp_path: Path) -> None:
    clients, version = staged
    # 1 GiB free on the first replica's GPU: the recorded 1200 MiB (+256 MiB) do not fit.
    proxies = [GpuProxy(clients.replicas[0], {}, used_base=TOTAL - 1024 * MiB),
               *[GpuProxy(s, {}) for s in clients.replicas[1:]]]
    try:
        # Measured for other bytes (re-staged since): estimated from the initializers.
        _record(clients, stack_settings, version, candidate_bytes=1200 * MiB, restaged=True)
        estimated = _dry_swap(stack_settings, clients, version, proxies)
        assert estimated["footprint"]["source"] == "estimate"  # type: ignore[index]
        assert "other bytes" in estimated["footprint"]["detail"]  # type: ignore[index]
        headroom = estimated["headroom"]
        assert isinstance(headroom, dict) and headroom["fits"]
        assert headroom["footprint"]["source"] == "estimated"
        assert headroom["footprint"]["bytes_per_gpu"] < 1024 * MiB - 256 * MiB

        # The canary measured these bytes: that measurement is used, and does not fit.
        time.sleep(1.1)  # release ids sort by the second: this record is the newest
        measured = _record(clients, stack_settings, version, candidate_bytes=1200 * MiB)
        with pytest.raises(PreflightError) as refused:
            _dry_swap(stack_settings, clients, version, proxies)
    finally:
        for proxy in proxies:
            proxy.close()
    err = refused.value
    assert err.exit_code == 1
    assert f"measured by the canary of release {measured.id}" in err.message
    assert "free 1,024 MiB, needs 1,456 MiB (does NOT fit)" in err.message
    served = [m for s in clients.replicas for m in s.repository_index()
              if m.get("name") == MODEL and m.get("state") == "READY"]
    assert served == [], "a dry run changed a replica"
