"""Reconcile: bring every reachable replica to the production recorded in the repository.

The record is the **pin**, ``P/<model>/config.pbtxt``: the swap writes it after success
with ``version_policy: specific [V]`` (V is production) and signs it (HMAC in its S3
metadata, :func:`tasks.swap.pin_signature`). A replica that restarted empty, one left on
another version by a crashed coordinator, or one serving another config, is brought back.

Same shape as the swap (:mod:`modelship.triton.swap_plan` + :mod:`tasks.swap`):

- :func:`plan_reconcile` is pure: per replica, ``ok`` (serves exactly V with the pin's
  serving digest), ``load`` (anything else) or ``skip`` (unreachable);
- :func:`reconcile` reads the pin, renders it in the fleet's form (the CPU form of a GPU
  config on CPU servers, :mod:`modelship.triton.target`; a no-op for the pins the swap
  writes, which are already in that form), verifies V (signed manifest, every byte
  hashed), observes the fleet, and performs the ``load`` steps in parallel: a full-config override
  (never unload-then-load), V ready, and the golden probe answered with the outputs
  recorded at staging. It reports what it changed.

Nothing is loaded from an unsigned pin or a version that does not verify.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from typing import Any, Literal

from modelship.errors import ModelshipError, StagingError
from modelship.progress import Progress, quiet
from modelship.repository import CONFIG_NAME, model_prefix, read_verified
from modelship.settings import TritonEndpoint
from modelship.signing import key_bytes
from modelship.storage import S3Storage
from modelship.triton.client import TritonServer
from modelship.triton.model_config import ModelConfig, from_pbtxt, serving_digest, to_pbtxt
from modelship.triton.swap_plan import ReplicaView
from modelship.triton.target import render_for_servers
from tasks.swap import PIN_SIGNATURE_METADATA, apply_config, observe_fleet, pin_signature

__all__ = ["Pin", "ReconcilePlan", "ReconcileStep", "pinned_models", "plan_reconcile",
           "read_pin", "reconcile", "reconcile_stack", "watch"]

Lock = Callable[[str], AbstractContextManager[Any]]
StepAction = Literal["ok", "load", "skip"]


@dataclass(frozen=True)
class Pin:
    """The recorded production of one model: its version and full serving config."""

    model: str
    version: int
    config: ModelConfig


@dataclass(frozen=True)
class ReconcileStep:
    """What one replica needs, and why."""

    replica: str
    action: StepAction
    reason: str


@dataclass(frozen=True)
class ReconcilePlan:
    """Per replica: ``ok``, ``load`` or ``skip``, decided before anything changes."""

    model: str
    version: int
    steps: tuple[ReconcileStep, ...]

    @property
    def to_load(self) -> tuple[str, ...]:
        return tuple(s.replica for s in self.steps if s.action == "load")

    def describe(self) -> list[str]:
        return [f"{self.model} v{self.version} on {s.replica}: {s.action} ({s.reason})"
                for s in self.steps]


def _served(view: ReplicaView) -> str:
    return ", ".join(f"v{v}" for v in view.ready_versions) or "nothing"


def plan_reconcile(pin: Pin, replicas: Sequence[ReplicaView]) -> ReconcilePlan:
    """Which replicas must be brought to the pin (pure)."""
    digest = serving_digest(pin.config)
    steps = []
    for view in replicas:
        if not view.live:
            steps.append(ReconcileStep(view.name, "skip",
                                       f"unreachable: {view.problem or 'not live'}"))
        elif view.ready_versions == (pin.version,) and view.serving_digest == digest:
            steps.append(ReconcileStep(view.name, "ok", f"serves v{pin.version}"))
        elif view.ready_versions == (pin.version,):
            steps.append(ReconcileStep(view.name, "load",
                                       f"serves v{pin.version} with another config"))
        else:
            steps.append(ReconcileStep(view.name, "load", f"serves {_served(view)}"))
    return ReconcilePlan(pin.model, pin.version, tuple(steps))


def _pin_key(repository_prefix: str, model: str) -> str:
    return f"{model_prefix(repository_prefix, model)}/{CONFIG_NAME}"


def read_pin(storage: S3Storage, *, repository_prefix: str, model: str,
             signing_key: bytes) -> Pin | None:
    """The model's production pin; None when no swap has recorded one yet.

    Only a ``config.pbtxt`` signed by a swap is a pin. The one staging writes for a
    model's first version carries no signature and is ignored, and so is a pin whose
    signature was stripped: reconcile then loads nothing for that model (it never loads
    what it cannot authenticate).

    Raises:
        StagingError: the pin carries a signature that does not verify with our key (it
            was rewritten outside modelship), or it does not parse (exit 3).
    """
    key = _pin_key(repository_prefix, model)
    head = storage.head(key)
    if head is None:
        return None
    body = storage.get_bytes(key)
    try:
        config = from_pbtxt(body.decode())
    except (ModelshipError, UnicodeDecodeError) as exc:
        raise StagingError(f"the production pin s3://{storage.bucket}/{key} does not parse",
                           hint="swap the model again (`modelship swap MODEL --to V`)",
                           model=model) from exc
    versions = list(config.version_policy.specific.versions)
    signature = {str(k).lower(): str(v) for k, v in head["metadata"].items()}.get(
        PIN_SIGNATURE_METADATA)
    if signature is None or len(versions) != 1:
        return None
    if signature != pin_signature(body, signing_key):
        raise StagingError(
            f"the production pin s3://{storage.bucket}/{key} (v{versions[0]}) is not signed "
            "with our key; it was not written by a swap, so reconcile will not load from it",
            hint=f"re-pin production with `modelship swap {model} --to V` (the version "
            "that should serve)", model=model, key=key,
        )
    return Pin(model, versions[0], config)


def pinned_models(storage: S3Storage, *, repository_prefix: str) -> list[str]:
    """Models that have a ``config.pbtxt`` at the top of their folder, sorted."""
    root = repository_prefix.strip("/") + "/"
    models = set()
    for key in storage.list_keys(root):
        parts = key[len(root):].split("/")
        if len(parts) == 2 and parts[1] == CONFIG_NAME:
            models.add(parts[0])
    return sorted(models)


def _reconcile_model(replicas: Sequence[TritonServer], *, model: str, storage: S3Storage,
                     repository_prefix: str, signing_key: bytes, timeout_s: float,
                     probe_timeout_s: float, dry_run: bool,
                     progress: Progress) -> dict[str, Any]:
    result: dict[str, Any] = {"model": model, "version": None, "changed": [], "ok": True,
                              "replicas": []}
    pin = read_pin(storage, repository_prefix=repository_prefix, model=model,
                   signing_key=signing_key)
    if pin is None:
        result["status"] = ("no production recorded: no config.pbtxt signed by a swap "
                            "(never swapped, or its pin was rewritten); nothing loaded")
        return result
    result["version"] = pin.version
    observed = observe_fleet(replicas, model)
    # The pin is written in the fleet's form by the swap; rendering it again is a no-op then,
    # and turns a GPU pin into its CPU form on a CPU fleet (a pin from before issue 13).
    config, form = render_for_servers(pin.config, replicas, timeout_s=probe_timeout_s)
    pin = replace(pin, config=config)
    result["serving_form"] = form.to_dict()
    plan = plan_reconcile(pin, [o.view for o in observed])
    for line in plan.describe():
        progress(line)
    rows = {s.replica: {"replica": s.replica, "action": s.action, "reason": s.reason,
                        "ok": s.action == "ok"} for s in plan.steps}
    result["replicas"] = list(rows.values())
    result["skipped"] = [s.replica for s in plan.steps if s.action == "skip"]
    if not plan.to_load:
        result["status"] = "converged"
        return result
    if dry_run:
        result["status"] = "dry run: would load " + ", ".join(plan.to_load)
        return result
    verified = read_verified(storage, model=model, version=pin.version,
                             repository_prefix=repository_prefix, deep=True,
                             signing_key=signing_key)
    if verified.probe is None:
        raise StagingError(f"{model}/{pin.version} was staged without a golden probe, so a "
                           "reconciled replica could not be checked",
                           hint=f"stage {model} v{pin.version} again, then swap to it",
                           model=model, version=pin.version)
    golden = verified.probe
    servers = {s.name: s for s in replicas}

    def load(name: str) -> tuple[str, tuple[bool, str | None, float]]:
        progress(f"{model}: loading v{pin.version} (production config) on {name}")
        return name, apply_config(servers[name], model=model, config=pin.config,
                                  version=pin.version, golden=golden, timeout_s=timeout_s,
                                  probe_timeout_s=probe_timeout_s)

    with ThreadPoolExecutor(max_workers=len(plan.to_load)) as pool:
        for name, (ok, reason, seconds) in pool.map(load, plan.to_load):
            rows[name].update(ok=ok, seconds=round(seconds, 3),
                              outcome="loaded" if ok else f"failed: {reason}")
            if ok:
                result["changed"].append(name)
            progress(f"{model}: {name} {'serves' if ok else 'FAILED to serve'} "
                     f"v{pin.version}{'' if ok else f': {reason}'} ({seconds:.1f} s)")
    result["ok"] = all(r["ok"] or r["action"] == "skip" for r in rows.values())
    result["status"] = "converged" if result["ok"] else "some replicas failed"
    return result


def reconcile(
    replicas: Sequence[TritonServer],
    *,
    storage: S3Storage,
    repository_prefix: str,
    signing_key: bytes,
    model: str | None = None,
    timeout_s: float = 120.0,
    probe_timeout_s: float = 5.0,
    dry_run: bool = False,
    lock: Lock | None = None,
    recover: Callable[[str], dict[str, Any]] | None = None,
    progress: Progress = quiet,
    traffic: Callable[[], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Bring every reachable replica to each pinned model's production; report changes.

    Args:
        replicas: The production fleet (not the canary).
        storage: The repository's S3 client.
        repository_prefix: The repository prefix inside the bucket.
        signing_key: Verifies the pin and the version's manifest.
        model: One model, or None for every model with a pin.
        timeout_s: Deadline of one replica's load, ready and probe, in s.
        probe_timeout_s: Bound of one probe request, in s.
        dry_run: Plan only.
        lock: ``lock(model)`` returns a context manager held while that model is
            reconciled (the release lock, so a reconcile never races a swap).
        recover: ``recover(model)``, called under that lock before anything else:
            finishes or undoes what dead or incomplete releases of the model left
            (:func:`tasks.fleet.recover_model`), so the pin read next is the truth; what
            it did is reported as ``recovered``. Skipped on a dry run.
        progress: Receives one human line per step.
        traffic: With a traffic router, ``traffic()``
            (:func:`tasks.traffic_state.reconcile_hook`) first returns an orphaned split
            (no live release owns it) to 100 % production; its report is ``traffic``, and
            a router that could not be restored or read makes the round fail (``ok``
            false, exit 1) while the replicas are still reconciled. Skipped on a dry run.

    Returns:
        ``{"models": [{"model", "version", "status", "ok", "changed", "skipped",
        "replicas": [{"replica", "action", "reason", "ok", ...}]}], "changed": N,
        "ok": bool}``; a model whose pin or version does not verify has ``ok: false``
        and an ``error`` (nothing was loaded for it); ``traffic`` with a ``traffic`` hook.
    """
    routed = traffic() if traffic is not None and not dry_run else None
    names = [model] if model is not None else pinned_models(
        storage, repository_prefix=repository_prefix)
    results = []
    for name in names:
        guard = lock(name) if lock is not None else nullcontext()
        try:
            with guard:
                recovered = _recover(recover, name, progress) \
                    if recover is not None and not dry_run else None
                result = _reconcile_model(
                    replicas, model=name, storage=storage,
                    repository_prefix=repository_prefix, signing_key=signing_key,
                    timeout_s=timeout_s, probe_timeout_s=probe_timeout_s, dry_run=dry_run,
                    progress=progress)
                if recovered and any(recovered.get(k) for k in ("finished", "unloaded",
                                                                "error")):
                    result["recovered"] = recovered
                if recovered and recovered.get("error"):
                    # the replicas were still brought to the pin; the release is not done
                    result.update(ok=False, error=recovered["error"],
                                  hint=recovered.get("hint"), exit_code=1)
                results.append(result)
        except ModelshipError as exc:
            progress(f"{name}: not reconciled: {exc.message}")
            results.append({"model": name, "ok": False, "changed": [], "error": exc.message,
                            "hint": exc.hint, "exit_code": exc.exit_code})
    return {"models": results, "changed": sum(len(r["changed"]) for r in results),
            "ok": all(r["ok"] for r in results)
            and not (routed and ("error" in routed or "unread" in routed)),
            "dry_run": dry_run, **({"traffic": routed} if routed is not None else {})}


def _recover(recover: Callable[[str], dict[str, Any]], model: str,
             progress: Progress) -> dict[str, Any]:
    """The recover hook; a release it could not finish (a dependency down) is reported,
    and the replicas are still reconciled to the pin: what it could do (the fleet first)
    is done, and a restarted replica must not wait for MLflow."""
    try:
        return recover(model)
    except ModelshipError as exc:
        progress(f"{model}: {exc.message}")
        return {"error": exc.message, "hint": exc.hint}


def watch(
    replicas: Sequence[TritonServer],
    *,
    interval_s: float = 10.0,
    rounds: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
    **kwargs: Any,
) -> Iterator[dict[str, Any]]:
    """``reconcile --watch``: reconcile every ``interval_s`` s, yielding each report.

    Args:
        replicas: The production fleet.
        interval_s: Pause between rounds, in s.
        rounds: Stop after this many rounds (None: until the caller stops iterating).
        sleep: The pause function (tests pass a fake one).
        **kwargs: Passed to :func:`reconcile` (storage, repository_prefix, signing_key,
            model, lock, progress, ...).
    """
    done = 0
    while rounds is None or done < rounds:
        yield reconcile(replicas, **kwargs)
        done += 1
        if rounds is None or done < rounds:
            sleep(interval_s)


def reconcile_stack(state: dict[str, Any], *, progress: Progress = quiet,
                    timeout_s: float = 120.0) -> dict[str, Any]:
    """The embedded stack's ready hook (``manager.up(on_ready=...)``): reconcile its replicas.

    Builds the clients from the stack state (``stack.json``), reconciles every pinned model
    on the production replicas (not the canary) and closes them again.
    """
    storage = S3Storage(endpoint=state["s3_endpoint"], bucket=state["bucket"],
                        access_key=state["access_key"], secret_key=state["secret_key"],
                        region=state.get("region", "us-east-1"))
    replicas = [TritonServer(TritonEndpoint(**endpoint), timeout_s=10.0,
                             control_timeout_s=timeout_s)
                for endpoint in state["triton"]["replicas"]]
    try:
        return reconcile(replicas, storage=storage,
                         repository_prefix=state["repository_prefix"],
                         signing_key=key_bytes(state.get("manifest_signing_key")),
                         timeout_s=timeout_s, progress=progress)
    finally:
        for replica in replicas:
            replica.close()


def pin_text(pin: Pin) -> str:
    """The pin as ``config.pbtxt`` text (for reports)."""
    return to_pbtxt(pin.config)
