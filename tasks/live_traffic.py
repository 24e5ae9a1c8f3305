"""I/O shared by the live-traffic stages (the progressive canary, the holdback bake): one
version served alone on the canary Triton behind the router, and per-server scrapes of
Triton's metrics for the per-version judges (:mod:`tasks.live_judge`, :mod:`tasks.bake`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

from modelship.clients import Clients
from modelship.errors import InfrastructureError, ModelshipError, UsageError
from modelship.progress import Progress, quiet
from modelship.repository import staged_config
from modelship.settings import Settings
from modelship.split_scope import SplitScope
from modelship.traffic.port import TrafficRouter
from modelship.triton.client import TritonServer
from modelship.triton.metrics import Scrape, parse_metrics, scrape_text
from modelship.triton.model_config import ModelConfig, from_pbtxt, to_json, with_versions
from modelship.triton.target import render_for_servers
from tasks.approve import canary_cleanup
from tasks.traffic_state import configured_router

__all__ = ["canary_and_router", "scrape_servers", "serving_on_canary", "split_scope"]

_READY_POLL_S = 0.1


def split_scope(clients: Clients, model: str, progress: Progress = quiet) -> SplitScope:
    """The requests a release of ``model`` may split: its own HTTP requests, and gRPC too
    only when the replicas serve no other model (gRPC names the model in its body, which
    the gateway does not read). A replica that does not answer counts as serving others."""
    others: set[str] = set()
    for replica in clients.replicas:
        try:
            others |= {str(m.get("name")) for m in replica.repository_index()
                       if m.get("state") == "READY" and m.get("name") != model}
        except ModelshipError as exc:
            others.add(f"(unknown: {replica.name}: {exc.message})")
    if others:
        shown = ", ".join(sorted(others)[:5]) + (" ..." if len(others) > 5 else "")
        progress(f"traffic: the split covers {model}'s HTTP requests only; gRPC requests "
                 f"stay on production (the fleet also serves {shown}, and gRPC names the "
                 "model inside the request body)")
    return SplitScope(model, grpc=not others)


def canary_and_router(settings: Settings, clients: Clients, *, what: str, model: str,
                      progress: Progress = quiet) -> tuple[TritonServer, TrafficRouter]:
    """The canary Triton and the configured router, its splits over ``model``'s requests
    (:func:`split_scope`), or a usage error (exit 2) naming what is missing for ``what``
    (e.g. ``canary.traffic: progressive``)."""
    router = configured_router(settings, progress, scope=split_scope(clients, model, progress))
    if router is None or clients.canary is None:
        missing = "a traffic router" if router is None else "a canary Triton"
        raise UsageError(f"{what} needs {missing}: live requests reach the candidate "
                         "(or the holdback) only through the router",
                         hint="run `modelship stack up` (its gateway), or set "
                         "MODELSHIP_K8S_ROUTE; else use the replay canary / no holdback",
                         key=what.split(":")[0])
    return clients.canary, router


def _config(settings: Settings, clients: Clients, *, model: str, version: int,
            config_pbtxt: str | None) -> ModelConfig:
    if config_pbtxt is not None:
        return from_pbtxt(config_pbtxt)
    assert clients.storage is not None  # promote refuses a release without the repository
    return staged_config(clients.storage, repository_prefix=settings.repository_prefix,
                         model=model, version=version)


@contextmanager
def serving_on_canary(settings: Settings, clients: Clients, server: TritonServer, *,
                      model: str, version: int, config_pbtxt: str | None = None,
                      progress: Progress = quiet) -> Iterator[None]:
    """``version`` alone on the canary Triton for the block (its staged config in the
    canary's form), so that requests the router sends there (no version in the URL) are
    answered by it; unloaded after the block on every path.

    Raises:
        InfrastructureError: it did not become ready within the control timeout.
    """
    staged = _config(settings, clients, model=model, version=version,
                     config_pbtxt=config_pbtxt)
    config, _ = render_for_servers(with_versions(staged, [version]), [server],
                                   timeout_s=settings.http_timeout_s)
    progress(f"loading {model} v{version} alone on the canary {server.name}")
    try:
        server.load_model(model, config_json=to_json(config))
        end = time.monotonic() + settings.control_timeout_s
        while not server.is_model_ready(model, str(version)):
            if time.monotonic() > end:
                raise InfrastructureError(
                    f"{model} v{version} did not become ready on the canary {server.name} "
                    f"within {settings.control_timeout_s:g} s",
                    hint="see the canary Triton log", model=model, version=version)
            time.sleep(_READY_POLL_S)
        yield
    finally:
        done = canary_cleanup(clients, model)
        progress(f"canary {server.name}: {done}")


def scrape_servers(servers: Sequence[TritonServer], timeout_s: float
                   ) -> tuple[dict[str, Scrape], dict[str, str]]:
    """Every server's metrics (one fetch each, in parallel), and the ones that did not
    answer with why."""
    def one(server: TritonServer) -> tuple[str, Scrape | None, str | None]:
        try:
            return server.name, parse_metrics(scrape_text(server.endpoint.metrics,
                                                          timeout_s)), None
        except ModelshipError as exc:
            return server.name, None, exc.message

    found: dict[str, Scrape] = {}
    failed: dict[str, str] = {}
    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        for name, scraped, error in pool.map(one, servers):
            if scraped is None:
                failed[name] = error or "no answer"
            else:
                found[name] = scraped
    return found, failed
