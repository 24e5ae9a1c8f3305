"""Sockets for timeout tests that must hold on a loaded machine.

A test that bounds a client's wall time against its timeout (``elapsed < 1.5`` for a
0.5-s timeout) fails when the machine is busy building the client. These count what only
the cause can produce instead: each connection a client opens to a listener that never
answers (its first attempt and every retry) waits in the listener's backlog.
"""

from __future__ import annotations

import socket


def closed_port() -> int:
    """A loopback port that was free a moment ago: nothing listens there."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def connections_made(listener: socket.socket) -> int:
    """How many connections reached ``listener`` (never accepted until now), and accept
    them, so the count starts again from zero."""
    listener.setblocking(False)
    count = 0
    while True:
        try:
            conn, _ = listener.accept()
        except BlockingIOError:
            return count
        conn.close()
        count += 1
