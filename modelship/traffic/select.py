"""Which TrafficRouter a command steers: the Kubernetes Gateway API route when one is
configured (``MODELSHIP_K8S_ROUTE``), else the embedded stack's local gateway when its
``stack.json`` has one, else none (a fleet without a router: replay canaries only)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from modelship.errors import UsageError
from modelship.settings import Settings
from modelship.split_scope import SplitScope
from modelship.traffic.gateway_api import build_gateway_api_router
from modelship.traffic.local_gateway import LocalGateway
from modelship.traffic.port import TrafficRouter


def router_for(settings: Settings, state: Mapping[str, Any] | None = None, *,
               scope: SplitScope | None = None) -> TrafficRouter | None:
    """The router for these settings (no I/O but reading ``stack.json`` when ``state`` is
    not given; the router talks to its data plane on first use). ``scope``: the requests
    the local gateway's splits apply to (the Gateway API's route is one model's already).

    Raises:
        UsageError: the Gateway API settings do not parse, or ``stack.json`` is not JSON.
    """
    options = settings.gateway_api_router()
    if options is not None:
        return build_gateway_api_router(options)
    if state is None:
        state = _stack_state(settings)
    if state and state.get("gateway"):
        return LocalGateway.from_state(dict(state), scope=scope)
    return None


def _stack_state(settings: Settings) -> dict[str, Any] | None:
    path = settings.stack_file
    if not path.is_file():
        return None
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path} is not readable JSON ({exc})",
                         hint="run `modelship stack down` to clear it, then "
                         "`modelship stack up`") from exc
    return state if isinstance(state, dict) else None
