"""Start, watch and stop the stack's server processes.

Each component runs in its own session (process group), so that ``stack down`` can stop it
and everything it forked by PID, and nothing else. A PID is only trusted together with the
process start time recorded next to it, so a recycled PID is never signalled.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from modelship.errors import StackError
from modelship.procinfo import process_start_ticks

LOOPBACK = "127.0.0.1"


@dataclass(frozen=True)
class ProcessRecord:
    """What the state file keeps about one started process."""

    name: str
    pid: int
    start_ticks: int | None
    ports: tuple[int, ...]
    log: str
    #: its process group when it started (its own PID: each server gets a session)
    pgid: int | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "pid": self.pid,
            "pgid": self.pgid,
            "start_ticks": self.start_ticks,
            "ports": list(self.ports),
            "log": self.log,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, object]) -> ProcessRecord:
        ticks = data.get("start_ticks")
        pgid = data.get("pgid")
        ports = data.get("ports") or []
        assert isinstance(ports, list)
        return cls(
            name=str(data["name"]),
            pid=int(str(data["pid"])),
            start_ticks=int(str(ticks)) if ticks is not None else None,
            ports=tuple(int(p) for p in ports),
            log=str(data.get("log", "")),
            pgid=int(str(pgid)) if pgid is not None else None,
        )


#: The kernel's default range of ephemeral ports (Linux), when /proc does not say.
EPHEMERAL_DEFAULT = (32768, 60999)
#: The lowest port a stack takes: below, the well-known and commonly configured ports.
PORT_FLOOR = 10000
#: SeaweedFS derives a gRPC port as the HTTP port + this; the pair must both stay clear.
GRPC_OFFSET = 10000


def ephemeral_range(path: Path = Path("/proc/sys/net/ipv4/ip_local_port_range")
                    ) -> tuple[int, int]:
    """The kernel's ephemeral port range: where every outgoing connection's local port comes
    from."""
    try:
        low, high = (int(v) for v in path.read_text().split())
    except (OSError, ValueError):
        return EPHEMERAL_DEFAULT
    return low, high


def pick_range(ephemeral: tuple[int, int]) -> tuple[int, int] | None:
    """The ports a stack picks from, ``[low, high)``: below the ephemeral range, with room
    for :data:`GRPC_OFFSET` above each; None when that leaves fewer than 2,000 (pure).

    A port picked inside the ephemeral range, released and bound a few seconds later by its
    server, can meanwhile become the local end of any outgoing connection (a client's, or
    the stack's own servers talking to each other), and the server then fails with
    'address already in use'. Outside it, only another picker can take it.
    """
    high = min(ephemeral[0], 65536) - GRPC_OFFSET
    return (PORT_FLOOR, high) if high - PORT_FLOOR >= 2000 else None


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((LOOPBACK, port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port that is free on loopback right now (the kernel picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((LOOPBACK, 0))
        return int(sock.getsockname()[1])


def free_ports(count: int, *, avoid: set[int] | None = None) -> list[int]:
    """``count`` distinct free loopback ports, none of them in ``avoid``.

    They come from :func:`pick_range`, consecutive from a random start (two stacks that
    start at once rarely draw overlapping blocks, and one whose port was taken tries
    again, :func:`modelship.stack.manager.up`); from the kernel's own choice when the
    ephemeral range leaves no room below it.
    """
    chosen: list[int] = []
    taken = set(avoid or ())
    span = pick_range(ephemeral_range())
    if span is None:
        while len(chosen) < count:
            port = free_port()
            # SeaweedFS derives gRPC ports as HTTP + 10000: keep HTTP ports below 55535.
            if port not in taken and port <= 55000:
                taken.add(port)
                chosen.append(port)
        return chosen
    low, high = span
    start = int.from_bytes(os.urandom(4), "big") % (high - low)
    for offset in range(high - low):
        port = low + (start + offset) % (high - low)
        if port not in taken and _bindable(port):
            taken.add(port)
            chosen.append(port)
            if len(chosen) == count:
                return chosen
    raise StackError(f"no {count} free loopback ports between {low} and {high}",
                     hint="stop what holds them (`modelship stack down` in other homes)")


def port_open(port: int, host: str = LOOPBACK, timeout_s: float = 0.5) -> bool:
    """True when something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return True
    except OSError:
        return False


def is_alive(record: ProcessRecord) -> bool:
    """True when the recorded process still runs and is the one we started."""
    ticks = process_start_ticks(record.pid)
    if ticks is None:
        return False
    if record.start_ticks is not None and ticks != record.start_ticks:
        return False
    try:
        state = Path(f"/proc/{record.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def start_process(
    name: str,
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    log_path: Path,
    cwd: Path | None = None,
    ports: Sequence[int] = (),
) -> tuple[subprocess.Popen[bytes], ProcessRecord]:
    """Start ``argv`` detached in its own session, output appended to ``log_path``."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as log:
        log.write(f"\n--- modelship: starting {name}: {' '.join(argv)}\n".encode())
        log.flush()
        try:
            proc = subprocess.Popen(
                list(argv),
                env=dict(env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            raise StackError(
                f"{name}: cannot run {argv[0]} ({exc.strerror})",
                hint="run `make install` to (re)build the virtualenvs, then try again",
                component=name,
            ) from exc
    try:
        pgid: int | None = os.getpgid(proc.pid)
    except ProcessLookupError:  # it died at once; wait_ready reports why
        pgid = None
    record = ProcessRecord(
        name=name,
        pid=proc.pid,
        start_ticks=process_start_ticks(proc.pid),
        ports=tuple(ports),
        log=str(log_path),
        pgid=pgid,
    )
    return proc, record


def log_tail(path: str | Path, lines: int = 8) -> str:
    """The last lines of a log file, for error messages."""
    try:
        text = Path(path).read_text(errors="replace")
    except OSError:
        return ""
    return "\n".join(text.rstrip().splitlines()[-lines:])


def wait_ready(
    record: ProcessRecord,
    proc: subprocess.Popen[bytes] | None,
    check: Callable[[], bool],
    *,
    deadline_s: float,
    interval_s: float = 0.2,
) -> float:
    """Poll ``check`` until it passes; fail fast if the process dies. Returns seconds waited."""
    started = time.monotonic()
    strangers: list[int] = []
    while True:
        if proc is not None and proc.poll() is not None:
            raise StackError(
                f"{record.name} exited with code {proc.returncode} during startup; "
                f"see {record.log}:\n{log_tail(record.log)}",
                hint=f"read {record.log}, fix the cause, then run `modelship stack up` again",
                component=record.name,
                log=record.log,
            )
        try:
            if check():
                # The answer may come from another process on a port this one has not
                # bound yet (two stacks that picked the same free port at once): ready
                # only once no stranger listens on its ports; it binds them, or exits.
                strangers = foreign_listeners(record)
                if not strangers:
                    return time.monotonic() - started
        except Exception:  # noqa: BLE001 - any failure of a probe just means "not yet"
            pass
        if time.monotonic() - started > deadline_s:
            taken = (f" (another process listens on port(s) {', '.join(map(str, strangers))}"
                     ")" if strangers else "")
            raise StackError(
                f"{record.name} was not ready after {deadline_s:.0f} s{taken}; see "
                f"{record.log}:\n{log_tail(record.log)}",
                hint=f"read {record.log}; the machine may be overloaded: retry "
                "`modelship stack up`, or give it longer with MODELSHIP_STACK_READY_TIMEOUT_S "
                f"(now {deadline_s:.0f})",
                component=record.name,
                log=record.log,
            )
        time.sleep(interval_s)


def listening_sockets(proc_net: Path = Path("/proc/net")) -> dict[int, set[int]]:
    """Port -> the inodes of the TCP sockets listening on it (``/proc/net/tcp`` and
    ``tcp6``; empty where there is no such file)."""
    found: dict[int, set[int]] = {}
    for name in ("tcp", "tcp6"):
        try:
            lines = (proc_net / name).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] == "0A":  # TCP_LISTEN
                port = int(fields[1].rsplit(":", 1)[1], 16)
                found.setdefault(port, set()).add(int(fields[9]))
    return found


def group_sockets(pgid: int, proc: Path = Path("/proc")) -> set[int]:
    """The inodes of the sockets the processes of group ``pgid`` hold open."""
    inodes: set[int] = set()
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # the group is the 3rd field after the parenthesised command (which may hold
            # spaces or parentheses of its own)
            if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[2]) != pgid:
                continue
            for fd in (entry / "fd").iterdir():
                target = os.readlink(fd)
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
        except (OSError, ValueError, IndexError):
            continue  # it ended meanwhile, or is not ours to read
    return inodes


def foreign_listeners(record: ProcessRecord, *, proc: Path = Path("/proc")) -> list[int]:
    """The recorded ports on which a process outside the record's process group listens
    (none where ``/proc`` cannot tell)."""
    listening = listening_sockets(proc / "net")
    busy = {port: listening[port] for port in record.ports if port in listening}
    if not busy:
        return []
    ours = group_sockets(record.pgid if record.pgid is not None else record.pid, proc)
    return sorted(port for port, inodes in busy.items() if not inodes <= ours)


SHM_PREFIX = "/dev/shm/triton_"


def shm_regions(pids: Sequence[int]) -> set[str]:
    """The Triton shared-memory regions (``/dev/shm/triton_*``) these processes map."""
    regions = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:
            continue
        for line in maps.splitlines():
            fields = line.split()
            if fields and fields[-1].startswith(SHM_PREFIX):
                regions.add(fields[-1])
    return regions


def remove_files(paths: set[str]) -> list[str]:
    """Unlink ``paths``; returns those that were removed (missing ones are skipped)."""
    removed = []
    for path in sorted(paths):
        try:
            os.unlink(path)
            removed.append(path)
        except FileNotFoundError:
            pass
    return removed


def stop_process(record: ProcessRecord, *, grace_s: float = 10.0,
                 clean_shm: bool = False) -> bool:
    """Stop the recorded process group (SIGTERM, then SIGKILL). False if it was not running.

    A leader that died on its own (say, a SIGKILLed Triton) can leave its children behind
    (the Python backend stubs); they still carry its process group id, and are stopped too.

    With ``clean_shm`` (Triton), the ``/dev/shm/triton_*`` regions mapped by the group are
    collected before it is stopped and removed afterwards: a killed Triton leaves them.
    """
    regions: set[str] = set()
    if clean_shm:
        ticks = process_start_ticks(record.pid)
        if ticks is None or ticks == record.start_ticks:  # never a stranger's PID
            regions = shm_regions([record.pid, *group_members(record.pid)])
    try:
        return _stop_group(record, grace_s=grace_s)
    finally:
        remove_files(regions)


def _stop_group(record: ProcessRecord, *, grace_s: float) -> bool:
    if not is_alive(record):
        ticks = process_start_ticks(record.pid)
        # The leader is gone (or is our own zombie), not a stranger that reused its PID.
        if (ticks is None or ticks == record.start_ticks) and group_members(record.pid):
            _kill_group_leftovers(record.pid, grace_s=0.0)
        return False
    try:
        pgid = os.getpgid(record.pid)
    except ProcessLookupError:
        return False
    # Only signal the group if the process leads it: we started it with its own session.
    target_group = pgid == record.pid
    _signal(record.pid, signal.SIGTERM, target_group)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if not is_alive(record):
            break
        time.sleep(0.1)
    else:
        _signal(record.pid, signal.SIGKILL, target_group)
    if target_group:
        # Children of the group (e.g. Triton's Python backend stubs) may outlive the leader.
        _kill_group_leftovers(pgid, grace_s=3.0)
    try:  # reap it if it is our own child (same process ran `up` and `down`)
        os.waitpid(record.pid, os.WNOHANG)
    except ChildProcessError:
        pass
    return True


def _signal(pid: int, sig: signal.Signals, group: bool) -> None:
    try:
        if group:
            os.killpg(pid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def group_members(pgid: int) -> list[int]:
    """Live (non-zombie) processes whose process group is ``pgid``."""
    members: list[int] = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def _kill_group_leftovers(pgid: int, *, grace_s: float) -> None:
    deadline = time.monotonic() + grace_s
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.1)
    if group_members(pgid):
        try:
            os.killpg(pgid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# --------------------------------------------------------------------------------------
# what still listens on a stack's port: the stack's own server, or a stranger


def listening_pids(ports: Sequence[int]) -> dict[int, list[int]]:
    """The live processes holding a TCP socket that listens on each of ``ports`` (any
    address): /proc/net/tcp{,6} name the sockets' inodes, each process's fds theirs."""
    by_inode: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local_address is HEXIP:HEXPORT; state 0A is LISTEN; field 9 is the inode
            if len(fields) > 9 and fields[3] == "0A":
                port = int(fields[1].rsplit(":", 1)[1], 16)
                if port in ports:
                    by_inode[f"socket:[{fields[9]}]"] = port
    found: dict[int, list[int]] = {port: [] for port in ports}
    if not by_inode:
        return found
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fds = list((entry / "fd").iterdir())
        except OSError:
            continue
        for port in sorted({by_inode[link] for link in map(_link, fds) if link in by_inode}):
            if process_start_ticks(int(entry.name)) is not None:
                found[port].append(int(entry.name))
    return found


def _link(path: Path) -> str:
    """Where a /proc fd points, or "" when it closed meanwhile."""
    try:
        return os.readlink(path)
    except OSError:
        return ""


@dataclass(frozen=True)
class ProcessView:
    """What Linux shows of a live process: its executable and its command line."""

    pid: int
    exe: str
    cmdline: tuple[str, ...]

    @classmethod
    def of(cls, pid: int) -> ProcessView | None:
        try:
            exe = os.path.realpath(f"/proc/{pid}/exe")
            raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            return None
        return cls(pid=pid, exe=exe, cmdline=tuple(a.decode(errors="replace")
                                                   for a in raw.split(b"\0") if a))


def own_executables(argv: Sequence[str]) -> set[str]:
    """The executables a server started with ``argv`` runs as: ``argv[0]`` itself, and the
    interpreter named by its ``#!`` line when it is a script (``.venv/bin/prefect``)."""
    first = Path(argv[0])
    found = {os.path.realpath(first)}
    try:
        with first.open("rb") as handle:
            head = handle.readline(512)
    except OSError:
        return found
    if head.startswith(b"#!"):
        words = head[2:].decode(errors="replace").split()
        if words:
            found.add(os.path.realpath(words[0]))
    return found


def is_own_server(view: ProcessView, argv: Sequence[str], executables: set[str]) -> bool:
    """True only when ``view`` is a server the stack started with ``argv`` (pure): it runs
    one of the stack's ``executables`` and its command line holds the recorded command
    whole (the ports and paths in it are the stack's own). A script's command line has its
    interpreter in front; nginx's master rewrites its title to ``nginx: master process``
    followed by its command."""
    if view.exe not in executables or not argv:
        return False
    n, line = len(argv), list(view.cmdline)
    if any(line[i:i + n] == list(argv) for i in range(len(line) - n + 1)):
        return True
    title = f"{Path(argv[0]).name}: master process {' '.join(argv)}"
    return len(line) == 1 and line[0] == title


def stop_pid(pid: int, *, grace_s: float = 10.0) -> None:
    """SIGTERM ``pid`` (its process group when it leads one), then SIGKILL after the grace;
    its group's leftovers go too."""
    ticks = process_start_ticks(pid)
    if ticks is None:
        return
    record = ProcessRecord(name=str(pid), pid=pid, start_ticks=ticks, ports=(), log="")
    _stop_group(record, grace_s=grace_s)


def reap(proc: subprocess.Popen[bytes] | None) -> None:
    """Collect the exit status of a child we started, so it does not linger as a zombie."""
    if proc is not None:
        try:
            proc.wait(timeout=0)
        except subprocess.TimeoutExpired:
            pass
