"""Which form of a staged config a server or a fleet loads: ``cpu`` or ``gpu``.

One staged version per model, rendered for the policy's declared target
(:mod:`modelship.triton.model_config`); the fleet's **actual** target is applied when a
config is loaded. Every place that loads a staged config onto a server (the canary, the
swap and its production pin, reconcile, the trial load) goes through
:func:`render_for_servers`, so they all arrive at the same bytes and digests:

- :func:`decide_target` (pure) decides from what each server's metrics say: a server that
  exports ``nv_gpu_*`` memory gauges is ``gpu``, one that answers without them is ``cpu``
  (:func:`modelship.triton.gpu.fleet_target`). Servers whose metrics could not be read
  do not vote. When none could be read the staged form is kept (what was staged and
  hashed serves; never guess *down* to the CPU form on what may be a GPU fleet). A fleet
  with both kinds has no single form, so it is refused before anything changes.
- :func:`~modelship.triton.model_config.for_target` (pure) derives the CPU form from a GPU
  config; a CPU config is served as is on any fleet.
- :func:`with_visible_gpus` (pure): on a GPU fleet whose servers all show the same number
  of GPUs, a ``KIND_GPU`` group that names no ``gpus`` gets them all, explicitly. Triton
  fills an empty list in the same way when it loads the model, so the live config would
  otherwise never digest like the one loaded: a no-op swap would reload and reconcile would
  reload it every round.
- :func:`detect_targets` is the only I/O: one metrics scrape per server, cached on the
  :class:`~modelship.triton.client.TritonServer` (``server.target``) once it succeeded, so
  a reconcile watch does not scrape every round. Callers that already scraped the metrics
  (the canary before it loads, the swap for its GPU headroom) pass the texts in.

Why the fleet, not each replica: the swap's plan and ``modelship status`` compare the
replicas' configs by digest, and the production pin must be one config that a restarted
replica can load; a per-replica form would make a mixed fleet look consistent.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

from tritonclient.grpc import model_config_pb2

from modelship.errors import ModelshipError, PreflightError
from modelship.policy import Target
from modelship.triton.client import TritonServer
from modelship.triton.gpu import fleet_target, parse_gpu_metrics
from modelship.triton.metrics import scrape_text
from modelship.triton.model_config import ModelConfig, for_target

__all__ = ["FleetTarget", "decide_target", "detect_targets", "render_for_servers",
           "staged_target", "with_visible_gpus"]

TargetSource = Literal["detected", "staged"]


@dataclass(frozen=True)
class FleetTarget:
    """The form a set of servers loads, and how that was decided.

    Attributes:
        target: ``cpu`` or ``gpu``.
        source: ``detected`` (from the servers' metrics) or ``staged`` (no server's
            metrics could be read, so the staged form is kept).
        servers: Server name to what its metrics said (None: not read).
    """

    target: Target
    source: TargetSource
    servers: dict[str, Target | None]

    def describe(self) -> str:
        """One line for plans and progress."""
        if self.source == "staged":
            return (f"serving form {self.target}: kept as staged (no server's metrics could be "
                    "read to detect cpu or gpu)")
        said = ", ".join(f"{name} {found or 'unread'}" for name, found in self.servers.items())
        return f"serving form {self.target}: detected from the servers' metrics ({said})"

    def to_dict(self) -> dict[str, Any]:
        return {"target": self.target, "source": self.source, "servers": dict(self.servers)}


def staged_target(cfg: ModelConfig) -> Target:
    """``gpu`` when the config has a ``KIND_GPU`` instance group, else ``cpu`` (pure)."""
    gpu = model_config_pb2.ModelInstanceGroup.KIND_GPU
    return "gpu" if any(g.kind == gpu for g in cfg.instance_group) else "cpu"


def decide_target(found: Mapping[str, Target | None], *, staged: ModelConfig,
                  what: str = "model") -> FleetTarget:
    """The one form ``found``'s servers load (pure).

    Args:
        found: Server name to the target its metrics show, None where they were not read.
        staged: The staged config (its form is kept when nothing was read).
        what: The model, for the refusal message.

    Raises:
        PreflightError: some servers are GPU servers and others CPU servers (exit 1).
    """
    known = {name: t for name, t in found.items() if t is not None}
    kinds = set(known.values())
    if len(kinds) > 1:
        listed = "; ".join(f"{name}: {t}" for name, t in known.items())
        raise PreflightError(
            f"the servers of {what} are of two kinds ({listed}), and one config cannot serve "
            "on both: KIND_GPU does not load on a CPU server, KIND_CPU wastes the GPUs",
            hint="serve each kind from its own fleet (a Service per kind), or start the GPU "
            "servers with --allow-gpu-metrics=true if they read as cpu; nothing was changed",
            model=what, servers=dict(found))
    if not kinds:
        return FleetTarget(staged_target(staged), "staged", dict(found))
    return FleetTarget(kinds.pop(), "detected", dict(found))


def detect_targets(servers: Sequence[TritonServer], *, timeout_s: float,
                   texts: Mapping[str, str | None] | None = None) -> dict[str, Target | None]:
    """What each server is, ``cpu`` or ``gpu``, from its metrics; None where unread.

    A server's answer is cached on it (``server.target``). ``texts`` holds metrics the
    caller already scraped (server name to text, None for a failed scrape, which is not
    retried); other servers are scraped here, in parallel.
    """
    given = dict(texts or {})

    def one(server: TritonServer) -> Target | None:
        if server.target is not None:
            return server.target
        if server.name in given:
            text = given[server.name]
        else:
            try:
                text = scrape_text(server.endpoint.metrics, timeout_s)
            except ModelshipError:
                text = None
        if text is None:
            return None
        server.target = fleet_target(text)
        server.gpu_count = len(parse_gpu_metrics(text)) if server.target == "gpu" else 0
        return server.target

    with ThreadPoolExecutor(max_workers=max(1, len(servers))) as pool:
        return dict(zip([s.name for s in servers], pool.map(one, servers), strict=True))


def render_for_servers(staged: ModelConfig, servers: Sequence[TritonServer], *,
                       timeout_s: float, texts: Mapping[str, str | None] | None = None
                       ) -> tuple[ModelConfig, FleetTarget]:
    """The form of ``staged`` that ``servers`` load, and how it was decided.

    Args:
        staged: A config as staged (``P/<model>/<V>/config.pbtxt``) or pinned.
        servers: The servers it is about to be loaded on (the fleet, or the canary).
        timeout_s: Bound of one metrics scrape, in s.
        texts: Metrics texts the caller already has (see :func:`detect_targets`).

    Raises:
        PreflightError: the servers are of two kinds (see :func:`decide_target`).
    """
    fleet = decide_target(detect_targets(servers, timeout_s=timeout_s, texts=texts),
                          staged=staged, what=staged.name or "model")
    config = for_target(staged, fleet.target)
    counts = {s.gpu_count for s in servers if s.target == "gpu" and s.gpu_count}
    if fleet.target == "gpu" and len(counts) == 1:
        config = with_visible_gpus(config, counts.pop())
    return config, fleet


def with_visible_gpus(cfg: ModelConfig, count: int) -> ModelConfig:
    """``cfg`` with every ``KIND_GPU`` group that names no ``gpus`` on GPUs ``0..count-1``,
    as Triton places it (pure; a copy; groups that name their GPUs are kept)."""
    out = ModelConfig()
    out.CopyFrom(cfg)
    for group in out.instance_group:
        if group.kind == model_config_pb2.ModelInstanceGroup.KIND_GPU and not group.gpus:
            group.gpus.extend(range(count))
    return out
