"""``modelship locks`` and ``unlock``: who holds a model's release lock (and the canary
slot), and breaking a lock whose holder is gone."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from modelship.cli._common import JsonOpt, ModelArg, app, finish, run_reporting, table, with_clients


def render_locks(rows: list[dict[str, Any]], model: str | None) -> str:
    """The ``locks`` table, and the command that frees each lock whose holder is gone."""
    if not rows:
        return "no lock is held" + (f" for {model}" if model else "")
    body = []
    for row in rows:
        holder = row.get("holder") or {}
        alive = {True: "alive", False: "GONE", None: "unknown"}[row.get("holder_alive")]
        body.append((row["model"], row.get("lock", "release"),
                     "held" if row["held"] else "free", holder.get("release_id", "?"),
                     holder.get("kind", "?"), f"{holder.get('host', '?')}:{holder.get('pid', '?')}",
                     holder.get("since_iso", "?"), alive))
    text = table(["model", "lock", "state", "release", "kind", "host:pid", "since", "holder"],
                 body)
    for row in rows:
        holder = row.get("holder")
        canary = " --canary" if row.get("lock") == "canary" else ""
        if row.get("holder_alive") is False and holder:
            text += (f"\nnext: `modelship unlock {row['model']}{canary} --release "
                     f"{holder['release_id']}` frees the lock of a holder that is gone")
        elif holder is None:
            text += (f"\n{row['model']}: the lock's holder is unknown (its document could not "
                     f"be read); `modelship unlock {row['model']}{canary}` frees it once "
                     "nothing has written it for a whole lease")
    return text


@app.command("locks")
def locks(model: Annotated[str | None, typer.Argument(help="Only this model.")] = None,
          as_json: JsonOpt = False) -> None:
    """Show every held lock (release locks and the canary slot): the release, host, pid,
    since, and whether its holder lives."""
    from modelship.locks import list_locks  # lazy: botocore (~30 ms) only when a command runs

    def action() -> list[dict[str, Any]]:
        return with_clients(lambda current, clients: list_locks(
            storage=clients.storage, home=current.home, model=model))

    finish(run_reporting(action, as_json=as_json, render=lambda rows: render_locks(rows, model),
                         to_json=lambda rows: {"locks": rows}))


@app.command("unlock")
def unlock(model: ModelArg,
           release: Annotated[str | None, typer.Option(
               "--release", help="The holder's release id (see `modelship locks`); without "
               "it, whatever holds the lock, once shown to be gone.")] = None,
           canary: Annotated[bool, typer.Option(
               "--canary", help="Break the canary slot (held for MODEL's canary) instead of "
               "MODEL's release lock.")] = False,
           as_json: JsonOpt = False) -> None:
    """Break a lock whose holder is gone (refused while it lives); says how it knew, and
    records it in the ledger."""
    # lazy: modelship.locks pulls botocore (~30 ms); only when a command runs
    from modelship.locks import CANARY_SLOT, break_lock

    def action() -> dict[str, Any]:
        # lazy: the ledger pulls numpy (~0.15 s); only when a command runs
        from modelship.ledger import Ledger, ReleaseRecord

        def body(current: Any, clients: Any) -> dict[str, Any]:
            done = break_lock(model, release, storage=clients.storage, home=current.home,
                              canary_slot_name=CANARY_SLOT if canary else None)
            broken = done["broken"]
            who = broken["release_id"] if broken else "an unknown holder"
            what = "the canary slot" if canary else f"the release lock of {model}"
            done["recorded_as"] = None
            if clients.storage is not None and not canary:
                ledger = Ledger(clients.storage)
                record = ReleaseRecord.start("unlock", model, requester=current.requester)
                record.reason = f"broke {what} held by {who}: {done['how']}"
                record.finish("released", 0, record.reason)
                ledger.write(record)
                done["recorded_as"] = record.id
                for old in ledger.records(model):
                    if broken and old.id == broken["release_id"] and old.status == "running":
                        old.finish("interrupted", 1, f"its lock was broken by {record.id}")
                        ledger.write(old)
            done["what"] = f"broke {what} held by {who}"
            return done

        return dict(with_clients(body))

    def render(doc: dict[str, Any]) -> str:
        recorded = f"; recorded as {doc['recorded_as']}" if doc.get("recorded_as") else ""
        return f"{doc['what']}: {doc['how']}{recorded}"

    finish(run_reporting(action, as_json=as_json, render=render, to_json=lambda d: d))
