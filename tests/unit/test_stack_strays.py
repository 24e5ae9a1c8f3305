"""Nothing the stack started outlives ``stack down``, and two ``up`` in one home take turns.

- ``down`` (and a restart) stop a server still listening on one of the stack's recorded
  ports only when it is that component's own server: its executable and its recorded
  command line (:func:`is_own_server`, a table test), never a stranger on the port.
- ``up`` and ``down`` hold the home's lock, so a second ``up`` waits and then finds the
  first one's stack (one Prefect, not two).
- No modelship process lets Prefect start an ephemeral server (the "leaked Prefect server"
  of session 21: ``python -m uvicorn`` on a port in 8000-8999, started by a client without
  an API URL, orphaned when its parent was SIGKILLed).
- A new home's Prefect database is copied from a migrated template, built once.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from modelship.prefect_api import BOUNDED_CLIENT
from modelship.settings import Settings
from modelship.stack import manager, prefect_db
from modelship.stack.process import (
    ProcessView,
    is_own_server,
    listening_pids,
    own_executables,
)

PY = "/usr/bin/python3.11"
PREFECT = "/w/.venv/bin/prefect"
PREFECT_ARGV = [PREFECT, "server", "start", "--host", "127.0.0.1", "--port", "41234",
                "--analytics-off"]
NGINX_ARGV = ["/usr/sbin/nginx", "-p", "/h/gateway", "-c", "/h/gateway/nginx.conf"]


@pytest.mark.parametrize(("exe", "cmdline", "argv", "executables", "own"), [
    # the stack's Prefect: a script, so its interpreter runs it
    (PY, [PY, *PREFECT_ARGV], PREFECT_ARGV, {PY, PREFECT}, True),
    # the same server on another port is another stack's
    (PY, [PY, *PREFECT_ARGV[:-2], "41235", "--analytics-off"], PREFECT_ARGV, {PY, PREFECT},
     False),
    # an ephemeral Prefect server (what leaked) is no stack server
    (PY, [PY, "-m", "uvicorn", "--factory", "prefect.server.api.server:create_app",
          "--port", "8710"], PREFECT_ARGV, {PY, PREFECT}, False),
    # the same command line from another interpreter: not the stack's binary
    ("/opt/other/python", ["/opt/other/python", *PREFECT_ARGV], PREFECT_ARGV, {PY, PREFECT},
     False),
    # a stranger that mentions the command inside a longer argument
    (PY, [PY, "-c", " ".join(PREFECT_ARGV)], PREFECT_ARGV, {PY, PREFECT}, False),
    # nginx's master rewrites its title but keeps its command
    ("/usr/sbin/nginx", ["nginx: master process " + " ".join(NGINX_ARGV)], NGINX_ARGV,
     {"/usr/sbin/nginx"}, True),
    # another gateway's master (another prefix)
    ("/usr/sbin/nginx", ["nginx: master process /usr/sbin/nginx -p /other -c /other/n.conf"],
     NGINX_ARGV, {"/usr/sbin/nginx"}, False),
    # its workers hold the socket too, but are stopped with their master
    ("/usr/sbin/nginx", ["nginx: worker process"], NGINX_ARGV, {"/usr/sbin/nginx"}, False),
    # a recorded command that is empty matches nothing
    (PY, [PY], [], {PY}, False),
])
def test_only_the_components_own_server_is_ever_stopped(
        exe: str, cmdline: list[str], argv: list[str], executables: set[str],
        own: bool) -> None:
    view = ProcessView(pid=1, exe=exe, cmdline=tuple(cmdline))
    assert is_own_server(view, argv, executables) is own


def test_a_script_runs_as_its_interpreter(tmp_path: Path) -> None:
    script = tmp_path / "prefect"
    script.write_text(f"#!{sys.executable}\nprint(1)\n")
    found = own_executables([str(script), "server"])
    assert os.path.realpath(sys.executable) in found
    assert os.path.realpath(script) in found
    binary = own_executables(["/bin/sh", "-c", "true"])  # ELF: itself only
    assert binary == {os.path.realpath("/bin/sh")}


def test_the_process_listening_on_a_port_is_found() -> None:
    with socket.socket() as listening, socket.socket() as bound_only:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        bound_only.bind(("127.0.0.1", 0))  # bound, not listening: not a server
        port, other = listening.getsockname()[1], bound_only.getsockname()[1]
        found = listening_pids([port, other])
        assert found == {port: [os.getpid()], other: []}
        me = ProcessView.of(os.getpid())
        assert me is not None and me.exe == os.path.realpath(f"/proc/{os.getpid()}/exe")
    assert listening_pids([port]) == {port: []}


def test_a_second_up_or_down_in_one_home_waits_for_the_first(tmp_path: Path) -> None:
    settings = Settings(home=tmp_path / "home")
    said: list[str] = []
    entered = threading.Event()
    with manager.home_lock(settings):
        second = threading.Thread(target=lambda: _enter(settings, said, entered))
        second.start()
        time.sleep(0.3)
        assert not entered.is_set()  # it waits for the first to end
        assert said and "waiting for another" in said[0]
    second.join(timeout=10)
    assert entered.is_set()
    assert (tmp_path / "home" / manager.HOME_LOCK_FILE).stat().st_mode & 0o777 == 0o600


def _enter(settings: Settings, said: list[str], entered: threading.Event) -> None:
    with manager.home_lock(settings, said.append):
        entered.set()


def test_no_modelship_process_lets_prefect_start_an_ephemeral_server(tmp_path: Path) -> None:
    """A Prefect client without an API URL refuses, instead of starting a server no stack
    owns; run events are dropped instead of sent to one."""
    code = textwrap.dedent("""
        import os
        from pathlib import Path
        from prefect.client.orchestration import get_client
        from prefect.events import emit_event
        from modelship.prefect_api import pointed_at
        try:
            get_client()
        except ValueError as exc:
            print("refused:", exc)
        with pointed_at("http://127.0.0.1:9/api"):
            pass
        emit_event("modelship.test.late", resource={"prefect.resource.id": "late"})
        children = [p.name for p in Path("/proc").iterdir() if p.name.isdigit()
                    and (p / "stat").read_text().rsplit(")", 1)[1].split()[2] == str(os.getpid())]
        print("children:", children)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={**env, **BOUNDED_CLIENT, "PREFECT_HOME": str(tmp_path)},
                          timeout=120, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "refused: No Prefect API URL provided" in done.stdout
    # a late run event, after the block: no ephemeral server was started to take it
    assert "children: []" in done.stdout, done.stdout
    assert "temporary server" not in done.stderr
    assert "ephemeral" not in done.stderr.lower(), done.stderr[-2000:]


def _fake_prefect(bin_dir: Path, calls: Path) -> Path:
    """A `prefect` whose `server database upgrade` writes the database its env names."""
    bin_dir.mkdir()
    script = bin_dir / "prefect"
    script.write_text(textwrap.dedent(f"""\
        #!{sys.executable}
        import os, sys, time
        assert sys.argv[1:] == ["server", "database", "upgrade", "-y"], sys.argv
        assert "PREFECT_API_URL" not in os.environ
        url = os.environ["PREFECT_SERVER_DATABASE_CONNECTION_URL"]
        with open({str(calls)!r}, "a") as log:
            log.write(url + "\\n")
        time.sleep(0.3)
        open(url.removeprefix("sqlite+aiosqlite:///"), "w").write("migrated")
        """))
    script.chmod(0o755)
    return bin_dir


def test_a_new_home_starts_from_the_migrated_template_built_once(tmp_path: Path) -> None:
    calls = tmp_path / "calls"
    venv_bin = _fake_prefect(tmp_path / "bin", calls)
    env = {prefect_db.CACHE_ENV: str(tmp_path / "cache"), "PATH": "/usr/bin:/bin",
           "PREFECT_API_URL": "http://127.0.0.1:9/api"}
    homes = [tmp_path / f"home{i}" / "prefect.db" for i in range(3)]
    outcomes: list[str] = []
    threads = [threading.Thread(target=lambda db=db: outcomes.append(
        prefect_db.seed(db, venv_bin=venv_bin, env=env))) for db in homes[:2]]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    # two stacks starting at once: one builds, the other waits and copies
    assert sorted(outcomes) == ["built", "copied"]
    assert len(calls.read_text().splitlines()) == 1
    assert prefect_db.seed(homes[2], venv_bin=venv_bin, env=env) == "copied"
    for db in homes:
        assert db.read_text() == "migrated" and db.stat().st_mode & 0o777 == 0o600
    homes[2].write_text("a home's own data")
    assert prefect_db.seed(homes[2], venv_bin=venv_bin, env=env) == "kept"
    assert homes[2].read_text() == "a home's own data"
    assert len(calls.read_text().splitlines()) == 1


def test_without_a_template_prefect_migrates_its_own(tmp_path: Path) -> None:
    broken = tmp_path / "bin"
    broken.mkdir()
    (broken / "prefect").write_text("#!/bin/sh\nexit 3\n")
    (broken / "prefect").chmod(0o755)
    db = tmp_path / "home" / "prefect.db"
    said: list[str] = []
    env = {prefect_db.CACHE_ENV: str(tmp_path / "cache")}
    assert prefect_db.seed(db, venv_bin=broken, env=env, progress=said.append) == "unseeded"
    assert not db.exists() and "Prefect migrates its own" in said[-1]
    assert not list((tmp_path / "cache").glob("prefect-*.db"))


@pytest.mark.parametrize(("env", "expected"), [
    ({prefect_db.CACHE_ENV: "/c"}, "/c"),
    ({"XDG_CACHE_HOME": "/x", "HOME": "/h"}, "/x/modelship"),
    ({"HOME": "/h"}, "/h/.cache/modelship"),
])
def test_the_cache_directory(env: dict[str, str], expected: str) -> None:
    assert prefect_db.cache_dir(env) == Path(expected)
    assert prefect_db.template_path(Path(expected), "3.9.1").name == "prefect-3.9.1.db"


def test_one_threads_block_never_changes_where_anothers_run_events_go() -> None:
    """Each pointed_at block sends run events to its API; the events client is reset (to
    one that drops them, with no API URL here) only when the last open block ends."""
    from prefect.events.clients import NullEventsClient, PrefectEventsClient
    from prefect.events.worker import EventsWorker
    from prefect.settings import PREFECT_API_URL

    from modelship.prefect_api import pointed_at

    assert not PREFECT_API_URL.value()
    saved = EventsWorker._client_override
    inside, release = threading.Event(), threading.Event()

    def other_block() -> None:
        with pointed_at("http://127.0.0.1:9/api"):
            inside.set()
            release.wait(10)

    other = threading.Thread(target=other_block)
    try:
        other.start()
        assert inside.wait(10)
        with pointed_at("http://127.0.0.1:9/api"):
            pass
        override = EventsWorker._client_override
        assert override is not None and override[0] is PrefectEventsClient  # still open
        release.set()
        other.join(10)
        override = EventsWorker._client_override
        assert override is not None and override[0] is NullEventsClient
    finally:
        release.set()
        other.join(10)
        EventsWorker._client_override = saved
