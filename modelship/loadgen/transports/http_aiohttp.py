"""KServe v2 HTTP/REST over aiohttp: only for ``https://`` endpoints.

Plain ``http://`` goes through the raw HTTP/1.1 transport (:mod:`.http1`), which costs
about a third of aiohttp's client CPU per request (``bench/loadgen``: raw ≈ 105-120 /
225-275 µs against aiohttp's ≈ 355-460 / 675-1000 µs at concurrency 16 / 1).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from modelship.loadgen.spec import LoadSpec, Target
from modelship.loadgen.transports.base import RequestFailed, Requests
from modelship.loadgen.transports.kserve_http import (
    answer_outputs,
    build_body,
    failed_answer,
    http_base,
    infer_path,
)


class AiohttpTransport:
    """KServe v2 HTTP/REST over aiohttp with binary tensors, one pool per server."""

    def __init__(
        self,
        targets: Sequence[Target],
        payload: Mapping[str, np.ndarray],
        spec: LoadSpec,
        connections: int,
    ) -> None:
        # Lazy: aiohttp costs ~0.8 s to import on a busy machine; only https runs need it.
        import aiohttp

        self._aiohttp = aiohttp
        self._keep_outputs = spec.keep_outputs
        self._timeout = aiohttp.ClientTimeout(total=spec.timeout_s)
        self._connections = connections
        self._sessions: dict[str, Any] = {}
        self._bases = [http_base(t.url) for t in targets]
        self._urls = [
            f"{base}{infer_path(t)}" for base, t in zip(self._bases, targets, strict=True)
        ]
        self._requests = Requests(targets, payload, spec.batch_size, build_body)

    def _session(self, base: str) -> Any:
        """The pooled session of one server."""
        # Created lazily: aiohttp sessions must be made inside the running event loop.
        session = self._sessions.get(base)
        if session is None:
            connector = self._aiohttp.TCPConnector(limit=self._connections)
            session = self._sessions[base] = self._aiohttp.ClientSession(
                connector=connector, timeout=self._timeout
            )
        return session

    async def send(self, target: int, request: int) -> tuple[str, dict[str, np.ndarray] | None]:
        """One POST; a transport error or a non-200 answer fails the request."""
        body, headers = self._requests.get(target, request)
        session = self._session(self._bases[target])
        try:
            async with session.post(self._urls[target], data=body, headers=headers) as response:
                content = await response.read()
                status = response.status
                header_length = response.headers.get("Inference-Header-Content-Length")
        except (self._aiohttp.ClientError, TimeoutError) as exc:
            raise RequestFailed(f"{type(exc).__name__}: {exc}") from None
        if status != 200:
            raise failed_answer(status, content)
        header = content[: int(header_length)] if header_length else content
        version = str(json.loads(header).get("model_version", ""))
        outputs = None
        if self._keep_outputs:
            outputs = answer_outputs(content, int(header_length) if header_length else None)
        return version, outputs

    async def close(self) -> None:
        """Close every session."""
        for session in self._sessions.values():
            await session.close()
