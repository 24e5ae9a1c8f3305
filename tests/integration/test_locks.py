"""The release lock and the canary slot on the session's S3 server (SeaweedFS): conditional
puts let exactly one writer win; a SIGKILLed holder on this host is taken over at once; a
live holder never is; an unknown holder is freed only once nothing renews it; the end of a
release is bounded when S3 stops answering; queued canary slots never overlap."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from modelship import locks
from modelship.clients import build_clients
from modelship.errors import ReleaseLocked, UsageError
from modelship.locks import break_lock, canary_slot, list_locks, lock_key, release_lock
from modelship.settings import Settings
from modelship.storage import S3Storage
from tests.conftest import run_cli

pytestmark = pytest.mark.integration

HOLD = """
import sys, time
from pathlib import Path
from modelship.clients import build_clients
from modelship.locks import release_lock
from modelship.settings import load_settings
settings = load_settings(home=Path(sys.argv[2]))
with release_lock(sys.argv[1], storage=build_clients(settings).storage, home=settings.home,
                  release_id=sys.argv[3], kind="promote"):
    print("held", flush=True)
    time.sleep(600)
"""


@pytest.fixture(scope="module")
def storage(stack_settings: Settings) -> Iterator[S3Storage]:
    clients = build_clients(stack_settings)
    assert clients.storage is not None
    yield clients.storage
    clients.close()


def _model(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:6]}"


def _holder(settings: Settings, model: str, release_id: str) -> subprocess.Popen[str]:
    process = subprocess.Popen([sys.executable, "-c", HOLD, model, str(settings.home),
                                release_id], stdout=subprocess.PIPE, text=True)
    assert process.stdout is not None and process.stdout.readline().strip() == "held"
    return process


def _killed(settings: Settings, model: str, release_id: str) -> None:
    process = _holder(settings, model, release_id)
    os.kill(process.pid, signal.SIGKILL)
    process.wait(timeout=10)


def test_of_many_writers_at_once_exactly_one_takes_the_lock(storage: S3Storage,
                                                            tmp_path: Path) -> None:
    model, won, refused = _model("lock-race"), [], []
    barrier, release = threading.Barrier(8), threading.Event()

    def take(i: int) -> None:
        barrier.wait()
        try:
            with release_lock(model, storage=storage, home=tmp_path, release_id=f"r{i}"):
                won.append(i)
                release.wait(10)
        except ReleaseLocked:
            refused.append(i)

    threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + 30
    while len(won) + len(refused) < 8 and len(refused) < 7 and time.monotonic() < deadline:
        time.sleep(0.05)
    release.set()
    for thread in threads:
        thread.join(15)
    assert len(won) == 1 and len(refused) == 7, (won, refused)
    assert list_locks(storage=storage, home=tmp_path, model=model) == []  # released


def test_a_killed_holder_on_this_host_is_taken_over_at_once(stack_settings: Settings,
                                                            storage: S3Storage) -> None:
    model = _model("lock-takeover")
    _killed(stack_settings, model, "dead-run")
    (row,) = list_locks(storage=storage, home=stack_settings.home, model=model)
    assert row["held"] and row["holder_alive"] is False and row["holder"]["release_id"] == \
        "dead-run"

    with release_lock(model, storage=storage, home=stack_settings.home,
                      release_id="next-run") as lock:
        assert lock.took_over is not None and lock.took_over.release_id == "dead-run"
        (row,) = list_locks(storage=storage, home=stack_settings.home, model=model)
        assert row["holder"]["release_id"] == "next-run" and row["holder_alive"] is True
        lock.renew()  # a heartbeat: still ours
        assert lock.lost is None
    assert lock.release_error is None


def test_a_live_holder_is_never_taken_over_nor_unlocked(stack_settings: Settings,
                                                        storage: S3Storage) -> None:
    model = _model("lock-live")
    process = _holder(stack_settings, model, "live-run")
    try:
        with pytest.raises(ReleaseLocked) as refused:
            with release_lock(model, storage=storage, home=stack_settings.home,
                              release_id="second"):
                pass
        assert "live-run" in refused.value.message
        with pytest.raises(ReleaseLocked, match="holder is alive"):
            break_lock(model, "live-run", storage=storage, home=stack_settings.home)
    finally:
        process.kill()
        process.wait(timeout=10)


def test_unlock_frees_a_gone_holder_and_says_how_it_knew(stack_settings: Settings,
                                                         storage: S3Storage) -> None:
    model = _model("lock-unlock")
    _killed(stack_settings, model, "gone-run")
    wrong = run_cli("unlock", model, "--release", "other", "--json", home=stack_settings.home)
    assert wrong.returncode == 2, wrong.stderr
    done = run_cli("unlock", model, "--json", home=stack_settings.home)
    assert done.returncode == 0, done.stderr
    import json

    doc = json.loads(done.stdout)
    assert doc["broken"]["release_id"] == "gone-run"
    assert "no longer running" in doc["how"] and doc["recorded_as"]
    assert list_locks(storage=storage, home=stack_settings.home, model=model) == []
    again = run_cli("unlock", model, home=stack_settings.home)
    assert again.returncode == 2 and "nothing holds it" in again.stderr


def test_an_unknown_holder_is_freed_only_once_nothing_renews_it(
        stack_settings: Settings, storage: S3Storage, monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model("lock-unknown")
    storage.put_bytes(lock_key(model), b"{not json")  # a holder nobody can name
    (row,) = list_locks(storage=storage, home=stack_settings.home, model=model)
    assert row["held"] and row["holder"] is None and row["unreadable"]
    with pytest.raises(ReleaseLocked, match="unknown"):
        break_lock(model, None, storage=storage, home=stack_settings.home)
    with pytest.raises(ReleaseLocked, match="unknown"):
        with release_lock(model, storage=storage, home=stack_settings.home):
            pass
    monkeypatch.setattr(locks, "LEASE_S", 1.0)
    time.sleep(2.5)  # S3's own clock: LastModified against its Date header, whole seconds
    done = break_lock(model, None, storage=storage, home=stack_settings.home)
    assert done["broken"] is None and "unknown" in done["how"]
    with release_lock(model, storage=storage, home=stack_settings.home) as lock:
        assert lock.took_over is None


def test_the_end_of_a_release_is_bounded_when_s3_stops_answering(
        stack_settings: Settings, storage: S3Storage) -> None:
    model = _model("lock-s3-down")
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen()
        dead = S3Storage(endpoint=f"http://127.0.0.1:{silent.getsockname()[1]}",
                         bucket=storage.bucket, access_key="x", secret_key="y", timeout_s=30)
        started = time.monotonic()
        with release_lock(model, storage=storage, home=stack_settings.home,
                          release_id="cut-off") as lock:
            assert lock.store is not None
            lock.store.storage = dead  # S3 goes away during the release
        elapsed = time.monotonic() - started
    assert elapsed < locks.RELEASE_BUDGET_S + 5, elapsed
    assert lock.release_error and "did not answer" in lock.release_error
    # Not wedged: the lock names its holder (this process, so it is still refused; once
    # the process is gone, the next run takes it over, as the test above shows).
    (row,) = list_locks(storage=storage, home=stack_settings.home, model=model)
    assert row["holder"]["release_id"] == "cut-off" and row["holder_alive"] is True
    with pytest.raises(ReleaseLocked, match="cut-off"):
        with release_lock(model, storage=storage, home=stack_settings.home):
            pass


def test_queued_canary_slots_never_overlap(storage: S3Storage) -> None:
    slot = _model("slot")
    spans: dict[str, tuple[float, float]] = {}
    lines: list[str] = []
    holding = threading.Event()

    def canary(name: str, hold_s: float) -> None:
        with canary_slot(storage, model=name, owner=name, slot=slot, wait_s=30,
                         progress=lines.append):
            start = time.time()
            holding.set()
            time.sleep(hold_s)
            spans[name] = (start, time.time())

    first = threading.Thread(target=canary, args=("model-a", 2.0))
    first.start()
    # a holds the slot before b asks (not a fixed sleep: taking it is an S3 write, slow
    # on a busy machine; b asking first would only swap the roles)
    assert holding.wait(30), "model-a never took the slot"
    canary("model-b", 0.2)
    first.join(10)
    assert spans["model-a"][1] <= spans["model-b"][0], spans  # b began after a ended
    assert any("waiting for the canary Triton" in line and "model-a" in line for line in lines)
    with pytest.raises(ReleaseLocked, match="stayed busy"):
        with canary_slot(storage, model="x", owner="holder", slot=slot, wait_s=30):
            with canary_slot(storage, model="y", owner="late", slot=slot, wait_s=0):
                pass
    with pytest.raises(UsageError):
        break_lock("x", None, storage=storage, home=Path("."), canary_slot_name=slot)
