"""What every transport is: the ``send``/``close`` contract, its failure, and the shared
cache of prebuilt requests.

Each distinct request is serialized once per target and then only written: on a small
machine the client's CPU is taken from the server under test.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from modelship.loadgen.payload import check_payload, distinct_requests, request_rows
from modelship.loadgen.spec import Target


class RequestFailed(Exception):
    """A request got no answer; ``str()`` is the short error text for the record.

    ``unread``: the server provably never read the request (a stream refused or above a
    GOAWAY's last stream id, a call queued on a closing connection, or a reused keep-alive
    connection closed before any byte of its answer, as a proxy's graceful reload does),
    so a transport may send it once more on a new connection without running it twice.
    """

    def __init__(self, text: str, *, unread: bool = False) -> None:
        super().__init__(text)
        self.unread = unread


class Transport(Protocol):
    """Sends prepared requests to targets; one instance per run."""

    async def send(self, target: int, request: int) -> tuple[str, dict[str, np.ndarray] | None]:
        """Send a prepared request; return the answering version and maybe the outputs."""
        ...

    async def close(self) -> None:
        """Release connections."""
        ...


class Requests:
    """Lazily built, cached request bodies per (target, request index)."""

    def __init__(
        self,
        targets: Sequence[Target],
        payload: Mapping[str, np.ndarray],
        batch_size: int,
        build: Callable[[Target, dict[str, np.ndarray]], Any],
    ) -> None:
        self._targets = targets
        self._payload = {k: np.ascontiguousarray(v) for k, v in payload.items()}
        self._batch_size = batch_size
        self._n_rows = check_payload(payload)
        self._period = distinct_requests(batch_size, self._n_rows)
        self._build = build
        self._cache: list[dict[int, Any]] = [{} for _ in targets]

    def get(self, target: int, request: int) -> Any:
        """The body of request ``request`` to target ``target``, built on first use."""
        key = request % self._period
        cache = self._cache[target]
        built = cache.get(key)
        if built is None:
            rows = request_rows(key, self._batch_size, self._n_rows)
            arrays = {name: np.ascontiguousarray(a[rows]) for name, a in self._payload.items()}
            built = cache[key] = self._build(self._targets[target], arrays)
        return built


def no_delay(transport: asyncio.Transport) -> asyncio.Transport:
    """The transport with Nagle off: a small request goes out at once, not after an ACK."""
    sock = transport.get_extra_info("socket")
    if sock is not None:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return transport
