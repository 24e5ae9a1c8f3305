"""A pre-warmed process that forks one command run per request (tests only).

A CLI run of modelship spends 10-30 s importing (Prefect, MLflow, GX, pandas, ONNX) before
it does anything, and a test that runs the CLI many times pays that every time. A zygote
imports once, then forks a child per run: the child is the run, a real process with its
own pid (a lock's holder, the ledger's ``holder.pid``), its own signals (SIGKILL ends it
as it would end ``modelship``; its own handlers run for SIGTERM and SIGINT), stdout and
stderr into files and an exit code, exactly as ``subprocess.run`` reports it (negative:
killed by that signal).

What the fork must not carry over, and how it is kept out:

- **State read at import.** Prefect reads its settings from the environment when it is
  imported, MLflow its URIs. The zygote's environment is fixed when it starts and every
  child runs with it; a run may only add the variables declared *late* (read at run time,
  such as ``tests.faults``'s ``FAULT``), anything else is refused. ``prepare`` runs before
  the imports (e.g. the CLI's own environment defaults, which it sets before it imports
  Prefect).
- **Threads.** A fork copies only the calling thread; a lock another thread held stays held
  forever in the child. The zygote refuses to serve unless the preloaded modules left it
  single-threaded, and it never runs anything but imports.
- **One run's changes.** Each child forks from the zygote, never from an earlier child, so
  nothing one run changes (module globals, monkeypatches, caches) reaches the next.
- **Copies.** The server freezes what its imports built (``gc.freeze``) before each fork:
  no collection in a child walks those objects (writing their headers), so their memory
  pages stay shared with the server instead of being copied into each child.
- **Buffers and exit.** Python's buffers are flushed before the fork; a child runs every
  exit handler, flushes and leaves with ``os._exit`` (as ``modelship``'s console script
  does since it skips the interpreter teardown), so the zygote's own state is never torn
  down in a child.

:func:`serve` is the server; :class:`Zygote` starts it and runs commands through it, from
one thread or several at once (each run its own child, reported with its CPU time;
:meth:`Zygote.bound`: with some late variables set for every run).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import json
import logging
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

#: Exit code of a child that refused its request (an undeclared environment variable).
REFUSED = 70
#: How long the server may take to import its modules and say it is ready.
READY_TIMEOUT_S = 600.0


def _resolve(ref: str) -> Callable[[], Any]:
    """``"package.module:function"`` -> the function."""
    module, _, name = ref.partition(":")
    fn = getattr(importlib.import_module(module), name)
    assert callable(fn), ref
    return fn


def exit_code(exc: SystemExit) -> int:
    """The process exit status of ``SystemExit(code)``, as the interpreter maps it (a
    message is printed to stderr and is status 1)."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1


# --------------------------------------------------------------------------------------
# the server (its own process, started by Zygote)


def _send(conn: socket.socket, doc: Mapping[str, Any]) -> None:
    conn.sendall((json.dumps(doc) + "\n").encode())


class _Lines:
    """Lines read from a socket (honours its timeout: raises TimeoutError)."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self.buffer = b""

    def next(self) -> bytes:
        while b"\n" not in self.buffer:
            chunk = self.conn.recv(4096)
            if not chunk:
                raise ConnectionError(f"the zygote closed the connection ({self.buffer!r})")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return line


def _child(request: Mapping[str, Any], late: frozenset[str], target: Callable[[], Any]) -> None:
    """In the forked child: become the run, then leave with its exit status."""
    code = 1
    try:
        extra = dict(request.get("env") or {})
        refused = sorted(k for k in extra if k not in late)
        stdin = os.open(os.devnull, os.O_RDONLY)
        out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        for fd, to in ((stdin, 0), (out, 1), (err, 2)):
            os.dup2(fd, to)
            os.close(fd)
        if refused:
            print(f"zygote: refused: {refused} are not declared late (read at import, "
                  f"they would not take effect); start a zygote with them set", file=sys.stderr)
            code = REFUSED
            return
        os.environ.update(extra)
        sys.argv = list(request["argv"])
        try:
            target()
            code = 0
        except SystemExit as exc:
            code = exit_code(exc)
        except KeyboardInterrupt:
            # as the interpreter does: an unhandled Ctrl-C ends the process by SIGINT
            traceback.print_exc()
            _flush()
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        except BaseException:  # noqa: BLE001 - as the interpreter: the traceback, status 1
            traceback.print_exc()
            code = 1
        try:
            atexit._run_exitfuncs()  # what the interpreter runs at exit, before its teardown
        except BaseException:  # noqa: BLE001 - an exit handler's failure is printed, as at exit
            traceback.print_exc()
    finally:
        logging.shutdown()
        _flush()
        os._exit(code)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def _serve(listener: socket.socket, late: frozenset[str], target: Callable[[], Any]) -> None:
    """Serve requests until told to stop, runs side by side: each request forks its child
    at once, and each child's exit status goes back to its own caller when it ends. The
    server stays one thread (a fork copies only the calling thread): it polls for ended
    children while some run, and blocks in ``accept`` otherwise."""
    running: dict[int, socket.socket] = {}  # pid -> the connection waiting for its status
    while True:
        _reap(running)
        ready, _, _ = select.select([listener], [], [], _POLL_S if running else None)
        if not ready:
            continue
        conn, _ = listener.accept()
        request = json.loads(_Lines(conn).next())
        if request.get("stop"):
            for pid in list(running):  # a caller gone without its run: nobody waits for it
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            while running:
                _reap(running, block=True)
            _send(conn, {"stopped": True})
            conn.close()
            return
        _flush()
        gc.freeze()  # what the imports built: no child's collection touches (copies) it
        pid = os.fork()
        if pid == 0:
            listener.close()
            for other in (conn, *running.values()):
                other.close()
            _child(request, late, target)  # never returns
        _send(conn, {"pid": pid})
        running[pid] = conn


#: Seconds between two looks for ended children while runs are going on.
_POLL_S = 0.05


def _reap(running: dict[int, socket.socket], *, block: bool = False) -> None:
    """Send each ended child's exit status to its caller (``block``: wait for one)."""
    while running:
        pid, status, usage = os.wait4(-1, 0 if block else os.WNOHANG)
        if pid == 0:
            return
        conn = running.pop(pid, None)
        if conn is None:
            continue
        with conn:
            try:
                _send(conn, {"returncode": os.waitstatus_to_exitcode(status),
                             "cpu_s": round(usage.ru_utime + usage.ru_stime, 3)})
            except OSError:  # the client went away (it timed out): the child is reaped
                pass
        if block:
            return


def serve(config_path: str) -> None:
    """The server: prepare, import, then serve (see the module)."""
    config = json.loads(Path(config_path).read_text())
    began, cpu = time.monotonic(), time.process_time()
    if config.get("prepare"):
        _resolve(config["prepare"])()
    for name in config.get("preload", ()):
        importlib.import_module(name)
    target = _resolve(config["target"])
    threads = [t.name for t in threading.enumerate() if t is not threading.main_thread()]
    if threads:
        raise SystemExit(f"zygote: the preloaded modules started threads {threads}; a fork "
                         f"would copy their locks but not them")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(config["socket"])
    listener.listen(1)
    print(json.dumps({"ready": True, "pid": os.getpid(),
                      "import_s": round(time.monotonic() - began, 2),
                      "import_cpu_s": round(time.process_time() - cpu, 2),
                      "modules": len(sys.modules)}), flush=True)
    try:
        _serve(listener, frozenset(config.get("late_env", ())), target)
    finally:
        listener.close()
        _flush()
        os._exit(0)  # nothing to tear down but imports


# --------------------------------------------------------------------------------------
# the client


class Completed(subprocess.CompletedProcess[str]):
    """A run's :class:`subprocess.CompletedProcess`, and its CPU time: user + system
    seconds of the child and of the processes it waited for (None: not reported)."""

    def __init__(self, args: list[str], returncode: int, stdout: str, stderr: str, *,
                 cpu_s: float | None = None) -> None:
        super().__init__(args, returncode, stdout, stderr)
        self.cpu_s = cpu_s


class Zygote:
    """A started zygote server (see the module): :meth:`run` commands (several threads may
    each run one at once), then :meth:`close` (or use it as a context manager).

    Args:
        target: ``"module:function"`` each run calls with its ``sys.argv``, e.g.
            ``"modelship.cli:main"``.
        preload: Modules imported once, before serving.
        env: The environment of the server and of every run.
        cwd: Working directory of the server and of every run.
        late_env: Variables a run may add (read by the run, not at import).
        prepare: ``"module:function"`` called before ``preload`` (environment defaults).
    """

    def __init__(self, *, target: str, preload: Sequence[str] = (), env: Mapping[str, str],
                 cwd: Path, late_env: Sequence[str] = (), prepare: str | None = None) -> None:
        self._dir = Path(tempfile.mkdtemp(prefix="zygote-"))
        self.socket_path = str(self._dir / "z.sock")
        config = {"target": target, "preload": list(preload), "late_env": list(late_env),
                  "prepare": prepare, "socket": self.socket_path}
        (self._dir / "config.json").write_text(json.dumps(config))
        self.log = self._dir / "server.log"
        self.runs = 0
        self._count = threading.Lock()  # runs may be asked for from several threads at once
        with self.log.open("w") as log:
            self._server = subprocess.Popen(
                # -c, not -m: a child's __main__ has no package, so click names the
                # program from argv[0] ("modelship"), as in the console script
                [sys.executable, "-c", "import sys; from tests.zygote import serve; "
                 "serve(sys.argv[1])", str(self._dir / "config.json")],
                stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL, text=True,
                env=dict(env), cwd=cwd)
        self.ready: dict[str, Any] = {}

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> dict[str, Any]:
        """Block until the server has imported its modules; its ready document."""
        with self._count:  # one reader of the ready line, whichever thread asks first
            return self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> dict[str, Any]:
        if self.ready:
            return self.ready
        assert self._server.stdout is not None
        done = threading.Event()
        line: list[str] = []

        def read() -> None:
            assert self._server.stdout is not None
            line.append(self._server.stdout.readline())
            done.set()

        threading.Thread(target=read, daemon=True).start()
        if not done.wait(timeout_s) or not line[0]:
            log = self.log.read_text()[-3000:]
            self.close()
            raise RuntimeError(f"the zygote did not start: {log}")
        self.ready = json.loads(line[0])
        return self.ready

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float | None = None) -> Completed:
        """Run one command (``argv[0]`` is its program name, as ``sys.argv``) in a forked
        child; like ``subprocess.run(..., capture_output=True, text=True)``: its exit code
        (negative: the signal that killed it), stdout and stderr, and its CPU time. On
        ``timeout`` the child is killed and :class:`subprocess.TimeoutExpired` raised."""
        self.wait_ready()
        with self._count:
            self.runs += 1
            n = self.runs
        out, err = self._dir / f"{n}.out", self._dir / f"{n}.err"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.connect(self.socket_path)
            _send(conn, {"argv": list(argv), "env": dict(env or {}),
                         "stdout": str(out), "stderr": str(err)})
            lines = _Lines(conn)
            pid = json.loads(lines.next())["pid"]
            conn.settimeout(timeout)
            try:
                ended = json.loads(lines.next())
            except TimeoutError:
                os.kill(pid, signal.SIGKILL)
                conn.settimeout(None)
                lines.next()
                raise subprocess.TimeoutExpired(list(argv), timeout or 0.0, out.read_text(),
                                                err.read_text()) from None
            except BaseException:  # the caller stops (Ctrl-C, a test timeout): so does the run
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                raise
        result = Completed(list(argv), ended["returncode"], out.read_text(), err.read_text(),
                           cpu_s=ended.get("cpu_s"))
        out.unlink()
        err.unlink()
        return result

    def close(self) -> None:
        """Stop the server (a run still going on, whose caller is gone, is killed)."""
        if self._server.poll() is None:
            try:
                with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                    conn.settimeout(10)
                    conn.connect(self.socket_path)
                    _send(conn, {"stop": True})
                    _Lines(conn).next()
            except OSError:
                pass
            try:
                self._server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._server.kill()
                self._server.wait()
        if self._server.stdout is not None:
            self._server.stdout.close()
        shutil.rmtree(self._dir, ignore_errors=True)

    def bound(self, env: Mapping[str, str]) -> Bound:
        """This zygote's runs with ``env`` added to each (late variables only, as any run's:
        e.g. the home of a stack that came up while the zygote imported)."""
        return Bound(self, env)

    def __enter__(self) -> Zygote:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()



class Bound:
    """A :class:`Zygote`'s runs with some late variables set for every run (a run's own
    ``env`` goes on top); :meth:`run` as :meth:`Zygote.run`."""

    def __init__(self, zygote: Zygote, env: Mapping[str, str]) -> None:
        self.zygote, self.env = zygote, dict(env)

    def run(self, argv: Sequence[str], *, env: Mapping[str, str] | None = None,
            timeout: float | None = None) -> Completed:
        return self.zygote.run(argv, env={**self.env, **(env or {})}, timeout=timeout)
