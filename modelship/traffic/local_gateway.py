"""The local adapter of the TrafficRouter port: the embedded stack's nginx gateway.

A change renders the whole configuration from the new :class:`TrafficSplit`
(:func:`render`, pure), checks it with ``nginx -t``, replaces the file atomically, and
reloads the master gracefully (SIGHUP); it returns once the workers answering on the admin
port carry the new configuration's generation. :meth:`LocalGateway.live` asks those
workers, never the file: what they answer is what routes requests.

What a reload does to clients (docs/gateway.md): no request that nginx has read is lost,
and the old workers finish those; a request sent on a connection the old worker is closing
was never read, and clients send it again (gRPC: GOAWAY's last stream id; HTTP/1.1: the
connection closes with no byte of an answer). The project's load generator does both.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from modelship import nginx
from modelship.errors import InfrastructureError
from modelship.procinfo import process_start_ticks
from modelship.split_scope import SplitScope, scope_report
from modelship.traffic.port import TrafficSplit

#: Seconds one call may take (the check, the reload and its confirmation).
CALL_TIMEOUT_S = 15.0


def render(layout: nginx.GatewayLayout, split: TrafficSplit, generation: str,
           scope: SplitScope | None = None) -> str:
    """The gateway's configuration for ``split`` over ``scope``'s requests (pure; shares
    to nginx's 0.01 %)."""
    return nginx.render_config(layout, split.canary_pct, split.mirror_pct, generation, scope)


def as_live(split: TrafficSplit) -> TrafficSplit:
    """``split`` as the gateway holds it (shares quantized to 0.01 %), for comparisons."""
    return TrafficSplit(canary_pct=nginx.quantize_pct(split.canary_pct),
                        mirror_pct=nginx.quantize_pct(split.mirror_pct))


class LocalGateway:
    """The stack's nginx as a :class:`~modelship.traffic.port.TrafficRouter`.

    Args:
        layout: the gateway's ports, upstreams and paths (``stack.json``'s ``gateway``).
        pid: the nginx master's PID; ``start_ticks``: its start time, so a recycled PID is
            never signalled.
        timeout_s: bound of each call.
        scope: the requests a split applies to (one model's; :class:`~modelship.split_scope.
            SplitScope`); None splits every request. A release scopes its router to its
            model, or another model's requests in the share would reach the canary Triton,
            which serves only the candidate.
    """

    name = "local-gateway"

    def __init__(self, layout: nginx.GatewayLayout, *, pid: int, start_ticks: int | None,
                 timeout_s: float = CALL_TIMEOUT_S,
                 scope: SplitScope | None = None) -> None:
        self.layout = layout
        self.scope = scope
        self.pid = pid
        self.start_ticks = start_ticks
        self.timeout_s = timeout_s
        self._lock = threading.Lock()

    @classmethod
    def from_state(cls, state: dict[str, Any], *, timeout_s: float = CALL_TIMEOUT_S,
                   scope: SplitScope | None = None) -> LocalGateway:
        """The gateway of a stack, from its ``stack.json`` document.

        Raises:
            InfrastructureError: the stack has no gateway (started by an older modelship).
        """
        gateway = state.get("gateway")
        record = next((p for p in state.get("processes", []) if p.get("name") == "gateway"),
                      None)
        if not gateway or record is None:
            raise InfrastructureError(
                "this stack has no gateway (it was started by an older modelship)",
                hint="run `modelship stack down` then `modelship stack up`",
                component="gateway")
        ticks = record.get("start_ticks")
        return cls(nginx.GatewayLayout.from_dict(gateway["layout"]), pid=int(record["pid"]),
                   start_ticks=int(ticks) if ticks is not None else None,
                   timeout_s=timeout_s, scope=scope)

    # ------------------------------------------------------------------ the port

    def set_weights(self, canary_pct: float) -> None:
        """Answer ``canary_pct`` % from the canary; the mirror share stays."""
        with self._lock:
            current = self.live()
            self._apply(TrafficSplit(canary_pct=canary_pct, mirror_pct=current.mirror_pct),
                        current)

    def mirror(self, share_pct: float) -> None:
        """Copy ``share_pct`` % to the canary, answers thrown away; the weights stay."""
        with self._lock:
            current = self.live()
            self._apply(TrafficSplit(canary_pct=current.canary_pct, mirror_pct=share_pct),
                        current)

    def live(self) -> TrafficSplit:
        """What the running workers route by, asked on a new connection.

        During a reload the retiring workers may still take a new connection and answer
        with the split being replaced: a reader (status, recovery, another process) would
        see the new split, then the old one. So while more workers than configured take
        connections, it waits (at most ``timeout_s``) for the retiring ones to stop.

        Raises:
            InfrastructureError: the master is dead (its orphaned workers may still answer
                with the split they had, but nothing can change it: a dead gateway), or
                the workers do not answer.
        """
        self._settled()
        canary, mirror, _ = nginx.read_live(self.layout, timeout_s=self.timeout_s)
        return TrafficSplit(canary_pct=canary, mirror_pct=mirror)

    def live_scoped(self) -> tuple[TrafficSplit, dict[str, Any]]:
        """:meth:`live` and the requests it applies to (``scope_report``), from the same
        answer of the running workers (the scope compiled into their configuration).

        Raises:
            InfrastructureError: as :meth:`live`.
        """
        self._settled()
        canary, mirror, _, scope = nginx.read_live_scoped(self.layout,
                                                          timeout_s=self.timeout_s)
        return TrafficSplit(canary_pct=canary, mirror_pct=mirror), scope_report(scope)

    def _settled(self) -> None:
        """The master is alive and no retiring worker takes connections (at most
        ``timeout_s``; see :meth:`live`)."""
        self._check_master()
        deadline = time.monotonic() + self.timeout_s
        while nginx.accepting_workers(self.pid) > nginx.WORKER_PROCESSES \
                and time.monotonic() < deadline:
            time.sleep(0.02)

    # ------------------------------------------------------------------ internals

    def _apply(self, split: TrafficSplit, current: TrafficSplit) -> None:
        """Render, check, write, reload, and wait until the new workers answer. A split
        that is live already costs no reload (no connection is closed for nothing). A split
        without a mirror deletes the shadow's sample log (production's inputs): whoever
        turns the mirror off (the shadow, recovery, reconcile) leaves none behind."""
        if as_live(split) == current:
            if not split.mirror_pct:
                nginx.forget_samples(self.layout)
            return
        deadline = time.monotonic() + self.timeout_s
        self._check_master()
        generation = f"{time.time_ns():x}"
        text = render(self.layout, split, generation, self.scope)
        nginx.check_config(nginx.nginx_binary(), self.layout, text,
                           timeout_s=max(deadline - time.monotonic(), 0.1))
        nginx.write_config(self.layout, text)
        nginx.reload(self.pid)
        self._await_generation(generation, deadline)
        if not split.mirror_pct:  # no worker logs mirrored bodies any more
            nginx.forget_samples(self.layout)

    def _check_master(self) -> None:
        ticks = process_start_ticks(self.pid)
        if ticks is None or (self.start_ticks is not None and ticks != self.start_ticks):
            raise InfrastructureError(
                f"the local gateway (nginx, pid {self.pid}) is not running",
                hint="run `modelship stack up`: it restarts the gateway on its recorded "
                f"ports; its log is {self.layout.error_log}", component="gateway")

    def _await_generation(self, generation: str, deadline: float) -> None:
        """Poll the admin port (a new connection each time) until the new workers answer,
        then until the old ones take no new connection (so the old split is over).

        Raises:
            InfrastructureError: they did not by the deadline (nginx refused the reload, or
                is stuck), or the master died meanwhile.
        """
        seen = ""
        while True:
            left = deadline - time.monotonic()
            try:
                _, _, seen = nginx.read_live(self.layout, timeout_s=max(min(left, 2.0), 0.1))
            except InfrastructureError:
                self._check_master()
            if seen == generation and \
                    nginx.accepting_workers(self.pid) <= nginx.WORKER_PROCESSES:
                return
            if time.monotonic() >= deadline:
                raise InfrastructureError(
                    f"the local gateway did not take the new split within {self.timeout_s:g} s "
                    f"(its workers still answer generation {seen or 'nothing'})",
                    hint=f"read {self.layout.error_log}; `modelship stack status` shows "
                    "whether it runs, and `modelship stack up` restarts it",
                    component="gateway")
            time.sleep(0.02)
