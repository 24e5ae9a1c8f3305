"""The release lock on the session's Prefect server: a SIGKILLed holder on this host is taken
over at once; a live holder never is."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from modelship.errors import ReleaseLocked
from modelship.locks import list_locks, release_lock
from modelship.settings import Settings

pytestmark = pytest.mark.integration

HOLD = """
import sys, time
from pathlib import Path
from modelship.locks import release_lock
with release_lock(sys.argv[1], prefect_api_url=sys.argv[2], home=Path(sys.argv[3]),
                  release_id=sys.argv[4], kind="promote"):
    print("held", flush=True)
    time.sleep(600)
"""


def _holder(settings: Settings, model: str, release_id: str) -> subprocess.Popen[str]:
    process = subprocess.Popen(
        [sys.executable, "-c", HOLD, model, str(settings.prefect_api_url), str(settings.home),
         release_id], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def test_a_killed_holder_on_this_host_is_taken_over_at_once(stack_settings: Settings) -> None:
    model = "lock-takeover"
    process = _holder(stack_settings, model, "dead-run")
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)
    (row,) = list_locks(prefect_api_url=stack_settings.prefect_api_url,
                        home=Path(stack_settings.home), model=model)
    assert row["held"] and row["holder_alive"] is False  # its lease still holds the slot

    with release_lock(model, prefect_api_url=stack_settings.prefect_api_url,
                      home=stack_settings.home, release_id="next-run") as lock:
        assert lock.took_over is not None and lock.took_over.release_id == "dead-run"
        (row,) = list_locks(prefect_api_url=stack_settings.prefect_api_url,
                            home=Path(stack_settings.home), model=model)
        assert row["holder"]["release_id"] == "next-run" and row["holder_alive"] is True


def test_a_live_holder_is_never_taken_over(stack_settings: Settings) -> None:
    model = "lock-live"
    process = _holder(stack_settings, model, "live-run")
    try:
        with pytest.raises(ReleaseLocked) as refused:
            with release_lock(model, prefect_api_url=stack_settings.prefect_api_url,
                              home=stack_settings.home, release_id="second"):
                pass
        assert "live-run" in refused.value.message
    finally:
        process.kill()
        process.wait(timeout=10)
