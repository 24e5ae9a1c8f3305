"""``modelship locks`` and ``unlock``: who holds a model's release lock, and breaking the
lock of a holder that is gone."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from modelship.cli._common import JsonOpt, ModelArg, app, finish, run_reporting, settings, table


@app.command("locks")
def locks(model: Annotated[str | None, typer.Argument(help="Only this model.")] = None,
          as_json: JsonOpt = False) -> None:
    """Show every held release lock: the release, host, pid, since, and whether it lives."""
    from modelship.locks import list_locks

    def action() -> list[dict[str, Any]]:
        current = settings()
        return list_locks(prefect_api_url=current.prefect_api_url, home=current.home,
                          model=model)

    def render(rows: list[dict[str, Any]]) -> str:
        if not rows:
            return "no release lock is held" + (f" for {model}" if model else "")
        body = []
        for row in rows:
            holder = row.get("holder") or {}
            alive = {True: "alive", False: "GONE", None: "?"}[row.get("holder_alive")]
            body.append((row["model"], "held" if row["held"] else "free",
                         holder.get("release_id", "-"), holder.get("kind", "-"),
                         f"{holder.get('host', '-')}:{holder.get('pid', '-')}",
                         holder.get("since_iso", "-"), alive))
        text = table(["model", "lock", "release", "kind", "host:pid", "since", "holder"], body)
        gone = [r for r in rows if r.get("holder_alive") is False and r.get("holder")]
        if gone:
            text += "\n" + "\n".join(
                f"next: `modelship unlock {r['model']} --release "
                f"{r['holder']['release_id']}` frees the lock of a holder that is gone"
                for r in gone)
        return text

    finish(run_reporting(action, as_json=as_json, render=render,
                         to_json=lambda rows: {"locks": rows}))


@app.command("unlock")
def unlock(model: ModelArg,
           release: Annotated[str, typer.Option("--release", help="The holder's release id "
                                                "(see `modelship locks`).")],
           as_json: JsonOpt = False) -> None:
    """Break the lock of a release whose process is gone (refused while it lives);
    recorded in the ledger."""
    from modelship.locks import break_lock

    def action() -> dict[str, Any]:
        from model_registry.ledger import Ledger, ReleaseRecord
        from modelship.clients import build_clients

        current = settings()
        holder = break_lock(model, release, prefect_api_url=current.prefect_api_url,
                            home=current.home)
        clients = build_clients(current)
        recorded = None
        try:
            if clients.storage is not None:
                ledger = Ledger(clients.storage)
                record = ReleaseRecord.start("unlock", model, requester=current.requester)
                record.reason = f"broke the lock of {holder.describe()}"
                record.finish("released", 0, record.reason)
                ledger.write(record)
                recorded = record.id
                for old in ledger.records(model):
                    if old.id == release and old.status == "running":
                        old.finish("interrupted", 1, f"its lock was broken by {record.id}")
                        ledger.write(old)
        finally:
            clients.close()
        return {"model": model, "broken": holder.to_dict(), "recorded_as": recorded}

    def render(doc: dict[str, Any]) -> str:
        return (f"broke the release lock of {model} held by {doc['broken']['release_id']} "
                f"(pid {doc['broken']['pid']} on {doc['broken']['host']}); recorded as "
                f"{doc['recorded_as']}")

    finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda d: d))
