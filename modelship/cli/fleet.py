"""``modelship swap | rollback | status | load | canary``: the fleet."""

from __future__ import annotations

import getpass
import json
import os
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Annotated, Any, TextIO

import typer

from modelship.cli._common import (
    DryRunOpt,
    ForceOpt,
    JsonOpt,
    ModelArg,
    PolicyOpt,
    VersionOpt,
    app,
    finish,
    progress,
    run_reporting,
    table,
    with_clients,
)
from modelship.errors import UsageError


def _render_swap(doc: dict[str, Any]) -> str:
    lines = list(doc.get("plan") or [])
    if doc.get("dry_run"):
        return "\n".join(["dry run: nothing was changed", *lines])
    if doc["kind"] == "noop":
        return f"{doc['model']} v{doc['to_version']} already serves on every replica"
    rows = [(p["name"], f"{p['seconds']:.2f}",
             ", ".join(f"{r}:{'ok' if v['ok'] else 'FAILED'}" for r, v in p["replicas"].items()))
            for p in doc["phases"]]
    skew = "n/a" if doc["skew_ms"] is None else f"{doc['skew_ms']:.0f} ms"
    return (table(["phase", "seconds", "replicas"], rows)
            + f"\n{doc['model']}: v{doc['from_version']} -> v{doc['to_version']} on every "
            f"replica in {doc['total_s']:.1f} s (skew {skew})")


@app.command("swap")
def swap(model: ModelArg,
         to: Annotated[int, typer.Option("--to", help="The staged version to serve.")],
         policy: PolicyOpt = None, force: ForceOpt = False, dry_run: DryRunOpt = False,
         as_json: JsonOpt = False) -> None:
    """Swap every replica to a staged version with a passing canary on record (atomic; a
    mixed fleet is converged). Moves the aliases and records the swap."""
    # lazy: a command imports its flow and tasks when it runs, so the CLI starts fast
    from flows import standalone
    from modelship.policy import policy_for

    def action() -> Any:
        return with_clients(lambda settings, clients: standalone.swap(
            settings, clients, policy_for(model, settings.policies_dir, policy), model=model,
            target=to, force=force, dry_run=dry_run, requester=_requester(settings),
            progress=progress))

    finish(run_reporting(action, as_json=as_json, render=_render_swap, to_json=lambda d: d))


@app.command("rollback")
def rollback(model: ModelArg,
             to: Annotated[int | None, typer.Option("--to", help="Version to go back to "
                                                    "(default: the previous one).")] = None,
             policy: PolicyOpt = None, force: ForceOpt = False, dry_run: DryRunOpt = False,
             as_json: JsonOpt = False) -> None:
    """Roll back to what served before (the ledger says which): the alias first, then every
    replica; the alias is put back if anything fails."""
    # lazy: a command imports its flow and tasks when it runs, so the CLI starts fast
    from flows import standalone
    from modelship.policy import policy_for

    def action() -> Any:
        return with_clients(lambda settings, clients: standalone.rollback(
            settings, clients, policy_for(model, settings.policies_dir, policy), model=model,
            to=to, force=force, dry_run=dry_run, requester=_requester(settings),
            progress=progress))

    def render(doc: dict[str, Any]) -> str:
        verb = "would roll back" if doc.get("dry_run") else "rolled back"
        return (_render_swap(doc["swap"]) + f"\n{verb} {model} "
                f"v{doc['from_version']} -> v{doc['to_version']}")

    finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda d: d))


@app.command("status")
def status(model: ModelArg, as_json: JsonOpt = False) -> None:
    """Compare the replicas (versions and live configs, batching included) with the
    production pin, the production alias and the newest ledger record. Exit 1 on any
    disagreement, naming the command that repairs it; a source that is down is noted."""
    from tasks.status import status_report  # lazy: a command imports its tasks when it runs
    from tasks.traffic_state import configured_router

    finish(run_reporting(
        lambda: with_clients(lambda settings, clients: status_report(
            settings, clients, model=model, router=configured_router(settings, progress))),
        as_json=as_json, render=_render_status, to_json=lambda d: d,
        exit_code=lambda d: 0 if d["consistent"] else 1))


def _render_status(doc: dict[str, Any]) -> str:
    """A short table per replica, what each source says, the disagreements and next."""
    model, pin = doc["model"], doc.get("pin")

    def batching(row: dict[str, Any]) -> str:
        return {True: "on", False: "off", None: "-"}[row.get("dynamic_batching")]

    def matches(row: dict[str, Any]) -> str:
        return {True: "yes", False: "NO", None: "-"}[row.get("matches_pin")]

    rows = [(r.get("name"), ",".join(f"v{v}" for v in r.get("ready_versions", [])) or "-",
             batching(r), matches(r), r.get("error") or "")
            for r in doc["replicas"]]
    record = doc.get("record") or {}
    said = [f"pin {'v' + str(pin['version']) if pin else '-'}" if "s3" not in doc["unread"]
            else "pin: S3 not read",
            f"alias production {_v(doc['aliases'].get('production'))}"
            if "mlflow" not in doc["unread"] else "alias: MLflow not read",
            (f"ledger {record['kind']} {record['id']} {_v(record['from_version'])} -> "
             f"{_v(record['to_version'])} {record['status']}") if record else "ledger: -"]
    lines = [table(["replica", "ready", "batching", "as pinned", "error"], rows),
             doc["summary"], "; ".join(said)]
    if doc.get("traffic"):
        lines.append(_traffic_line(doc["traffic"], replicas=len(doc.get("replicas") or [])))
    if doc.get("in_progress"):
        lines.append(f"in progress: {doc['in_progress']}")
    lines.extend(f"DISAGREES ({d['kind']}): {d['detail']}\n  repair: {d['repair']}"
                 for d in doc["disagreements"])
    lines.extend(f"note: {note}" for note in doc.get("notes") or [])
    if doc.get("next"):
        lines.append(f"next: {doc['next']}")
    elif not doc.get("served") and not doc.get("expected"):
        lines.append(f"next: `modelship promote {model} --version V` releases it")
    return "\n".join(lines)


def _v(version: int | None) -> str:
    return f"v{version}" if version is not None else "-"


def _load_targets(settings: Any, servers: list[Any], protocol: str, *, gateway: bool,
                  via: str) -> tuple[list[str], str]:
    """Where ``modelship load`` sends, and what it calls them: the gateway when the stack
    has one and ``gateway`` allows it (production traffic's way), else ``servers``."""
    url = settings.gateway_grpc if protocol == "grpc" else settings.gateway_url
    if url and gateway:
        return [url], "gateway"
    return [s.endpoint.grpc if protocol == "grpc" else s.endpoint.http for s in servers], via


@app.command("load")
def load(model: ModelArg, version: VersionOpt = None,
         concurrency: Annotated[int | None, typer.Option(help="Closed-loop clients.")] = None,
         rate: Annotated[float | None, typer.Option(help="Open-loop requests/s.")] = None,
         duration: Annotated[float | None, typer.Option(
             help="Run this many seconds (default: until 3 windows are stable).")] = None,
         protocol: Annotated[str, typer.Option(help="grpc or http.")] = "grpc",
         max_error_rate: Annotated[float, typer.Option(
             help="Exit 1 when more than this share of requests failed (0 to 1).")] = 0.0,
         canary: Annotated[bool, typer.Option("--canary",
                                              help="Load the canary, not the fleet.")] = False,
         direct: Annotated[bool, typer.Option(
             "--direct", help="Load the replicas themselves, not the gateway in front of "
             "them (production traffic's way when the stack has one).")] = False,
         as_json: JsonOpt = False) -> None:
    """The canary load generator on its own: latency percentiles, throughput, errors.

    Production traffic goes through the gateway when there is one (``gateway_url``), so it
    is routed (and mirrored) as live traffic is; ``--direct`` loads the replicas."""
    # lazy: a command imports its flow and tasks when it runs, so the CLI starts fast
    from modelship.loadgen import LoadSpec, run_load_sync
    from tasks import fleet

    def action() -> Any:
        def body(settings: Any, clients: Any) -> Any:
            if concurrency is not None and rate is not None:
                raise UsageError("pass --concurrency or --rate, not both",
                                 hint="e.g. `--concurrency 8` or `--rate 200`")
            servers = [clients.canary] if canary else clients.replicas
            if not servers or servers[0] is None:
                raise UsageError("no Triton servers are configured",
                                 hint="run `modelship stack up`")
            served = version
            if served is None:
                served = fleet.status(clients, model=model)["production_version"]
            if served is None:
                raise UsageError(f"{model} is not served consistently; cannot pick payloads",
                                 hint="pass --version V (a staged version)")
            from tasks.payload import load_payload  # lazy: as above

            payload, source = load_payload(clients.storage, clients.registry,
                                           repository_prefix=settings.repository_prefix,
                                           model=model, version=served)
            progress(f"loading {model} (payload: {source} rows of v{served})")
            spec = LoadSpec(protocol=protocol,  # type: ignore[arg-type]
                            concurrency=None if rate is not None
                            else 4 if concurrency is None else concurrency,
                            rate_rps=rate,
                            duration_s=duration, timeout_s=settings.http_timeout_s)
            urls, via = _load_targets(settings, servers, protocol,
                                      gateway=not (canary or direct),
                                      via="canary" if canary else "replicas")
            progress(f"sending to the {via}: {', '.join(urls)}")
            report = run_load_sync(urls, model, payload, spec,
                                   version=str(version) if version is not None else "")
            return {**report.to_dict(), "via": via, "targets": urls}

        return with_clients(body)

    finish(run_reporting(action, as_json=as_json, render=_load_table, to_json=lambda d: d,
                          exit_code=lambda doc: _load_exit_code(doc, max_error_rate)))


def _load_table(doc: dict[str, Any]) -> str:
    """``modelship load``'s report as a table."""
    lat = doc["latency_ms"]
    return table(["requests", "errors", "req/s", "p50 ms", "p90 ms", "p95 ms", "p99 ms"],
                 [(doc["requests"], doc["errors"], f"{doc['throughput_rps']:.0f}",
                   *(f"{lat[k]:.2f}" if lat[k] is not None else "-"
                     for k in ("p50", "p90", "p95", "p99")))])


def _load_exit_code(doc: dict[str, Any], max_error_rate: float) -> int:
    """1 when nothing answered (the run measured nothing: a wrong model, version or server)
    or more than ``max_error_rate`` of the requests failed (said on stderr), else 0."""
    if doc["requests"] == 0:
        return 1
    rate = doc["errors"] / doc["requests"]
    if rate > max_error_rate:
        reasons = "; ".join(f"{text} x{count}"
                            for text, count in doc.get("error_texts", {}).items())
        progress(f"error: {doc['errors']} of {doc['requests']} requests failed "
                 f"({rate:.2%} > --max-error-rate {max_error_rate:g}): {reasons}")
        return 1
    return 0


VERDICT_EXIT = {"passed": 0, "noop": 0, "failed": 4, "inconclusive": 6, "error": 1}


@app.command("canary")
def canary(model: ModelArg,
           version: Annotated[int, typer.Option("--version", "-v", help="Candidate version.")],
           policy: PolicyOpt = None,
           sequential: Annotated[bool | None, typer.Option(
               "--sequential/--fixed",
               help="Watch with always-valid sequential tests and stop as soon as the "
               "answer is clear, or run the fixed-horizon canary (default: the policy's "
               "canary.sequential).")] = None,
           as_json: JsonOpt = False) -> None:
    """Canary the candidate against production on the canary Triton; apply the gates."""
    # lazy: a command imports its flow and tasks when it runs, so the CLI starts fast
    from flows import standalone
    from modelship.policy import policy_for

    def action() -> Any:
        def body(settings: Any, clients: Any) -> Any:
            chosen = policy_for(model, settings.policies_dir, policy)
            if sequential is not None:
                chosen = chosen.model_copy(update={"canary": chosen.canary.model_copy(
                    update={"sequential": sequential})})
            return standalone.canary(settings, clients, chosen, model=model, version=version,
                                progress=progress)

        return with_clients(body)

    def render(doc: dict[str, Any]) -> str:
        if doc["verdict"] == "noop":
            return doc["message"]
        paths = doc.get("report") or {}
        markdown = ""
        if paths.get("markdown"):
            markdown = Path(paths["markdown"]).read_text()
        return (markdown + f"\nverdict: {doc['verdict']}; report: {paths.get('markdown')}, "
                f"plot: {paths.get('png')}")

    finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda d: d,
                          exit_code=lambda d: VERDICT_EXIT.get(d["verdict"], 1)))




def _requester(current: Any) -> str:
    return str(current.requester or getpass.getuser())


@app.command("reconcile")
def reconcile(model: Annotated[str | None, typer.Argument(
                  help="One model (default: every model with a production pin).")] = None,
              watch: Annotated[bool, typer.Option(
                  "--watch", help="Keep reconciling every --interval seconds (one JSON "
                  "line per round with --json); stop with Ctrl-C.")] = False,
              interval: Annotated[float, typer.Option(
                  "--interval", help="Seconds between rounds with --watch.")] = 10.0,
              dry_run: DryRunOpt = False, as_json: JsonOpt = False) -> None:
    """Bring every reachable replica back to the production recorded in the repository (a
    replica that restarted empty, or one a crashed swap left behind). Verified bytes only."""
    from tasks import reconcile as reconciling  # lazy: a command imports its tasks when it runs

    def arguments(settings: Any, clients: Any) -> dict[str, Any]:
        return _reconcile_arguments(settings, clients, model=model, dry_run=dry_run)

    if not watch:
        finish(run_reporting(lambda: with_clients(lambda settings, clients: reconciling.reconcile(
            clients.replicas, **arguments(settings, clients))),
            as_json=as_json, render=_render_reconcile, to_json=lambda d: d,
            exit_code=_reconcile_exit_code))

    stdout = sys.stdout  # run_reporting sends stdout to stderr while the body runs
    finish(run_reporting(
        lambda: with_clients(lambda settings, clients: _print_rounds(
            lambda: reconciling.watch(clients.replicas, interval_s=interval,
                                      **arguments(settings, clients)),
            as_json=as_json, stdout=stdout)),
        as_json=False, render=lambda _: "", to_json=lambda d: d,
        exit_code=lambda last: last))


def _traffic_line(traffic: dict[str, Any], replicas: int = 0) -> str:
    """The live weights as the router reads them back (status), or why they were not; with
    a canary share live and ``replicas`` known, the canary server's load relative to one
    replica's (:func:`tasks.traffic_plan.server_load`: a progressive step's latency is
    judged only at equal load or below)."""
    live = traffic.get("live")
    if live is None:
        return f"traffic ({traffic['router']}): not read: {traffic.get('error')}"
    mirror = f", {live['mirror_pct']:g} % mirrored to the canary" if live["mirror_pct"] else ""
    scope = traffic.get("scope")
    applies = (f"; applies to {scope['applies_to']}"
               if isinstance(scope, dict) and scope.get("applies_to") else "")
    load = ""
    if live["canary_pct"] > 0 and replicas > 0:
        from tasks.traffic_plan import latency_judged, server_load  # lazy: CLI start-up

        ratio = server_load(live["canary_pct"], replicas)
        above = "" if latency_judged(ratio) else " (above equal load)"
        load = f"; canary server at {ratio:.2f}× a replica's load{above}"
    return (f"traffic ({traffic['router']}): {live['production_pct']:g} % production, "
            f"{live['canary_pct']:g} % canary{mirror}{load}{applies}")


def _reconcile_arguments(settings: Any, clients: Any, *, model: str | None,
                         dry_run: bool) -> dict[str, Any]:
    """The keyword arguments of a reconcile (one round, or ``--watch``), from the wiring.

    Raises:
        UsageError: the replicas or the S3 repository are not configured.
    """
    # lazy: a command imports what it needs when it runs, so the CLI starts fast
    from modelship.locks import release_lock
    from modelship.policy import policy_for
    from modelship.signing import key_bytes
    from tasks import fleet
    from tasks.traffic_state import configured_router, reconcile_hook, slot_owners

    if not clients.replicas or clients.storage is None:
        raise UsageError("reconcile needs the Triton replicas and the S3 repository",
                         hint="run `modelship stack up` or set MODELSHIP_TRITON_REPLICAS "
                         "and MODELSHIP_S3_ENDPOINT")
    router = configured_router(settings, progress)
    return {"storage": clients.storage, "repository_prefix": settings.repository_prefix,
            "signing_key": key_bytes(settings.manifest_signing_key), "model": model,
            "timeout_s": settings.control_timeout_s,
            "probe_timeout_s": settings.http_timeout_s, "dry_run": dry_run,
            "lock": lambda name: release_lock(name, storage=clients.storage,
                                              home=settings.home, kind="reconcile"),
            # first, under that lock: finish or undo dead and incomplete releases
            "recover": lambda name: fleet.recover_model(
                settings, clients, policy_for(name, settings.policies_dir, None),
                model=name, by=f"reconcile-{os.getpid()}", progress=progress),
            # an orphaned split (no live release owns it) back to 100 % production
            "traffic": None if router is None else reconcile_hook(
                router, slot_owners(clients.storage, home=settings.home), progress=progress),
            "progress": progress}


def _render_reconcile(doc: dict[str, Any]) -> str:
    """One reconcile round for a person: a row per replica, the failures, a summary."""
    rows = [(m["model"], f"v{m['version']}" if m.get("version") is not None else "-",
             r.get("replica", "-"), r.get("action", "-"), r.get("reason") or "")
            for m in doc["models"] for r in (m.get("replicas") or [{}])]
    failed = [f"{m['model']}: {m['error']}" + (f" ({m['hint']})" if m.get("hint") else "")
              for m in doc["models"] if m.get("error")]
    if doc.get("dry_run"):
        loads = sum(r.get("action") == "load" for m in doc["models"]
                    for r in m.get("replicas") or [])
        summary = f"dry run: would load {loads} replica(s); nothing was changed"
    else:
        summary = f"changed {doc['changed']} replica(s)"
    head = table(["model", "production", "replica", "action", "reason"], rows) if rows \
        else "no model has a production pin yet: nothing to reconcile"
    traffic = doc.get("traffic") or {}
    routed = [f"traffic ({traffic['router']}): {traffic['reason']}"
              + (f"; FAILED: {traffic['error']}" if traffic.get("error") else "")
              ] if traffic.get("action") in ("restore", "unknown") else []
    return "\n".join([head, *failed, *routed, summary])


def _reconcile_exit_code(doc: dict[str, Any]) -> int:
    """0 when every model reconciled, else the worst failed model's exit code."""
    if doc["ok"]:
        return 0
    return max((int(m.get("exit_code") or 1) for m in doc["models"] if not m["ok"]),
               default=1)


def _print_rounds(rounds: Callable[[], Iterable[dict[str, Any]]], *, as_json: bool,
                  stdout: TextIO) -> int:
    """Print each ``--watch`` round as it ends (a JSON line with --json) until Ctrl-C.

    Returns:
        The last round's exit code.
    """
    last = 0
    try:
        for doc in rounds():
            print(json.dumps(doc) if as_json else _render_reconcile(doc), file=stdout,
                  flush=True)
            last = _reconcile_exit_code(doc)
    except KeyboardInterrupt:
        progress("reconcile --watch stopped")
    return last

