"""How ``stack up`` waits for its servers and how the stack's servers are stopped.

- The wait ends at the first failure of any server, whichever place it has in the list: a
  Triton that dies at once is reported while Prefect is still booting, and everything
  stops then (it used to wait for each earlier server's readiness first).
- ``down`` and a failed startup stop the servers all at once, the S3 server last (Triton
  and MLflow read from it until they stop).
"""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from modelship.errors import StackError
from modelship.stack import manager
from modelship.stack.process import ProcessRecord


def _record(name: str) -> ProcessRecord:
    return ProcessRecord(name=name, pid=1, start_ticks=1, ports=(), log="")


def test_the_first_failure_ends_the_wait_while_earlier_servers_still_boot() -> None:
    booting = threading.Event()
    with ThreadPoolExecutor(max_workers=2) as pool:
        slow: Future[None] = pool.submit(booting.wait, 30)  # type: ignore[arg-type]

        def dies() -> None:
            raise StackError("triton-0 exited with code 3 during startup")

        failed: Future[None] = pool.submit(dies)
        with pytest.raises(StackError, match="triton-0 exited"):
            manager._settle({slow, failed})
        assert not slow.done()  # the wait did not sit on the slow one
        booting.set()


def test_settle_until_returns_what_still_runs_once_that_one_is_ready() -> None:
    gate, later = threading.Event(), threading.Event()
    with ThreadPoolExecutor(max_workers=2) as pool:
        s3: Future[None] = pool.submit(gate.wait, 30)  # type: ignore[arg-type]
        other: Future[None] = pool.submit(later.wait, 30)  # type: ignore[arg-type]
        gate.set()
        assert manager._settle({s3, other}, until=s3) == {other}
        later.set()
        assert manager._settle({other}) == set()


@pytest.mark.parametrize("names", [
    ["seaweedfs", "prefect", "mlflow", "slack", "triton-0", "canary", "gateway"],
    ["seaweedfs"],
    ["mlflow", "prefect"],
])
def test_servers_stop_at_once_and_s3_last(monkeypatch: pytest.MonkeyPatch,
                                          names: list[str]) -> None:
    others = [n for n in names if n != "seaweedfs"]
    # every server but S3 must be inside its stop at the same time, or this times out
    together = threading.Barrier(len(others)) if others else None
    stopped: list[str] = []
    lock = threading.Lock()

    def stop(record: ProcessRecord, **kwargs: Any) -> bool:
        if record.name == "seaweedfs":
            assert sorted(stopped) == sorted(others), "S3 stopped before what reads from it"
        else:
            assert together is not None
            together.wait(timeout=10)
            assert kwargs["clean_shm"] == manager._is_triton(record.name)
        with lock:
            stopped.append(record.name)
        return record.name != "slack"  # slack: already gone

    monkeypatch.setattr(manager, "stop_process", stop)
    result = manager._stop_records([_record(n) for n in names])
    assert result == {n: n != "slack" for n in names}
    assert stopped[-1] == "seaweedfs" or "seaweedfs" not in names
