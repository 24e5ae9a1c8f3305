"""A stack component is ready only when its ports are its own: two stacks that picked the
same free port at once must not take another process's answer for their server's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from modelship.errors import StackError
from modelship.stack.manager import port_taken
from modelship.stack.process import ProcessRecord, foreign_listeners, wait_ready

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/net/tcp"), reason="Linux /proc")


def _record(port: int, pgid: int) -> ProcessRecord:
    return ProcessRecord(name="canary", pid=pgid, start_ticks=None, ports=(port, 1),
                         log="/dev/null", pgid=pgid)


@pytest.fixture
def listener() -> Iterator[socket.socket]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        yield sock


@pytest.fixture
def stranger_group() -> Iterator[int]:
    """The process group of another process (its own session), which holds no socket."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"],
                             start_new_session=True)
    yield child.pid
    child.kill()
    child.wait()


def test_a_port_this_group_listens_on_is_its_own(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    assert foreign_listeners(_record(port, os.getpgid(0))) == []


def test_a_port_another_process_listens_on_is_named(listener: socket.socket,
                                                    stranger_group: int) -> None:
    port = listener.getsockname()[1]
    assert foreign_listeners(_record(port, stranger_group)) == [port]


def test_ready_is_not_taken_from_a_stranger_on_the_port(listener: socket.socket,
                                                        stranger_group: int) -> None:
    port = listener.getsockname()[1]
    with pytest.raises(StackError) as caught:
        wait_ready(_record(port, stranger_group), None, lambda: True, deadline_s=0.5,
                   interval_s=0.05)
    assert f"another process listens on port(s) {port}" in caught.value.message


def test_ready_once_the_group_itself_answers(listener: socket.socket) -> None:
    port = listener.getsockname()[1]
    assert wait_ready(_record(port, os.getpgid(0)), None, lambda: True, deadline_s=5) < 5


@pytest.mark.parametrize(("message", "taken"), [
    ("canary exited with code 1 during startup; see x.log:\nE main.cc:257] \"failed to start "
     "HTTP service: Unavailable - Socket '127.0.0.1:47405' already in use \"", True),
    ("gateway exited with code 1 during startup; see g.log:\nnginx: [emerg] bind() to "
     "127.0.0.1:4000 failed (98: Address already in use)", True),
    ("canary was not ready after 120 s (another process listens on port(s) 47405); see x",
     True),
    ("mlflow was not ready after 120 s; see m.log:\nTraceback ...", False),
    ("triton-0 exited with code 1 during startup; see t.log:\nfailed to load backend", False),
])
def test_a_port_taken_while_starting_is_told_from_other_failures(message: str,
                                                                  taken: bool) -> None:
    assert port_taken(StackError(message)) is taken
