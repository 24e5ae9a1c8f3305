"""tests.zygote: a forked run behaves as its own process (exit code, signals, output, pid,
environment), and nothing leaks between runs or from a threaded preload."""

from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.zygote import REFUSED, Zygote

ROOT = Path(__file__).resolve().parents[2]
COUNTER = [0]  # changed by one run; the next run must not see it


def _probe() -> None:
    """The target the zygote runs: what ``sys.argv[1]`` says."""
    what = sys.argv[1]
    if what == "echo":
        print(json.dumps({"argv": sys.argv, "pid": os.getpid(), "ppid": os.getppid(),
                          "late": os.environ.get("ZYGOTE_LATE"),
                          "fixed": os.environ.get("ZYGOTE_FIXED")}))
        print("to stderr", file=sys.stderr)
        sys.exit(3)
    if what == "signal":  # a signal a process sends itself arrives before kill() returns
        os.kill(os.getpid(), getattr(signal, sys.argv[2]))
        time.sleep(1)  # reached only when it is ignored (SIGINT in a background job)
    if what == "mutate":
        COUNTER[0] += 1
        print(COUNTER[0])
    if what == "atexit":
        atexit.register(lambda: print("exit handler ran", flush=True))
        print("body", flush=True)
    if what == "sleep":
        time.sleep(60)
    if what == "message":
        sys.exit("a message")
    if what == "meet":  # say I am here (argv[2]), then wait for the other (argv[3])
        Path(f"{sys.argv[2]}.tmp").write_text(str(os.getpid()))
        Path(f"{sys.argv[2]}.tmp").rename(sys.argv[2])  # never seen half written
        deadline = time.monotonic() + 20
        while not Path(sys.argv[3]).exists():
            if time.monotonic() > deadline:
                sys.exit(9)
            time.sleep(0.01)
        print(Path(sys.argv[3]).read_text())


def _start_thread() -> None:
    threading.Thread(target=time.sleep, args=(30,), daemon=True, name="stray").start()


@pytest.fixture(scope="module")
def zygote() -> Iterator[Zygote]:
    env = {**os.environ, "ZYGOTE_FIXED": "set at start"}
    with Zygote(target="tests.unit.test_zygote:_probe", preload=["json"], env=env,
                cwd=ROOT, late_env=["ZYGOTE_LATE"]) as z:
        z.wait_ready(60)
        yield z


def test_a_run_has_its_own_pid_argv_output_and_exit_code(zygote: Zygote) -> None:
    done = zygote.run(["prog", "echo", "x"], env={"ZYGOTE_LATE": "late"}, timeout=30)
    doc = json.loads(done.stdout)
    assert done.returncode == 3
    assert done.stderr == "to stderr\n"
    assert doc["argv"] == ["prog", "echo", "x"]
    assert doc["late"] == "late" and doc["fixed"] == "set at start"
    assert doc["pid"] not in (os.getpid(), zygote.ready["pid"])
    assert doc["ppid"] == zygote.ready["pid"]
    assert not Path(f"/proc/{doc['pid']}").exists()  # reaped, not a zombie
    # a late variable lasts one run only
    assert json.loads(zygote.run(["prog", "echo"], timeout=30).stdout)["late"] is None


@pytest.mark.parametrize("name", ["SIGKILL", "SIGTERM", "SIGINT"])
def test_a_signal_ends_the_run_as_it_ends_a_process(zygote: Zygote, name: str) -> None:
    done = zygote.run(["prog", "signal", name], timeout=30)
    plain = subprocess.run(
        [sys.executable, "-c", f"import os, signal, time; os.kill(os.getpid(), "
                               f"signal.{name}); time.sleep(1)"],
        capture_output=True, text=True, timeout=30)
    expected = -getattr(signal, name)
    if name == "SIGINT" and signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        # This process started with SIGINT ignored (a background job of a script, as CI's
        # `make test` may be): its children inherit that, and a plain process ignores it too.
        expected = 0
    assert done.returncode == plain.returncode == expected, (done, plain)


def test_nothing_a_run_changes_reaches_the_next(zygote: Zygote) -> None:
    assert [zygote.run(["prog", "mutate"], timeout=30).stdout for _ in range(2)] == \
        ["1\n", "1\n"]


def test_exit_handlers_run_and_a_message_is_status_1(zygote: Zygote) -> None:
    done = zygote.run(["prog", "atexit"], timeout=30)
    assert (done.returncode, done.stdout) == (0, "body\nexit handler ran\n")
    done = zygote.run(["prog", "message"], timeout=30)
    assert (done.returncode, done.stderr) == (1, "a message\n")


def test_a_variable_read_at_import_is_refused(zygote: Zygote) -> None:
    done = zygote.run(["prog", "echo"], env={"ZYGOTE_FIXED": "other"}, timeout=30)
    assert done.returncode == REFUSED and "ZYGOTE_FIXED" in done.stderr, done
    # bound for every run: refused the same way
    done = zygote.bound({"ZYGOTE_FIXED": "other"}).run(["prog", "echo"], timeout=30)
    assert done.returncode == REFUSED and "ZYGOTE_FIXED" in done.stderr, done


def test_bound_variables_reach_every_run_and_a_run_s_own_win(zygote: Zygote) -> None:
    bound = zygote.bound({"ZYGOTE_LATE": "bound"})
    assert [json.loads(bound.run(["prog", "echo"], timeout=30).stdout)["late"]
            for _ in range(2)] == ["bound", "bound"]
    done = bound.run(["prog", "echo"], env={"ZYGOTE_LATE": "own"}, timeout=30)
    assert json.loads(done.stdout)["late"] == "own"
    # the zygote itself is unchanged
    assert json.loads(zygote.run(["prog", "echo"], timeout=30).stdout)["late"] is None


def test_a_timeout_kills_the_run(zygote: Zygote) -> None:
    began = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        zygote.run(["prog", "sleep"], timeout=1)
    assert time.monotonic() - began < 20
    assert zygote.run(["prog", "mutate"], timeout=30).stdout == "1\n"  # serves on


def test_runs_asked_for_at_once_run_side_by_side(zygote: Zygote, tmp_path: Path) -> None:
    """Two runs from two threads: each waits until the other has started, so one at a
    time would end the first with 9 after 20 s; side by side both see the other's pid,
    each gets its own output and exit code, and a third run meanwhile is not held up."""
    here, there = tmp_path / "a", tmp_path / "b"
    with ThreadPoolExecutor(max_workers=2) as pool:
        first = pool.submit(zygote.run, ["prog", "meet", str(here), str(there)], timeout=60)
        second = pool.submit(zygote.run, ["prog", "meet", str(there), str(here)], timeout=60)
        assert zygote.run(["prog", "mutate"], timeout=30).stdout == "1\n"
        a, b = first.result(), second.result()
    assert (a.returncode, b.returncode) == (0, 0), (a, b)
    assert (a.stdout, b.stdout) == (there.read_text() + "\n", here.read_text() + "\n")
    assert here.read_text() != there.read_text()


def test_a_preload_that_leaves_a_thread_is_refused() -> None:
    with Zygote(target="tests.unit.test_zygote:_probe", env=dict(os.environ), cwd=ROOT,
                prepare="tests.unit.test_zygote:_start_thread") as z, \
            pytest.raises(RuntimeError, match="stray"):
        z.wait_ready(60)
